"""A slot's KV state as bytes another server can import (``POST /slots/{id}?action=export``
and ``?action=import``; ``Runtime.export_slot`` / ``import_slot``).

The engine reads a slot's state out as a ``SlotKV`` (its tokens, the LoRA set that computed
them, ``llama_state_seq_get_data`` of its sequence). Leaving the server, the state carries
what makes it meaningful elsewhere: which model file computed it, the KV cache's types and the
adapters by file rather than by this server's adapter ids. An import is refused with a 400 when
any of them differs from the importing server's; llama.cpp itself then checks the state's
layout (layers, cell sizes, V transposition) as it writes it.

The bytes: ``MAGIC``, a 4-byte big-endian header length, the msgpack ``Header``, the state.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import msgspec

from llamactor.protocol.errors import RequestError
from llamactor.protocol.lora import LoraSet
from llamactor.protocol.slots import SlotKV

MAGIC = b"llamactor-slot-kv\n"
VERSION = 1
_LENGTH = struct.Struct(">I")
# the digest of a file reads its size, its first and its last MiB: a GGUF's first bytes are its
# metadata (often the same for fine-tunes of one base), its last are tensor data
DIGEST_SPAN = 1 << 20
# the largest state an import reads (the body stops there with a 413): a SmolLM2 slot of 8,192
# tokens is about 180 MiB, a gemma3-270m slot of 4,096 about 72 MiB
MAX_IMPORT_BYTES = 1 << 30
MAX_HEADER_BYTES = 16 << 20  # the header's tokens: 16 MiB holds over 3 million token ids


def file_digest(path: str | os.PathLike[str]) -> str:
    """A short identity of a model or adapter file: sha256 of its size and its first and last
    ``DIGEST_SPAN`` bytes (the whole file when smaller)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(str(size).encode())
        h.update(f.read(DIGEST_SPAN))
        if size > 2 * DIGEST_SPAN:
            f.seek(size - DIGEST_SPAN)
        h.update(f.read(DIGEST_SPAN))
    return h.hexdigest()[:32]


class Identity(msgspec.Struct, frozen=True):
    """What a server's slots' states depend on, beside the state's own layout."""

    model: str  # file_digest of the model, and of what else changes its KV (``identity``)
    model_name: str  # its file name, for error messages
    type_k: str
    type_v: str
    adapters: tuple[str, ...]  # file_digest of each loaded LoRA adapter, by adapter id


def identity(
    model: str | os.PathLike[str],
    type_k: str,
    type_v: str,
    adapters: Sequence[str],
    context: Sequence[object] = (),
    control_vectors: Sequence[tuple[str, float]] = (),
) -> Identity:
    """The identity of a server of ``model`` with these KV types and adapter files; ``context``:
    the other settings its KV depends on (RoPE and YaRN), ``control_vectors`` (file, scale) added
    to its layers. Reads the files: call it off the event loop."""
    h = hashlib.sha256(file_digest(model).encode())
    h.update(repr(tuple(context)).encode())
    for path, scale in control_vectors:
        h.update(f"{file_digest(path)}:{scale}".encode())
    return Identity(h.hexdigest()[:32], Path(model).name, type_k, type_v, tuple(file_digest(a) for a in adapters))


class Header(msgspec.Struct, frozen=True):
    version: int
    model: str
    model_name: str
    type_k: str
    type_v: str
    lora: tuple[tuple[str, float], ...]  # (adapter file digest, scale)
    tokens: tuple[int, ...]


def pack(kv: SlotKV, ident: Identity) -> bytes:
    """The bytes of an exported slot."""
    lora = tuple((ident.adapters[i], scale) for i, scale in kv.lora)
    header = msgspec.msgpack.encode(
        Header(VERSION, ident.model, ident.model_name, ident.type_k, ident.type_v, lora, kv.tokens)
    )
    return b"".join((MAGIC, _LENGTH.pack(len(header)), header, kv.state))


def unpack(data: bytes | bytearray, ident: Identity) -> SlotKV:
    """The state in ``data`` (``pack``'s bytes) for a server of identity ``ident``, or a
    ``RequestError`` saying what differs."""
    start = len(MAGIC) + _LENGTH.size
    if not data.startswith(MAGIC) or len(data) < start:
        raise RequestError("the body is not an exported slot (POST /slots/{id}?action=export writes one)")
    (n,) = _LENGTH.unpack_from(data, len(MAGIC))
    if n > MAX_HEADER_BYTES:
        raise RequestError(f"the exported slot's header is {n} bytes, over the limit of {MAX_HEADER_BYTES}")
    try:
        header = msgspec.msgpack.decode(data[start : start + n], type=Header)
    except msgspec.DecodeError as exc:
        raise RequestError(f"the exported slot's header cannot be read: {exc}") from None
    if header.version != VERSION:
        raise RequestError(f"the exported slot has format version {header.version}; this server reads {VERSION}")
    if header.model != ident.model:
        raise RequestError(
            f"the slot was exported by a server of another model ({header.model_name}) or other RoPE, YaRN or "
            f"control-vector settings; this server runs {ident.model_name}"
        )
    if (header.type_k, header.type_v) != (ident.type_k, ident.type_v):
        raise RequestError(
            f"the slot's KV cache types are K {header.type_k}, V {header.type_v}; this server's are "
            f"K {ident.type_k}, V {ident.type_v} (-ctk, -ctv)"
        )
    lora: list[tuple[int, float]] = []
    for digest, scale in header.lora:
        if digest not in ident.adapters:
            raise RequestError(
                "the slot's KV was computed with a LoRA adapter this server has not loaded (--lora): "
                "it can only be imported where the same adapter files are loaded"
            )
        lora.append((ident.adapters.index(digest), scale))
    return SlotKV(tokens=header.tokens, lora=_canonical(lora), state=bytes(memoryview(data)[start + n :]))


def _canonical(lora: list[tuple[int, float]]) -> LoraSet:
    return tuple(sorted(lora))
