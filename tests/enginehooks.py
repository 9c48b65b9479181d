"""Hooks made inside the engine process (``engine_hooks="…/enginehooks.py:Class"``): tests of
the isolated engine perturb an engine they cannot reach otherwise. Standalone (loaded by file path in the
child). ``LLAMACTOR_TEST_MARKS`` names a folder where each engine process leaves a mark, so a
hook can act in the first engine only."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any


def _first_engine() -> bool:
    """True in the first engine process of a test (it leaves a mark; later ones see it)."""
    marks = Path(os.environ["LLAMACTOR_TEST_MARKS"])
    n = len(list(marks.glob("engine-*")))
    (marks / f"engine-{os.getpid()}").touch()
    return n == 0


class _Quiet:
    def on_assign(self, group: int, task: Any) -> None: ...
    def before_decode(self, group: int, n_prompt: int, n_generate: int) -> None: ...
    def before_sample(self, group: int, task: Any) -> None: ...
    def before_send(self, group: int, task: Any) -> None: ...
    def after_step(self, group: Any, result: Any) -> None: ...


class HangOnce(_Quiet):
    """The first engine's 30th decode step never returns (a hung ggml-rpc worker)."""

    def __init__(self) -> None:
        self.hang = _first_engine()
        self.steps = 0

    def before_decode(self, group: int, n_prompt: int, n_generate: int) -> None:
        self.steps += 1
        if self.hang and self.steps == 30:
            (Path(os.environ["LLAMACTOR_TEST_MARKS"]) / "hung").touch()  # what a test waits for
            time.sleep(3600)


class SlowRestart(_Quiet):
    """Engines after the first take a while to start (requests pile up meanwhile)."""

    def __init__(self) -> None:
        if not _first_engine():
            time.sleep(float(os.environ.get("LLAMACTOR_TEST_START_S", "2")))


class Slow(_Quiet):
    """Every decode step takes a few milliseconds more, so a test can act while requests run."""

    def before_decode(self, group: int, n_prompt: int, n_generate: int) -> None:
        time.sleep(0.003)


class Slower(_Quiet):
    """Every decode step takes 20 ms more: streams long enough to outlive a replica killed mid-way."""

    def before_decode(self, group: int, n_prompt: int, n_generate: int) -> None:
        time.sleep(0.02)


class AbortOnPoison(Slow):
    """Any engine aborts (SIGABRT, as llama.cpp's GGML_ABORT or an uncaught C++ exception in a
    sampler) when the first token of a request whose prompt starts with token POISON is
    sampled; steps are slow, as in ``Slow``, so other requests are running then."""

    POISON = 77

    def before_sample(self, group: int, task: Any) -> None:
        if len(task.prompt) and int(task.prompt[0]) == self.POISON:
            os.abort()


class IllegalInWarmup(_Quiet):
    """Every engine's warm-up decode dies by SIGILL, as a build with an instruction set this CPU
    traps on dies there (the AMX tile instructions of a VM that advertises them)."""

    def before_warmup(self, group: int) -> None:
        os.kill(os.getpid(), signal.SIGILL)


class IllegalInLaterWarmup(IllegalInWarmup):
    """The first engine serves; the engines started after it die by SIGILL in their warm-up."""

    def __init__(self) -> None:
        self.first = _first_engine()

    def before_warmup(self, group: int) -> None:
        if not self.first:
            super().before_warmup(group)
