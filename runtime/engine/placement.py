"""Where the weights go and how they are read: llama-server's tensor buffer type overrides
(``-ot/--override-tensor``, ``-cmoe/--cpu-moe``, ``-ncmoe/--n-cpu-moe``, ``-ncffn/--n-cpu-ffn``),
its load mode (``-lm/--load-mode``, the older ``--mmap``/``--no-mmap``/``--mlock``) and its lazy
mode (``-lzm/--lazy-mode``), as ``llama_model_params`` fields.

An override is a (pattern, buffer type name) pair: a tensor whose name the pattern matches
(a regular expression searched in the name, as llama.cpp's ``std::regex_search``) is placed in
that buffer type instead of where ``-ngl``/``-dev`` would put it. The names are those of the
devices' buffer types (``ggml_backend_buft_name``): ``CPU`` here, and one per GPU or ggml-rpc
worker where there are some; an unknown name is a ConfigError listing the available ones, as
llama-server prints them. llama-cpp-python binds none of the ggml backend registry functions,
so the three needed are declared with ctypes on the bundled ``libggml.so`` (the same library
instance llama.cpp uses, so the pointers are the ones it compares with).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
from typing import Any

import llama_cpp

from llamactor.protocol.errors import ConfigError

# llama.cpp's common.h: the tensors -cmoe/-ncmoe keep on the CPU (MoE experts) and those
# -ncffn keeps there (a dense model's FFN), layer by layer as blk.<i><regex>
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
FFN_DENSE_REGEX = r"\.ffn_(up|down|gate)\."
CPU_BUFFER_TYPE = "CPU"  # ggml_backend_cpu_buffer_type()'s name

LOAD_MODES = {
    "auto": llama_cpp.LLAMA_LOAD_MODE_AUTO,
    "none": llama_cpp.LLAMA_LOAD_MODE_NONE,
    "mmap": llama_cpp.LLAMA_LOAD_MODE_MMAP,
    "mlock": llama_cpp.LLAMA_LOAD_MODE_MLOCK,
    "mmap+mlock": llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK,
    "dio": llama_cpp.LLAMA_LOAD_MODE_DIRECT_IO,
}
LAZY_MODES = {
    "on": llama_cpp.LLAMA_LAZY_MODE_ON,
    "auto": llama_cpp.LLAMA_LAZY_MODE_AUTO,
    "off": llama_cpp.LLAMA_LAZY_MODE_OFF,
}

Override = tuple[str, str]  # (tensor name pattern, buffer type name)


class BuftOverride(ctypes.Structure):
    """llama.h's ``llama_model_tensor_buft_override`` (the binding's ``llama_model_tensor_override``
    is another struct: a pattern and an int)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def parse_override_tensor(text: str) -> tuple[Override, ...]:
    """``-ot PATTERN=TYPE,...``: the pairs in order. A part without ``=`` is an error, as in
    llama-server; the buffer type names are checked when the model is placed (``buffer_types``)."""
    out = []
    for part in text.split(","):
        pattern, found, buft = part.partition("=")
        if not found:
            raise argparse.ArgumentTypeError(f"{part!r} is not PATTERN=BUFFER_TYPE")
        if not pattern:
            raise argparse.ArgumentTypeError(f"{part!r} has no tensor name pattern")
        out.append((pattern, buft))
    return tuple(out)


def cpu_moe(on: bool) -> tuple[Override, ...]:
    """``-cmoe``: every layer's MoE expert weights on the CPU."""
    return ((FFN_EXPS_REGEX, CPU_BUFFER_TYPE),) if on else ()


def n_cpu_layers(n: int, ffn_regex: str) -> tuple[Override, ...]:
    """``-ncmoe N``/``-ncffn N``: the FFN weights of layers 0..N-1 on the CPU."""
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return tuple((rf"blk\.{i}{ffn_regex}", CPU_BUFFER_TYPE) for i in range(n))


def n_cpu_moe(text: str) -> tuple[Override, ...]:
    return n_cpu_layers(int(text), FFN_EXPS_REGEX)


def n_cpu_ffn(text: str) -> tuple[Override, ...]:
    return n_cpu_layers(int(text), FFN_DENSE_REGEX)


@functools.cache
def _ggml() -> ctypes.CDLL:
    from llamactor.runtime.engine.backends import ggml_path

    ggml = ctypes.CDLL(str(ggml_path()), mode=ctypes.RTLD_GLOBAL)
    ggml.ggml_backend_dev_count.argtypes = []
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    ggml.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_buft_name.restype = ctypes.c_char_p
    return ggml


def buffer_types() -> dict[str, int]:
    """Each device's buffer type by name (llama-server's list for -ot), ggml-rpc workers
    included once registered (``rpc.add_servers``)."""
    ggml = _ggml()
    out: dict[str, int] = {}
    for i in range(ggml.ggml_backend_dev_count()):
        buft = ggml.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_get(i))
        if buft:
            out[ggml.ggml_backend_buft_name(buft).decode()] = buft
    return out


def check_buffer_types(overrides: tuple[Override, ...]) -> None:
    """ConfigError naming a buffer type no device has, with the available ones."""
    known = buffer_types()
    for pattern, name in overrides:
        if name not in known:
            raise ConfigError(
                f"--override-tensor {pattern}={name}: unknown buffer type {name!r}; "
                f"available buffer types: {', '.join(sorted(known))}"
            )


def override_array(overrides: tuple[Override, ...]) -> tuple[ctypes.Array[Any], list[bytes]]:
    """The NULL-terminated ``llama_model_tensor_buft_override`` array for
    ``llama_model_params.tensor_buft_overrides``, and the pattern strings it points into (keep
    both alive as long as the model)."""
    check_buffer_types(overrides)
    known = buffer_types()
    patterns = [pattern.encode() for pattern, _ in overrides]
    array = (BuftOverride * (len(overrides) + 1))()
    for i, ((_, name), pattern) in enumerate(zip(overrides, patterns, strict=True)):
        array[i].pattern = pattern
        array[i].buft = known[name]
    return array, patterns
