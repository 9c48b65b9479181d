"""What this build of llama.cpp runs on: its backends, devices, CPU features and build record.

- ``load_backends``: a build with GPU backends is made of loadable modules (``GGML_BACKEND_DL``,
  ``make install BACKEND=cuda``): they are loaded here, once, before anything asks llama.cpp
  for a device. A module whose driver or runtime is missing (a CUDA build on a machine without
  the NVIDIA driver) does not load, and the server runs on the CPU. A build without modules has
  its backends compiled in; nothing is loaded then.
- ``devices``: every device ggml knows (CPU, GPUs, ggml-rpc workers once registered) with its
  kind and memory, as ``/props`` and the startup log show them. A ggml-rpc worker's memory is
  not asked (0): that is a call over the network, and ggml-rpc aborts the process when the
  worker it was registered for has gone (a process that served a split model before).
- ``cpu_features``: the instruction sets the CPU backend was compiled for (llama.cpp's system
  info); ``build_record``: how setup built it (ops/setup/cpuprobe.py's verdicts and the CMake
  arguments, in ``.venv/llamactor-build.json``).
- ``cpu_buffer_types``: the buffer types a weight placed "on the CPU" may land in: the CPU's own
  and its extra ones (AMX, CPU_REPACK), which llama.cpp prefers where the CPU runs them.

llama-cpp-python binds none of ggml's backend registry: the functions are declared here with
ctypes on the bundled ``libggml.so.0`` (the instance llama.cpp uses: ``ggml_path``).
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
import sys
import sysconfig
from pathlib import Path
from typing import Any

import llama_cpp

from llamactor.protocol.build import BuildInfo, Device

BUILD_RECORD = "llamactor-build.json"  # written by ops/setup_venv.sh into the venv
# ggml-backend.h's enum ggml_backend_dev_type
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}

_dev_t = ctypes.c_void_p


def library_dir() -> Path:
    """The folder of libllama.so and its ggml libraries (and backend modules)."""
    return Path(llama_cpp.__file__).resolve().parent / "lib"


GPU_MODULES = ("libggml-cuda.so", "libggml-vulkan.so", "libggml-hip.so", "libggml-metal.so")


def ggml_path() -> Path:
    """The libggml to declare ggml's functions on. A wheel holds copies, not links, of
    ``libggml.so``, ``libggml.so.0`` and ``libggml.so.0.x.y``; each copy loaded is a ggml of its
    own with its own backend registry. A build of loadable modules (a GPU backend: ``make install
    BACKEND=cuda``) must load them into the copy libllama links, its soname ``libggml.so.0``, or
    llama.cpp has no device at all. The CPU-only build registers its backends in every copy, and
    keeps ``libggml.so``: ggml-rpc devices registered there stay out of llama.cpp's own list,
    which ggml-rpc would abort the process on listing once their worker has gone."""
    lib = library_dir()
    modular = any((lib / name).exists() for name in GPU_MODULES)
    return lib / "libggml.so.0" if modular and (lib / "libggml.so.0").exists() else lib / "libggml.so"


@functools.cache
def ggml() -> ctypes.CDLL:
    """libggml.so with the registry functions used here declared (argtypes checked against
    ggml-backend.h of the llama.cpp that llama-cpp-python 0.3.36 vendors)."""
    lib = ctypes.CDLL(str(ggml_path()), mode=ctypes.RTLD_GLOBAL)
    lib.ggml_backend_reg_count.argtypes = []
    lib.ggml_backend_reg_count.restype = ctypes.c_size_t
    lib.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_load_all_from_path.restype = None
    lib.ggml_backend_dev_count.argtypes = []
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = _dev_t
    lib.ggml_backend_dev_name.argtypes = [_dev_t]
    lib.ggml_backend_dev_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_description.argtypes = [_dev_t]
    lib.ggml_backend_dev_description.restype = ctypes.c_char_p
    lib.ggml_backend_dev_type.argtypes = [_dev_t]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_memory.argtypes = [_dev_t, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    lib.ggml_backend_dev_buffer_type.argtypes = [_dev_t]
    lib.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_backend_reg.argtypes = [_dev_t]
    lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buft_name.restype = ctypes.c_char_p
    return lib


@functools.cache
def load_backends() -> int:
    """Load the backend modules of a modular build (once per process); the number of backends
    registered afterwards. A compiled-in build has its backends registered already."""
    lib = ggml()
    if lib.ggml_backend_reg_count() == 0:
        preload_wheel_libraries()
        lib.ggml_backend_load_all_from_path(str(library_dir()).encode())
    llama_cpp.llama_backend_init()
    return int(lib.ggml_backend_reg_count())


def preload_wheel_libraries() -> list[str]:
    """Load the cuBLAS of NVIDIA's wheel, when setup installed it into this environment for a
    CUDA build (ops/setup/cudatoolkit.py): the CUDA module's run path is its own folder, so its
    dlopen finds the libraries by their sonames only once they are loaded. PyTorch does the
    same with the same wheels. The libraries loaded, by path."""
    if not (library_dir() / "libggml-cuda.so").exists():
        return []
    loaded = []
    site = Path(sysconfig.get_paths()["purelib"])
    for name in ("libcublasLt.so.*", "libcublas.so.*"):  # cuBLAS needs cuBLASLt
        for path in sorted(site.glob(f"nvidia/*/lib/{name}")):
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue  # the module then fails to load, and the CPU serves
            loaded.append(str(path))
    return loaded


def devices() -> list[Device]:
    """Every device ggml knows now, in its order (GPUs before the CPU, as llama.cpp lists them)."""
    load_backends()
    lib = ggml()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        name = lib.ggml_backend_dev_name(dev).decode()
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        if not name.startswith("RPC"):  # a worker's memory is a round trip, and an abort once it is gone
            lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(
            Device(
                name=name,
                description=lib.ggml_backend_dev_description(dev).decode(),
                type=DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "unknown"),
                memory_total=total.value,
                memory_free=free.value,
            )
        )
    return out


def gpus() -> list[Device]:
    """The devices that take offloaded layers (-ngl): GPUs, integrated GPUs and accelerators,
    not the CPU and not ggml-rpc workers (those are named with --rpc/--device)."""
    return [d for d in devices() if d.type != "cpu" and not d.name.startswith("RPC")]


_EXTRA_BUFTS = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), _dev_t)


def cpu_buffer_types() -> list[str]:
    """The CPU device's buffer type and its extra ones (AMX, CPU_REPACK, ... where built and
    usable): where llama.cpp may put a weight that stays on the CPU."""
    load_backends()
    lib = ggml()
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        if DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev)) != "cpu":
            continue
        names = [lib.ggml_backend_buft_name(lib.ggml_backend_dev_buffer_type(dev)).decode()]
        reg = lib.ggml_backend_dev_backend_reg(dev)
        address = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts") if reg else None
        if address:
            extra = _EXTRA_BUFTS(address)(dev)
            j = 0
            while extra and extra[j]:
                names.append(lib.ggml_backend_buft_name(extra[j]).decode())
                j += 1
        return names
    return []


def cpu_features() -> tuple[str, ...]:
    """The CPU backend's compiled features as llama.cpp reports them (``AVX2``, ``AMX_INT8``, ...)."""
    info = llama_cpp.llama_print_system_info().decode()
    return tuple(sorted(set(re.findall(r"(\w+) = 1", info))))


def build_record() -> dict[str, Any] | None:
    """What setup recorded of this build: the backend, the CMake arguments and the CPU probe's
    verdicts (None for a llama-cpp-python installed otherwise)."""
    path = Path(sys.prefix) / BUILD_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def summary() -> BuildInfo:
    """The build as ``/props`` shows it (``engine.build``) and the startup log states it."""
    record = build_record() or {}
    probe = record.get("probe") or {}
    kept = probe.get("kept")
    return BuildInfo(
        backend=str(record.get("backend", "unknown")),
        cpu=probe.get("cpu"),
        cpu_features=cpu_features(),
        probed=tuple(kept) if isinstance(kept, list) else None,
        cmake_args=record.get("cmake_args"),
        devices=tuple(devices()),
    )
