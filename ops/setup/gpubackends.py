"""The GPU backend's part of the llama.cpp build: its ``-D`` options and the GPU architectures to compile for.

ops/setup/cpuprobe.py adds these to the CPU instruction sets it probed (``build_options``).

Standard library only: setup runs the probe with the system's Python before the venv has anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

BACKENDS = ("cpu", "cuda", "vulkan", "rocm", "metal")


def backend_options(backend: str, env: Mapping[str, str] | None = None) -> list[str]:
    """The ``-D`` options of a GPU backend. GPU backends are built as loadable modules
    (``GGML_BACKEND_DL``): on a machine without the GPU's driver or runtime the module fails to
    load and the server runs on the CPU, instead of the whole library failing to import.
    The CPU backend is then a module too, built for what the probe ran, as above."""
    env = os.environ if env is None else env
    if backend == "cpu":
        return []
    if backend == "metal":
        return ["-DGGML_METAL=ON"]  # macOS: Metal is llama.cpp's default there; no module needed
    dl = ["-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=OFF"]
    if backend == "cuda":
        archs = env.get("CUDA_ARCHITECTURES") or cuda_architectures()
        # without VMM, ggml-cuda links the CUDA runtime only, not the driver library: a toolkit
        # without the driver's stubs (a build machine without a GPU) still links it
        return [*dl, "-DGGML_CUDA=ON", "-DGGML_CUDA_NO_VMM=ON", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
    if backend == "vulkan":
        return [*dl, "-DGGML_VULKAN=ON"]
    if backend == "rocm":
        targets = env.get("AMDGPU_TARGETS") or rocm_targets()
        return [*dl, "-DGGML_HIP=ON", f"-DAMDGPU_TARGETS={targets}"]
    raise ValueError(f"unknown backend {backend!r}: one of {', '.join(BACKENDS)}")


DEFAULT_CUDA_ARCH = "80"  # with no GPU to ask (a build machine): one architecture, Ampere and newer run it


def cuda_architectures() -> str:
    """The compute capabilities of the GPUs nvidia-smi lists (e.g. "90"), or DEFAULT_CUDA_ARCH."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        caps = sorted({line.strip().replace(".", "") for line in out.splitlines() if line.strip()})
        if caps:
            return ";".join(caps)
    return DEFAULT_CUDA_ARCH


def rocm_targets() -> str:
    """The gfx names rocminfo lists, or llama.cpp's common targets."""
    if shutil.which("rocminfo"):
        try:
            out = subprocess.run(["rocminfo"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        names = sorted({w for w in out.split() if w.startswith("gfx") and w[3:].isalnum() and w != "gfx000"})
        if names:
            return ";".join(names)
    return "gfx1030;gfx1100"
