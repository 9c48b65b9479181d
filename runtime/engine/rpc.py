"""ggml-rpc: llama.cpp's own RPC backend, through llama-cpp-python's shared libraries
(for a layer split over remote workers).

llama-cpp-python 0.3.x has no bindings for it, so the few functions we need are declared here
with ctypes on the bundled ``libggml.so`` / ``libggml-rpc.so`` (built with GGML_RPC=ON by
``ops/setup_venv.sh``). Candid note: once llama-cpp-python binds ggml-rpc itself, this module
can shrink to calls into those bindings.

- ``serve_worker`` runs a ggml-rpc server in this process (blocks; ``llamactor worker``);
- ``add_servers`` registers remote workers as devices named RPC0, RPC1, … (in the order given);
- ``device_array`` builds the NULL-terminated device list for ``llama_model_params.devices``.

llama.cpp aborts the whole process when it cannot connect to a worker (GGML_ABORT), so every
endpoint is first checked here with a plain TCP connect, turning that into a clear ConfigError.
"""

from __future__ import annotations

import ctypes
import functools
import socket
from pathlib import Path

import llama_cpp

from llamactor.protocol.errors import ConfigError

CONNECT_TIMEOUT_S = 3.0
DEFAULT_WORKER_PORT = 50052

_dev_t = ctypes.c_void_p
_reg_t = ctypes.c_void_p


def library_dir() -> Path:
    return Path(llama_cpp.__file__).resolve().parent / "lib"


@functools.cache
def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    lib = library_dir()
    rpc_path = lib / "libggml-rpc.so"
    if not rpc_path.exists():
        raise ConfigError(
            f"llama-cpp-python was built without ggml-rpc ({rpc_path} is missing); "
            f"rebuild it with CMAKE_ARGS=-DGGML_RPC=ON (make install does)"
        )
    from llamactor.runtime.engine.backends import ggml_path  # backends imports this module

    ggml = ctypes.CDLL(str(ggml_path()), mode=ctypes.RTLD_GLOBAL)
    rpc = ctypes.CDLL(str(rpc_path), mode=ctypes.RTLD_GLOBAL)
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_dev_get.restype = _dev_t
    ggml.ggml_backend_dev_by_name.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_dev_by_name.restype = _dev_t
    ggml.ggml_backend_dev_name.argtypes = [_dev_t]
    ggml.ggml_backend_dev_name.restype = ctypes.c_char_p
    ggml.ggml_backend_dev_description.argtypes = [_dev_t]
    ggml.ggml_backend_dev_description.restype = ctypes.c_char_p
    ggml.ggml_backend_register.argtypes = [_reg_t]
    ggml.ggml_backend_register.restype = None
    ggml.ggml_backend_reg_dev_count.argtypes = [_reg_t]
    ggml.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_dev_get.argtypes = [_reg_t, ctypes.c_size_t]
    ggml.ggml_backend_reg_dev_get.restype = _dev_t
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_add_server.restype = _reg_t
    rpc.ggml_backend_rpc_start_server.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.POINTER(_dev_t),
    ]
    rpc.ggml_backend_rpc_start_server.restype = None
    return ggml, rpc


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"invalid RPC endpoint {text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def check_reachable(endpoint: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    host, port = parse_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot reach RPC worker {endpoint}: {exc.strerror or exc}") from None


def list_devices() -> list[tuple[str, str]]:
    """(name, description) of every device ggml knows now (CPU, registered RPC workers, …)."""
    ggml, _ = _libs()
    from llamactor.runtime.engine.backends import load_backends

    load_backends()
    out = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        out.append((ggml.ggml_backend_dev_name(dev).decode(), ggml.ggml_backend_dev_description(dev).decode()))
    return out


def add_servers(endpoints: list[str]) -> list[str]:
    """Register each worker (after a reachability check); return the device names it added."""
    ggml, rpc = _libs()
    names: list[str] = []
    for endpoint in endpoints:
        check_reachable(endpoint)
        reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise ConfigError(f"RPC worker {endpoint} reported no devices")
        ggml.ggml_backend_register(reg)
        for i in range(ggml.ggml_backend_reg_dev_count(reg)):
            names.append(ggml.ggml_backend_dev_name(ggml.ggml_backend_reg_dev_get(reg, i)).decode())
    return names


def device_array(names: list[str]) -> ctypes.Array:
    """The NULL-terminated ``ggml_backend_dev_t`` array for ``llama_model_params.devices``."""
    ggml, _ = _libs()
    devices = []
    for name in names:
        dev = ggml.ggml_backend_dev_by_name(name.encode())
        if not dev:
            known = ", ".join(n for n, _ in list_devices())
            raise ConfigError(f"unknown device {name!r}; available: {known}")
        devices.append(dev)
    return (_dev_t * (len(devices) + 1))(*devices, None)


def serve_worker(host: str, port: int, threads: int, device: str = "CPU", cache_dir: str | None = None) -> None:
    """Run a ggml-rpc server on HOST:PORT with one local device; blocks until the process ends."""
    ggml, rpc = _libs()
    from llamactor.runtime.engine.backends import load_backends

    load_backends()  # a GPU build's modules: the worker may serve a GPU (--device CUDA0)
    dev = ggml.ggml_backend_dev_by_name(device.encode())
    if not dev:
        known = ", ".join(n for n, _ in list_devices())
        raise ConfigError(f"unknown device {device!r}; available: {known}")
    devices = (_dev_t * 1)(dev)
    endpoint = f"{host}:{port}".encode()
    rpc.ggml_backend_rpc_start_server(endpoint, cache_dir.encode() if cache_dir else None, threads, 1, devices)
