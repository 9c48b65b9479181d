"""Slot selection: prefix reuse first, then the least busy group, then the lowest id; and the
policy's view of a group. The pure functions (``actors.scheduling``) and the places that use
them: the supervisor, the group actor, the replay simulator."""

from __future__ import annotations

import random
from collections.abc import Iterable
from types import SimpleNamespace

import anyio
import numpy as np
import pytest

from llamactor.actors.costs import StepCosts
from llamactor.actors.group import GroupActor
from llamactor.actors.policies import BUILTIN
from llamactor.actors.scheduling import (
    PREFIX_SIMILARITY,
    SlotEntry,
    SlotSnapshot,
    choose_slots,
    group_view,
)
from llamactor.actors.supervisor import Supervisor
from llamactor.ops.replay.costfit import CostModel, Linear
from llamactor.ops.replay.simulate import Simulation
from llamactor.ops.replay.tracefile import Header, Request, Trace
from llamactor.protocol.lora import NO_LORA
from llamactor.protocol.plan import GroupView, SlotView
from llamactor.runtime import Runtime
from llamactor.runtime.engine.slot import Phase, Slot


async def _complete_all(rt: Runtime, prompts: list) -> list[int]:
    slots: list[int] = [0] * len(prompts)

    async def one(i: int) -> None:
        slots[i] = (await rt.complete(prompts[i], max_tokens=30, temperature=0, ignore_eos=True)).slot

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return slots


async def test_new_prompts_take_lowest_slots_and_cached_prefix_wins(make_config):
    """Distinct prompts pack into the lowest slot ids (compact sequence range for llama.cpp's
    split KV), and a prompt extending a cached one goes back to that slot (KV reuse)."""
    async with Runtime.open(make_config(parallel=8, n_ctx=8 * 256)) as rt:
        first = await _complete_all(rt, [[100 + i] * 40 for i in range(8)])
        assert sorted(first) == list(range(8))
        again = await _complete_all(rt, [[200 + i] * 40 for i in range(3)])
        assert sorted(again) == [0, 1, 2]
        reuse = await rt.complete([105] * 40 + [7] * 5, max_tokens=2, temperature=0)
        assert reuse.slot == first[5] and reuse.n_cached == 40


async def test_groups_are_balanced(make_config):
    """Slot selection with pipeline groups: concurrent requests spread over groups before filling one."""
    async with Runtime.open(make_config(parallel=8, n_ctx=8 * 256, pipeline_groups=2)) as rt:
        slots = await _complete_all(rt, [[300 + i] * 20 for i in range(4)])
        assert sorted(s // 4 for s in slots) == [0, 0, 1, 1]


# ---- the pure functions: ``actors.scheduling`` -------------------------------------------------


def _table(groups: int, per_group: int, busy: Iterable[int] = ()) -> list[SlotEntry]:
    taken = set(busy)
    return [
        SlotEntry(g * per_group + i, g, i, busy=g * per_group + i in taken)
        for g in range(groups)
        for i in range(per_group)
    ]


def _tokens(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def test_free_slots_pack_from_the_lowest_id_of_the_least_busy_group():
    """Nothing cached: the least busy group, then its lowest free slot id; n > 1 takes the next
    free slots of that group, parent first."""
    table = _table(2, 4, busy=[0, 1, 4])
    assert choose_slots(table, _tokens(1, 2, 3)) == (5,)  # group 1 has one busy slot, group 0 two
    assert choose_slots(table, _tokens(1, 2, 3), n=3) == (5, 6, 7)
    assert choose_slots(_table(2, 4), _tokens(1)) == (0,)


def test_the_longest_cached_prefix_wins_when_it_covers_enough_of_the_prompt():
    """KV reuse first, over a less busy group and a lower id; a prefix under
    ``PREFIX_SIMILARITY`` of the prompt counts as none."""
    prompt = np.arange(100, dtype=np.int32)
    table = _table(2, 4, busy=[0, 1])
    table[3].cached = prompt[:20].copy()
    table[2].cached = prompt[:15].copy()
    assert choose_slots(table, prompt) == (3,)  # 20 tokens beat 15, and beat group 1's idleness
    table[3].cached = prompt[: int(PREFIX_SIMILARITY * 100) - 1].copy()
    table[2].cached = prompt[:3].copy()
    assert choose_slots(table, prompt) == (4,)  # under 10% of the prompt: least busy group, lowest id
    table[6].cached = np.concatenate([prompt[:50], [999]]).astype(np.int32)
    assert choose_slots(table, prompt, n=2) == (6, 4)  # the parent holds the prefix, then the lowest free


def test_kv_of_another_lora_set_is_not_reused():
    prompt = np.arange(40, dtype=np.int32)
    table = _table(1, 3)
    table[2].cached, table[2].lora = prompt[:30].copy(), ((0, 1.0),)
    assert choose_slots(table, prompt) == (0,)
    assert choose_slots(table, prompt, lora=((0, 1.0),)) == (2,)


def test_id_slot_pins_and_n_needs_one_group():
    """``id_slot`` takes that slot or waits; n > 1 choices never split across groups; groups
    that are down take nothing; the table is not changed."""
    table = _table(2, 3, busy=[0, 4])
    before = [(e.busy, e.cached.tobytes()) for e in table]
    assert choose_slots(table, _tokens(5), id_slot=2) == (2,)
    assert choose_slots(table, _tokens(5), id_slot=2, n=2) == (2, 1)
    assert choose_slots(table, _tokens(5), id_slot=4) is None  # busy: wait
    assert choose_slots(table, _tokens(5), id_slot=5, n=3) is None  # group 1 has only two free
    assert choose_slots(table, _tokens(5), id_slot=1, unavailable={0}) is None  # its group is down
    assert choose_slots(table, _tokens(5), n=3) is None  # two free slots in each group: never split
    assert choose_slots(table, _tokens(5), n=2) == (1, 2)  # equally busy: the lowest id
    assert choose_slots(table, _tokens(5), unavailable={0}) == (3,)
    assert choose_slots(table, _tokens(5), unavailable={0, 1}) is None
    assert [(e.busy, e.cached.tobytes()) for e in table] == before


def test_group_view_shows_busy_slots_with_work_in_arrival_order():
    """Idle slots, finished choices (waiting for their siblings) and prefix followers are left
    out; ``prompt_left`` counts only while prefilling; arrival order, then slot order."""
    states = [
        SlotSnapshot(0, "idle", 0, 0),
        SlotSnapshot(1, "generate", 0, 2, -1, 2.0, 10, 4, 2.5),
        SlotSnapshot(2, "prefill", 7, 1, -1, 1.0, 9, 0, 0.0),
        SlotSnapshot(3, "generate", 0, 2, 1, 2.0, 10, 4, 2.5, finished=True),
        SlotSnapshot(4, "prefill", 30, 3, waiting=True),
        SlotSnapshot(5, "ready", 5, 2, 1, 2.0, 10, 0, 0.0),
    ]
    view = group_view(1, 64, states, 3.0, 0.5, 2.0)
    assert view == GroupView(
        1,
        64,
        (
            SlotView(2, "prefill", 7, 1, -1, 1.0, 9, 0, 0.0),
            SlotView(1, "generate", 0, 2, -1, 2.0, 10, 4, 2.5),
            SlotView(5, "ready", 0, 2, 1, 2.0, 10, 0, 0.0),
        ),
        3.0,
        0.5,
        2.0,
    )


def test_the_group_actor_builds_its_view_with_group_view():
    """The live group's snapshot of its ``Slot``s: the same rows ``group_view`` gives."""
    slots = [Slot(10 + i, i) for i in range(4)]
    parent, child, follower = slots[1], slots[2], slots[3]
    for s, order in ((parent, 1), (child, 1), (follower, 2)):
        s.task = SimpleNamespace(arrived=1.5, priority=2, tags={}, n_predict=10)  # type: ignore[assignment]
        s.order = order
        s.prompt = np.arange(12, dtype=np.int32)
    parent.phase, parent.n_past, parent.n_decoded, parent.t_prompt_done = Phase.GENERATE, 12, 3, 2.0
    child.phase, child.parent, child.n_decoded, child.finished = Phase.GENERATE, parent, 5, True
    follower.phase, follower.follows = Phase.PREFILL, parent
    fake = SimpleNamespace(slots=slots, group=3, engine=None, costs=StepCosts())
    view = GroupActor._view(fake)  # type: ignore[arg-type]
    assert view.group == 3 and view.slots == (SlotView(1, "generate", 0, 1, -1, 1.5, 12, 3, 2.0, 2, n_remaining=7),)
    follower.follows = None
    view = GroupActor._view(fake)  # type: ignore[arg-type]
    assert [v.local for v in view.slots] == [1, 3] and view.slots[1].prompt_left == 12


def _simulation(groups: int, per_group: int, requests: list[Request], policy: str = "adaptive") -> Simulation:
    header = Header(version=1, groups=groups, n_slots=per_group, n_batch=64, policy=policy)
    cost = CostModel(Linear(1.0), Linear(0.0))
    return Simulation(Trace("mem", header, tuple(requests), ()), BUILTIN[policy], cost)


def _supervisor(groups: int, per_group: int, slot_choice: str = "lowest") -> Supervisor:
    sup = Supervisor(
        groups,
        per_group,
        lambda g: None,  # type: ignore[arg-type,return-value]
        queue_size=8,
        max_restarts=1,
        restart_window_s=1.0,
        slot_choice=slot_choice,
    )
    sup.groups = [object()] * groups  # type: ignore[list-item]  # every group up
    return sup


@pytest.mark.parametrize("policy", ["adaptive", "continuous"])
def test_the_simulator_and_the_supervisor_choose_the_same_slots(policy):
    """For the same table (busy slots, cached prefixes, release order) and request, the replay
    simulator's slot choice is the supervisor's, in random tables of 1-3 groups of 1-4 slots,
    with the lowest-id rule and with llama-server's least-recently-used rule."""
    rng = random.Random(7)
    for _ in range(400):
        groups, per_group = rng.randint(1, 3), rng.randint(1, 4)
        prompt = rng.randint(1, 60)
        rec = Request(
            group=rng.randrange(groups),
            submitted=0.0,
            prompt=prompt,
            generated=3,
            cached=rng.choice([0, rng.randrange(prompt)]),
            n=rng.randint(1, per_group),
        )
        sim = _simulation(groups, per_group, [rec], policy)
        sup = _supervisor(groups, per_group, sim.slot_choice)
        try:
            for e, mine in zip(sim.table, sup.table):
                e.busy = mine.busy = rng.random() < 0.4
                e.released = mine.released = rng.choice([-1, rng.randrange(5)])
                mine.cached = e.cached
            task = SimpleNamespace(prompt=sim._prompt_of(rec), n=rec.n, id_slot=-1, lora=NO_LORA)
            chosen = sup._choose(task)  # type: ignore[arg-type]
            assert sim.choose(rec) == (None if chosen is None else tuple(e.id for e in chosen)), (rec, sim.table)
        finally:
            sup._inbox_send.close()
            sup._inbox_recv.close()


def test_the_simulator_sends_a_request_back_to_its_cached_prefix_only_as_the_supervisor_would():
    """The recorded group wins when the reused prefix covers at least ``PREFIX_SIMILARITY`` of
    the prompt; below that the least busy group does (the simulator used to prefer the recorded
    group for any reused prefix, which the supervisor never did)."""
    big = Request(group=1, submitted=0.0, prompt=100, generated=1, cached=40)
    small = Request(group=1, submitted=0.0, prompt=100, generated=1, cached=5)
    sim = _simulation(2, 2, [big, small])
    sim.table[2].busy = True  # group 1 is the busier one
    assert sim.choose(big) == (3,)
    assert sim.choose(small) == (0,)


def test_llama_servers_rule_takes_the_least_recently_used_slot_ties_to_the_highest_id():
    """``prefer=LRU`` (continuous): an idle server's burst lands on the highest slots first (all
    tie at "never used"), then the slot released longest ago; a cached prefix still wins."""
    from llamactor.actors.scheduling import LRU

    table = [SlotEntry(i, 0, i) for i in range(4)]
    order = []
    for _ in range(4):
        [chosen] = choose_slots(table, np.arange(5, dtype=np.int32), prefer=LRU)
        table[chosen].busy = True
        order.append(chosen)
    assert order == [3, 2, 1, 0]
    for when, slot in enumerate((2, 0, 3)):  # released in this order
        table[slot].busy, table[slot].released = False, when
    assert choose_slots(table, np.arange(5, dtype=np.int32), prefer=LRU) == (2,)
    table[3].cached = np.arange(5, dtype=np.int32)
    assert choose_slots(table, np.arange(9, dtype=np.int32), prefer=LRU) == (3,)  # its prefix
    assert choose_slots(table, np.arange(5, 9, dtype=np.int32)) == (0,)  # lowest id otherwise
