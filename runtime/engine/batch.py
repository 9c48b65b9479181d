"""A ``llama_batch`` over numpy buffers we own (no per-token Python objects on the hot path).

The step fills these arrays with slice assignments and hands llama.cpp the batch; since we own
every buffer, ``llama_batch_free`` must never be called on it.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np


class OwnedBatch:
    __slots__ = ("_seq_ptrs", "batch", "nseq", "out", "pos", "ramp", "seq", "tok")

    def __init__(self, n: int, *, output_all: bool = False) -> None:
        """``n`` rows; ``output_all``: every row outputs (an embedding context), else none by default."""
        self.tok = np.zeros(n, dtype=np.int32)
        self.pos = np.zeros(n, dtype=np.int32)
        self.nseq = np.ones(n, dtype=np.int32)  # one sequence per row
        self.seq = np.zeros(n, dtype=np.int32)
        self.out = (np.ones if output_all else np.zeros)(n, dtype=np.int8)
        self.ramp = np.arange(n, dtype=np.int32)  # 0..n-1, for position ranges
        seq_ptrs = (ctypes.POINTER(llama_cpp.llama_seq_id) * n)()
        base = self.seq.ctypes.data
        for i in range(n):
            seq_ptrs[i] = ctypes.cast(base + 4 * i, ctypes.POINTER(llama_cpp.llama_seq_id))
        self._seq_ptrs = seq_ptrs  # kept alive with the batch
        # llama_cpp's stub types the batch fields as arrays; they are pointers to our buffers.
        b = llama_cpp.llama_batch()
        b.token = self.tok.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))  # type: ignore[assignment]
        b.embd = ctypes.POINTER(ctypes.c_float)()  # type: ignore[assignment]
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos))  # type: ignore[assignment]
        b.n_seq_id = self.nseq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))  # type: ignore[assignment]
        b.seq_id = seq_ptrs  # type: ignore[assignment]
        b.logits = self.out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))  # type: ignore[assignment]
        self.batch = b
