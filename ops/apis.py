"""The two wire dialects the harness speaks: request bodies and stream-event decoding (pure).

``NativeApi`` is llama-server's ``POST /completion``: each SSE event carries the ids of the
tokens it delivers (``tokens``), and the last one has ``stop: true`` with the server's own
``tokens_predicted``. ``OpenAIApi`` is ``POST /v1/completions``: events carry text only, the
token count comes from ``usage`` (asked for with ``stream_options.include_usage``; llama-server
puts it in its last chunk anyway), and the stream ends with ``data: [DONE]``.

Both servers under test (llamactor and llama.cpp's llama-server) accept exact token ids as the
prompt, ``ignore_eos`` and ``cache_prompt`` on both endpoints, so the same body measures both.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from llamactor.ops.stats import RequestRecord

DONE_PAYLOAD = b"[DONE]"
ERROR_FIELD = b"error"
DATA_FIELD = b"data"

_decode = msgspec.json.decode


class SseDecoder:
    """Splits a byte stream into ``(field, value)`` pairs, one per SSE line that has a value.

    Fed once per received network chunk; a line cut across two chunks is kept until its end
    arrives. Only the ``data`` and ``error`` fields matter here; comments (``:``) are dropped.
    """

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> list[tuple[bytes, bytes]]:
        buf = self._tail + chunk
        lines = buf.split(b"\n")
        self._tail = lines.pop()
        out = []
        for raw in lines:
            line = raw.rstrip(b"\r")
            if not line or line.startswith(b":"):
                continue
            name, sep, value = line.partition(b":")
            if sep:
                out.append((name.strip(), value.strip()))
        return out


class Api(Protocol):
    """One dialect. ``apply`` is called once per SSE line with a value, in arrival order."""

    name: str
    path: str

    def body(
        self,
        prompt: list[int],
        n_predict: int,
        temperature: float,
        cache_prompt: bool = False,
        return_tokens: bool = False,
    ) -> dict[str, Any]: ...

    def apply(self, rec: RequestRecord, field: bytes, value: bytes, now_s: float) -> None: ...

    def finish(self, rec: RequestRecord) -> None:
        """Called once when the HTTP stream ended; flags a stream that ended early."""
        ...


def _error_text(obj: Any) -> str:
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def _decode_or_error(rec: RequestRecord, field: bytes, value: bytes) -> Any:
    """The JSON value of a data line, or ``None`` after recording an error on ``rec``."""
    try:
        obj = _decode(value)
    except msgspec.DecodeError:
        rec.error = f"undecodable event: {value[:120]!r}"
        return None
    if field == ERROR_FIELD or (isinstance(obj, dict) and "error" in obj):
        rec.error = _error_text(obj)
        return None
    if field != DATA_FIELD or not isinstance(obj, dict):
        return None
    return obj


class NativeApi:
    name = "native"
    path = "/completion"

    def body(
        self,
        prompt: list[int],
        n_predict: int,
        temperature: float,
        cache_prompt: bool = False,
        return_tokens: bool = False,
    ) -> dict[str, Any]:
        body = {
            "prompt": prompt,
            "n_predict": n_predict,
            "stream": True,
            "ignore_eos": True,
            "temperature": temperature,
            "cache_prompt": cache_prompt,
        }
        if return_tokens:
            # llama-server's switch for ``tokens`` in a non-streamed answer; stream chunks carry
            # each token's id anyway, which is where the harness reads them (chat history)
            body["return_tokens"] = True
        return body

    def apply(self, rec: RequestRecord, field: bytes, value: bytes, now_s: float) -> None:
        obj = _decode_or_error(rec, field, value)
        if obj is None:
            return
        if obj.get("stop"):
            rec.done_s = now_s
            rec.n_generated_server = obj.get("tokens_predicted")
            rec.n_prompt_server = obj.get("tokens_evaluated")
            return
        tokens = obj.get("tokens")
        n = len(tokens) if isinstance(tokens, list) else (1 if obj.get("content") else 0)
        if n:
            rec.event_times.append(now_s)
            rec.event_tokens.append(n)
            if rec.token_ids is not None and isinstance(tokens, list):
                rec.token_ids.extend(tokens)

    def finish(self, rec: RequestRecord) -> None:
        if rec.error is None and rec.done_s is None:
            rec.error = "stream ended without a final (stop: true) event"


class OpenAIApi:
    name = "openai"
    path = "/v1/completions"

    def body(
        self,
        prompt: list[int],
        n_predict: int,
        temperature: float,
        cache_prompt: bool = False,
        return_tokens: bool = False,
    ) -> dict[str, Any]:
        return {
            "prompt": prompt,
            "max_tokens": n_predict,
            "stream": True,
            "ignore_eos": True,
            "temperature": temperature,
            "cache_prompt": cache_prompt,
            "stream_options": {"include_usage": True},
        }

    def apply(self, rec: RequestRecord, field: bytes, value: bytes, now_s: float) -> None:
        if field == DATA_FIELD and value == DONE_PAYLOAD:
            rec.done_s = now_s
            return
        obj = _decode_or_error(rec, field, value)
        if obj is None:
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            rec.n_generated_server = usage.get("completion_tokens")
            rec.n_prompt_server = usage.get("prompt_tokens")
        for choice in obj.get("choices") or ():
            if choice.get("finish_reason") is None and choice.get("text"):
                rec.event_times.append(now_s)
                rec.event_tokens.append(1)

    def finish(self, rec: RequestRecord) -> None:
        if rec.error is None and rec.done_s is None:
            rec.error = "stream ended without data: [DONE]"


APIS: dict[str, Api] = {"native": NativeApi(), "openai": OpenAIApi()}

__all__ = ["APIS", "Api", "NativeApi", "OpenAIApi", "SseDecoder"]
