"""The messages between the API process and the engine process, msgpack-framed.

    engine ──Ready──► API              first, once its model is loaded and its actors run
    API ──Submit──► engine             a request (a task without its stream), maybe a resume
    API ──Cancel──► engine             the client left
    API ──GetSlots/SlotAction/GetMetrics/GetLive/Embed──► engine
    engine ──Slots/SlotDone/MetricsText/Live/EmbedDone──► API     their answers, by ``call_id``
    engine ──CallFailed──► API         a call that raised: the error, by class name
    engine ──Events──► API             every event of one decode step, all requests together
    engine ──Beat──► API               once a second: the engine's event loop is alive

Each direction is one tagged union; a call and its answer share a ``call_id`` and each call
has its own answer type. Errors cross as ``events.Failed`` (class name and message) and are
made again by ``errors.error_from``. A frame is a 4-byte big-endian length and a msgpack body.
"""

from __future__ import annotations

import struct
import time
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from llamactor.protocol.build import BuildInfo
from llamactor.protocol.embedding import EmbedderInfo
from llamactor.protocol.events import Event, Failed
from llamactor.protocol.live import LiveSnapshot
from llamactor.protocol.messages import Cancel, Task, TaskSpec  # Cancel: the supervisor's, passed on
from llamactor.protocol.slots import SlotActionResult, SlotKV, SlotState

HEADER = struct.Struct(">I")


class WireTask(TaskSpec, frozen=True, kw_only=True):
    """A ``messages.Task`` without its stream: what the engine needs to serve it."""

    prompt: bytes  # int32 token ids, native byte order (both ends are one machine)

    def tokens(self) -> npt.NDArray[np.int32]:
        return np.frombuffer(self.prompt, dtype=np.int32)

    def task(self, sink: Any) -> Task:
        """The task again, on the engine's side: its events go to ``sink``; it arrived now."""
        spec = {name: getattr(self, name) for name in TaskSpec.__struct_fields__}
        return Task(prompt=self.tokens(), sink=sink, arrived=time.perf_counter(), **spec)


# ---- API process -> engine ----------------------------------------------------------------


class Submit(msgspec.Struct, frozen=True, tag=True):
    task: WireTask


class GetSlots(msgspec.Struct, frozen=True, tag=True):
    call_id: int


class SlotAction(msgspec.Struct, frozen=True, tag=True):
    """Erase, save, restore, export or import one slot (answered by ``SlotDone``)."""

    call_id: int
    slot: int
    action: str
    path: str = ""
    kv: SlotKV | None = None  # import: the state to write into the slot


class GetMetrics(msgspec.Struct, frozen=True, tag=True):
    call_id: int


class GetLive(msgspec.Struct, frozen=True, tag=True):
    call_id: int


class Embed(msgspec.Struct, frozen=True, tag=True):
    """Embed token-id inputs (int32 bytes each) with the engine's embedding actor."""

    call_id: int
    inputs: tuple[bytes, ...]
    normalize: int


# ---- engine -> API process ----------------------------------------------------------------


class Ready(msgspec.Struct, frozen=True, tag=True):
    pid: int
    embedder: EmbedderInfo | None = None  # the engine serves embeddings (--embedding)
    build: BuildInfo | None = None  # its llama.cpp build and devices (GET /props' engine.build)


class Events(msgspec.Struct, frozen=True, tag=True):
    """(task id, event) in the order the groups sent them; ``ended``: tasks whose stream closed."""

    events: tuple[tuple[int, Event], ...]
    ended: tuple[int, ...] = ()


class Beat(msgspec.Struct, frozen=True, tag=True):
    steps: int  # decode steps so far, all groups: progress the API process can watch


class Slots(msgspec.Struct, frozen=True, tag=True):
    call_id: int
    slots: tuple[SlotState, ...]


class SlotDone(msgspec.Struct, frozen=True, tag=True):
    call_id: int
    result: SlotActionResult


class MetricsText(msgspec.Struct, frozen=True, tag=True):
    call_id: int
    text: bytes  # Prometheus exposition text


class Live(msgspec.Struct, frozen=True, tag=True):
    call_id: int
    snapshot: LiveSnapshot


class EmbedDone(msgspec.Struct, frozen=True, tag=True):
    """An ``Embed``'s answer: per input a float32 array as (bytes, shape)."""

    call_id: int
    vectors: tuple[tuple[bytes, tuple[int, ...]], ...]
    n_tokens: tuple[int, ...]
    pooling: str


class CallFailed(msgspec.Struct, frozen=True, tag=True):
    call_id: int
    error: Failed


Call = GetSlots | SlotAction | GetMetrics | GetLive | Embed
Answer = Slots | SlotDone | MetricsText | Live | EmbedDone | CallFailed
ToEngine = Submit | Cancel | Call
FromEngine = Ready | Events | Beat | Answer

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
