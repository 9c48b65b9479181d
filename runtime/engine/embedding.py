"""An embedding context over the loaded model: batch fill, pooled vectors, normalization (embeddings, rerank).

``EmbeddingContext`` is a second kind of llama_context made from the one ``Model`` whose weights
the generation groups already use: embeddings on, pooling set, its own KV cells. One call of
``decode`` packs several whole sequences into one llama_batch (sequence ids 0..k-1, positions
from 0) and returns one result per sequence:

- pooled (mean, cls, last): the pooled vector, shape (n_embd,);
- none: one vector per token, shape (n_tokens, n_embd);
- rank: the classifier's scores, shape (n_cls_out,) (the relevance score is element 0).

Why every sequence must fit in one physical batch: llama.cpp pools per ubatch, so a sequence
split over two ubatches would be pooled from half of its tokens. The context is therefore made
with ``n_ubatch == n_batch`` and a unified KV (one stream: ``split_simple`` keeps the batch
whole; per-sequence streams would cut it into equal-length pieces), and ``decode`` is never given
more than ``n_batch`` tokens. Sequences are stateless: the KV is cleared before every batch.

Cost: with embeddings on llama.cpp outputs every token, so besides the KV cells the context holds
logits for n_batch tokens (n_vocab × n_batch × 4 bytes) and computes the output layer for them
(SmolLM2-135M at n_batch 512: 11 MiB KV, 100 MiB compute buffer, 96 MiB logits once used).

Numerics: an input packed with others and the same input alone agree to llama.cpp's kernel
choice for the batch size (measured: 1e-3 on the tiny test model with flash attention's f16 path,
2e-3 relative on SmolLM2 Q4_1 with or without it); equal inputs in one batch come out equal.

Called from one worker thread at a time (the owning ``EmbeddingActor``); never from the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np

from llamactor.protocol.errors import ConfigError, EngineError
from llamactor.runtime.engine.batch import OwnedBatch
from llamactor.runtime.engine.controlvector import ControlVector
from llamactor.runtime.engine.gguffile import gguf_tensor_names
from llamactor.runtime.engine.model import Model, open_context
from llamactor.runtime.engine.overrides import RopeOptions

POOLING_CODES = {
    "none": llama_cpp.LLAMA_POOLING_TYPE_NONE,
    "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
    "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
    "rank": llama_cpp.LLAMA_POOLING_TYPE_RANK,
}
POOLING_NAMES = {code: name for name, code in POOLING_CODES.items()}
INT16_RANGE = 32760.0  # normalize=0 scales into an int16 range, as llama.cpp's common_embd_normalize
CLASSIFIER_TENSORS = ("cls.weight", "cls.output.weight")  # llama.cpp's rank pooling head (build_pooling)


@dataclass(frozen=True)
class EmbeddingOptions:
    n_batch: int  # tokens per decode (also the physical batch): the longest input accepted
    n_seq_max: int  # sequences packed into one decode
    n_threads: int
    pooling: str = ""  # "" = the model's own (llama.cpp: none for generative models)
    flash_attn: int = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
    rope: RopeOptions = RopeOptions()  # --rope-*/--yarn-*, as the groups' contexts
    control_vector: ControlVector | None = None  # --control-vector, as the groups' contexts


class EmbeddingContext:
    """A llama_context with embeddings on; ``decode`` turns whole sequences into vectors."""

    def __init__(self, model: Model, opts: EmbeddingOptions) -> None:
        if opts.pooling and opts.pooling not in POOLING_CODES:
            raise ConfigError(f"--pooling must be one of {', '.join(POOLING_CODES)}, got {opts.pooling!r}")
        self.model = model
        pooling = POOLING_CODES[opts.pooling] if opts.pooling else llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED
        # stateless sequences: one batch worth of cells is all it needs
        self.ptr = open_context(
            model,
            "the embedding context",
            n_ctx=opts.n_batch,
            n_batch=opts.n_batch,
            n_ubatch=opts.n_batch,
            n_seq_max=opts.n_seq_max,
            n_threads=opts.n_threads,
            n_threads_batch=opts.n_threads,
            kv_unified=True,
            embeddings=True,
            pooling_type=pooling,
            flash_attn_type=opts.flash_attn,
            **opts.rope.settings(),
        )
        if opts.control_vector is not None:
            try:
                opts.control_vector.apply(self.ptr)
            except BaseException:
                self.close()
                raise
        self.memory = llama_cpp.llama_get_memory(self.ptr)  # NULL for encoder-only models (BERT)
        self.pooling = POOLING_NAMES[llama_cpp.llama_pooling_type(self.ptr)]
        if self.pooling == "rank" and not has_classifier_head(model.path):
            # llama.cpp would score with the first hidden unit of the wrong rows: refuse instead.
            self.close()
            raise ConfigError(
                f"--pooling rank needs a reranker model with a classifier head (a cls.output "
                f"tensor); {model.name} has none"
            )
        self.n_batch = int(llama_cpp.llama_n_batch(self.ptr))
        self.n_seq_max = int(llama_cpp.llama_n_seq_max(self.ptr))
        self.n_embd = int(llama_cpp.llama_model_n_embd_out(model.ptr))
        self.n_cls_out = int(llama_cpp.llama_model_n_cls_out(model.ptr))
        self._alloc_batch(self.n_batch)

    def _alloc_batch(self, n: int) -> None:
        self._owned = OwnedBatch(n, output_all=True)
        o = self._owned
        self._tok, self._pos, self._nseq, self._seq, self._out, self._ramp = o.tok, o.pos, o.nseq, o.seq, o.out, o.ramp
        self._batch = o.batch

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_free(self.ptr)
            self.ptr = None

    def fits(self, n_tokens: int, n_seqs: int) -> bool:
        """Whether ``n_seqs`` sequences of ``n_tokens`` tokens in all fit one ``decode``."""
        return n_tokens <= self.n_batch and n_seqs <= self.n_seq_max

    def decode(self, seqs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Decode whole sequences in one batch; return each one's vector(s) or scores (copies).

        The caller packs at most ``n_seq_max`` non-empty sequences of at most ``n_batch`` tokens in all.
        """
        n = 0
        for seq, tokens in enumerate(seqs):
            k = len(tokens)
            self._tok[n : n + k] = tokens
            self._pos[n : n + k] = self._ramp[:k]
            self._seq[n : n + k] = seq
            n += k
        assert 0 < n <= self.n_batch and len(seqs) <= self.n_seq_max
        if self.memory:
            llama_cpp.llama_memory_clear(self.memory, False)
        self._batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.ptr, self._batch)
        if rc != 0:
            raise EngineError(f"llama_decode failed with status {rc} in the embedding context")
        if self.pooling == "none":
            ptr = llama_cpp.llama_get_embeddings(self.ptr)
            if not ptr:
                raise EngineError("llama.cpp returned no token embeddings")
            rows = np.ctypeslib.as_array(ptr, shape=(n, self.n_embd))
            out, start = [], 0
            for tokens in seqs:
                out.append(rows[start : start + len(tokens)].copy())
                start += len(tokens)
            return out
        width = self.n_cls_out if self.pooling == "rank" else self.n_embd
        pooled = []
        for seq in range(len(seqs)):
            ptr = llama_cpp.llama_get_embeddings_seq(self.ptr, seq)
            if not ptr:
                raise EngineError(f"llama.cpp returned no pooled embedding for sequence {seq}")
            pooled.append(np.ctypeslib.as_array(ptr, shape=(width,)).copy())
        return pooled


def normalize(vec: np.ndarray, norm: int) -> np.ndarray:
    """llama.cpp's ``common_embd_normalize``: -1 none, 0 max-abs into int16 range, 1 taxicab,
    2 euclidean, p > 2 p-norm. A zero vector stays zero. Returns float32."""
    v = vec.astype(np.float64)
    if norm == -1:
        return vec.astype(np.float32)
    if norm == 0:
        total = float(np.abs(v).max(initial=0.0)) / INT16_RANGE
    elif norm == 2:
        total = float(np.sqrt(np.dot(v, v)))
    else:
        total = float(np.power(np.power(np.abs(v), norm).sum(), 1.0 / norm))
    scale = 1.0 / total if total > 0.0 else 0.0
    return (v * scale).astype(np.float32)


def rerank_tokens(model: Model, query: str, document: str) -> list[int]:
    """The tokens llama-server scores for one (query, document) pair (``format_prompt_rerank``).

    With a ``rerank`` chat template in the GGUF, its ``{query}``/``{document}`` are filled in;
    otherwise [BOS] query [EOS] [SEP] document [EOS], each special token as the vocabulary asks.
    """
    template = llama_cpp.llama_model_chat_template(model.ptr, b"rerank")
    if template:
        text = template.decode("utf-8", "replace").replace("{query}", query).replace("{document}", document)
        return model.tokenize(text, add_special=False, parse_special=True)
    vocab = model.vocab
    eos = llama_cpp.llama_vocab_eos(vocab)
    if eos == llama_cpp.LLAMA_TOKEN_NULL:
        eos = llama_cpp.llama_vocab_sep(vocab)
    add_eos = bool(llama_cpp.llama_vocab_get_add_eos(vocab))
    out: list[int] = [model.bos] if model.add_bos else []
    out += model.tokenize(query, add_special=False, parse_special=False)
    if add_eos:
        out.append(eos)
    if llama_cpp.llama_vocab_get_add_sep(vocab):
        out.append(llama_cpp.llama_vocab_sep(vocab))
    out += model.tokenize(document, add_special=False, parse_special=False)
    if add_eos:
        out.append(eos)
    return out


def has_classifier_head(path: str | Path) -> bool:
    names = set(gguf_tensor_names(path))
    return any(t in names for t in CLASSIFIER_TENSORS)
