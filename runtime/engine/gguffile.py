"""A GGUF file's tensor directory, read with the standard library.

llama.cpp offers no API to list the tensors of a file, nor to read one from a file that is not
a model, so the few places that need it read the header here: the embedding context (does the
model have a classifier head?) and the control-vector loader (a file's ``direction.N``
vectors). GGUF v2 and v3, little-endian, as llama.cpp writes them: the magic, the version, the
tensor and metadata counts, the metadata (skipped, but ``general.alignment``), one entry per
tensor (name, dimensions in ggml's order, type, offset), then the data, aligned.

A file that is not such a GGUF, or that ends early, is a ConfigError naming it. The file is
memory-mapped: asking which tensors a 10 GB model has reads its header only.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from llamactor.protocol.errors import ConfigError

GGML_TYPE_F32 = 0
GGML_MAX_DIMS = 4
GGUF_DEFAULT_ALIGNMENT = 32  # llama.cpp's GGUF_DEFAULT_ALIGNMENT, when general.alignment is absent
_VERSIONS = (2, 3)
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # metadata type -> bytes
_UINT32, _STRING, _ARRAY = 4, 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml's ne: the innermost dimension first
    ggml_type: int
    offset: int  # from the start of the data section

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class GgufFile:
    """An open GGUF file: its ``tensors`` (in file order) and, for F32 tensors, their values.
    Use as a context manager; the values ``f32`` returns are copies that outlive it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb")  # noqa: SIM115  # closed by close()
        try:
            if self.path.stat().st_size < _HEADER_BYTES:
                raise ConfigError(f"{self.path} is not a GGUF file")
            self._buf = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                self.tensors, self._data_start = self._read_directory()
            except struct.error:
                raise ConfigError(f"{self.path} is not a GGUF file: it ends inside its header") from None
            except BaseException:
                self._buf.close()
                raise
        except BaseException:
            self._file.close()
            raise

    def __enter__(self) -> GgufFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if not self._buf.closed:
            self._buf.close()
        self._file.close()

    def _read_directory(self) -> tuple[list[TensorInfo], int]:
        buf, path = self._buf, self.path
        if buf[:4] != b"GGUF":
            raise ConfigError(f"{path} is not a GGUF file")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in _VERSIONS:
            raise ConfigError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        off, alignment = _HEADER_BYTES, GGUF_DEFAULT_ALIGNMENT

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            if at + 8 + n > len(buf):
                raise struct.error("a string past the end of the file")
            return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

        def skip(kind: int, at: int) -> int:
            if kind in _SCALAR:
                return at + _SCALAR[kind]
            if kind == _STRING:
                return at + 8 + struct.unpack_from("<Q", buf, at)[0]
            if kind == _ARRAY:
                inner, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if inner in _SCALAR:
                    return at + count * _SCALAR[inner]
                for _ in range(count):
                    at = skip(inner, at)
                    if at > len(buf):
                        raise struct.error("an array past the end of the file")
                return at
            raise ConfigError(f"{path}: unknown GGUF metadata type {kind}")

        for _ in range(n_kv):
            key, off = string(off)
            (kind,) = struct.unpack_from("<I", buf, off)
            if key == "general.alignment" and kind == _UINT32:
                (alignment,) = struct.unpack_from("<I", buf, off + 4)
            off = skip(kind, off + 4)
            if off > len(buf):
                raise struct.error("metadata past the end of the file")
        if alignment == 0 or alignment & (alignment - 1):
            raise ConfigError(f"{path}: general.alignment {alignment} is not a power of two")
        tensors = []
        for _ in range(n_tensors):
            name, off = string(off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            if n_dims > GGML_MAX_DIMS:
                raise ConfigError(f"{path}: tensor {name} has {n_dims} dimensions (at most {GGML_MAX_DIMS})")
            shape = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            off += 4 + 8 * n_dims
            ggml_type, offset = struct.unpack_from("<IQ", buf, off)
            off += 12
            tensors.append(TensorInfo(name, tuple(shape), ggml_type, offset))
        return tensors, off + (-off % alignment)

    def f32(self, tensor: TensorInfo) -> np.ndarray:
        """The values of an F32 tensor of this file, flat (a copy)."""
        if tensor.ggml_type != GGML_TYPE_F32:
            raise ValueError(f"{tensor.name} is not an F32 tensor")
        start = self._data_start + tensor.offset
        if start + 4 * tensor.n_elements > len(self._buf):
            raise ConfigError(f"{self.path}: the data of tensor {tensor.name} runs past the end of the file")
        return np.frombuffer(self._buf, dtype="<f4", count=tensor.n_elements, offset=start).astype(np.float32)


def gguf_tensor_names(path: str | Path) -> list[str]:
    """The tensor names in a GGUF file's header."""
    with GgufFile(path) as f:
        return [t.name for t in f.tensors]
