"""``Faults``: the tests' implementation of ``GroupHooks`` (runtime/hooks.py).

Injected with ``Runtime.open(config, hooks=faults)``. Each knob makes one point of a request's
life fail or wait; ``poison`` picks the requests a request-scoped fault hits (by a predicate on
the task, e.g. its ``n_predict``), so a test can fail one request among many.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from llamactor.protocol.errors import EngineError

TaskPredicate = Callable[[Any], bool]


class InjectedFault(RuntimeError):
    """Raised by a request-scoped injected fault."""


class Faults:
    def __init__(self) -> None:
        self.fail_decode = 0  # the next N decode steps raise (a group failure)
        self.fail_decode_when: Callable[[int, int], bool] = lambda n_prompt, n_generate: True
        self.decode_groups: set[int] | None = None  # groups whose decode may fail or hold (None: all)
        self.hold: threading.Event | None = None  # decode steps wait on this event
        self.hold_groups: set[int] | None = None
        self.holding: set[int] = set()  # groups whose decode step waits on ``hold`` right now
        self.poison: dict[str, TaskPredicate] = {}  # point ("assign", "sample", "send") -> which tasks fail
        self.on_step: Callable[[Any, Any], None] | None = None

    def _mine(self, groups: set[int] | None, group: int) -> bool:
        return groups is None or group in groups

    def on_assign(self, group: int, task: Any) -> None:
        self._poisoned("assign", task)

    def before_decode(self, group: int, n_prompt: int, n_generate: int) -> None:
        hold = self.hold
        if hold is not None and self._mine(self.hold_groups, group):
            self.holding.add(group)
            hold.wait()
            self.holding.discard(group)
        if (
            self.fail_decode > 0
            and self._mine(self.decode_groups, group)
            and self.fail_decode_when(n_prompt, n_generate)
        ):
            self.fail_decode -= 1
            raise EngineError("injected decode failure")

    def before_sample(self, group: int, task: Any) -> None:
        self._poisoned("sample", task)

    def before_send(self, group: int, task: Any) -> None:
        self._poisoned("send", task)

    def after_step(self, group: Any, result: Any) -> None:
        if self.on_step is not None:
            self.on_step(group, result)

    def _poisoned(self, point: str, task: Any) -> None:
        pred = self.poison.get(point)
        if pred is not None and pred(task):
            raise InjectedFault(f"injected {point} failure")
