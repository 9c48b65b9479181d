"""What the engine's llama.cpp build runs on, as ``/props`` and the engine's ready message carry it."""

from __future__ import annotations

import msgspec


class Device(msgspec.Struct, frozen=True, kw_only=True):
    """One ggml device: CPU, a GPU (CUDA0, Vulkan0, ...), a ggml-rpc worker (RPC0, ...)."""

    name: str
    description: str
    type: str  # cpu | gpu | igpu | accel
    memory_total: int  # bytes (the host's memory for the CPU)
    memory_free: int


class BuildInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The build the engine runs: how setup made it and what it found on this machine."""

    backend: str  # what setup was asked for: cpu, cuda, vulkan, rocm, metal ("unknown": not built by setup)
    cpu: str | None = None  # the CPU's name, as the setup's probe read it
    cpu_features: tuple[str, ...] = ()  # what the CPU backend was compiled for (llama.cpp's system info)
    probed: tuple[str, ...] | None = None  # the instruction sets setup's probe ran here (None: no probe)
    cmake_args: str | None = None  # the CMake arguments of the llama.cpp build
    devices: tuple[Device, ...] = ()
