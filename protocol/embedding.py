"""The embedding actor's mailbox and what it answers (embeddings and rerank).

    Runtime ──EmbedJob──► EmbeddingActor ──Embedded | Failed──► job.sink

A job is one request: several inputs, already tokenized and checked (each fits one embedding
decode). The actor packs the inputs of all queued jobs into shared decode steps and, once every
input of a job is done, sends one ``Embedded`` on the job's sink (a one-slot stream); a job that
fails gets one ``Failed`` (``protocol.events``) instead. There is no cancel message: a caller
that leaves closes its receive end, and the actor drops a job whose stream has no receiver
before packing its next input (so a cancel can never wait behind a full mailbox).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt


class EmbedJob(msgspec.Struct, frozen=True, tag=True):
    """Embed ``inputs`` (token ids, each non-empty); ``normalize`` as llama.cpp's embd_normalize.

    Pooled vectors are normalized; per-token vectors (pooling none) and rank scores never are.
    """

    id: int
    inputs: tuple[npt.NDArray[np.int32], ...]
    normalize: int = 2
    sink: Any = None  # send end of a one-slot anyio stream; the actor is its only writer


EmbedMsg = EmbedJob


class EmbedderInfo(msgspec.Struct, frozen=True):
    """What an embedding context can do: its pooling, vector width and longest input."""

    pooling: str
    n_embd: int
    max_input_tokens: int


class Embedded(msgspec.Struct, frozen=True):
    """One job's result: per input, a vector (n_embd,), per-token vectors (n_tokens, n_embd) for
    pooling none, or classifier scores (n_cls_out,) for pooling rank; in input order."""

    vectors: tuple[Any, ...]
    n_tokens: tuple[int, ...]  # tokens of each input
    pooling: str
