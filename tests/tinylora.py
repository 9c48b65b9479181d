"""A tiny random LoRA adapter GGUF for tinymodel.py's model (LoRA tests).

The layout is what llama.cpp's convert_lora_to_gguf.py writes and llama_adapter_lora_init
reads: ``general.type = "adapter"``, ``general.architecture`` of the base model,
``adapter.type = "lora"``, ``adapter.lora.alpha``, and for each adapted base tensor a pair
``<name>.lora_a`` (rank x in) and ``<name>.lora_b`` (out x rank), so that the update is
``scale * alpha / rank * B @ A``. Every attention and feed-forward matrix of every layer is
adapted (K and V included, so the KV a prompt leaves differs under the adapter), with random
weights large enough to change greedy output at scale 1. The same seed gives the same bytes.
"""

from __future__ import annotations

import os
import pathlib

import gguf
import numpy as np
from tinymodel import ARCHITECTURE, HEAD_DIM, N_EMBD, N_FF, N_HEAD, N_HEAD_KV, N_LAYER, write_out

RANK = 4
ALPHA = float(RANK)  # alpha / rank = 1: the scale is the whole multiplier
LORA_STD = 0.3  # B @ A entries ~ sqrt(RANK) * 0.3**2 = 0.18, beside the base weights' 0.1

# base tensor -> (out features, in features)
TARGETS = {
    "attn_q": (N_HEAD * HEAD_DIM, N_EMBD),
    "attn_k": (N_HEAD_KV * HEAD_DIM, N_EMBD),
    "attn_v": (N_HEAD_KV * HEAD_DIM, N_EMBD),
    "attn_output": (N_EMBD, N_HEAD * HEAD_DIM),
    "ffn_up": (N_FF, N_EMBD),
    "ffn_down": (N_EMBD, N_FF),
}


def write_tiny_lora(path: str | os.PathLike, *, seed: int = 1) -> pathlib.Path:
    """Write the adapter to ``path`` and return it as a Path."""
    path = pathlib.Path(path)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, ARCHITECTURE)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, ALPHA)
    for layer in range(N_LAYER):
        for name, (out_features, in_features) in TARGETS.items():
            base = f"blk.{layer}.{name}.weight"
            writer.add_tensor(
                base + ".lora_a", (rng.standard_normal((RANK, in_features)) * LORA_STD).astype(np.float32)
            )
            writer.add_tensor(
                base + ".lora_b", (rng.standard_normal((out_features, RANK)) * LORA_STD).astype(np.float32)
            )
    return write_out(writer, {}, path)
