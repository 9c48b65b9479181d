"""The multimodal projector (``--mmproj``): libmtmd next to the model, images and audio into prompts.

Two operations, each where llama-server does it:

- ``Vision.tokenize`` (admission): a prompt text with media markers and the media files
  become the prompt's token ids, with a stand-in token at every position an image or a clip
  of audio takes (``protocol.media``), and one ``MediaChunk`` per media chunk.
  ``mtmd_tokenize`` does the work: libmtmd's helper decodes the files (images: png, jpeg, ...
  as stb_image reads them; audio: wav, mp3 and flac, resampled to the projector's rate, as
  miniaudio reads them), preprocesses them and tokenizes the text around them (a model's
  media framing tokens are text tokens). A projector has an image encoder, an audio encoder
  or both (``vision``, ``audio``); a file of the other kind is a RequestError naming it.
- ``Vision.decode`` (a group's step, ``step.DecodeStep``): one media chunk is encoded by the
  projector and its embeddings decoded into one slot's sequence at its positions, alone,
  before that slot's next text goes into the shared batch (llama-server's process_chunk).
  The engine gets a medium as its file bytes and encodes it again from them, so a task that
  crosses to the engine process, or is resumed by a new one, carries everything it needs.
  Audio is cut into 30 s chunks (Whisper-style encoders): a longer clip is several chunks.

Stand-in values come from ``MediaKeys``: one per distinct file (SHA-256) and chunk, never
reused in this process, so two different files never compare equal. ``tokenize`` is
``layout`` (decode the files and tokenize: libmtmd's work) then ``place`` (give stand-ins;
``runtime.engine.medialayout``): the isolated engine's API process runs ``layout`` in a decoder
process of its own (``runtime.service.mediaproc``: a projector on the CPU, without warmup;
libmtmd reads a medium's token count from the projector's settings only with its weights
loaded) and ``place`` itself, with its ``MediaKeys``. An image whose header declares more pixels than
``imagesize.MAX_IMAGE_PIXELS`` is refused before it is decoded.

Encoding is not thread-safe in libmtmd (one output buffer per context): decodes hold a lock,
so the groups of one engine encode one medium at a time. Tokenizing is thread-safe.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd

from llamactor.protocol.errors import ConfigError, RequestError
from llamactor.protocol.media import MediaChunk
from llamactor.runtime.engine.imagesize import check_pixels
from llamactor.runtime.engine.medialayout import MediaKeys, MediaSpan, place
from llamactor.runtime.engine.model import Model, init_backend

GGML_LOG_LEVEL_ERROR = 4
GGML_LOG_LEVEL_CONT = 5
IMAGE_FORMATS = "png, jpeg, bmp, gif, ..."
AUDIO_FORMATS = "wav, mp3, flac"

_NO_CALLBACK = mtmd.mtmd_helper_post_decode_callback()  # a NULL function pointer
_errors: deque[str] = deque(maxlen=8)  # libmtmd's last error lines (its log is otherwise dropped)
_errors_lock = threading.Lock()


@functools.cache
def _log_callback() -> Any:
    """libmtmd's log: dropped, but error lines are kept to say why a projector did not load."""
    last = [0]

    @llama_cpp.llama_log_callback
    def _keep_errors(level: int, text: bytes, user_data: Any) -> None:
        if level == GGML_LOG_LEVEL_CONT:
            level = last[0]
        last[0] = level
        if level == GGML_LOG_LEVEL_ERROR:
            line = text.decode("utf-8", "replace").strip()
            if line:
                with _errors_lock:
                    _errors.append(line)

    mtmd.mtmd_helper_log_set(_keep_errors, ctypes.c_void_p())
    return _keep_errors


def looks_like_audio(data: bytes) -> bool:
    """Whether libmtmd's helper takes ``data`` for audio (its ``is_audio_file``: a RIFF/WAVE,
    ID3 or MPEG-frame, or fLaC header) and decodes it as such, not as an image."""
    if len(data) < 12:
        return False
    return (
        (data[:4] == b"RIFF" and data[8:12] == b"WAVE")
        or data[:3] == b"ID3"
        or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0)
        or data[:4] == b"fLaC"
    )


def _last_errors() -> str:
    with _errors_lock:
        lines = list(_errors)
        _errors.clear()
    return "; ".join(line.replace("\n", " ") for line in lines)


class MediaFacts:
    """What a projector takes (its media marker, images, audio), as a server reports it:
    ``Vision`` itself, or the API process's handle on a decoder process that loaded one."""

    marker: str
    vision: bool  # takes images
    audio: bool  # takes audio

    @property
    def modalities(self) -> tuple[str, ...]:
        """The kinds of media it takes: "image", "audio"."""
        return (("image",) if self.vision else ()) + (("audio",) if self.audio else ())

    @property
    def takes(self) -> str:
        """What it takes, as errors say it."""
        return " and ".join(k if k == "audio" else "images" for k in self.modalities)


class Vision(MediaFacts):
    """A projector loaded next to ``model`` (the whole model, or its vocabulary only)."""

    def __init__(
        self,
        path: str | Path,
        model: Model,
        *,
        use_gpu: bool = True,
        n_threads: int = 1,
        image_min_tokens: int = -1,
        image_max_tokens: int = -1,
        batch_max_tokens: int = 1024,
    ) -> None:
        """``image_min_tokens``/``image_max_tokens``: the bounds of an image's token count for
        projectors with dynamic resolution (-1: the file's); ``batch_max_tokens``: image tokens
        encoded per batch (llama-server's --image-min-tokens, --image-max-tokens,
        --mtmd-batch-max-tokens)."""
        init_backend()
        _log_callback()
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--mmproj: multimodal projector file not found: {path}")
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = max(1, n_threads)
        params.print_timings = False
        params.warmup = False
        params.image_min_tokens = image_min_tokens
        params.image_max_tokens = image_max_tokens
        params.batch_max_tokens = batch_max_tokens
        _last_errors()
        ptr = mtmd.mtmd_init_from_file(str(path).encode(), model.ptr, params)
        if not ptr:
            why = _last_errors() or "not a multimodal projector GGUF"
            raise ConfigError(f"--mmproj {path}: libmtmd could not load it for this model ({why})")
        self.ptr: Any = ptr
        self.path = path
        self.model = model
        self.marker = (mtmd.mtmd_get_marker(ptr) or mtmd.mtmd_default_marker()).decode()
        self.vision = bool(mtmd.mtmd_support_vision(ptr))
        self.audio = bool(mtmd.mtmd_support_audio(ptr))
        self.keys = MediaKeys()
        self._encode_lock = threading.Lock()

    def close(self) -> None:
        if self.ptr:
            mtmd.mtmd_free(self.ptr)
            self.ptr = None

    # ---- admission ------------------------------------------------------------------------

    def tokenize(
        self,
        text: str,
        files: Sequence[bytes],
        *,
        add_special: bool = True,
        parse_special: bool = True,
        n_ubatch: int = 0,
        names: Sequence[str] = (),
    ) -> tuple[list[int], tuple[MediaChunk, ...]]:
        """The tokens of ``text`` with each media marker replaced by the next file of
        ``files``, and the media chunks. RequestError names what is wrong with the input.
        ``n_ubatch``: the contexts' physical batch, which media decoded with non-causal
        attention (Gemma 3's images) must fit in whole (0: not checked). ``names``: where each
        file came from (its URL; "" for none), said in errors."""
        spans = self.layout(text, files, add_special=add_special, parse_special=parse_special, names=names)
        return place(spans, files, self.keys, n_ubatch)

    def layout(
        self,
        text: str,
        files: Sequence[bytes],
        *,
        add_special: bool = True,
        parse_special: bool = True,
        names: Sequence[str] = (),
    ) -> list[list[int] | MediaSpan]:
        """What ``tokenize`` makes of the prompt before stand-ins are given: its text runs'
        token ids and its media chunks, in order. This is the part that decodes the files
        (the isolated server runs it in a process of its own: ``runtime.service.mediaproc``)."""
        markers = text.count(self.marker)
        if markers != len(files):
            noun = "image" if not self.audio else "audio file" if not self.vision else "media file"
            raise RequestError(
                f"the prompt has {markers} media marker{'s' if markers != 1 else ''} ({self.marker!r}) "
                f"but {len(files)} {noun}{'s were' if len(files) != 1 else ' was'} given: each {noun} takes the "
                "place of one marker"
            )
        bitmaps: list[Any] = []
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            for i, data in enumerate(files):
                bitmaps.append(self._bitmap(data, i, len(files), names[i] if i < len(names) else ""))
            raw = text.encode("utf-8")
            inp = mtmd.mtmd_input_text(raw, len(raw), add_special, parse_special)
            array = (mtmd.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
            rc = mtmd.mtmd_tokenize(self.ptr, chunks, ctypes.byref(inp), array, len(bitmaps))
            if rc != 0:
                why = {1: "the media markers and the files do not pair up", 2: "a file could not be preprocessed"}
                raise RequestError(f"the prompt with its media could not be tokenized: {why.get(rc, f'status {rc}')}")
            return self._spans(chunks)
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)

    def _bitmap(self, data: bytes, index: int, count: int, name: str = "") -> Any:
        """The file decoded (an image's pixels, audio's samples), or a RequestError saying
        why not: a kind this projector has no encoder for, or bytes libmtmd cannot decode."""
        audio = looks_like_audio(data)
        kind = "image" if not self.audio else "audio file" if not self.vision else "file"  # what it takes
        which = f"{kind} {index + 1} of {count}" + (f" ({name})" if name else "")
        if audio and not self.audio:
            raise RequestError(
                f"{which} is audio ({AUDIO_FORMATS}): audio input is not supported by this multimodal projector "
                f"(--mmproj), it has no audio encoder: it takes {self.takes} only"
            )
        if not audio:
            check_pixels(data, which)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ptr, buf, len(data), False) if data else None
        if not bitmap:
            start = f"{len(data)} bytes starting {data[:8]!r}"
            if audio:
                raise RequestError(f"{which} is not audio libmtmd can decode ({AUDIO_FORMATS}): {start}")
            if not self.audio:
                raise RequestError(f"{which} is not an image libmtmd can read ({IMAGE_FORMATS}): {start}")
            if not self.vision:
                raise RequestError(f"{which} is not audio libmtmd can decode ({AUDIO_FORMATS}): {start}")
            raise RequestError(
                f"{which} is neither an image ({IMAGE_FORMATS}) nor audio ({AUDIO_FORMATS}) libmtmd can read: {start}"
            )
        if not mtmd.mtmd_bitmap_is_audio(bitmap) and not self.vision:
            mtmd.mtmd_bitmap_free(bitmap)
            raise RequestError(
                f"{which} is an image: image input is not supported by this multimodal projector (--mmproj), "
                f"it has no vision encoder: it takes {self.takes} only"
            )
        mtmd.mtmd_bitmap_set_id(bitmap, str(index).encode())
        return bitmap

    def _spans(self, chunks: Any) -> list[list[int] | MediaSpan]:
        spans: list[list[int] | MediaSpan] = []
        parts: dict[int, int] = {}  # file index -> media chunks seen of it
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                spans.append(list(ids[: n.value]) if n.value else [])
                continue
            index = int((mtmd.mtmd_input_chunk_get_id(chunk) or b"0").decode())
            part = parts.get(index, 0)
            parts[index] = part + 1
            spans.append(
                MediaSpan(
                    index=index,
                    part=part,
                    n_pos=mtmd.mtmd_input_chunk_get_n_pos(chunk),
                    n_tokens=mtmd.mtmd_input_chunk_get_n_tokens(chunk),
                    audio=kind == mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO,
                    non_causal=bool(mtmd.mtmd_decode_use_non_causal(self.ptr, chunk)),
                )
            )
        return spans

    # ---- a group's step -------------------------------------------------------------------

    def decode(self, ctx: Any, chunk: MediaChunk, seq: int, n_batch: int) -> int:
        """Encode ``chunk``'s image or audio and decode its embeddings into sequence ``seq`` of
        ``ctx`` at positions ``[chunk.pos, chunk.end)``; returns llama_decode's status (0: done,
        1: no KV cells for them). RequestError when it cannot be encoded (that request's
        failure alone)."""
        with self._encode_lock:
            bitmap = self._bitmap(chunk.data, 0, 1)
            chunks = mtmd.mtmd_input_chunks_init()
            try:
                image = self._image_chunk(chunks, bitmap, chunk)
                if mtmd.mtmd_encode_chunk(self.ptr, image) != 0:
                    raise RequestError("the multimodal projector could not encode the image or audio")
                embd = mtmd.mtmd_get_output_embd(self.ptr)
                n_past = llama_cpp.llama_pos(0)
                rc = mtmd.mtmd_helper_decode_image_chunk(
                    self.ptr, ctx, image, embd, chunk.pos, seq, n_batch, ctypes.byref(n_past), _NO_CALLBACK, None
                )
                if rc == 0 and n_past.value != chunk.end:
                    raise RequestError(f"the media took {n_past.value - chunk.pos} positions, not {chunk.n_pos}")
                return int(rc)
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
                mtmd.mtmd_bitmap_free(bitmap)

    def _image_chunk(self, chunks: Any, bitmap: Any, chunk: MediaChunk) -> Any:
        """The image or audio chunk ``chunk`` was admitted as, made again from its file alone."""
        raw = self.marker.encode()
        inp = mtmd.mtmd_input_text(raw, len(raw), False, True)
        array = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        if mtmd.mtmd_tokenize(self.ptr, chunks, ctypes.byref(inp), array, 1) != 0:
            raise RequestError("the media file could not be preprocessed again")
        seen = 0
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            c = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                continue
            if seen == chunk.part:
                if (
                    mtmd.mtmd_input_chunk_get_n_pos(c) != chunk.n_pos
                    or mtmd.mtmd_input_chunk_get_n_tokens(c) != chunk.n_tokens
                ):
                    break
                return c
            seen += 1
        raise RequestError("the media file does not make the chunk it was admitted with (another projector?)")
