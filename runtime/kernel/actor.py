"""The actor kernel: bounded typed mailboxes, tell / try_tell / ask, ordered start/stop.

An actor owns its state; the only way in is its mailbox, a bounded anyio memory stream of
frozen msgspec Structs that ``handle`` dispatches with ``match``. Three ways to send:

- ``await tell(msg)``: waits while the mailbox is full (back-pressure);
- ``try_tell(msg)``: never waits, raises ``Overloaded`` when full;
- ``await ask(make, timeout_s)``: builds the message around a one-shot reply channel, sends
  it and waits for the answer, always with a deadline.

``ActorScope`` starts actors one after another with ``tg.start`` (each is ready only after
its ``setup``) and stops them in reverse start order: closing an actor's mailbox is its stop
signal, so it finishes the messages already queued and then runs ``teardown``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from llamactor.protocol.errors import Closed, Overloaded

M = TypeVar("M")
T = TypeVar("T")

DEFAULT_MAILBOX_SIZE = 256
STOP_TIMEOUT_S = 10.0


class Reply(Generic[T]):
    """One-shot reply channel carried inside an ``ask`` message."""

    __slots__ = ("_send",)

    def __init__(self, send: MemoryObjectSendStream[Any]) -> None:
        self._send = send

    def send(self, value: T) -> None:
        self._deliver((True, value))

    def fail(self, error: BaseException) -> None:
        self._deliver((False, error))

    def _deliver(self, item: tuple[bool, Any]) -> None:
        # The asker may have timed out and gone away: that is not the replier's problem.
        try:
            self._send.send_nowait(item)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
            pass
        finally:
            self._send.close()


@dataclass(frozen=True)
class ActorStatistics:
    name: str
    mailbox_used: int  # messages waiting
    mailbox_size: int  # the bound
    finished: bool


class Actor(Generic[M]):
    """Base class. Subclasses implement ``handle(msg)``; may override ``setup``/``teardown``/``loop``."""

    mailbox_size: int = DEFAULT_MAILBOX_SIZE
    name: str = "actor"

    def __init__(self) -> None:
        self._inbox_send: MemoryObjectSendStream[M]
        self._inbox_recv: MemoryObjectReceiveStream[M]
        self._inbox_send, self._inbox_recv = anyio.create_memory_object_stream(self.mailbox_size)
        self._finished = anyio.Event()

    # ---- sending ---------------------------------------------------------------------

    async def tell(self, msg: M) -> None:
        try:
            await self._inbox_send.send(msg)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise Closed(f"{self.name} is stopped") from None

    def try_tell(self, msg: M) -> None:
        try:
            self._inbox_send.send_nowait(msg)
        except anyio.WouldBlock:
            raise Overloaded(f"{self.name} mailbox is full ({self.mailbox_size} messages)") from None
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise Closed(f"{self.name} is stopped") from None

    async def ask(self, make: Callable[[Reply[T]], M], timeout_s: float) -> T:
        """Send ``make(reply)`` and wait at most ``timeout_s`` for the answer (TimeoutError past it)."""
        send, recv = anyio.create_memory_object_stream[tuple[bool, Any]](1)
        # The asker closes both ends when done, so a replier that never answers leaks nothing.
        with recv, send:
            await self.tell(make(Reply(send)))
            with anyio.fail_after(timeout_s):
                try:
                    ok, value = await recv.receive()
                except anyio.EndOfStream:
                    raise Closed(f"{self.name} dropped the request") from None
        if not ok:
            raise value
        return value

    def drain_queued(self, handle: Callable[[M], None], more: Callable[[], bool] = lambda: True) -> bool:
        """Handle queued messages without waiting, while ``more()``; False once the mailbox is closed."""
        while more():
            try:
                msg = self._inbox_recv.receive_nowait()
            except anyio.WouldBlock:
                return True
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return False
            handle(msg)
        return True

    def statistics(self) -> ActorStatistics:
        return ActorStatistics(
            self.name, self._inbox_send.statistics().current_buffer_used, self.mailbox_size, self._finished.is_set()
        )

    # ---- lifecycle -------------------------------------------------------------------

    async def setup(self) -> None:
        """Called once before the actor reports ready; may raise to fail the start."""

    async def teardown(self) -> None:
        """Called once after the mailbox is closed and drained, or the loop failed."""

    async def handle(self, msg: M) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    async def loop(self) -> None:
        """Default loop: handle each message in order until the mailbox is closed."""
        async with self._inbox_recv:
            async for msg in self._inbox_recv:
                await self.handle(msg)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await self.setup()
            task_status.started()
            await self.loop()
        finally:
            # No new messages from here on (senders get Closed), then teardown may drain the rest.
            self._inbox_send.close()
            with anyio.move_on_after(STOP_TIMEOUT_S, shield=True):
                await self.teardown()
            self._inbox_recv.close()
            self._finished.set()

    def close_mailbox(self) -> None:
        """The stop signal: no more messages; the loop ends once the queued ones are handled."""
        self._inbox_send.close()

    async def wait_finished(self) -> None:
        await self._finished.wait()


class ActorScope:
    """Starts actors in order and stops them in reverse order. Use ``open_actor_scope``."""

    def __init__(self, tg: TaskGroup) -> None:
        self._tg = tg
        self._started: list[Actor[Any]] = []

    async def start(self, actor: Actor[Any]) -> None:
        await self._tg.start(actor.run)
        self._started.append(actor)

    async def stop_all(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        for actor in reversed(self._started):
            actor.close_mailbox()
            with anyio.move_on_after(timeout_s, shield=True):
                await actor.wait_finished()
        self._started.clear()


@asynccontextmanager
async def open_actor_scope():
    """``async with open_actor_scope() as scope: await scope.start(a); ...`` — stops on exit."""
    async with anyio.create_task_group() as tg:
        scope = ActorScope(tg)
        try:
            yield scope
        finally:
            await scope.stop_all()
            tg.cancel_scope.cancel()
