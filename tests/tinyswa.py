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
from tinymodel import (
    CONTEXT_LENGTH,
    HEAD_DIM,
    N_EMBD,
    N_FF,
    N_HEAD,
    N_HEAD_KV,
    RMS_NORM_EPS,
    ROPE_FREQ_BASE,
    SPECIAL_TOKEN_OUTPUT_SCALE,
    SPECIAL_TOKENS,
    WEIGHT_STD,
    _add_tokenizer,
    _build_vocab,
    write_out,
)

ARCHITECTURE = "gemma3"
N_LAYER = 2  # gemma3 makes 5 of every 6 layers sliding-window ones: both are
WINDOW = 32


def write_tiny_swa_model(path: str | os.PathLike, *, seed: int = 0) -> pathlib.Path:
    """Write the tiny sliding-window model to ``path`` and return it as a Path."""
    path = pathlib.Path(path)
    tokens, types, merges = _build_vocab(SPECIAL_TOKENS)
    writer = gguf.GGUFWriter(path, ARCHITECTURE)
    writer.add_name("llamactor-tiny-swa")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(len(tokens))
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
    writer.add_sliding_window(WINDOW)
    _add_tokenizer(writer, tokens, types, merges)
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * WEIGHT_STD).astype(np.float16)

    def norm(n: int = N_EMBD) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    tensors = {"token_embd.weight": matrix(len(tokens), N_EMBD)}
    for layer in range(N_LAYER):
        p = f"blk.{layer}."
        tensors |= {
            p + "attn_norm.weight": norm(),
            p + "attn_q.weight": matrix(N_HEAD * HEAD_DIM, N_EMBD),
            p + "attn_k.weight": matrix(N_HEAD_KV * HEAD_DIM, N_EMBD),
            p + "attn_v.weight": matrix(N_HEAD_KV * HEAD_DIM, N_EMBD),
            p + "attn_q_norm.weight": norm(HEAD_DIM),
            p + "attn_k_norm.weight": norm(HEAD_DIM),
            p + "attn_output.weight": matrix(N_EMBD, N_HEAD * HEAD_DIM),
            p + "post_attention_norm.weight": norm(),
            p + "ffn_norm.weight": norm(),
            p + "ffn_gate.weight": matrix(N_FF, N_EMBD),
            p + "ffn_up.weight": matrix(N_FF, N_EMBD),
            p + "ffn_down.weight": matrix(N_EMBD, N_FF),
            p + "post_ffw_norm.weight": norm(),
        }
    output = matrix(len(tokens), N_EMBD)  # special tokens are the last rows
    output[-len(SPECIAL_TOKENS) :] *= np.float16(SPECIAL_TOKEN_OUTPUT_SCALE)
    tensors |= {"output_norm.weight": norm(), "output.weight": output}
    return write_out(writer, tensors, path)
