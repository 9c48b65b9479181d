"""The actor kernel: bounded typed mailboxes, tell/try_tell/ask, ordered start and stop."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from llamactor.protocol.errors import Closed, Overloaded
from llamactor.runtime.kernel.actor import Actor, Reply, open_actor_scope


class Add(msgspec.Struct, frozen=True, tag=True):
    n: int


class Get(msgspec.Struct, frozen=True, tag=True):
    reply: Reply


class Never(msgspec.Struct, frozen=True, tag=True):
    reply: Reply


class Counter(Actor[Add | Get | Never]):
    mailbox_size = 2

    def __init__(self, log: list[str], name: str = "counter") -> None:
        super().__init__()
        self.total = 0
        self.log = log
        self.name = name

    async def setup(self) -> None:
        self.log.append(f"start {self.name}")

    async def teardown(self) -> None:
        self.log.append(f"stop {self.name}")

    async def handle(self, msg: Add | Get | Never) -> None:
        match msg:
            case Add(n=n):
                self.total += n
            case Get(reply=reply):
                reply.send(self.total)
            case Never():
                pass  # never answers: the asker's deadline must fire


async def test_tell_ask_and_ordered_stop():
    """Messages are handled in order; ask gets its answer; stop runs in reverse start order."""
    log: list[str] = []
    a, b = Counter(log, "a"), Counter(log, "b")
    async with open_actor_scope() as scope:
        await scope.start(a)
        await scope.start(b)
        assert log == ["start a", "start b"]  # each ready only after its setup
        for i in range(5):
            await a.tell(Add(i))
        assert await a.ask(lambda r: Get(r), timeout_s=1) == 10
    assert log == ["start a", "start b", "stop b", "stop a"]


async def test_try_tell_raises_overloaded_when_full():
    """try_tell never waits; a full mailbox raises Overloaded."""
    actor = Counter([])
    actor.try_tell(Add(1))
    actor.try_tell(Add(2))
    with pytest.raises(Overloaded, match="mailbox is full"):
        actor.try_tell(Add(3))
    stats = actor.statistics()
    assert (stats.mailbox_used, stats.mailbox_size, stats.finished) == (2, 2, False)
    async with open_actor_scope() as scope:  # drain and close it
        await scope.start(actor)
    assert actor.total == 3


async def test_ask_deadline_and_closed():
    """``ask`` always has a deadline; telling a stopped actor raises Closed."""
    actor = Counter([])
    async with open_actor_scope() as scope:
        await scope.start(actor)
        with pytest.raises(TimeoutError):
            await actor.ask(lambda r: Never(r), timeout_s=0.05)
    with pytest.raises(Closed):
        await actor.tell(Add(1))
    with pytest.raises(Closed):
        actor.try_tell(Add(1))


async def test_setup_failure_fails_start():
    """An actor whose setup raises is never reported ready."""

    class Broken(Counter):
        async def setup(self) -> None:
            raise RuntimeError("no context")

    with pytest.raises(BaseException) as info:
        async with open_actor_scope() as scope:
            await scope.start(Broken([]))
    assert "no context" in repr(info.value)


async def test_queued_messages_handled_before_stop():
    """Closing the mailbox is the stop signal; queued messages are still handled."""
    actor = Counter([])
    async with open_actor_scope() as scope:
        await scope.start(actor)
        actor.try_tell(Add(4))
        actor.try_tell(Add(5))
    assert actor.total == 9
    with anyio.fail_after(1):
        await actor.wait_finished()
