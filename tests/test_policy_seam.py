"""The policy seam of a live server: every plan is checked (a bad policy fails the request it
got wrong, with a message naming the policy and the slot, and the group serves on under the
fallback), a request's priority and tags reach the policy, policy options pass through, and
a policy may be given as a class or an instance (one per group)."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import anyio
import pytest
from conftest import wait_until
from faults import Faults
from serveargs import parse_serve

from llamactor.actors.policies.continuous import ContinuousPolicy
from llamactor.actors.policy import GroupView, Policy, StepPlan, check_plan, fill_prefill, generating
from llamactor.protocol.messages import Grant
from llamactor.protocol.plan import SlotView
from llamactor.runtime import EngineError, Runtime, Token

PROMPT = "The quick brown fox jumps over the lazy dog"


class OverFeeds(Policy):
    """Continuous batching, but a request tagged ``bad`` gets more prompt tokens than it has."""

    name = "over-feeds"

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        generate = generating(view)
        prefill = list(fill_prefill(view.slots, view.n_batch - len(generate)))
        for i, (local, k) in enumerate(prefill):
            if next(s for s in view.slots if s.local == local).tags.get("bad"):
                prefill[i] = (local, k + 5)
        return StepPlan(prefill=tuple(prefill), generate=generate)


class Raises(Policy):
    name = "raises"

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        if any(s.tags.get("bad") for s in view.slots):
            raise ZeroDivisionError("the policy's own bug")
        return ContinuousPolicy(self.group).plan(view, grant)


class Records(ContinuousPolicy):
    """Continuous batching that records what it was given and what it saw."""

    name = "records"
    made: ClassVar[list[Records]] = []
    seen: ClassVar[list[SlotView]] = []

    def __init__(self, group: int = 0, **options: Any) -> None:
        super().__init__(group, **options)
        Records.made.append(self)

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        Records.seen.extend(view.slots)
        return super().plan(view, grant)


def test_check_plan_names_the_slot_and_why():
    view = GroupView(0, 8, (SlotView(1, "prefill", 3, 0, -1), SlotView(2, "generate", 0, 1, -1)))
    assert check_plan(view, StepPlan(prefill=((1, 3),), generate=(2,))) is None
    problem = check_plan(view, StepPlan(prefill=((1, 4),)))
    assert problem is not None and problem.slot == 1 and "3 prompt tokens left" in problem.why
    assert check_plan(view, StepPlan(generate=(1,))).slot == 1
    assert check_plan(view, StepPlan(prefill=((1, 3),), generate=(2, 2))).why == "appears twice in the plan"
    assert "more than n_batch" in check_plan(GroupView(0, 2, view.slots), StepPlan(prefill=((1, 3),))).why


async def test_a_plan_that_cannot_run_fails_its_request_and_the_group_serves_on(make_config):
    """The request on the slot the policy got wrong fails with a message naming the policy and
    the slot; the request beside it completes; the group is not restarted and serves the next
    requests under continuous batching."""
    async with Runtime.open(make_config(scheduler=OverFeeds)) as rt:
        async with anyio.create_task_group() as tg:
            good: list[Any] = []

            async def run_good() -> None:
                good.append(await rt.complete(PROMPT, max_tokens=8, temperature=0, ignore_eos=True))

            tg.start_soon(run_good)
            with pytest.raises(EngineError) as failed:
                await rt.complete(PROMPT + " again", max_tokens=8, tags={"bad": "yes"})
        message = str(failed.value)
        assert "'over-feeds'" in message and "continuous batching" in message
        assert "slot" in message and "prompt tokens left" in message
        assert good[0].n_predicted == 8
        assert rt.engine.supervisor.snapshot().restarts == (0,)
        after = await rt.complete(PROMPT, max_tokens=4, tags={"bad": "yes"})  # the fallback serves it
        assert after.n_predicted == 4
        policy_now = rt.engine.coordinator.policy(0)
        assert policy_now.name == "continuous" and "over-feeds" in policy_now.failed


async def test_a_policy_that_raises_is_replaced_and_its_traceback_logged(make_config, capsys):
    """A policy whose plan raises names no slot: nothing fails, the group goes on under the
    fallback (the request that made it raise completes), and the traceback is in the log."""
    async with Runtime.open(make_config(scheduler=Raises)) as rt:
        out = await rt.complete(PROMPT, max_tokens=4, tags={"bad": "yes"})
        assert out.n_predicted == 4
        assert rt.engine.supervisor.snapshot().restarts == (0,)
        assert "ZeroDivisionError" in rt.engine.coordinator.policy(0).failed
    err = capsys.readouterr()
    logged = err.out + err.err
    assert "policy_failed" in logged and "ZeroDivisionError" in logged and "raise ZeroDivisionError" in logged


async def test_priority_and_tags_reach_the_policy(make_config):
    Records.seen.clear()
    async with Runtime.open(make_config(scheduler=Records)) as rt:
        await rt.complete(PROMPT, max_tokens=2, priority=-3, tags={"tenant": "a"})
    assert any(s.priority == -3 and s.tags == {"tenant": "a"} for s in Records.seen)


async def test_options_reach_the_policy_and_each_group_has_its_own(make_config):
    Records.made.clear()
    async with Runtime.open(make_config(scheduler=Records, scheduler_options={"boost": 3}, pipeline_groups=2)) as rt:
        await rt.complete(PROMPT, max_tokens=2)
        policies = [rt.engine.coordinator.policy(g) for g in range(2)]
    assert [p.inner.options["boost"] for p in policies] == [3, 3]
    assert policies[0].inner is not policies[1].inner and len(Records.made) == 2  # one each, made once


async def test_a_policy_instance_is_copied_for_each_group(make_config):
    template = Records(0, boost=7)
    async with Runtime.open(make_config(scheduler=template, pipeline_groups=2)) as rt:
        inner = [rt.engine.coordinator.policy(g).inner for g in range(2)]
    assert all(isinstance(p, Records) and p.options["boost"] == 7 for p in inner)
    assert inner[0] is not inner[1] and template not in inner and [p.group for p in inner] == [0, 1]


async def test_a_policy_class_reaches_an_engine_process(make_config):
    """A class crosses to the engine process by its import path (examples.custom_policy)."""
    from examples.custom_policy import ShortestPromptFirst

    async with Runtime.open(make_config(scheduler=ShortestPromptFirst), isolate=True) as rt:
        out = await rt.complete(PROMPT, max_tokens=3)
        assert out.n_predicted == 3


def test_scheduler_options_on_the_command_line():
    opts = parse_serve(["--scheduler", "priority", "--scheduler-option", "boost=3", "--scheduler-option", "mode=fast"])
    assert opts.config.scheduler == "priority"
    assert opts.config.scheduler_options == {"boost": 3, "mode": "fast"}


async def test_a_high_priority_arrival_gets_its_first_token_before_earlier_low_priority_ones(make_config):
    """Under load (one slot, held busy while three more requests queue for it), a request that
    arrives last with a lower priority value starts as soon as the slot frees, before the
    earlier ones."""
    faults = Faults()
    faults.hold = threading.Event()  # decode steps wait until the queue is set up
    first_token: list[str] = []
    async with Runtime.open(make_config(parallel=1, scheduler="priority"), hooks=faults) as rt:

        async def run(name: str, priority: int) -> None:
            async for ev in rt.stream(PROMPT, max_tokens=8, ignore_eos=True, priority=priority):
                if isinstance(ev, Token) and name not in first_token:
                    first_token.append(name)

        async with anyio.create_task_group() as tg:
            for i, (name, priority) in enumerate((("low-1", 5), ("low-2", 5), ("low-3", 5), ("high", 0))):
                tg.start_soon(run, name, priority)
                await wait_until(lambda i=i: rt.in_flight() == i + 1)
            faults.hold.set()
    assert first_token == ["low-1", "high", "low-2", "low-3"]
