"""Supervisor: owns the task queue and the slot table of every group, and keeps groups alive.

Slot selection runs over every free slot of every group: longest common prefix of
the slot's cached tokens with the prompt first (KV reuse), then the least busy group, then
the lowest slot id (not least recently used: see ``actors.scheduling`` for the measurement); a task may
pin ``id_slot``. A task with n > 1 choices needs n free slots in one group; it
waits otherwise and never splits. The queue is bounded: past ``queue_size`` a task is refused
with ``Overloaded`` (HTTP 503 + Retry-After), never an unbounded wait.

Supervision: a group whose loop raises has every in-flight request failed with an
``EngineError`` event (none hangs), its slots returned to the table, and is restarted with a
fresh context, one-for-one; more than ``max_restarts`` within ``restart_window_s`` marks the
runtime unhealthy and the group stays down. Requests are never silently retried.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import msgspec
import numpy as np
import structlog
from anyio.abc import TaskGroup, TaskStatus

from llamactor.actors.group import GroupActor
from llamactor.actors.scheduling import EMPTY, LOWEST, SlotEntry, choose_slots
from llamactor.protocol.errors import Closed, NotFound, Overloaded, Unavailable
from llamactor.protocol.events import Failed
from llamactor.protocol.lora import NO_LORA, LoraSet
from llamactor.protocol.messages import (
    PREFIX_HOLDER,
    Assign,
    Cancel,
    Released,
    Revoke,
    SlotCached,
    SlotCommand,
    SlotRequest,
    Submit,
    SupervisorMsg,
    Task,
)
from llamactor.protocol.slots import SlotActionResult, SlotKV, SlotState
from llamactor.runtime.engine.promptcache import common_prefix
from llamactor.runtime.kernel.actor import Actor

log = structlog.get_logger("llamactor.supervisor")


@dataclass(frozen=True)
class TableSnapshot:
    queue_depth: int
    busy: tuple[bool, ...]
    healthy: bool
    groups_down: tuple[int, ...]
    restarts: tuple[int, ...]  # per group


class Supervisor(Actor[SupervisorMsg]):
    name = "supervisor"

    def __init__(
        self,
        n_groups: int,
        slots_per_group: int,
        make_group: Callable[[int], GroupActor],
        *,
        queue_size: int,
        max_restarts: int,
        restart_window_s: float,
        slot_choice: str = LOWEST,
    ) -> None:
        self.mailbox_size = max(64, queue_size + 64)
        super().__init__()
        self.make_group = make_group
        self.queue_size = queue_size
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.groups: list[GroupActor | None] = [None] * n_groups
        self.table = [SlotEntry(g * slots_per_group + i, g, i) for g in range(n_groups) for i in range(slots_per_group)]
        self.queue: deque[Task] = deque()
        self.running: dict[int, int] = {}  # task id -> group
        # slot id -> the prompt and adapters of the request it serves (busy)
        self.serving: dict[int, tuple[np.ndarray, LoraSet]] = {}
        self.down: set[int] = set()  # groups past their restart limit
        self.restarts = [0] * n_groups
        self._schedule_soon = False
        self._tg: TaskGroup | None = None  # where the groups run (``restart_down`` starts more)
        self.slot_choice = slot_choice  # choose_slots' rule among equal candidates
        self._releases = 0  # counts slot releases: the order ``LRU`` goes by

    # ---- lifecycle: the supervisor starts, watches and stops its groups ------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for g in range(len(self.groups)):
                    await tg.start(self._keep_group, g)
                task_status.started()
                await self.loop()
                for g in reversed(range(len(self.groups))):
                    group = self.groups[g]
                    if group is not None:
                        group.close_mailbox()
                        await group.wait_finished()
                tg.cancel_scope.cancel()
        finally:
            self._fail_queue("the runtime is shutting down")
            self._inbox_send.close()
            self._inbox_recv.close()
            self._finished.set()

    async def _keep_group(self, g: int, *, task_status: TaskStatus[None]) -> None:
        """Run group ``g``; restart it after a failure, within the intensity limit.

        A failure before the first start completed is not supervised: it fails the runtime's
        start (a context that cannot be created once will not be created on retry either).
        """
        status = _StartOnce(task_status)
        failures: deque[float] = deque()
        while True:
            group = self.make_group(g)
            self.groups[g] = group
            if self._schedule_soon:
                self._schedule_soon = False
                self._schedule()  # queued tasks may go to the restarted group (it queues them until ready)
            try:
                await group.run(task_status=status)
                return  # clean stop: the mailbox was closed
            except Exception as exc:
                if not status.started_once:
                    raise
                log.error("group_failed", group=g, error=str(exc))
                # The group failed its requests itself; its slots are free and hold nothing now,
                # before a successor exists, so no new task can land on a slot still marked busy.
                self._reset_group(g)
                now = time.monotonic()
                failures.append(now)
                while failures and now - failures[0] > self.restart_window_s:
                    failures.popleft()
                if len(failures) > self.max_restarts:
                    log.error("group_down", group=g, restarts=self.restarts[g])
                    self.down.add(g)
                    self.groups[g] = None
                    self._fail_unservable()
                    return
                self.restarts[g] += 1
                self._schedule_soon = True

    async def restart_down(self) -> None:
        """Start again the groups that went down past their restart limit (each with a fresh
        restart budget); a group that cannot start stays down. Returns once they are serving."""
        assert self._tg is not None
        for g in sorted(self.down):
            self.down.discard(g)
            log.info("group_restart_asked", group=g)
            try:
                await self._tg.start(self._keep_group, g)
            except Exception as exc:
                log.error("group_restart_failed", group=g, error=str(exc))
                self.down.add(g)
                self.groups[g] = None
        self._schedule()

    def group(self, g: int) -> GroupActor | None:
        return self.groups[g]

    @property
    def healthy(self) -> bool:
        return not self.down

    # ---- messages ----------------------------------------------------------------------

    async def loop(self) -> None:
        """Each wake-up handles every message already queued before anything else runs: requests
        submitted together are placed together, so their groups plan them into one step (as
        llama-server takes every queued task before its next step)."""
        async with self._inbox_recv:
            async for msg in self._inbox_recv:
                self._on(msg)
                self.drain_queued(self._on)

    async def handle(self, msg: SupervisorMsg) -> None:
        self._on(msg)

    def _on(self, msg: SupervisorMsg) -> None:
        match msg:
            case Submit(task=task):
                self._submit(task)
            case Cancel(task_id=task_id):
                self._cancel(task_id)
            case Released(group=g, slots=locals_, cached=cached, task_id=task_id, lora=lora):
                self.running.pop(task_id, None)
                self._released(g, locals_, cached, lora)
            case SlotCached(group=g, slot=local, cached=cached, lora=lora):
                e = self._entry(g, local)
                e.cached, e.lora = (np.asarray(cached, dtype=np.int32) if cached else EMPTY), lora
            case SlotRequest():
                self._slot_request(msg)

    def snapshot(self) -> TableSnapshot:
        return TableSnapshot(
            queue_depth=len(self.queue),
            busy=tuple(e.busy for e in self.table),
            healthy=self.healthy,
            groups_down=tuple(sorted(self.down)),
            restarts=tuple(self.restarts),
        )

    def slot_states(self) -> list[SlotState]:
        """Every slot of every group (each reported by its group); a group that is down past its
        restart limit shows its slots as "down"."""
        states: list[SlotState] = []
        per_group = len(self.table) // len(self.groups)
        for g, group in enumerate(self.groups):
            if group is not None:
                states += group.slot_states()
            else:
                states += [SlotState(id=g * per_group + i, group=g, busy=False, phase="down") for i in range(per_group)]
        return states

    def _submit(self, task: Task) -> None:
        if task.id_slot >= len(self.table):
            _fail(task, f"slot {task.id_slot} does not exist (0..{len(self.table) - 1})", "NotFound")
            return
        if self._unservable(task):
            _fail(task, "no group can serve this request: the runtime is unhealthy", "Unavailable")
            return
        if not self._try_start(task):
            if len(self.queue) >= self.queue_size:
                _fail(task, f"the server is busy: {len(self.queue)} requests are queued", "Overloaded")
                return
            self.queue.append(task)

    def _cancel(self, task_id: int) -> None:
        for t in self.queue:
            if t.id == task_id:
                self.queue.remove(t)
                t.sink.close()
                return
        g = self.running.get(task_id)
        group = self.groups[g] if g is not None else None
        if group is not None:
            try:
                group.try_tell(Revoke(task_id))
            except (Overloaded, Closed):
                pass  # the group also frees the slots when it finds the stream closed

    def _released(
        self, g: int, locals_: tuple[int, ...], cached: tuple[tuple[int, ...], ...], lora: tuple[LoraSet, ...] = ()
    ) -> None:
        self._releases += 1
        for i, (local, toks) in enumerate(zip(locals_, cached)):
            e = self._entry(g, local)
            e.busy = False
            self.serving.pop(e.id, None)
            e.released = self._releases
            e.cached = np.asarray(toks, dtype=np.int32) if toks else EMPTY
            e.lora = lora[i] if i < len(lora) else NO_LORA
        self._schedule()

    def _reset_group(self, g: int) -> None:
        for e in self.table:
            if e.group == g:
                e.busy = False
                e.cached = EMPTY
                self.serving.pop(e.id, None)
        self.running = {t: grp for t, grp in self.running.items() if grp != g}

    def _fail_unservable(self) -> None:
        """Queued tasks that no live group can serve fail now instead of waiting forever."""
        for t in list(self.queue):
            if self._unservable(t):
                self.queue.remove(t)
                _fail(t, "no group can serve this request: the runtime is unhealthy", "Unavailable")

    def _unservable(self, task: Task) -> bool:
        if task.id_slot >= 0:
            return self.table[task.id_slot].group in self.down
        return len(self.down) == len(self.groups)

    def _slot_request(self, req: SlotRequest) -> None:
        if req.slot == PREFIX_HOLDER and req.action == "export" and req.kv is not None:
            holder = self._prefix_holder(np.asarray(req.kv.tokens, dtype=np.int32), req.kv.lora)
            if holder < 0:  # no slot shares any of it (under those adapters): nothing to export
                req.reply.send(SlotActionResult(slot=-1, action="export", n_tokens=0, kv=SlotKV(tokens=())))
                return
            req = msgspec.structs.replace(req, slot=holder)
        if not 0 <= req.slot < len(self.table):
            req.reply.fail(NotFound(f"slot {req.slot} does not exist (0..{len(self.table) - 1})"))
            return
        e = self.table[req.slot]
        group = self.groups[e.group]
        if group is None:
            req.reply.fail(Unavailable(f"group {e.group} is down"))
            return
        # Only the owning group is involved: other groups keep decoding.
        try:
            group.try_tell(SlotCommand(req.action, e.local, req.path, req.reply, req.kv))
        except (Overloaded, Closed) as exc:
            req.reply.fail(Overloaded(f"group {e.group} cannot take more slot commands now: {exc}"))

    def _prefix_holder(self, tokens: np.ndarray, lora: LoraSet) -> int:
        """The slot whose KV, computed under ``lora``, shares the longest prefix with ``tokens``
        (busy or idle: a busy slot holds its request's prompt, as far as its prefill has gone);
        -1 when none shares any."""
        best, best_n = -1, 0
        for e in self.table:
            if e.group in self.down or self.groups[e.group] is None:
                continue
            held, held_lora = self.serving.get(e.id, (EMPTY, NO_LORA)) if e.busy else (e.cached, e.lora)
            n = common_prefix(held, tokens) if held_lora == lora else 0
            if n > best_n:
                best, best_n = e.id, n
        return best

    # ---- scheduling --------------------------------------------------------------------

    def _schedule(self) -> None:
        """Start what can start: queued requests in priority order (lower first; ties keep
        their arrival order: the sort is stable)."""
        for task in sorted(self.queue, key=_priority):
            if self._try_start(task):
                self.queue.remove(task)

    def _try_start(self, task: Task) -> bool:
        chosen = self._choose(task)
        if chosen is None:
            return False
        group = self.groups[chosen[0].group]
        assert group is not None
        try:
            group.try_tell(Assign(task, tuple(e.local for e in chosen)))
        except (Overloaded, Closed):
            return False  # the group is failing or full: the task stays queued
        for e in chosen:
            e.busy = True
            self.serving[e.id] = (task.prompt, task.lora)
        self.running[task.id] = chosen[0].group
        return True

    def _choose(self, task: Task) -> list[SlotEntry] | None:
        """The parent slot plus n-1 free slots of the same group, by ``scheduling.choose_slots``
        (the rule the replay simulator uses too): the longest reusable cached prefix, then the
        least busy group, then the lowest slot id; ``id_slot`` pins."""
        unavailable = self.down.union(g for g, group in enumerate(self.groups) if group is None)
        ids = choose_slots(
            self.table,
            task.prompt,
            n=task.n,
            id_slot=task.id_slot,
            lora=task.lora,
            unavailable=unavailable,
            prefer=self.slot_choice,
        )
        return None if ids is None else [self.table[i] for i in ids]

    def _entry(self, g: int, local: int) -> SlotEntry:
        return self.table[g * (len(self.table) // len(self.groups)) + local]

    def _fail_queue(self, message: str) -> None:
        while self.queue:
            _fail(self.queue.popleft(), message, "Unavailable")


class _StartOnce:
    """Passes the first ``started()`` to the real task status; later restarts report nothing."""

    def __init__(self, status: TaskStatus[None]) -> None:
        self._status = status
        self.started_once = False

    def started(self, value: None = None) -> None:
        if not self.started_once:
            self.started_once = True
            self._status.started(value)


def _priority(task: Task) -> int:
    return task.priority


def _fail(task: Task, message: str, error: str) -> None:
    try:
        task.sink.send_nowait(Failed(message, error))
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
        pass
    task.sink.close()
