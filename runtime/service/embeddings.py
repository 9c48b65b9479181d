"""Embeddings and rerank in the embedding API: ``Runtime.embed`` and ``Runtime.rerank``.

Inputs are narrowed, tokenized and checked here, before anything reaches the ``EmbeddingActor``:
an input is a string or a list of token ids, a request holds one input or a list of them (at
most ``MAX_EMBEDDING_INPUTS``), no input may be empty or longer than one embedding decode, and
every token id must be in the vocabulary. Each problem is a ``RequestError`` naming the field
and the input's index, and nothing else is affected.

A runtime started without embeddings answers ``NotSupported`` (501, llama-server's
``not_supported_error``); rerank needs rank pooling (``--pooling rank``, ``--reranking`` or a
reranker GGUF whose own pooling is rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from llamactor.protocol.embedding import EmbedderInfo
from llamactor.protocol.errors import NotSupported, RequestError
from llamactor.runtime.engine.embedding import rerank_tokens
from llamactor.runtime.engine.model import Model
from llamactor.runtime.service.engine import Embedder

MAX_EMBEDDING_INPUTS = 2048  # inputs per request (OpenAI's limit for /v1/embeddings)
TOKENIZE_IN_THREAD_CHARS = 4096  # inputs longer than this in all are tokenized off the event loop
NO_EMBEDDINGS = "This server does not support embeddings. Start it with `--embeddings`"
NO_RERANK = "This server does not support reranking. Start it with `--reranking`"

# a text, token ids, or {"content": [{"type": "text", "text": ...}, ...]} (its texts joined)
Input = str | Sequence[int] | Mapping[str, Any]


@dataclass(frozen=True)
class Embeddings:
    """The answer of ``Runtime.embed``: one entry per input, in input order.

    ``vectors[i]`` is a float32 array: (n_embd,) for pooled embeddings (normalized as asked),
    (n_tokens, n_embd) per-token vectors for pooling ``none`` (never normalized).
    """

    vectors: tuple[np.ndarray, ...]
    n_tokens: tuple[int, ...]
    pooling: str

    @property
    def prompt_tokens(self) -> int:
        return sum(self.n_tokens)


@dataclass(frozen=True)
class Ranked:
    """One document of ``Runtime.rerank``: its index in the request and its relevance score."""

    index: int
    score: float
    n_tokens: int


class EmbeddingService:
    """Admission and answers for embedding and rerank requests of one runtime."""

    def __init__(self, model: Model, embedder: Embedder | None, *, normalize: int = 2) -> None:
        self.model = model
        self.embedder = embedder  # None: the runtime was started without embeddings
        self.normalize = normalize

    @property
    def info(self) -> EmbedderInfo | None:
        return self.embedder.info if self.embedder is not None else None

    def require(self, *, oai: bool = False) -> Embedder:
        if self.embedder is None:
            raise NotSupported(NO_EMBEDDINGS)
        if oai and self.embedder.info.pooling == "none":
            raise RequestError("Pooling type 'none' is not OAI compatible. Please use a different pooling type")
        return self.embedder

    def require_rerank(self) -> Embedder:
        if self.embedder is None:
            raise NotSupported(NO_RERANK)
        pooling = self.embedder.info.pooling
        if pooling != "rank":
            raise NotSupported(
                f"{NO_RERANK} (this server's pooling is {pooling!r}; reranking needs "
                f"--pooling rank and a reranker model)"
            )
        return self.embedder

    async def embed(
        self, inputs: Input | Sequence[Input], *, normalize: int | None = None, field: str = "input", oai: bool = False
    ) -> Embeddings:
        embedder = self.require(oai=oai)
        norm = self.normalize if normalize is None else normalize
        if not isinstance(norm, int) or isinstance(norm, bool) or norm < -1:
            raise RequestError(f"embd_normalize must be an integer >= -1, got {norm!r}")
        items = narrow_inputs(inputs, field)
        tokens = await self._tokenize(items, field)
        self._check(tokens, field, embedder.info.max_input_tokens)
        done = await embedder.embed(tokens, norm)
        return Embeddings(done.vectors, done.n_tokens, done.pooling)

    async def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None) -> list[Ranked]:
        """Score every document against ``query``; best first, at most ``top_n``."""
        check_top_n(top_n)
        ranked = await self.rerank_all(query, documents)
        return ranked[:top_n] if top_n is not None else ranked

    async def rerank_all(self, query: str, documents: Sequence[str]) -> list[Ranked]:
        """Every document scored against ``query``, best first (ties keep the request's order)."""
        embedder = self.require_rerank()
        if not isinstance(query, str):
            raise RequestError('"query" must be a string')
        if isinstance(documents, str) or not documents:
            raise RequestError('"documents" must be a non-empty string array')
        if len(documents) > MAX_EMBEDDING_INPUTS:
            raise RequestError(f'"documents" has {len(documents)} items; at most {MAX_EMBEDDING_INPUTS} per request')
        for i, doc in enumerate(documents):
            if not isinstance(doc, str):
                raise RequestError(f"documents[{i}] must be a string")
        model = self.model

        def pairs() -> list[list[int]]:
            return [rerank_tokens(model, query, doc) for doc in documents]

        chars = len(query) * len(documents) + sum(map(len, documents))
        tokens = await anyio.to_thread.run_sync(pairs) if chars > TOKENIZE_IN_THREAD_CHARS else pairs()
        self._check(tokens, "documents", embedder.info.max_input_tokens)
        done = await embedder.embed(tokens, -1)
        ranked = [Ranked(i, float(v[0]), n) for i, (v, n) in enumerate(zip(done.vectors, done.n_tokens))]
        ranked.sort(key=lambda r: -r.score)
        return ranked

    # ---- admission ---------------------------------------------------------------------

    async def _tokenize(self, items: list[str | list[int]], field: str) -> list[list[int]]:
        model = self.model

        def run() -> list[list[int]]:
            out: list[list[int]] = []
            for i, item in enumerate(items):
                if isinstance(item, str):
                    out.append(model.tokenize(item, add_special=True, parse_special=True))
                    continue
                try:
                    model.check_tokens(item)
                except RequestError as exc:
                    raise RequestError(f"{field}[{i}]: {exc}") from None
                out.append(item)
            return out

        chars = sum(len(x) for x in items if isinstance(x, str))
        return await anyio.to_thread.run_sync(run) if chars > TOKENIZE_IN_THREAD_CHARS else run()

    @staticmethod
    def _check(tokens: list[list[int]], field: str, max_tokens: int) -> None:
        for i, t in enumerate(tokens):
            if not t:
                raise RequestError(f"{field}[{i}] is empty: nothing to embed")
            if len(t) > max_tokens:
                raise RequestError(
                    f"{field}[{i}] has {len(t)} tokens; one input may have at most {max_tokens} "
                    f"(the embedding batch: raise --ubatch-size)"
                )


def check_top_n(top_n: int | None) -> None:
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1):
        raise RequestError(f"top_n must be a positive integer, got {top_n!r}")


def narrow_inputs(raw: Any, field: str = "input") -> list[str | list[int]]:
    """One input or a list of inputs; an input is a string or a list of token ids.

    llama-server's shapes: "text", [1, 2, 3], ["a", "b"], [[1, 2], [3]], ["a", [1, 2]].
    """
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, Sequence) and not isinstance(raw, (bytes, bytearray)):
        if not raw:
            raise RequestError(f'"{field}" must not be empty')
        if all(_is_token(t) for t in raw):
            items = [list(raw)]
        else:
            items = list(raw)
    else:
        raise RequestError(
            f'"{field}" must be a string, a list of strings, a list of token ids or a list of token-id lists'
        )
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise RequestError(f'"{field}" has {len(items)} items; at most {MAX_EMBEDDING_INPUTS} per request')
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        if isinstance(item, Mapping):
            item = _content_text(item, f"{field}[{i}]")
        if isinstance(item, str):
            if not item:
                raise RequestError(f"{field}[{i}] is an empty string: nothing to embed")
            out.append(item)
        elif isinstance(item, Sequence) and not isinstance(item, (bytes, bytearray)) and all(map(_is_token, item)):
            if not item:
                raise RequestError(f"{field}[{i}] is an empty token list: nothing to embed")
            out.append([int(t) for t in item])
        else:
            raise RequestError(f"{field}[{i}] must be a string or a list of token ids")
    return out


def _content_text(item: Mapping[str, Any], where: str) -> str:
    """An input given as ``{"content": [parts]}`` (llama-server's multimodal input shape): its
    text parts joined. Media parts need a multimodal embedding model, which is not served here."""
    parts = item.get("content")
    if not isinstance(parts, list) or not parts:
        raise RequestError(f'{where}: an object input needs "content", a non-empty array of content parts')
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "input_audio", "input_video"):
            raise RequestError(f"{where}.content[{k}]: {kind} input is not supported for embeddings here (text only)")
        else:
            raise RequestError(f'{where}.content[{k}] must be a {{"type": "text", "text": ...}} part, got {part!r}')
    return "".join(texts)


def _is_token(t: Any) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, bool)
