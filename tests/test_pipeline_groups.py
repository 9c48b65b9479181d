"""Pipeline groups: N contexts over one model, N batches in flight."""

from __future__ import annotations

import re
import threading

import anyio
import httpx
import pytest
from conftest import greedy_together, open_server, wait_until
from faults import Faults
from structlog.testing import capture_logs

from llamactor.runtime import ConfigError, Runtime, RuntimeConfig
from llamactor.runtime.service.handles import collect

PROMPTS = [f"prompt number {i}: {'abc ' * i}" for i in range(8)]


@pytest.mark.slow
async def test_greedy_identical_for_1_2_4_groups(make_config):
    """Greedy output is byte-identical for 1, 2 and 4 pipeline groups, through HTTP."""
    results = {}
    for n in (1, 2, 4):
        used: set[int] = set()
        results[n] = await greedy_together(make_config(parallel=8, n_ctx=8 * 512, pipeline_groups=n), PROMPTS, 20, used)
        assert used == set(range(n))
    assert results[1] == results[2] == results[4]
    assert len({tuple(r) for r in results[1]}) == len(PROMPTS)


def test_context_sizing_split_and_unified(tiny_model):
    """Split KV gives each slot C/P; unified gives each request C."""
    split = RuntimeConfig(model=tiny_model, n_ctx=4096, parallel=8, pipeline_groups=2).validated()
    assert (split.ctx_per_context, split.slots_per_group, split.ctx_per_request, split.total_kv_cells) == (
        2048,
        4,
        512,
        4096,
    )
    assert [list(split.group_slots(g)) for g in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    unified = RuntimeConfig(model=tiny_model, n_ctx=4096, parallel=8, pipeline_groups=2, kv_unified=True).validated()
    assert (unified.ctx_per_context, unified.ctx_per_request, unified.total_kv_cells) == (4096, 4096, 8192)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"parallel": 6, "pipeline_groups": 4}, "--parallel (6) must be a multiple of --pipeline-groups (4)"),
        ({"parallel": 2, "pipeline_groups": 4}, "--pipeline-groups (4) must not exceed --parallel (2)"),
        ({"pipeline_groups": 0}, "--pipeline-groups must be >= 1, got 0"),
        ({"parallel": 4, "pipeline_groups": 4, "n_ctx": 4098}, "--ctx-size (4098) must be a multiple of"),
    ],
)
def test_refusals_name_the_values(tiny_model, overrides, message):
    """P % N != 0, N > P, N < 1 refused with the values named."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        RuntimeConfig(model=tiny_model, **overrides).validated()


async def test_per_request_context_in_both_modes(make_config):
    """With split KV a prompt longer than C/P is refused; unified accepts it (up to C)."""
    long_prompt = [7] * 700
    async with Runtime.open(make_config(parallel=4, n_ctx=2048, pipeline_groups=2)) as rt:
        assert rt.engine.supervisor.groups[0].engine.n_ctx_seq == 512
        with pytest.raises(Exception, match=r"request \(700 tokens\) exceeds the available context size \(512"):
            await rt.complete(long_prompt, max_tokens=2)
    with capture_logs() as logs:
        async with Runtime.open(make_config(parallel=4, n_ctx=2048, pipeline_groups=2, kv_unified=True)) as rt:
            assert rt.engine.supervisor.groups[0].engine.n_ctx_seq == 2048
            out = await rt.complete(long_prompt, max_tokens=2, temperature=0)
            assert out.n_predicted == 2
    ready = [e for e in logs if e["event"] == "runtime_ready"][0]
    assert ready["ctx_per_request"] == 2048 and ready["total_kv_cells"] == 4096 and ready["kv"] == "unified"


async def test_slot_work_waits_only_for_owning_group(make_config):
    """With group 1 held inside a decode step, erasing and releasing a slot
    of group 0 complete; group 1's own slot commands wait for its step."""
    faults = Faults()
    faults.hold, faults.hold_groups = threading.Event(), {1}
    hold = faults.hold
    async with Runtime.open(make_config(parallel=4, pipeline_groups=2), hooks=faults) as rt:
        stuck = await rt.submit("held in group 1", max_tokens=8, temperature=0, id_slot=2)
        await wait_until(lambda: rt.engine.slot_states()[2].busy)
        with anyio.fail_after(5):
            out = await rt.complete("group 0 works", max_tokens=4, temperature=0, id_slot=0)  # release
            assert out.slot == 0
            erased = await rt.slot_action(0, "erase")
            assert erased.n_tokens > 0
        with anyio.move_on_after(0.2) as scope:
            await rt.slot_action(3, "erase")
        assert scope.cancelled_caught  # group 1 is inside its step
        hold.set()
        async with stuck:
            async for _ in stuck:
                pass
        await rt.slot_action(3, "erase")


def _series(text: str, name: str) -> dict[str, float]:
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(rf'^{re.escape(name)}{{group="(\d+)"}} (\S+)$', text, re.MULTILINE)
    }


async def test_metrics_per_group_sum_to_client_totals(make_config):
    """Per-group series sum to what the clients received; both groups decoded."""
    async with open_server(make_config(parallel=4, pipeline_groups=2)) as (rt, url):
        received = 0
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def one(i: int) -> None:
                nonlocal received
                r = await client.post(
                    "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 6 + i, "temperature": 0}
                )
                received += r.json()["usage"]["completion_tokens"]

            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(one, i)
            text = (await client.get("/metrics")).text
    predicted = _series(text, "llamactor:group_tokens_predicted_total")
    assert set(predicted) == {"0", "1"} and all(v > 0 for v in predicted.values())
    assert sum(predicted.values()) == received
    decodes = _series(text, "llamactor:group_n_decode_total")
    assert all(v > 0 for v in decodes.values())


async def test_n_choices_stay_in_one_group(make_config):
    """The parent and its children live in one group; a request waits rather than split."""
    async with Runtime.open(make_config(parallel=4, pipeline_groups=2)) as rt:
        blocker = await rt.submit("occupy group 0", max_tokens=30, temperature=0, id_slot=0)
        await blocker.first()
        out = await rt.complete("two choices", max_tokens=5, temperature=0, n=2)
        assert 2 <= out.slot <= 3  # group 0 has one free slot only: the request went to group 1
        async with blocker:
            async for _ in blocker:
                pass


async def test_n_choices_wait_rather_than_split(make_config):
    """With one free slot in each group, a request for n=2 waits in the queue (two free
    slots exist, but not in one group) and starts only when a group has two."""
    faults = Faults()
    faults.hold, faults.hold_groups = threading.Event(), {0, 1}
    faults.hold.set()
    async with Runtime.open(make_config(parallel=4, pipeline_groups=2), hooks=faults) as rt:
        a = await rt.submit("occupy group 0", max_tokens=100, temperature=0, ignore_eos=True, id_slot=0)
        b = await rt.submit("occupy group 1", max_tokens=40, temperature=0, ignore_eos=True, id_slot=2)
        await a.first()
        await b.first()
        faults.hold.clear()  # both groups stop at their next step: a and b keep their slots
        pair = await rt.submit("two choices", max_tokens=5, temperature=0, n=2)
        await wait_until(lambda: rt.engine.supervisor.snapshot().queue_depth == 1)
        await anyio.wait_all_tasks_blocked()  # every actor has handled what it was sent: nothing moves
        assert rt.engine.supervisor.snapshot().queue_depth == 1  # waiting, although slots 1 and 3 are free
        assert rt.engine.supervisor.snapshot().busy == (True, False, True, False)
        faults.hold.set()
        out = await collect(pair)
        assert out.slot in (0, 2) and {c.index for c in out.choices} == {0, 1}
        assert (await collect(b)).n_predicted == 40
        assert (await collect(a)).n_predicted == 100


async def test_profiler_logs_each_group(make_config):
    """One pipe_profile line per group per interval, with every field;
    off, the groups carry no profile object (the hot path pays a branch only)."""
    async with Runtime.open(make_config(parallel=4, pipeline_groups=2)) as rt:
        assert all(g.profile is None for g in rt.engine.supervisor.groups)
    with capture_logs() as logs:
        async with Runtime.open(make_config(parallel=4, pipeline_groups=2, profile=True, profile_interval_s=0.0)) as rt:
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(lambda i=i: rt.complete(f"x{i}", max_tokens=8, temperature=0, id_slot=i))
    lines = [e for e in logs if e["event"] == "pipe_profile"]
    assert {e["group"] for e in lines} == {0, 1}
    fields = {
        "wait_engine_ms",
        "build_ms",
        "decode_ms",
        "synchronize_ms",
        "after_decode_ms",
        "deliver_ms",
        "sample_ms_per_token",
        "detokenize_ms_per_token",
        "stop_strings_ms_per_token",
        "send_ms_per_token",
    }
    for e in lines:
        assert fields <= set(e) and all(e[f] >= 0 for f in fields)
    assert sum(e["tokens"] for e in lines) == 32


async def test_unified_kv_overcommit_stops_one_request_not_the_group(make_config):
    """Context sizing with --kv-unified: slots share C cells, so they can run out; the request holding the
    most cells is stopped with an error, the other finishes, and the group is not restarted."""
    async with Runtime.open(make_config(parallel=2, n_ctx=256, kv_unified=True, n_batch=64, n_ubatch=64)) as rt:
        outcomes: list[str] = []

        async def one(prompt: list[int]) -> None:
            try:
                out = await rt.complete(prompt, max_tokens=150, temperature=0, ignore_eos=True)
                outcomes.append(f"ok {out.n_predicted}")
            except Exception as exc:
                outcomes.append(f"error {exc}")

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, [9] * 90)
            tg.start_soon(one, [8] * 60)
        assert sorted(o.split()[0] for o in outcomes) == ["error", "ok"], outcomes
        assert any("KV cache is full" in o for o in outcomes)
        assert rt.engine.supervisor.restarts == [0]
        out = await rt.complete("after", max_tokens=3, temperature=0)
        assert out.n_predicted == 3
