"""The loaded model: weights (once per process, shared by every group's context) and vocabulary.

Everything here is safe to call from any thread: the vocabulary is read-only after load.
Contexts are made from a ``Model`` by ``runtime.engine.Context``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from llamactor.protocol.errors import ConfigError, EngineError, RequestError
from llamactor.runtime.engine.overrides import KvOverride, kv_override_array
from llamactor.runtime.engine.placement import LAZY_MODES, LOAD_MODES, Override, override_array

PIECE_BUFFER_BYTES = 256
GGML_LOG_LEVEL_ERROR = 4
_backend_lock = threading.Lock()
_backend_ready = False
# The error lines llama.cpp logs while this thread loads a model (None: not loading). The log
# callback runs on the thread that called into llama.cpp, so each load sees its own lines.
_load_errors = threading.local()


@functools.cache
def _silent_log_callback():
    # llama.cpp logs every load detail to stderr; keep the callback object alive forever. Its
    # errors during a model load are kept: they say why the load failed.
    @llama_cpp.llama_log_callback
    def _drop(level, text, user_data):
        lines = getattr(_load_errors, "lines", None)
        if lines is not None and level == GGML_LOG_LEVEL_ERROR:
            lines.append(text.decode("utf-8", "replace").strip())
        elif lines is not None and b"buffer type overridden to" in text:
            _load_errors.overridden = [*getattr(_load_errors, "overridden", []), _overridden(text)]
        return None

    return _drop


_OVERRIDDEN = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)")


def _overridden(text: bytes) -> tuple[str, str]:
    """(tensor, buffer type) from llama.cpp's line for a tensor an -ot pattern placed."""
    found = _OVERRIDDEN.search(text.decode("utf-8", "replace"))
    return (found.group(1), found.group(2)) if found else (text.decode("utf-8", "replace").strip(), "")


def _load_error(lines: list[str]) -> str:
    """llama.cpp's reason for a failed load, from its error lines ("" when it logged none):
    its "error loading model: ..." line, else its first error line."""
    for line in lines:
        _, found, why = line.partition("error loading model: ")
        if found:
            return why
    return lines[0] if lines else ""


def init_backend(*, quiet: bool = True) -> None:
    """Initialise llama.cpp once per process (idempotent, thread-safe)."""
    global _backend_ready
    with _backend_lock:
        if _backend_ready:
            return
        if quiet:
            llama_cpp.llama_log_set(_silent_log_callback(), ctypes.c_void_p())
        from llamactor.runtime.engine.backends import load_backends

        load_backends()  # a modular build's (GPU backends) modules, before any device is asked for
        _backend_ready = True


@dataclass(frozen=True)
class LoadOptions:
    """How to place the weights. ``devices`` is a NULL-terminated ggml device array or None."""

    n_gpu_layers: int = 0  # negative: every layer on the GPUs there are (none without one)
    main_gpu: int = 0  # -mg
    use_extra_bufts: bool = True  # --repack/--no-repack: the CPU's extra buffer types (AMX, CPU_REPACK)
    no_host: bool = False  # --no-host
    load_mode: str = "auto"  # -lm/--load-mode: auto | none | mmap | mlock | mmap+mlock | dio (placement.LOAD_MODES)
    lazy_mode: str = "auto"  # -lzm/--lazy-mode: on | auto | off (placement.LAZY_MODES)
    tensor_overrides: tuple[Override, ...] = ()  # -ot/-cmoe/-ncmoe/-ncffn: (pattern, buffer type name)
    special: bool = False  # -sp/--special: special tokens render as their text in generated output
    split_mode: int = llama_cpp.LLAMA_SPLIT_MODE_LAYER
    tensor_split: tuple[float, ...] = ()
    devices: ctypes.Array[Any] | None = None
    vocab_only: bool = False  # the tokenizer and metadata without weights (the API process of an isolated engine)
    graph_reuse: bool = True  # False: its contexts get llama.cpp's graph reuse off (see open_context)
    kv_overrides: tuple[KvOverride, ...] = ()  # --override-kv: metadata read instead of the file's


@dataclass(frozen=True)
class FimTokens:
    """Fill-in-the-middle token ids from the vocabulary (for /infill); -1 means the model has none."""

    pre: int
    suf: int
    mid: int
    pad: int
    rep: int
    sep: int


class Model:
    """One loaded GGUF model and its vocabulary."""

    def __init__(self, path: str | Path, options: LoadOptions = LoadOptions()) -> None:
        init_backend()
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"model file not found: {path}")
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = options.n_gpu_layers
        params.main_gpu = options.main_gpu
        params.use_extra_bufts = options.use_extra_bufts
        params.no_host = options.no_host
        params.load_mode = LOAD_MODES[options.load_mode]
        params.lazy_mode = LAZY_MODES[options.lazy_mode]
        params.split_mode = options.split_mode
        params.vocab_only = options.vocab_only
        if options.tensor_split:
            self._tensor_split = (ctypes.c_float * llama_cpp.llama_max_devices())(*options.tensor_split)
            params.tensor_split = self._tensor_split
        if options.devices is not None:
            self._devices = options.devices  # keep the array alive as long as the model
            params.devices = ctypes.cast(options.devices, ctypes.c_void_p)
        if options.kv_overrides:
            self._kv_overrides = kv_override_array(options.kv_overrides)  # alive as long as the model
            params.kv_overrides = ctypes.cast(self._kv_overrides, ctypes.POINTER(llama_cpp.llama_model_kv_override))
        if options.tensor_overrides:
            self._buft_overrides = override_array(options.tensor_overrides)  # alive as long as the model
            params.tensor_buft_overrides = ctypes.addressof(self._buft_overrides[0])
        self.path = path
        self.graph_reuse = options.graph_reuse
        self.special = options.special
        _load_errors.lines = []
        try:
            self.ptr = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        finally:
            errors, _load_errors.lines = _load_errors.lines, None
            self.overridden = getattr(_load_errors, "overridden", [])
            _load_errors.overridden = []
        if not self.ptr:
            why = " (with the --override-kv values given)" if options.kv_overrides else ""
            reason = _load_error(errors)
            raise ConfigError(f"llama.cpp could not load the model: {path}{why}" + (f": {reason}" if reason else ""))
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self.vocab)
        # a vocabulary-only load reads no hyperparameters: the file's metadata says them
        arch = self.meta("general.architecture") or ""
        self.n_ctx_train: int = llama_cpp.llama_model_n_ctx_train(self.ptr) or self._meta_int(f"{arch}.context_length")
        self.n_embd: int = llama_cpp.llama_model_n_embd_inp(self.ptr) or self._meta_int(f"{arch}.embedding_length")
        self.bos: int = llama_cpp.llama_vocab_bos(self.vocab)
        self.eos: int = llama_cpp.llama_vocab_eos(self.vocab)
        self.add_bos: bool = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.n_swa: int = llama_cpp.llama_model_n_swa(self.ptr)  # sliding-window size, 0 without SWA
        self._pieces: dict[int, bytes] = {}
        self._eog = [bool(llama_cpp.llama_vocab_is_eog(self.vocab, t)) for t in range(self.n_vocab)]
        self.name = path.name
        self.adapters: list[Any] = []  # LoRA adapters, by id; freed with the model

    def load_adapter(self, path: str | Path) -> int:
        """Load a LoRA adapter once for every context of this model; return its id.

        Called at startup only, before any context exists. ConfigError names a file that is
        missing or that llama.cpp refuses (not a LoRA GGUF, or made for another model).
        """
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"LoRA adapter file not found: {path}")
        ptr = llama_cpp.llama_adapter_lora_init(self.ptr, str(path).encode())
        if not ptr:
            raise ConfigError(
                f"llama.cpp could not load the LoRA adapter {path} (not a LoRA adapter GGUF, or made for another model)"
            )
        self.adapters.append(ptr)
        return len(self.adapters) - 1

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None

    # ---- metadata --------------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def _meta_int(self, key: str) -> int:
        value = self.meta(key)
        return int(value) if value is not None and value.isdigit() else 0

    def facts(self) -> dict[str, Any]:
        """What llama-server's ``/v1/models`` lists under ``meta`` of a model (its ``n_ctx``,
        the slot's context, is the server's to add). ``ftype`` is the file's quantisation as
        llama.cpp names it, from ``general.file_type`` (a vocabulary-only load, which loads no
        weights, would say "all F32")."""
        file_type = self._meta_int("general.file_type") if self.meta("general.file_type") else None
        ftype = llama_cpp.llama_model_ftype(self.ptr) if file_type is None else file_type
        return {
            "vocab_type": int(llama_cpp.llama_vocab_type(self.vocab)),
            "n_vocab": self.n_vocab,
            "n_ctx_train": self.n_ctx_train,
            "n_embd": self.n_embd,
            "n_params": int(llama_cpp.llama_model_n_params(self.ptr)),
            "size": int(llama_cpp.llama_model_size(self.ptr)),
            "ftype": (llama_cpp.llama_ftype_name(ftype) or b"").decode(),
        }

    def chat_template(self) -> str | None:
        raw = llama_cpp.llama_model_chat_template(self.ptr, None)
        return raw.decode("utf-8", "replace") if raw else None

    def fim_tokens(self) -> FimTokens:
        """The GGUF's fill-in-the-middle tokens; -1 (LLAMA_TOKEN_NULL) where it has none."""
        v = self.vocab
        return FimTokens(
            pre=llama_cpp.llama_vocab_fim_pre(v),
            suf=llama_cpp.llama_vocab_fim_suf(v),
            mid=llama_cpp.llama_vocab_fim_mid(v),
            pad=llama_cpp.llama_vocab_fim_pad(v),
            rep=llama_cpp.llama_vocab_fim_rep(v),
            sep=llama_cpp.llama_vocab_fim_sep(v),
        )

    def token_text(self, token: int) -> str:
        return (llama_cpp.llama_vocab_get_text(self.vocab, token) or b"").decode("utf-8", "replace")

    # ---- tokens ----------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise RequestError("the prompt could not be tokenized")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes of one token as generated output (special tokens render empty, or as their
        text with ``special``: llama-server's -sp). Cached."""
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(PIECE_BUFFER_BYTES)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, PIECE_BUFFER_BYTES, 0, self.special)
            cached = buf.raw[: max(n, 0)]
            self._pieces[token] = cached
        return cached

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return self._eog[token]

    @functools.cached_property
    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token of the vocabulary, ascending."""
        return tuple(t for t, eog in enumerate(self._eog) if eog)

    def check_tokens(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if not isinstance(t, int) or not 0 <= t < self.n_vocab:
                raise RequestError(f"token id {t!r} is outside the vocabulary [0, {self.n_vocab})")


GRAPH_REUSE_ENV = "LLAMA_GRAPH_REUSE_DISABLE"  # read by llama.cpp when it makes a context
_context_lock = threading.Lock()  # makes our contexts one at a time while the variable may change


def graph_reuse_user_setting() -> bool | None:
    """What the user asked of llama.cpp's graph reuse with LLAMA_GRAPH_REUSE_DISABLE (read as
    llama.cpp reads it, with atoi: "1" turns it off, "0" or "false" leave it on); None if unset."""
    value = os.environ.get(GRAPH_REUSE_ENV)
    if value is None:
        return None
    digits = re.match(r"\s*[+-]?\d+", value)
    return not (digits and int(digits.group()) != 0)


def open_context(model: Model, what: str, **settings: Any) -> Any:
    """A llama_context over ``model``: llama.cpp's default parameters with ``settings`` set and
    perf counters off; EngineError naming ``what`` when llama.cpp cannot create it.

    A model loaded with ``graph_reuse=False`` gets contexts with llama.cpp's graph reuse off,
    unless the user set LLAMA_GRAPH_REUSE_DISABLE. Two contexts decoding at once on one
    ggml-rpc device need that: ggml-rpc keeps one "last graph" per device and process, and a
    context whose graph did not change asks the worker to recompute its stored graph instead
    of sending it. If another context's graph reaches the worker between that test and that
    request, the worker recomputes the other graph and the first context reads its previous
    step's logits again (a repeated token; tests/test_rpc.py). Without reuse every decode sends
    a new graph. llama.cpp has no context parameter for it, only the variable it reads here, so
    it is set for this call and put back. Remove when ggml-rpc tests and sets its last graph
    atomically with the send (llama.cpp of llama-cpp-python 0.3.36 does not)."""
    params = llama_cpp.llama_context_default_params()
    for name, value in settings.items():
        setattr(params, name, value)
    params.no_perf = True
    with _context_lock:
        if model.graph_reuse or GRAPH_REUSE_ENV in os.environ:
            ptr = llama_cpp.llama_init_from_model(model.ptr, params)
        else:
            os.environ[GRAPH_REUSE_ENV] = "1"
            try:
                ptr = llama_cpp.llama_init_from_model(model.ptr, params)
            finally:
                del os.environ[GRAPH_REUSE_ENV]
    if not ptr:
        raise EngineError(f"llama.cpp could not create {what} (out of memory or bad sizes)")
    return ptr
