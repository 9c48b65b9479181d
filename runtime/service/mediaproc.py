"""The media decoder process: images and audio are decoded where a crash takes down no one else.

    python -m llamactor.runtime.service.mediaproc      (frames on stdin and stdout)

Tokenizing a prompt with media decodes its files (stb_image for images, miniaudio for audio,
inside libmtmd) and preprocesses them: C code fed bytes a client chose. In an isolated server
(the default) the API process does not run it itself: ``MediaProcess`` keeps one child that
loaded the model's vocabulary and the projector (on the CPU), sends it a prompt and its files,
and gets back the prompt's layout (``medialayout.MediaSpan``: its text runs' token ids and media
chunks). The stand-ins the chunks' positions hold are given in the API process
(``medialayout.place``), so they never repeat across restarts of the child.

- A file that crashes the decoder (a signal, an abort) fails its request alone, with a 400:
  the child is started again for the next request, and every other request carries on.
- A decode that takes longer than ``DECODE_TIMEOUT_S`` ends the child the same way.
- The child's address space is limited to what it had after loading plus ``MEMORY_HEADROOM``:
  a file that decodes to more fails to allocate (a 400) instead of taking the machine's
  memory. Images whose header declares more than ``imagesize.MAX_IMAGE_PIXELS`` are refused
  before any decoding.
- One file decodes at a time (one child, one request at a time): decoding takes
  milliseconds for the sizes projectors take in, and the engine's threads hold the cores.

The engine process decodes a medium again when it encodes it, from the same bytes, after they
passed here; a crash there is the engine's (restarted, its streams resumed).

Frames are a 4-byte big-endian length and a msgpack message: the config first (as the engine
process gets it), then ``Decode`` requests, each answered by ``Layout`` or ``Refused``.
"""

from __future__ import annotations

import os
import resource
import struct
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from subprocess import PIPE
from typing import Any, BinaryIO

import anyio
import msgspec
import structlog
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from llamactor.protocol.errors import ConfigError, LlamactorError, RequestError
from llamactor.protocol.media import MediaChunk
from llamactor.runtime.engine.medialayout import MediaKeys, MediaSpan, place
from llamactor.runtime.engine.vision import MediaFacts, Vision
from llamactor.runtime.service.config import RuntimeConfig, config_from_wire, config_to_wire

log = structlog.get_logger("llamactor.media")

START_TIMEOUT_S = 120.0  # loading the vocabulary and the projector
DECODE_TIMEOUT_S = 30.0  # one prompt's files
MEMORY_HEADROOM = 4 * 1024**3  # address space the child may grow by after loading (bytes)
FRAME_MAX = 1 << 30


class Decode(msgspec.Struct, tag=True):
    text: str
    files: list[bytes]
    add_special: bool = True
    parse_special: bool = True
    names: list[str] = []


class Ready(msgspec.Struct, tag=True):
    marker: str
    vision: bool
    audio: bool


class Layout(msgspec.Struct, tag=True):
    spans: list[list[int] | MediaSpan]


class Refused(msgspec.Struct, tag=True):
    message: str
    config: bool = False  # the projector did not load (at start): a ConfigError


Reply = Ready | Layout | Refused
_replies = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


# ---- the child -----------------------------------------------------------------------------


def _read_frame(stream: BinaryIO) -> bytes | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    data = stream.read(n)
    return data if len(data) == n else None


def _limit_memory(headroom: int) -> None:
    """Cap the address space at what this process maps now plus ``headroom`` (Linux)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[0])
        now = pages * os.sysconf("SC_PAGE_SIZE")
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = now + headroom
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (OSError, ValueError):  # no /proc, or a limit this process may not set: left as it is
        pass


def main() -> int:
    # frames go out on a copy of stdout; anything C code prints goes to stderr instead
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    stdin = sys.stdin.buffer
    first = _read_frame(stdin)
    if first is None:
        return 0
    cfg = config_from_wire(first)
    from llamactor.runtime.engine.model import LoadOptions, Model

    try:
        assert cfg.model is not None and cfg.mmproj is not None
        model = Model(cfg.model, LoadOptions(vocab_only=True, kv_overrides=cfg.kv_overrides, special=cfg.special))
        vision = Vision(
            cfg.mmproj,
            model,
            use_gpu=False,
            image_min_tokens=cfg.image_min_tokens,
            image_max_tokens=cfg.image_max_tokens,
            batch_max_tokens=cfg.mtmd_batch_max_tokens,
        )
    except LlamactorError as exc:
        out.write(_frame(_encoder.encode(Refused(str(exc), config=True))))
        return 2
    _limit_memory(MEMORY_HEADROOM)
    out.write(_frame(_encoder.encode(Ready(vision.marker, vision.vision, vision.audio))))
    requests = msgspec.msgpack.Decoder(Decode)
    while (frame := _read_frame(stdin)) is not None:
        job = requests.decode(frame)
        reply: Layout | Refused
        try:
            spans = vision.layout(
                job.text, job.files, add_special=job.add_special, parse_special=job.parse_special, names=job.names
            )
            reply = Layout(spans)
        except RequestError as exc:
            reply = Refused(str(exc))
        except MemoryError:
            reply = Refused("the media needs more memory to decode than a request may use")
        out.write(_frame(_encoder.encode(reply)))
    return 0


# ---- the API process's side ----------------------------------------------------------------


class MediaProcess(MediaFacts):
    """The API process's handle on its media decoder child; tokenizes prompts with media."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.keys = MediaKeys()
        self.restarts = 0  # children started again after one died or hung
        self._wire = config_to_wire(config)
        self._process: Process | None = None
        self._out: BufferedByteReceiveStream | None = None
        self._lock = anyio.Lock()

    @classmethod
    @asynccontextmanager
    async def open(cls, config: RuntimeConfig) -> AsyncIterator[MediaProcess]:
        """The decoder started (ConfigError when the projector does not load), stopped after."""
        self = cls(config)
        try:
            await self._start()
            yield self
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop()

    async def tokenize(
        self,
        text: str,
        files: Sequence[bytes],
        *,
        add_special: bool = True,
        parse_special: bool = True,
        n_ubatch: int = 0,
        names: Sequence[str] = (),
    ) -> tuple[list[int], tuple[MediaChunk, ...]]:
        """As ``Vision.tokenize``, with the files decoded in the child. RequestError when they
        cannot be, the child's death or a hang included (it is started again)."""
        job = Decode(text, list(files), add_special, parse_special, list(names))
        async with self._lock:
            with anyio.CancelScope(shield=True):  # a reply read half-way would desynchronise the frames
                reply = await self._exchange(_frame(_encoder.encode(job)))
        if isinstance(reply, Refused):
            raise RequestError(reply.message)
        if not isinstance(reply, Layout):
            raise RequestError("the media decoder answered out of turn")
        return place(reply.spans, files, self.keys, n_ubatch)

    async def _exchange(self, frame: bytes) -> Reply:
        if self._process is None or self._process.returncode is not None:
            await self._stop()
            self.restarts += 1
            await self._start()
        process, out = self._process, self._out
        assert process is not None and process.stdin is not None and out is not None
        reply: Reply | None = None
        with anyio.move_on_after(DECODE_TIMEOUT_S) as scope:
            try:
                await process.stdin.send(frame)
                reply = await self._receive(out)
            except (anyio.BrokenResourceError, anyio.EndOfStream, anyio.IncompleteRead, OSError):
                reply = None
        if reply is not None:
            return reply
        why = f"took longer than {DECODE_TIMEOUT_S:g} s" if scope.cancelled_caught else "ended the decoder"
        await self._stop()
        code = process.returncode
        log.warning("media_decoder_lost", why=why, exit_code=code)
        raise RequestError(
            f"the media could not be decoded: it {why}"
            + (f" (exit status {code})" if code is not None and not scope.cancelled_caught else "")
        )

    @staticmethod
    async def _receive(out: BufferedByteReceiveStream) -> Reply:
        (n,) = struct.unpack(">I", await out.receive_exactly(4))
        if n > FRAME_MAX:
            raise anyio.BrokenResourceError
        return _replies.decode(await out.receive_exactly(n))

    async def _start(self) -> None:
        process = await anyio.open_process(
            [sys.executable, "-m", "llamactor.runtime.service.mediaproc"], stdin=PIPE, stdout=PIPE, stderr=None
        )
        assert process.stdin is not None and process.stdout is not None
        self._process, self._out = process, BufferedByteReceiveStream(process.stdout)
        reply: Any = None
        with anyio.move_on_after(START_TIMEOUT_S):
            try:
                await process.stdin.send(_frame(self._wire))
                reply = await self._receive(self._out)
            except (anyio.BrokenResourceError, anyio.EndOfStream, anyio.IncompleteRead, OSError):
                reply = None
        if isinstance(reply, Ready):
            self.marker, self.vision, self.audio = reply.marker, reply.vision, reply.audio
            return
        await self._stop()
        if isinstance(reply, Refused):
            raise ConfigError(reply.message)
        raise ConfigError(f"the media decoder process did not start (exit status {process.returncode})")

    async def _stop(self) -> None:
        process, self._process, self._out = self._process, None, None
        if process is None:
            return
        if process.returncode is None:
            if process.stdin is not None:
                await process.stdin.aclose()  # its loop reads the end and exits
            with anyio.move_on_after(2.0):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
        await process.aclose()


class InThread(MediaFacts):
    """The engine's own projector tokenizing in a worker thread (an engine in this process:
    a decoder crash is the process's either way)."""

    def __init__(self, vision: Vision) -> None:
        self._vision = vision
        self.marker, self.vision, self.audio = vision.marker, vision.vision, vision.audio

    async def tokenize(
        self,
        text: str,
        files: Sequence[bytes],
        *,
        add_special: bool = True,
        parse_special: bool = True,
        n_ubatch: int = 0,
        names: Sequence[str] = (),
    ) -> tuple[list[int], tuple[MediaChunk, ...]]:
        vision = self._vision
        return await anyio.to_thread.run_sync(
            lambda: vision.tokenize(
                text, files, add_special=add_special, parse_special=parse_special, n_ubatch=n_ubatch, names=names
            )
        )


MediaTokenizer = MediaProcess | InThread


if __name__ == "__main__":
    sys.exit(main())
