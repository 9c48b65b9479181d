"""Where a CUDA build's cuBLAS comes from.

    python ops/setup/cudatoolkit.py requirement   # cuBLAS's pip requirement when the toolkit lacks it
    python ops/setup/cudatoolkit.py cmake         # CMake arguments for a cuBLAS installed from that wheel

ggml-cuda links cuBLAS. A full CUDA toolkit has it; a toolkit assembled from NVIDIA's pip wheels
(``nvidia-cuda-nvcc``, ``nvidia-cuda-runtime``, ...), as on the machines this project is built on,
has nvcc and the runtime but not cuBLAS, and CMake's FindCUDAToolkit then fails the build. Setup
then installs the ``nvidia-cublas`` wheel of the toolkit's release into the venv (the same wheel
PyTorch installs) and points the build at its library and headers. The engine loads the libraries
of that wheel before ggml's backend modules (runtime/engine/backends.py), since the built module's
run path is its own folder only.

Both commands print nothing when there is nothing to do: no nvcc, or a toolkit with cuBLAS.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path


def nvcc_release(nvcc: str) -> tuple[int, int] | None:
    """The toolkit's release, from ``nvcc --version`` ("release 13.0, V13.0.88")."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else None


def toolkit_library_dirs(nvcc: str) -> list[Path]:
    """The folders nvcc links from (its dry run's ``-L`` options, stubs left out), and the
    toolkit root's lib64 and lib. nvcc may be a wrapper script, so its path says nothing."""
    out = subprocess.run(
        [nvcc, "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stderr
    dirs = [Path(d) for d in re.findall(r'"-L([^"]+)"', out) if not d.rstrip("/").endswith("stubs")]
    top = re.search(r"^#\$ TOP=(.+)$", out, re.M)
    if top:
        dirs += [Path(top[1].strip()) / "lib64", Path(top[1].strip()) / "lib"]
    return dirs


def has_cublas(dirs: list[Path]) -> bool:
    return any(any(d.glob("libcublas.so*")) for d in dirs if d.is_dir())


def requirement(release: tuple[int, int]) -> str:
    """The cuBLAS wheel of a toolkit release: CUDA 13's is ``nvidia-cublas``, CUDA 12's
    ``nvidia-cublas-cu12``; the same minor release as the toolkit's headers and runtime."""
    major, minor = release
    name = "nvidia-cublas" if major >= 13 else f"nvidia-cublas-cu{major}"
    return f"{name}>={major}.{minor},<{major}.{minor + 1}"


def wheel_cublas(site: Path) -> Path | None:
    """The folder of the installed wheel's ``lib`` and ``include`` (nvidia/cu13 for CUDA 13,
    nvidia/cublas for CUDA 12), or None."""
    for lib in sorted(site.glob("nvidia/*/lib/libcublas.so.*")):
        return lib.parent.parent
    return None


def cmake_args(root: Path) -> list[str]:
    """FindCUDAToolkit's cache entries for the two libraries, and the headers' folder added to
    every CUDA and C++ compile (the wheel's headers are not in the toolkit's include folder)."""
    lib = root / "lib"
    blas = next(lib.glob("libcublas.so.*"))
    blas_lt = next(lib.glob("libcublasLt.so.*"))
    include = root / "include"
    return [
        f"-DCUDA_cublas_LIBRARY={blas}",
        f"-DCUDA_cublasLt_LIBRARY={blas_lt}",
        f"-DCMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES={include}",
        f"-DCMAKE_CXX_STANDARD_INCLUDE_DIRECTORIES={include}",
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ("requirement", "cmake"):
        print(__doc__, file=sys.stderr)
        return 2
    nvcc = shutil.which("nvcc")
    if nvcc is None or has_cublas(toolkit_library_dirs(nvcc)):
        return 0
    if argv[0] == "requirement":
        release = nvcc_release(nvcc)
        if release is not None:
            print(requirement(release))
        return 0
    root = wheel_cublas(Path(sysconfig.get_paths()["purelib"]))
    if root is not None:
        print(" ".join(cmake_args(root)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
