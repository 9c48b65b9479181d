"""Why an engine process died before it could serve, in words a user can act on.

An engine that dies while loading or in its warm-up decode has met no request: the cause is the
build, the machine or the model file, and every restart would meet it again. The API process
says so once, naming the signal, what was running and the remedy, and does not restart it
(startup fails; a restart that dies this way takes the engine DOWN with this reason, which
``/health`` then gives).
"""

from __future__ import annotations

import signal

from llamactor.protocol.errors import EngineError


class CannotStart(EngineError):
    """An engine process died before it was ready in a way a restart would meet again."""


REBUILD = (
    "rebuild llama.cpp for what this machine executes: `make install` (or `bash ops/setup_venv.sh`) "
    "runs each instruction set in a child process and rebuilds llama-cpp-python for those that ran"
)


def _features() -> str:
    try:
        from llamactor.runtime.engine.backends import cpu_features

        return ", ".join(cpu_features())
    except Exception:  # the build cannot even say: the message stands without it
        return "unknown"


def startup_death(code: int | None, *, in_warmup: bool) -> str | None:
    """The cause and remedy of an engine process that ended with ``code`` before it was ready
    (``in_warmup``: inside a context's warm-up decode), or None for an ending that says nothing
    more than its exit code (a config error the engine printed itself)."""
    if code is None or code >= 0:
        return None
    where = "in its warm-up decode" if in_warmup else "while loading the model"
    sig = -code
    if sig == signal.SIGILL:
        return (
            f"the engine died by SIGILL (illegal instruction) {where}: llama.cpp's CPU kernels hold an "
            f"instruction this machine does not execute (a build made on another machine, for instruction "
            f"sets this CPU advertises and traps on, or miscompiled kernels such as AMX's by GCC 12; "
            f"built for: {_features()}); {REBUILD}"
        )
    if sig == signal.SIGBUS:
        return (
            f"the engine died by SIGBUS {where}: the memory-mapped model file could not be read "
            "(a truncated file, or one changed while mapped); check the file, or load it with --no-mmap"
        )
    if sig == signal.SIGKILL:
        return (
            f"the engine was killed (SIGKILL) {where}, most likely by the out-of-memory killer: "
            "use a smaller context (-c) or fewer slots (-np), a quantized KV cache (-ctk/-ctv q8_0), "
            "or fewer layers on the GPU (-ngl)"
        )
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    return f"the engine died by {name} {where}; llama.cpp's log above says what it was doing"
