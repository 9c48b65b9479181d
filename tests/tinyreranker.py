"""A tiny random-weight reranker GGUF (Qwen3 architecture with a classifier head) for rerank tests.

llama.cpp's rank pooling reads one token's hidden state (the last one for a causal model) and
passes it through the model's classifier head, ``cls.output``; of the architectures the vendored
llama.cpp loads that head for, Qwen3 is the causal one (BERT-family rerankers are encoders). So
this file is the tiny LLaMA model of ``tinymodel.py`` (same vocabulary, same sizes) written as
Qwen3, plus per-head Q/K norms, a ``cls.output`` of two labels ("yes", "no": llama.cpp applies a
softmax over them for Qwen3, and the relevance score is P(yes)), the GGUF pooling type ``rank``
and a ``rerank`` chat template, as Qwen3-Reranker conversions carry. Weights are random: scores
are deterministic and differ per document, but mean nothing.
"""

from __future__ import annotations

import os
import pathlib

import gguf
import numpy as np
import tinymodel as tm

ARCHITECTURE = "qwen3"
LABELS = ("yes", "no")
RERANK_TEMPLATE = "<|im_start|>query\n{query}<|im_end|>\n<|im_start|>document\n{document}<|im_end|>\n"


def write_tiny_reranker(path: str | os.PathLike, *, seed: int = 1) -> pathlib.Path:
    path = pathlib.Path(path)
    tokens, types, merges = tm._build_vocab()
    rng = np.random.default_rng(seed)
    tensors = tm._weights(rng, len(tokens))
    for layer in range(tm.N_LAYER):
        tensors[f"blk.{layer}.attn_q_norm.weight"] = np.ones(tm.HEAD_DIM, dtype=np.float32)
        tensors[f"blk.{layer}.attn_k_norm.weight"] = np.ones(tm.HEAD_DIM, dtype=np.float32)
    tensors["cls.output.weight"] = (rng.standard_normal((len(LABELS), tm.N_EMBD)) * 1.0).astype(np.float32)
    writer = gguf.GGUFWriter(path, ARCHITECTURE)
    tm._add_hparams(writer, len(tokens))
    writer.add_pooling_type(gguf.PoolingType.RANK)
    writer.add_classifier_output_labels(list(LABELS))
    tm._add_tokenizer(writer, tokens, types, merges)
    writer.add_chat_template([{"name": "rerank", "template": RERANK_TEMPLATE}])
    return tm.write_out(writer, tensors, path)
