"""Control vectors (``--control-vector``, ``--control-vector-scaled``,
``--control-vector-layer-range``), loaded and applied as llama-server does.

A control vector file is a GGUF holding one F32 vector ``direction.N`` of n_embd values per
layer N >= 1 (llama.cpp's cvector-generator writes them). ``load_control_vector`` reads every
file as ``common_control_vector_load`` does: each direction times its file's scale, summed
into one buffer of n_embd values per layer, layer 1 first (several directions for one layer,
in one file or in several, add up). ``ControlVector.apply`` sets it on a context with
``llama_set_adapter_cvec``, over the layer range (both ends included; 0 or less: from layer 1,
to the model's last layer). llama.cpp adds layer N's vector to that layer's output.

It is server-wide, as in llama-server (which has no per-request control vector): every
context of the target model gets it, the groups' and the embedding context (llama-server's
one context serves both); a draft model's contexts do not, as in llama-server.

Unlike llama-server, which logs a file it cannot use and goes on without any control vector,
a missing or malformed file (no direction tensors, a name that is not ``direction.N`` with
N >= 1, a tensor that is not a 1-D F32 vector, vectors of different sizes) is a ConfigError
naming it: ``llamactor serve`` exits with code 2.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from llamactor.protocol.errors import ConfigError, EngineError
from llamactor.runtime.engine.gguffile import GGML_TYPE_F32, GgufFile

_LAYER = re.compile(r"\s*[+-]?\d+")  # std::stoi: leading blanks, a sign, digits; the rest ignored


@dataclass(frozen=True, eq=False)
class ControlVector:
    """The summed directions (``n_embd`` values per layer from layer 1, float32) and the layers
    they apply to."""

    data: np.ndarray
    n_embd: int
    layer_start: int
    layer_end: int

    def apply(self, ctx: Any) -> None:
        """Set on ``ctx`` (right after it is made, before its first decode; llama.cpp copies
        the values). EngineError if llama.cpp refuses it."""
        ptr = self.data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        if llama_cpp.llama_set_adapter_cvec(ctx, ptr, self.data.size, self.n_embd, self.layer_start, self.layer_end):
            raise EngineError("llama.cpp could not set the control vector on a context")


def _layer_of(name: str) -> int:
    """N of ``direction.N`` (llama.cpp splits at the first dot and reads N with stoi); -1 if none."""
    prefix, dot, rest = name.partition(".")
    match = _LAYER.match(rest) if dot and prefix == "direction" else None
    return int(match.group()) if match else -1


def read_directions(path: str | Path, scale: float) -> tuple[int, np.ndarray]:
    """One file's directions times ``scale``: (n_embd, n_embd values per layer from layer 1)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"control vector file not found: {path}")
    n_embd, data = -1, np.zeros(0, dtype=np.float32)
    with GgufFile(path) as f:
        if not f.tensors:
            raise ConfigError(f"control vector {path}: no direction tensors in it")
        for tensor in f.tensors:
            layer = _layer_of(tensor.name)
            if layer < 1:
                raise ConfigError(
                    f"control vector {path}: tensor {tensor.name!r} is not direction.N with a layer N >= 1"
                )
            if tensor.ggml_type != GGML_TYPE_F32 or len(tensor.shape) != 1:
                raise ConfigError(f"control vector {path}: {tensor.name} is not a 1-D F32 tensor")
            if n_embd == -1:
                n_embd = tensor.n_elements
            elif tensor.n_elements != n_embd:
                raise ConfigError(
                    f"control vector {path}: {tensor.name} has {tensor.n_elements} values, the others {n_embd}"
                )
            if data.size < n_embd * layer:
                data = np.concatenate([data, np.zeros(n_embd * layer - data.size, dtype=np.float32)])
            data[n_embd * (layer - 1) : n_embd * layer] += f.f32(tensor) * np.float32(scale)
    return n_embd, data


def load_control_vector(files: Sequence[tuple[str, float]]) -> tuple[int, np.ndarray]:
    """Every (file, scale)'s directions summed, as ``common_control_vector_load``: (n_embd, data)."""
    n_embd, data = -1, np.zeros(0, dtype=np.float32)
    for path, scale in files:
        n, cur = read_directions(path, scale)
        if n_embd not in (-1, n):
            raise ConfigError(f"control vector {path}: {n} values per layer, the files before it {n_embd}")
        n_embd = n
        if cur.size > data.size:
            data = np.concatenate([data, np.zeros(cur.size - data.size, dtype=np.float32)])
        data[: cur.size] += cur
    return n_embd, data


def control_vector_for(
    files: Sequence[tuple[str, float]], layers: tuple[int, int], n_embd_model: int, n_layer_model: int
) -> ControlVector:
    """The control vector of ``files`` for a model of ``n_embd_model`` and ``n_layer_model``
    (``layers``: --control-vector-layer-range, 0 or less for the default end). ConfigError
    naming the files if their vectors are not the model's size (llama.cpp would refuse them)."""
    n_embd, data = load_control_vector(files)
    if n_embd != n_embd_model:
        names = ", ".join(str(path) for path, _ in files)
        raise ConfigError(f"control vector {names}: {n_embd} values per layer, the model's n_embd is {n_embd_model}")
    start, end = layers
    return ControlVector(data, n_embd, start if start > 0 else 1, end if end > 0 else n_layer_model)
