"""Embeddings and rerank over HTTP, in llama-server's shapes.

- ``POST /v1/embeddings``: OpenAI's shape; ``encoding_format`` float or base64 (little-endian
  float32, as OpenAI and llama-server send it). Pooling ``none`` is refused, as llama-server does.
  A body with ``content`` and no ``input`` gets the native shape, as llama-server answers it.
- ``POST /embedding``, ``/embeddings``: llama-server's native shape ``[{index, embedding: [[...]]}]``;
  with pooling ``none`` one unnormalized vector per token. ``embd_normalize`` on both.
- ``POST /rerank`` (and ``/reranking``, ``/v1/rerank``, ``/v1/reranking``): Jina/Cohere shape
  (``documents``: ``results`` of ``{index, relevance_score, document?}``) or TEI shape (``texts``:
  a bare list of ``{index, score, text?}``), best first, at most ``top_n``.

A client that disconnects cancels its request: its inputs not yet decoded are dropped.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.requests import Request

from llamactor.protocol.errors import RequestError
from llamactor.protocol.wire import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    NativeEmbedding,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    TeiRerankResult,
)
from llamactor.runtime.http.disconnect import until_disconnect
from llamactor.runtime.service.embeddings import check_top_n

if TYPE_CHECKING:
    from llamactor.runtime.service.core import RuntimeCore as Runtime

ENCODING_FORMATS = ("float", "base64")


def _service(rt: Runtime, *, rerank: bool = False) -> Any:
    """The runtime's embedding service; 501 before any field is checked, as llama-server answers."""
    rt.require_ready()
    service = rt.embeddings
    assert service is not None
    service.require_rerank() if rerank else service.require()
    return service


async def openai_embeddings(rt: Runtime, req: EmbeddingRequest, model_id: str, request: Request) -> Any:
    service = _service(rt)
    if req.input is None:
        if req.content is None:
            raise RequestError('"input" or "content" must be provided')
        return await native_embeddings(rt, req, request)  # llama-server: "content" is not OAI
    if req.encoding_format not in ENCODING_FORMATS:
        raise RequestError(f"encoding_format must be float or base64, got {req.encoding_format!r}")
    info = service.info
    if req.dimensions is not None and info is not None and req.dimensions != info.n_embd:
        raise RequestError(f"dimensions: this model's embeddings have {info.n_embd} dimensions, got {req.dimensions}")
    raw = req.input
    out = await until_disconnect(
        request, lambda: service.embed(raw, normalize=req.embd_normalize, field="input", oai=True)
    )
    b64 = req.encoding_format == "base64"
    data = [
        EmbeddingData(_b64(v), i, "embedding", "base64") if b64 else EmbeddingData(v.tolist(), i, "embedding")
        for i, v in enumerate(out.vectors)
    ]
    usage = EmbeddingUsage(out.prompt_tokens, out.prompt_tokens)
    return EmbeddingResponse(data, req.model or model_id, usage)


async def native_embeddings(rt: Runtime, req: EmbeddingRequest, request: Request) -> list[NativeEmbedding]:
    service = _service(rt)
    field = "input" if req.input is not None else "content"
    raw = req.input if req.input is not None else req.content
    if raw is None:
        raise RequestError('"input" or "content" must be provided')
    if req.encoding_format != "float":
        raise RequestError(
            f"encoding_format {req.encoding_format!r} is only available on /v1/embeddings; the native "
            f"/embedding(s) endpoints answer floats"
        )
    out = await until_disconnect(request, lambda: service.embed(raw, normalize=req.embd_normalize, field=field))
    return [NativeEmbedding(i, v.tolist() if v.ndim == 2 else [v.tolist()]) for i, v in enumerate(out.vectors)]


async def rerank(rt: Runtime, req: RerankRequest, model_id: str, request: Request) -> Any:
    service = _service(rt, rerank=True)
    if req.query is None:
        raise RequestError('"query" must be provided')
    tei = req.texts is not None and req.documents is None
    docs = req.texts if tei else req.documents
    if docs is None:
        raise RequestError('"documents" must be a non-empty string array')
    check_top_n(req.top_n)
    query = req.query
    ranked_all = await until_disconnect(request, lambda: service.rerank_all(query, docs))
    n = sum(r.n_tokens for r in ranked_all)  # usage counts every document, as llama-server's
    ranked = ranked_all[: req.top_n] if req.top_n is not None else ranked_all
    if tei:
        return [TeiRerankResult(r.index, r.score, docs[r.index] if req.return_text else None) for r in ranked]
    with_docs = req.return_documents or req.return_text
    results = [RerankResult(r.index, r.score, RerankDocument(docs[r.index]) if with_docs else None) for r in ranked]
    return RerankResponse(req.model or model_id, EmbeddingUsage(n, n), results)


def _b64(vec: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(vec, dtype="<f4").tobytes()).decode("ascii")
