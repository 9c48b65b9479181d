"""Scheduling policies and the phase coordinator (prefill cohorts, phase exclusion)."""

from __future__ import annotations

import threading

import anyio
import httpx
import pytest
from conftest import open_server, wait_until
from faults import Faults
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_sim import GroupSim

from llamactor.actors.policies import BUILTIN, resolve_policy
from llamactor.actors.policy import GroupView, SlotView
from llamactor.actors.trace import TraceViolation, check_phase_exclusion
from llamactor.protocol.events import Token
from llamactor.protocol.messages import PhaseKind
from llamactor.runtime import Runtime

POLICIES = ["continuous", "no-cont-batching", "serial-prefill", "cohort", "stall-free", "adaptive", "slo", "priority"]
EXCLUSIVE = ["no-cont-batching", "serial-prefill", "cohort"]  # never mix phases in a batch
N_BATCH = 32


def config(make_config, scheduler: str, **kw):
    base = dict(parallel=4, n_batch=N_BATCH, n_ubatch=N_BATCH, scheduler=scheduler, trace_steps=True, prefill_budget=8)
    base.update(kw)
    return make_config(**base)


def freeze_after_first_ready(faults: Faults) -> tuple[threading.Event, anyio.Event]:
    """Once a prompt finishes prefill, hold the group's next decode step (via the injected hooks).

    Returns (hold, ready): ``ready`` is set at that moment; set ``hold`` to let the group go on.
    """
    hold, ready = threading.Event(), anyio.Event()
    hold.set()
    faults.hold = hold

    def on_step(g, res) -> None:
        if res.ready and not ready.is_set():
            hold.clear()
            ready.set()

    faults.on_step = on_step
    return hold, ready


def traces(rt: Runtime):
    return [rec for g in rt.engine.supervisor.groups for rec in g.trace]


async def _run_mix(rt: Runtime) -> dict[str, tuple[int, ...]]:
    """Prompts of several chunks, a short one, n > 1, and a cached-prefix continuation."""
    out: dict[str, tuple[int, ...]] = {}

    async def one(name: str, prompt, **kw) -> None:
        c = await rt.complete(prompt, max_tokens=8, temperature=0, ignore_eos=True, **kw)
        out[name] = tuple(t for ch in c.choices for t in ch.tokens)

    async def streamed(name: str, prompt) -> None:
        toks = [
            e.token
            async for e in rt.stream(prompt, max_tokens=8, temperature=0, ignore_eos=True)
            if isinstance(e, Token)
        ]
        out[name] = tuple(toks)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "long", [11] * 150)
        tg.start_soon(one, "short", [12] * 70)
        tg.start_soon(streamed, "stream", "hello there")
        tg.start_soon(lambda: one("n2", "two of them", n=2))
    await one("continued", [11] * 150 + [13] * 10)  # prefix cached from "long"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", POLICIES)
async def test_policies_change_timing_not_tokens(make_config, scheduler):
    """Every policy gives the greedy tokens of `continuous`; under the
    exclusive policies the trace shows no batch mixing phases (streaming, non-streaming, n > 1,
    cached prefix all included)."""
    async with Runtime.open(config(make_config, "continuous")) as rt:
        expected = await _run_mix(rt)
    async with Runtime.open(config(make_config, scheduler)) as rt:
        got = await _run_mix(rt)
        trace = traces(rt)
        assert not any(s.busy for s in rt.engine.slot_states())
    assert got == expected
    if scheduler in EXCLUSIVE:
        check_phase_exclusion(trace)
    else:
        with pytest.raises(TraceViolation):
            check_phase_exclusion(trace)  # continuous batching mixes by design


async def _first_token_times(rt: Runtime, prompts: dict[str, list[int]]) -> dict[str, int]:
    """Step number (trace length) at which each request got its first token."""
    first: dict[str, int] = {}

    async def one(name: str) -> None:
        async for e in rt.stream(prompts[name], max_tokens=4, temperature=0, ignore_eos=True):
            if isinstance(e, Token) and name not in first:
                first[name] = len(traces(rt))

    async with anyio.create_task_group() as tg:
        for name in prompts:
            tg.start_soon(one, name)
    return first


async def test_shorter_prompt_waits_for_longer_prefill(make_config):
    """Two prompts longer than n_batch; the shorter emits no
    token before the longer finished prefill, and they share the batch while prefilling."""
    async with Runtime.open(config(make_config, "cohort")) as rt:
        first = await _first_token_times(rt, {"long": [21] * (5 * N_BATCH), "short": [22] * (2 * N_BATCH + 5)})
        trace = traces(rt)
    check_phase_exclusion(trace)
    last_prefill = max(i for i, r in enumerate(trace) if r.prefill) + 1
    assert first["short"] > last_prefill and first["long"] > last_prefill
    shared = [r for r in trace if len(r.prefill) == 2]
    assert shared, "the two prompts never shared a prefill batch"


async def test_arrival_during_generate_waits_for_drain(make_config):
    """A request arriving during GENERATE starts no prefill until the
    cohort drained."""
    async with Runtime.open(config(make_config, "cohort")) as rt:
        first = await rt.submit("first", max_tokens=40, temperature=0, ignore_eos=True)
        await first.first()  # the cohort {first} is generating now
        steps_at_arrival = len(traces(rt))
        late = await rt.submit("late arrival", max_tokens=3, temperature=0, ignore_eos=True)
        async with first, late:
            async for _ in first:
                pass
            async for _ in late:
                pass
        trace = traces(rt)
    check_phase_exclusion(trace)
    after = trace[steps_at_arrival:]
    first_prefill = next(i for i, r in enumerate(after) if r.prefill)
    assert all(not r.prefill for r in after[:first_prefill])
    assert sum(1 for r in after[:first_prefill] if r.generate) >= 30  # `first` drained meanwhile


async def test_cohort_seals_at_first_member_done(make_config):
    """Arrivals before the seal join the cohort; after it, the next one."""
    faults = Faults()
    async with Runtime.open(config(make_config, "cohort"), hooks=faults) as rt:
        group = rt.engine.supervisor.groups[0]
        hold, sealed = freeze_after_first_ready(faults)
        try:
            long = await rt.submit([31] * (6 * N_BATCH), max_tokens=2, temperature=0, ignore_eos=True)
            joined = await rt.submit([32] * 10, max_tokens=2, temperature=0, ignore_eos=True)
            with anyio.fail_after(10):
                await sealed.wait()
            late = await rt.submit([33] * 10, max_tokens=2, temperature=0, ignore_eos=True)
            await wait_until(lambda: rt.engine.supervisor.table[2].busy)  # assigned; the group is frozen
        finally:
            hold.set()
        await wait_until(lambda: rt.engine.slot_states()[2].busy)
        rows = {s.id: s for s in rt.engine.slot_states()}
        assert rows[0].cohort == rows[1].cohort != rows[2].cohort
        assert rows[1].phase == "ready" and rows[2].phase == "prefill"
        for h in (long, joined, late):
            async with h:
                async for _ in h:
                    pass
        check_phase_exclusion(group.trace)


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["waiting", "prefilling"])
async def test_cancel_member_releases_barrier(make_config, victim):
    """Cancelling a member waiting at the barrier, or the one still
    prefilling, lets the rest proceed; no slot leaks; no busy loop while nothing is runnable."""
    faults = Faults()
    async with Runtime.open(config(make_config, "cohort"), hooks=faults) as rt:
        group = rt.engine.supervisor.groups[0]
        hold, short_ready = freeze_after_first_ready(faults)
        try:
            long = await rt.submit([41] * (8 * N_BATCH), max_tokens=3, temperature=0, ignore_eos=True)
            short = await rt.submit([42] * 5, max_tokens=3, temperature=0, ignore_eos=True)
            with anyio.fail_after(10):
                await short_ready.wait()
            faults.on_step = None
            cancelled, survivor = (short, long) if victim == "waiting" else (long, short)
            cancelled.close()
        finally:
            hold.set()
        async with survivor:
            tokens = [e async for e in survivor if isinstance(e, Token)]
        assert len(tokens) == 3
        await wait_until(lambda: not any(s.busy for s in rt.engine.slot_states()))
        steps = len(group.trace)
        await anyio.sleep(0.2)
        assert len(group.trace) == steps  # idle: no step ran, no busy loop
        check_phase_exclusion(group.trace)
        out = await rt.complete("after", max_tokens=2, temperature=0)
        assert out.n_predicted == 2


async def test_bounded_generate_hands_over_without_mixing(make_config):
    """With --cohort-max-generate-ms the next cohort may prefill while the first is paused."""
    async with Runtime.open(config(make_config, "cohort", cohort_max_generate_ms=1.0)) as rt:
        first = await rt.submit("first", max_tokens=300, temperature=0, ignore_eos=True)
        await first.first()
        late = await rt.submit("late", max_tokens=3, temperature=0, ignore_eos=True)
        async with late:
            late_tokens = [e async for e in late if isinstance(e, Token)]
        async with first:
            first_left = [e async for e in first if isinstance(e, Token)]
        trace = traces(rt)
    assert len(late_tokens) == 3 and len(first_left) == 299
    check_phase_exclusion(trace)


@pytest.mark.slow
async def test_observability_slots_and_metrics(make_config):
    """/slots shows phase and cohort; /metrics has phase per group, cohort sizes, barrier
    wait and requests waiting for a phase."""
    async with open_server(config(make_config, "cohort")) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.post("/completion", json={"prompt": [5] * 80, "n_predict": 4, "temperature": 0})
            assert r.status_code == 200
            text = (await client.get("/metrics")).text
            slots = (await client.get("/slots")).json()
    assert 'llamactor:group_phase{group="0",phase="idle"} 1.0' in text
    assert 'llamactor:cohort_size_count{group="0"} 1.0' in text
    assert 'llamactor:barrier_wait_seconds_count{group="0"} 1.0' in text
    assert 'llamactor:requests_waiting_for_phase{group="0"} 0.0' in text
    assert all("cohort" in s and "phase" in s for s in slots)


async def test_custom_policy_loaded_by_server(make_config):
    """examples/custom_policy.py is loaded with --scheduler module:Class and serves."""
    cls = resolve_policy("examples.custom_policy:ShortestPromptFirst")
    assert cls.name == "shortest-prompt-first"
    async with open_server(config(make_config, "examples.custom_policy:ShortestPromptFirst")) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.post("/completion", json={"prompt": "hi", "n_predict": 5, "temperature": 0})
            props = (await client.get("/props")).json()
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 5
    assert props["scheduler"] == "examples.custom_policy:ShortestPromptFirst"


requests = st.lists(
    st.tuples(st.integers(0, 6), st.integers(1, 200), st.integers(1, 12), st.booleans()),
    min_size=1,
    max_size=25,
)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILTIN))
@given(plan=requests, lag=st.booleans(), n_slots=st.integers(1, 5))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_policy_property(name, plan, lag, n_slots):
    """Random arrivals, prompt lengths and cancellations against a fake engine:
    every request finishes or is cancelled, exclusive policies never mix phases, no slot leaks."""
    sim = GroupSim(BUILTIN[name](0, prefill_budget=16, cohort_max_generate_ms=0), n_slots, N_BATCH, lag=lag)
    pending = list(plan)
    admitted = 0
    for _ in range(5000):
        while pending and pending[0][0] == 0:
            _, prompt, gen, cancel = pending.pop(0)
            if not sim.arrive(prompt, gen):
                pending.insert(0, (1, prompt, gen, cancel))
                break
            admitted += 1
            if cancel and len(sim.slots) > 1:
                victim = sorted(sim.slots)[len(sim.slots) // 2]
                sim.cancel(victim)
        if pending:
            delay, *rest = pending[0]
            pending[0] = (max(delay - 1, 0), *rest)
        sim.step()
        if not pending and not sim.slots:
            break
    assert not sim.slots, f"{name}: requests stuck: {sim.slots}"
    assert len(sim.finished) + len(sim.cancelled) == admitted
    if name in EXCLUSIVE:
        check_phase_exclusion(sim.trace)


# ---- adaptive (the default) -------------------------------------------------------------------


def _view(slots, now=100.0, n_batch=512, ms_tok=1.0, ms_step=40.0):
    return GroupView(0, n_batch, tuple(slots), now, ms_tok, ms_step)


def _stream(local, order, now=100.0, n=10, gap_ms=40.0):
    """A generating slot whose mean gap so far is ``gap_ms``."""
    return SlotView(local, "generate", 0, order, -1, now - 5, 8, n, now - (n - 1) * gap_ms / 1e3)


def _prompt(local, order, left, waited_s=0.0, now=100.0):
    return SlotView(local, "prefill", left, order, -1, now - waited_s, left)


def test_adaptive_whole_batch_when_nobody_generates():
    plan = BUILTIN["adaptive"]().plan(_view([_prompt(0, 1, 2000)]), None)
    assert plan.prefill == ((0, 512),) and plan.generate == ()


def test_adaptive_keeps_streams_on_track_within_the_itl_target():
    """Streams on track and one prompt that can still make its first-token target: the prompt
    gets what fits in the 200 ms target by the measured costs ((200 - 40) / 1 = 160 tokens)."""
    slots = [_stream(i, i + 1) for i in range(4)] + [_prompt(4, 5, 768)]
    plan = BUILTIN["adaptive"]().plan(_view(slots), None)
    assert plan.generate == (0, 1, 2, 3) and plan.prefill == ((4, 160),)
    plan = BUILTIN["adaptive"](0, target_itl_ms=100).plan(_view(slots), None)
    assert plan.prefill == ((4, 101),)  # the waiting prompts' share of n_batch, 508 / 5, is larger


def test_adaptive_spends_the_streams_slack_on_a_queue():
    """Two requests waiting: a step may take what every stream on track can afford without its
    mean gap passing the target, counting the gaps it wins back in its next 16 generation-only
    steps: 200 * 10 - 9 * 180 + (200 - 180) * 16 = 700 ms, so (700 - 180) / 2 = 260 prompt tokens,
    more than the share of n_batch (508 * 2 / 6 = 169). One request waiting keeps the share."""
    streams = [_stream(i, i + 1, gap_ms=180.0) for i in range(4)]
    queue = [_prompt(4, 5, 300), _prompt(5, 6, 300)]
    plan = BUILTIN["adaptive"]().plan(_view(streams + queue, ms_tok=2.0, ms_step=180.0), None)
    assert plan.prefill in (((4, 259),), ((4, 260),)) and plan.generate == (0, 1, 2, 3)
    # (times are float seconds: 259.99... tokens round down)
    plan = BUILTIN["adaptive"]().plan(_view(streams + queue[:1], ms_tok=2.0, ms_step=180.0), None)
    assert plan.prefill == ((4, 101),)  # 508 // 5: the lone prompt's share, no slack spent on it
    late = [_stream(i, i + 1, gap_ms=400.0) for i in range(2)]  # over the target: not counted ...
    tight = [_stream(2, 3, n=40, gap_ms=199.0), _stream(3, 4, n=40, gap_ms=199.0)]  # ... these bind
    plan = BUILTIN["adaptive"]().plan(_view(late + tight + queue, ms_tok=2.0, ms_step=180.0), None)
    # slack 200 * 40 - 39 * 199 + 320 = 559 ms: (559 - 180) / 2 = 189 > the share 508 * 2 / 6 = 169
    assert plan.prefill in (((4, 188),), ((4, 189),))
    # two whole 200-token prompts: the slack would take both (400 tokens), but the second one
    # finished in the same step would delay the first by 400 ms to spare itself one 180 ms step
    whole = [_prompt(4, 5, 200), _prompt(5, 6, 200)]
    plan = BUILTIN["adaptive"]().plan(_view(streams + whole, ms_tok=2.0, ms_step=180.0), None)
    assert plan.prefill == ((4, 200),)


def test_adaptive_ends_a_step_early_when_first_tokens_come_sooner():
    """A chat wave: seven 65-token turns wait beside one stream, at 1.2 ms a prompt token and
    45 ms a step. A fourth turn in the step would delay the three before it by 78 ms each, more
    than the 45 ms it saves each of the four after them (3 * 78 > 4 * 45): the step ends after
    three. A chunk of a prompt that does not finish joins while fewer prompts finish in the step
    than wait after them; a lone prompt gets its budget as before."""
    wave = [_stream(0, 1)] + [_prompt(i, i + 1, 65) for i in range(1, 8)]
    plan = BUILTIN["adaptive"]().plan(_view(wave, ms_tok=1.2, ms_step=45.0), None)
    assert plan.prefill == ((1, 65), (2, 65), (3, 65)) and plan.generate == (0,)
    plan = BUILTIN["continuous"]().plan(_view(wave, ms_tok=1.2, ms_step=45.0), None)
    assert len(plan.prefill) == 7  # what the step held before: all seven first tokens at its end
    two = [_prompt(1, 2, 65), _prompt(2, 3, 400)]  # 400 tokens would delay the first by 480 ms
    assert BUILTIN["adaptive"]().plan(_view(two, ms_tok=1.2, ms_step=45.0), None).prefill == ((1, 65),)
    long = [_prompt(1, 2, 65)] + [_prompt(i, i + 1, 1000) for i in range(2, 5)]  # 1 finished < 3 after
    assert BUILTIN["adaptive"]().plan(_view(long, ms_tok=1.2, ms_step=45.0), None).prefill == ((1, 65), (2, 447))
    lone = [_stream(0, 1), _prompt(1, 2, 300)]
    assert BUILTIN["adaptive"]().plan(_view(lone, ms_tok=1.2, ms_step=45.0), None).prefill == ((1, 255),)
    # in a hurry the step takes its whole budget: a prompt that would miss its target at the
    # normal budget (1500 tokens after 0.2 s: the whole n_batch), or one already past its target
    hurry = [_stream(i, i + 1) for i in range(4)] + [_prompt(4, 5, 65), _prompt(5, 6, 1500, waited_s=0.2)]
    assert BUILTIN["adaptive"]().plan(_view(hurry, ms_tok=1.2, ms_step=45.0), None).prefill == ((4, 65), (5, 443))
    # a prompt past its target (last in the order) still gets what is left after the shorter
    # ones that finish; left without, a stream of short prompts could hold it back
    past = [_stream(0, 1), _stream(1, 2), _prompt(2, 3, 65), _prompt(3, 4, 65), _prompt(4, 5, 900, waited_s=2.5)]
    plan = BUILTIN["adaptive"]().plan(_view(past, ms_tok=1.2, ms_step=45.0), None)
    assert plan.prefill == ((2, 65), (3, 65), (4, 380))
    fresh = past[:4] + [_prompt(4, 5, 900)]  # the same prompt, just arrived: it waits a step
    assert BUILTIN["adaptive"]().plan(_view(fresh, ms_tok=1.2, ms_step=45.0), None).prefill == ((2, 65), (3, 65))
    # a cold group (no generation-only step measured yet) under a burst of short prompts: no
    # split, or it would take one prompt a step until a step without prompts came, i.e. never
    cold = [_prompt(i, i + 1, 32) for i in range(8)]
    assert len(BUILTIN["adaptive"]().plan(_view(cold, ms_tok=1.2, ms_step=0.0), None).prefill) == 8


def test_adaptive_hurries_a_prompt_that_would_miss_its_target():
    """1800 tokens at 160 a step of 200 ms take 2.25 s > 2 s: the whole batch, streams included."""
    slots = [_stream(i, i + 1) for i in range(4)] + [_prompt(4, 5, 1500, waited_s=0.2)]
    plan = BUILTIN["adaptive"]().plan(_view(slots), None)
    assert plan.prefill == ((4, 508),) and len(plan.generate) == 4


def test_adaptive_burst_prefills_at_full_speed():
    """A burst: more hopeless prompts than streams on track, or most streams already late."""
    slots = [_stream(0, 1)] + [_prompt(i, i + 1, 1000, waited_s=3.0) for i in range(1, 6)]
    assert sum(k for _, k in BUILTIN["adaptive"]().plan(_view(slots), None).prefill) == 511
    late = [_stream(i, i + 1, gap_ms=600) for i in range(3)] + [_stream(3, 4), _prompt(4, 5, 300)]
    assert sum(k for _, k in BUILTIN["adaptive"]().plan(_view(late), None).prefill) == 300


def test_adaptive_order_shortest_feasible_first_then_oldest_then_starving():
    p = BUILTIN["adaptive"]()
    long_feasible, short_feasible = _prompt(0, 1, 900, waited_s=0.1), _prompt(1, 2, 100, waited_s=0.0)
    hopeless_old, hopeless_new = _prompt(2, 3, 5000, waited_s=5.0), _prompt(3, 4, 5000, waited_s=3.0)
    starving = _prompt(4, 5, 9000, waited_s=30.0)
    ordered = p.order(_view([]), [hopeless_new, long_feasible, hopeless_old, starving, short_feasible])
    assert [s.local for s in ordered] == [4, 1, 0, 2, 3]


def test_adaptive_no_starvation_under_a_stream_of_short_prompts():
    """A long prompt among short ones that keep arriving still finishes (fake engine)."""
    sim = GroupSim(BUILTIN["adaptive"](), 4, 64)
    assert sim.arrive(5000, 2)
    long_order = sim._order
    for step in range(3000):
        if len(sim.slots) < 4:
            sim.arrive(8, 2)
        sim.step()
        if long_order in sim.finished:
            break
    assert long_order in sim.finished


async def test_bounded_generate_ticks_once_per_deadline(make_config):
    """A cohort past its --cohort-max-generate-ms with nobody queued gets one tick, not a tick
    loop (a tick that finds no queue left the deadline as it was and was rescheduled at once)."""
    async with Runtime.open(config(make_config, "cohort", cohort_max_generate_ms=1.0)) as rt:
        policy = rt.engine.coordinator.policies[0]
        ticks = 0
        on_event = policy.on_event

        def counting(event):
            nonlocal ticks
            ticks += event.kind is PhaseKind.TICK
            return on_event(event)

        policy.on_event = counting
        out = await rt.complete("alone", max_tokens=40, temperature=0, ignore_eos=True)
        await anyio.sleep(0.1)  # a window to watch, not a wait: a tick loop would tick many times in it
    assert out.n_predicted == 40 and ticks <= 2


def test_step_costs_start_at_their_first_sample():
    """A group's generation-only step cost starts at the first such step measured, not near 0
    (from 0 a policy would see ten steps as nearly free, and ``take_split`` would end every step
    after one prompt). The prompt token's cost still starts from 0 (its first sample, taken
    before any generation-only step, charges the whole step to its tokens)."""
    from llamactor.actors.costs import StepCosts
    from llamactor.runtime.engine.context import StepResult

    costs = StepCosts()
    costs.learn(StepResult(n_prompt=100, n_rows=1), 130.0)  # before any generation-only step
    assert abs(costs.ms_per_prompt_token - 0.13) < 1e-9 and costs.ms_per_step == 0.0
    costs.learn(StepResult(n_generated=8, n_rows=8), 44.0)
    assert costs.ms_per_step == 44.0
    costs.learn(StepResult(n_generated=8, n_rows=8), 54.0)
    assert costs.ms_per_step == 45.0  # then the moving average, weight 0.1


# ---- slo -----------------------------------------------------------------------------------------


def _slo_stream(local, order, now=100.0, n=10, remaining=20, ttft_s=0.5):
    """A generating slot whose first token came ``ttft_s`` after it arrived."""
    first = now - 1.0
    return SlotView(local, "generate", 0, order, -1, first - ttft_s, 8, n, first, n_remaining=remaining)


def _slo_p90():
    """The percentile form of the objective: gaps within 150 ms at each request's own p90."""
    return BUILTIN["slo"](0, slo_itl_ms=150, slo_itl_pct=90)


def test_slo_feeds_equal_prompts_one_after_another_in_whole_steps():
    """Nobody generates: every step is n_batch of prompt, the shortest (then earliest) first,
    never shared: equal prompts get their first tokens one after another, as llama-server's.
    A short prompt that arrives with a long one gets its first token after its own 100 tokens
    (the step ends there: the long one's 412 would delay it by 412 ms, ending costs the long
    one a 40 ms step); a long one that can no longer make its target takes the rest of the step."""
    prompts = [_prompt(i, i + 1, 1000, waited_s=0.1 * (3 - i)) for i in range(3)]
    plan = BUILTIN["slo"]().plan(_view(prompts), None)
    assert plan.prefill == ((0, 512),)
    short = [_prompt(0, 1, 1000, waited_s=1.0), _prompt(1, 2, 100)]
    assert BUILTIN["slo"]().plan(_view(short), None).prefill == ((1, 100),)
    late = [_prompt(0, 1, 1000, waited_s=4.0), _prompt(1, 2, 100)]
    assert BUILTIN["slo"]().plan(_view(late), None).prefill == ((1, 100), (0, 412))


def test_slo_keeps_a_step_short_only_for_a_stream_that_needs_it():
    """A stream meeting its objective with no long gap left to spend (p90 of 29 gaps: 2) gets
    short steps: the prompt tokens that fit in 150 ms ((150 - 40) / 1 = 110). With long gaps
    to spend, or when it already missed its first-token target, the step takes the whole room."""
    policy = _slo_p90()
    stream = _slo_stream(0, 1, remaining=20)
    prompt = _prompt(1, 2, 5000)  # cannot make 2 s anyway: no first token to weigh against the stream
    plan = policy.plan(_view([stream, prompt]), None)
    assert plan.prefill == ((1, 511),) and policy.long_gaps[1] == 1  # a long step: one spent
    policy.plan(_view([stream, prompt]), None)
    assert policy.long_gaps[1] == 2
    plan = policy.plan(_view([stream, prompt]), None)
    assert plan.prefill == ((1, 110),)  # none left: short steps from now on
    late = _slo_stream(0, 1, remaining=20, ttft_s=3.0)  # missed its first-token target: not protected
    assert _slo_p90().plan(_view([late, prompt]), None).prefill == ((1, 511),)


def test_slo_weighs_first_tokens_against_the_streams_it_would_slow():
    """Short steps (250 prompt tokens at 100 ms + 0.2 ms a token) would make a prompt that can
    still reach its first token in time miss it: as many first tokens lost as streams saved,
    the step is long. With nothing to lose, it stays short for the stream."""
    fragile = _slo_stream(0, 1, n=10, remaining=1)  # 10 gaps at p90: 1 long gap allowed ...
    three = [_prompt(i, i + 1, 500, waited_s=1.3) for i in (1, 2, 3)]  # the third makes 2 s only in long steps
    policy = _slo_p90()
    policy.long_gaps[1] = 1  # ... and it is spent
    plan = policy.plan(_view([fragile, *three], ms_tok=0.2, ms_step=100.0), None)
    assert sum(k for _, k in plan.prefill) == 511
    policy = _slo_p90()
    policy.long_gaps[1] = 1
    plan = policy.plan(_view([fragile, *three[:2]], ms_tok=0.2, ms_step=100.0), None)
    assert plan.prefill == ((1, 250),)


def test_slo_feeds_prompts_that_missed_their_target_in_slot_order():
    """In a burst no prompt can make 2 s any more: equal prompts go in slot order, as
    llama-server feeds them (a later arrival in a lower slot first), not oldest first; one
    already under way (less left) goes on first. A prompt that can still make its target goes
    before them, until one of them has waited ten targets."""
    burst = [_prompt(3, 1, 1000, waited_s=30.0), _prompt(1, 5, 1000, waited_s=5.0), _prompt(2, 2, 1000, waited_s=25.0)]
    assert _slo_p90().plan(_view(burst), None).prefill == ((1, 512),)
    started = [*burst, _prompt(4, 3, 600, waited_s=20.0)]
    assert _slo_p90().plan(_view(started), None).prefill == ((4, 512),)
    fresh = _prompt(0, 9, 300)  # can make 2 s
    assert _slo_p90().plan(_view([*burst[1:], fresh]), None).prefill[0] == (0, 300)
    assert _slo_p90().plan(_view([*burst, fresh]), None).prefill[0] == (0, 300)  # shortest anyway
    long_fresh = _prompt(6, 9, 1000)  # can make 2 s at 0.5 ms a token, in a higher slot
    assert _slo_p90().plan(_view([burst[1], long_fresh], ms_tok=0.5), None).prefill[0] == (6, 512)
    starving = _prompt(3, 1, 1000, waited_s=22.0)  # ten targets (2.16 s: 4 x its 540 ms alone): the precedence ends
    assert _slo_p90().plan(_view([starving, long_fresh], ms_tok=0.5), None).prefill[0] == (3, 512)


def test_slo_does_not_shorten_steps_that_miss_the_gap_target_anyway():
    """Where a step with no prompt already takes longer than the gap target (a slow machine,
    many streams), short steps save no stream: the prompts get the whole room."""
    stream = _slo_stream(0, 1, remaining=20)
    policy = _slo_p90()
    policy.long_gaps[1] = 2  # no long gap left to spend: at 40 ms a step this is a short step
    assert policy.plan(_view([stream, _prompt(1, 2, 5000)]), None).prefill == ((1, 110),)
    assert policy.plan(_view([stream, _prompt(1, 2, 5000)], ms_step=160.0), None).prefill == ((1, 511),)


def test_slo_stops_shortening_steps_once_a_prompt_has_waited_twice_its_first_token_target():
    """A stream with no long gap left gets short steps while the prompt behind it waits; once
    that prompt has waited twice its first-token target (4 x its 1,040 ms alone: 4.16 s) the
    server is overloaded and every step takes the whole room, as llama-server's, at the mean
    objective as at a percentile."""
    stream = _slo_stream(0, 1, remaining=20)
    for waited, tokens in ((8.3, 110), (8.4, 511)):
        policy = _slo_p90()
        policy.long_gaps[1] = 2  # none left to spend
        assert policy.plan(_view([stream, _prompt(1, 2, 1000, waited_s=waited)]), None).prefill == ((1, tokens),)
    at_the_mean = BUILTIN["slo"](0, slo_itl_ms=150, slo_itl_pct=0)
    assert at_the_mean.plan(_view([stream, _prompt(1, 2, 1000, waited_s=8.3)]), None).prefill[0][1] < 511
    assert at_the_mean.plan(_view([stream, _prompt(1, 2, 1000, waited_s=8.4)]), None).prefill == ((1, 511),)


def test_slo_at_the_mean_spreads_a_streams_slack_over_its_remaining_gaps():
    """At the mean gap (the time per output token): a stream pays for prompt tokens from its slack (its target x
    its gaps, less what it spent and its remaining gaps at the plain step time), 90 % of it
    spread evenly over its remaining gaps; with no slack the prompts wait, unless as many
    first tokens would be lost as streams saved."""
    stream = _slo_stream(0, 1, n=10, remaining=30)  # 9 gaps in 1 s: 111 ms each, under 150
    prompt = _prompt(1, 2, 5000)
    mean = BUILTIN["slo"](0, slo_itl_ms=150, slo_itl_pct=0)
    # slack 150 x 39 - 1000 - 30 x 40 = 3650 ms; 0.9 x 3650 / 30 = 109.5 ms: 109 tokens at 1 ms
    assert mean.plan(_view([stream, prompt]), None).prefill == ((1, 109),)
    # 9 gaps in 1.46 s and one left at 40 ms: 1,500 ms for 10 gaps at 150, nothing to spare
    spent = SlotView(0, "generate", 0, 1, -1, 98.0, 8, 10, 98.54, n_remaining=1)
    late = _prompt(1, 2, 5000, waited_s=30.0)  # past 5 x its prefill already: nothing to lose
    assert mean.plan(_view([spent, late]), None).prefill == ()
    fresh = [_prompt(i, i + 1, 400, waited_s=1.0) for i in (1, 2)]  # both make 2 s only in long steps
    # the long step's budget (511), ending after the first prompt: the second's 111 tokens
    # would only delay its first token (the second makes 2 s in the next step either way)
    assert mean.plan(_view([spent, *fresh]), None).prefill == ((1, 400),)


def test_slo_a_long_prompt_past_the_fixed_first_token_target_keeps_its_stream_protected():
    """Two long prompts at once: the first, whose 2,600 tokens cost 2.6 s alone, gets its first
    token after 2.7 s, beyond the fixed 2 s but within 4 x its own cost; its stream (30 tokens
    left) is still one the policy protects, so the second prompt is fed in the short steps
    the stream can pay for from its slack at the 150 ms mean, not in one whole batch."""
    now = 100.0
    stream = SlotView(0, "generate", 0, 1, -1, now - 2.8, 2600, 2, now - 0.1, n_remaining=30)
    prompt = _prompt(1, 2, 1900, waited_s=2.8)
    policy = BUILTIN["slo"](0, slo_itl_ms=150, slo_itl_pct=0)
    view = _view([stream, prompt], ms_tok=1.0, ms_step=20.0)
    assert policy.ttft_target_ms(view, stream) == 4 * (2600 + 20)
    assert policy.meeting(view, stream)
    assert 0 < sum(k for _, k in policy.plan(view, None).prefill) < 511
    fixed_only = BUILTIN["slo"](0, slo_itl_ms=150, slo_itl_pct=0)
    fixed_only.ttft_target_ms = lambda _view, _s: 2000.0  # the target before: fixed whatever the prompt
    assert not fixed_only.meeting(view, stream)
    assert sum(k for _, k in fixed_only.plan(view, None).prefill) == 511


def test_slo_targets_of_0_are_four_times_what_the_prompt_or_a_token_costs_alone():
    """``slo_itl_ms=0``: the gap target is 4 x the measured step of one stream alone (else of
    the current steps); ``slo_ttft_ms=0``: the first-token target is 4 x the prompt's own cost
    (its tokens and one step). Unset, the fixed defaults (2000 and 150 ms), the first-token one
    raised to 4 x the prompt's own cost where that is longer: a prompt whose prefill alone takes
    most of 2 s is not written off for missing it."""
    policy = BUILTIN["slo"](0, slo_itl_ms=0, slo_ttft_ms=0)
    policy.plan(GroupView(0, 512, (_prompt(0, 1, 10),), 100.0, 1.0, 40.0, 20.0), None)
    assert policy.slo_itl_ms == 80.0
    policy.plan(GroupView(0, 512, (_prompt(0, 1, 10),), 100.0, 1.0, 40.0, 0.0), None)
    assert policy.slo_itl_ms == 160.0
    long_prompt = _prompt(0, 1, 3000)
    assert policy.ttft_target_ms(_view([long_prompt]), long_prompt) == 4 * (3000 + 40)
    assert policy.ttft_target_ms(_view([long_prompt], ms_tok=0.1), long_prompt) == 4 * (300 + 40)
    fixed = BUILTIN["slo"]()
    fixed.plan(GroupView(0, 512, (_prompt(0, 1, 10),), 100.0, 1.0, 40.0, 20.0), None)
    short_prompt = _prompt(0, 1, 10)
    assert fixed.slo_itl_ms == 150.0 and fixed.ttft_target_ms(_view([short_prompt]), short_prompt) == 2000.0
    assert fixed.ttft_target_ms(_view([long_prompt]), long_prompt) == 4 * (3000 + 40)
    assert fixed.ttft_target_ms(_view([long_prompt], ms_tok=0.1), long_prompt) == 2000.0
