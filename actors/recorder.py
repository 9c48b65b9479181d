"""Trace recording for replay (``--record-trace FILE``, read by ``llamactor replay``).

A runtime with a recorder writes one JSON object per line:

- ``{"type": "header", ...}`` first: model, groups, slots per group, n_batch, n_ubatch,
  n_ctx per slot, the policy and its options;
- ``{"type": "request", ...}`` when a request ends: its group, submitted / assigned / first
  token / finished times, prompt length, cached prefix reused, n_predict, n, tokens generated
  (per choice when n > 1) and how it ended (``stop``, ``length``, ``cancelled``, ``error``);
- ``{"type": "step", ...}`` per decode step: group, start, duration (ms), prompt and
  generated tokens, slots in the step, the KV cells those slots hold, and ``gap_ms``, the
  time from the end of the group's previous step to this one's start (``null`` after the
  group waited idle): the loop's own cost between two steps.

Times are ``time.perf_counter()`` seconds relative to the recorder's start (the runtime's).

The group calls ``step``, ``idle`` and ``request`` on the event loop; they only append a
small tuple to a deque (thread-safe for one appender and one popper). A writer thread
formats and writes the lines once per ``flush_interval_s`` and once more at ``close``: no
file I/O ever happens on the event loop or in the decode step. ``start`` and ``close``
block (open, final write, join): call them in a worker thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from llamactor.protocol.errors import ConfigError
from llamactor.protocol.plan import StepPlan
from llamactor.runtime.engine.context import StepResult
from llamactor.runtime.engine.slot import Slot

TRACE_VERSION = 1
FLUSH_INTERVAL_S = 1.0
_STEP, _REQUEST = 0, 1


class TraceRecorder:
    """Collects arrivals and steps of every group of one runtime; one writer thread."""

    def __init__(
        self, path: str | Path, header: Mapping[str, Any], *, flush_interval_s: float = FLUSH_INTERVAL_S
    ) -> None:
        self.path = Path(path).expanduser()
        self.origin = time.perf_counter()  # t = 0 of the trace
        self.flush_interval_s = flush_interval_s
        self._header = {"type": "header", "version": TRACE_VERSION, **header}
        self._pending: deque[tuple[Any, ...]] = deque()
        self._first_token: dict[tuple[int, int], float] = {}  # (group, order) -> released at (holding policies)
        self._last_end: dict[int, float] = {}  # group -> end of its previous step; absent after idle
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file: IO[bytes] | None = None
        self._encoder = msgspec.json.Encoder()
        self.steps = 0  # lines written, by kind (for tests and logs)
        self.requests = 0

    # ---- lifecycle (blocking: worker thread) ---------------------------------------------

    def start(self) -> None:
        """Open the file, write the header and start the writer thread (ConfigError if it cannot)."""
        try:
            self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        except OSError as exc:
            raise ConfigError(f"--record-trace: cannot write {self.path}: {exc.strerror}") from None
        self._file.write(self._encoder.encode(self._header) + b"\n")
        self._file.flush()
        self._thread = threading.Thread(target=self._run, name="llamactor-trace-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the writer, write what is left, close the file. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._file is not None:
            self._write_pending()
            self._file.close()
            self._file = None

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            self._write_pending()

    # ---- called by groups on the event loop (cheap: one tuple each) ----------------------

    def step(self, group: int, t0: float, t1: float, plan: StepPlan, res: StepResult, slots: Sequence[Slot]) -> None:
        """After a decode step, before its results are delivered (slots still hold their requests)."""
        kv = 0
        for local, _ in plan.prefill:
            kv += slots[local].n_past
        for local in plan.generate:
            kv += slots[local].n_past
        for local in plan.release:  # first tokens of requests a barrier held (sampled from kept logits)
            self._first_token[(group, slots[local].order)] = t1
        gap = self._last_end.get(group)
        self._last_end[group] = t1
        self._pending.append(
            (_STEP, group, t0, t1, res.n_prompt, res.n_generated, res.n_rows, kv, None if gap is None else t0 - gap)
        )

    def idle(self, group: int) -> None:
        """The group waits for work: the time until its next step is not loop overhead."""
        self._last_end.pop(group, None)

    def request(self, group: int, members: Sequence[Slot], *, failed: bool, cancelled: bool) -> None:
        """A request ended (any way); ``members`` are its slots, parent first, not yet reset."""
        parent = members[0]
        task = parent.task
        if task is None:
            return
        generated = tuple(m.n_decoded for m in members)
        first = self._first_token.pop((group, parent.order), None)
        if first is None and parent.t_prompt_done and sum(generated):
            first = parent.t_prompt_done  # the first token is sampled right after the prompt
        last = max(m.t_last for m in members) if sum(generated) else None
        if failed:
            finish = "error"
        elif cancelled:
            finish = "cancelled"
        else:
            finish = "length" if all(n >= task.n_predict for n in generated) else "stop"
        self._pending.append(
            (
                _REQUEST,
                group,
                task.arrived,
                parent.t_start,
                len(parent.prompt),
                parent.n_cached,
                task.n_predict,
                generated,
                first,
                last,
                finish,
            )
        )

    # ---- the writer thread ----------------------------------------------------------------

    def _write_pending(self) -> None:
        if self._file is None:
            return
        lines = []
        while True:
            try:
                rec = self._pending.popleft()
            except IndexError:
                break
            lines.append(self._encoder.encode(self._record(rec)))
        if lines:
            self._file.write(b"\n".join(lines) + b"\n")
            self._file.flush()

    def _t(self, at: float | None) -> float | None:
        return None if at is None else round(at - self.origin, 6)

    def _record(self, rec: tuple[Any, ...]) -> dict[str, Any]:
        if rec[0] == _STEP:
            _, group, t0, t1, n_prompt, n_gen, n_rows, kv, gap = rec
            self.steps += 1
            return {
                "type": "step",
                "group": group,
                "start": self._t(t0),
                "ms": round((t1 - t0) * 1e3, 3),
                "prompt": n_prompt,
                "generated": n_gen,
                "slots": n_rows,
                "kv": kv,
                "gap_ms": None if gap is None else round(gap * 1e3, 3),
            }
        _, group, arrived, assigned, n_prompt, n_cached, n_predict, generated, first, last, finish = rec
        self.requests += 1
        out = {
            "type": "request",
            "group": group,
            "submitted": self._t(arrived),
            "assigned": self._t(assigned),
            "prompt": n_prompt,
            "cached": n_cached,
            "n_predict": n_predict,
            "n": len(generated),
            "generated": sum(generated),
            "first_token": self._t(first),
            "finished": self._t(last),
            "finish": finish,
        }
        if len(generated) > 1:
            out["choices"] = list(generated)
        return out


__all__ = ["FLUSH_INTERVAL_S", "TRACE_VERSION", "TraceRecorder"]
