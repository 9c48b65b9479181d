"""Tiny sliding-window GGUF (gemma3 architecture) for tests of prefix reuse past a window.

The tiny model's tokenizer, sizes and weight scale (``tinymodel``) in gemma3's layout: q/k norms,
post-attention and post-FFN norms, every layer attending to the last ``WINDOW`` positions only.
llama.cpp sizes such layers' cache to the window plus a batch (padded to 256 cells), and reuses
the cells of positions that left the window: a prefix a slot cached is usable only while the
window before its end is still there, unless the context keeps every position (``swa_full``).
"""

from __future__ import annotations

import os
import pathlib

import gguf
import numpy as np
import tinymodel
from tinymodel import (
    HEAD_DIM,
    N_EMBD,
    SPECIAL_TOKENS,
    _add_hparams,
    _add_tokenizer,
    _build_vocab,
    _weights,
    write_out,
)

ARCHITECTURE = "gemma3"
EXTRA_NORMS = (
    ("attn_q_norm.weight", HEAD_DIM),
    ("attn_k_norm.weight", HEAD_DIM),
    ("post_attention_norm.weight", N_EMBD),
    ("post_ffw_norm.weight", N_EMBD),
)
N_LAYER = tinymodel.N_LAYER  # gemma3 makes 5 of every 6 layers sliding-window ones: both are
WINDOW = 32


def write_tiny_swa_model(path: str | os.PathLike, *, seed: int = 0) -> pathlib.Path:
    """Write the tiny sliding-window model to ``path`` and return it as a Path."""
    path = pathlib.Path(path)
    tokens, types, merges = _build_vocab(SPECIAL_TOKENS)
    writer = gguf.GGUFWriter(path, ARCHITECTURE)
    _add_hparams(writer, len(tokens))  # the tiny model's sizes, under gemma3's keys
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_sliding_window(WINDOW)
    _add_tokenizer(writer, tokens, types, merges)
    # the tiny model's tensors (gemma3 names them as llama does), plus gemma3's extra norms
    tensors = _weights(np.random.default_rng(seed), len(tokens))
    for layer in range(N_LAYER):
        p = f"blk.{layer}."
        tensors |= {p + name: np.ones(n, dtype=np.float32) for name, n in EXTRA_NORMS}
    return write_out(writer, tensors, path)
