"""The messages between the API process and the engine process (issue 14), msgpack-framed.

    engine ──Ready──► API              first, once its model is loaded and its actors run
    API ──Submit──► engine             a request (a Task without its stream), maybe a resume
    API ──Cancel──► engine             the client left
    API ──Call──► engine               anything else (slots, metrics, the live view, slot files)
    API ──Embed──► engine              embeddings and rerank (answered by EmbedDone)
    engine ──Events──► API             every event of one decode step, all requests together
    engine ──Reply──► API              the answer to a Call
    engine ──Beat──► API               once a second: the engine's event loop is alive

A frame is a 4-byte big-endian length and a msgpack body (``encode``/``decode``).
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np

from llamactor.protocol.events import Event
from llamactor.protocol.messages import REQUEST_FIELDS, Cancel, Request  # Cancel: the supervisor's, passed on

HEADER = struct.Struct(">I")


class WireTask(Request, frozen=True, kw_only=True):
    """``messages.Task`` without its stream: what the engine needs to serve it."""

    id: int
    prompt: bytes  # int32 token ids, native byte order (both ends are one machine)

    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.prompt, dtype=np.int32)

    def fields(self) -> dict[str, Any]:
        """The ``Request`` fields, to build a ``Task`` from."""
        return {name: getattr(self, name) for name in REQUEST_FIELDS}


class EmbedderInfo(msgspec.Struct, frozen=True):
    pooling: str
    n_embd: int
    max_input_tokens: int


class Ready(msgspec.Struct, frozen=True, tag=True):
    pid: int
    embedder: EmbedderInfo | None = None  # the engine serves embeddings (--embedding)


class Embed(msgspec.Struct, frozen=True, tag=True):
    """Embed token-id inputs (int32 bytes each) with the engine's embedding actor."""

    job_id: int
    inputs: tuple[bytes, ...]
    normalize: int


class EmbedDone(msgspec.Struct, frozen=True, tag=True):
    """An ``Embed``'s answer: per input a float32 array as (bytes, shape); or an error."""

    job_id: int
    vectors: tuple[tuple[bytes, tuple[int, ...]], ...] = ()
    n_tokens: tuple[int, ...] = ()
    pooling: str = ""
    error: str = ""
    kind: str = ""


class Submit(msgspec.Struct, frozen=True, tag=True):
    task: WireTask


class Call(msgspec.Struct, frozen=True, tag=True):
    """Run ``RuntimeCore.<method>(*args)`` in the engine process (awaited if it is a coroutine)."""

    call_id: int
    method: str
    args: tuple[Any, ...] = ()


class Events(msgspec.Struct, frozen=True, tag=True):
    """(task id, event) in the order the groups sent them; ``ended``: tasks whose stream closed."""

    events: tuple[tuple[int, Event], ...]
    ended: tuple[int, ...] = ()


class Reply(msgspec.Struct, frozen=True, tag=True):
    call_id: int
    value: Any = None
    error: str = ""  # the exception's message, and its class name in ``kind``
    kind: str = ""


class Beat(msgspec.Struct, frozen=True, tag=True):
    steps: int  # decode steps so far, all groups: progress the API process can watch


ToEngine = Submit | Cancel | Call | Embed
FromEngine = Ready | Events | Reply | Beat | EmbedDone

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def frame(msg: ToEngine | FromEngine) -> bytes:
    body = _encoder.encode(msg)
    return HEADER.pack(len(body)) + body


def decode_to_engine(body: bytes) -> ToEngine:
    return _to_engine.decode(body)


def decode_from_engine(body: bytes) -> FromEngine:
    return _from_engine.decode(body)
