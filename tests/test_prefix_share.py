"""A common prefix of concurrent prompts is prefilled once per group and shared by copying
its KV between the group's sequences (llama_memory_seq_cp), not once per slot."""

from __future__ import annotations

import re
import threading

import anyio
import httpx
import pytest
from conftest import open_server, wait_until
from faults import Faults

from llamactor.actors.policies import BUILTIN
from llamactor.runtime import Runtime
from llamactor.runtime.service.handles import collect

PREFIX = [(7 * i) % 200 + 3 for i in range(300)]
PROMPTS = [[*PREFIX, 100 + j, 101 + j, 50 + j] for j in range(8)]


def counter(rt: Runtime, name: str) -> float:
    text = rt.engine.metrics.render().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:_total)?(?:\{{[^}}]*\}})? (\S+)", text, re.MULTILINE))


async def alone(make_config, prompts: list[list[int]], n: int = 16) -> list[list[int]]:
    """Each prompt by itself, nothing reused: the reference greedy tokens."""
    async with Runtime.open(make_config(parallel=1)) as rt:
        return [
            (await rt.complete(p, max_tokens=n, temperature=0, ignore_eos=True, cache_prompt=False)).choices[0].tokens
            for p in prompts
        ]


async def together(rt: Runtime, prompts: list[list[int]], hold: threading.Event, n: int = 16) -> list:
    """All prompts submitted at once; decoding starts once every one holds a slot."""
    out: list = [None] * len(prompts)

    async def one(i: int) -> None:
        out[i] = await rt.complete(prompts[i], max_tokens=n, temperature=0, ignore_eos=True)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
        try:
            await wait_until(lambda: sum(rt.engine.supervisor.snapshot().busy) == len(prompts), timeout_s=30)
        finally:
            hold.set()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", [{}, {"kv_unified": True}, {"pipeline_groups": 2}], ids=["split-kv", "unified-kv", "two-groups"]
)
async def test_concurrent_prompts_prefill_their_common_prefix_once_per_group(make_config, layout):
    ref = await alone(make_config, PROMPTS)
    faults = Faults()
    faults.hold = threading.Event()
    async with Runtime.open(make_config(parallel=8, **layout), hooks=faults) as rt:
        outs = await together(rt, PROMPTS, faults.hold)
        groups = layout.get("pipeline_groups", 1)
        processed = counter(rt, "llamacpp:prompt_tokens")
        shared = counter(rt, "llamactor:prefix_tokens_shared")
    assert [o.choices[0].tokens for o in outs] == ref  # the copied KV continues exactly
    assert processed == groups * len(PREFIX) + len(PROMPTS) * 3  # the prefix once per group, then the suffixes
    assert shared == (len(PROMPTS) - groups) * len(PREFIX)
    assert sorted(o.n_cached for o in outs) == [0] * groups + [len(PREFIX)] * (len(PROMPTS) - groups)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", sorted(BUILTIN))
async def test_every_policy_serves_prompts_that_wait_for_a_shared_prefix(make_config, scheduler):
    """A prompt that waits for another slot's prefill is hidden from the policy until it copied
    the prefix; every policy (cohort barriers included) still serves every request."""
    prompts = PROMPTS[:4]
    ref = await alone(make_config, prompts)
    faults = Faults()
    faults.hold = threading.Event()
    async with Runtime.open(make_config(parallel=4, n_batch=64, scheduler=scheduler), hooks=faults) as rt:
        outs = await together(rt, prompts, faults.hold)
        assert counter(rt, "llamactor:prefix_tokens_shared") == 3 * len(PREFIX)
    assert [o.choices[0].tokens for o in outs] == ref


async def test_a_follower_copies_what_a_cancelled_leader_has(make_config):
    """The leader's request is cancelled partway through the shared prefix: the prompt that waited
    for it copies what was prefilled, prefills the rest itself and gives the same tokens."""
    long_prefix = [(11 * i) % 190 + 5 for i in range(1200)]
    first, second = [*long_prefix, 60, 61], [*long_prefix, 70, 71]
    ref = await alone(make_config, [second])
    gate = threading.Event()
    steps: list[int] = []

    def after_step(group, res) -> None:
        steps.append(res.n_prompt)
        if len(steps) == 3:
            gate.clear()  # step 4 waits: the follower and the leader's cancel arrive meanwhile

    faults = Faults()
    faults.on_step = after_step
    faults.hold = gate
    async with Runtime.open(make_config(parallel=2, n_batch=128, n_ubatch=128), hooks=faults) as rt:
        group = rt.engine.supervisor.groups[0]
        lead = await rt.submit(first, max_tokens=4, temperature=0, ignore_eos=True)
        await wait_until(lambda: sum(rt.engine.supervisor.snapshot().busy) == 1)
        gate.set()
        await wait_until(lambda: len(steps) == 3)
        follow = await rt.submit(second, max_tokens=16, temperature=0, ignore_eos=True)
        await wait_until(lambda: group.statistics().mailbox_used == 1)  # its Assign
        lead.close()  # cancels the leader
        await wait_until(lambda: group.statistics().mailbox_used == 2)  # and the Revoke
        gate.set()  # step 4 (the leader's 4th chunk), then both messages are handled
        out = await collect(follow)
    assert out.choices[0].tokens == ref[0]
    assert out.n_cached == 4 * 128


async def test_no_share_without_cache_prompt(make_config):
    faults = Faults()
    faults.hold = threading.Event()
    async with Runtime.open(make_config(parallel=4), hooks=faults) as rt:
        out: list = []

        async def one(p: list[int]) -> None:
            out.append(await rt.complete(p, max_tokens=4, temperature=0, cache_prompt=False))

        async with anyio.create_task_group() as tg:
            for p in PROMPTS[:4]:
                tg.start_soon(one, p)
            await wait_until(lambda: sum(rt.engine.supervisor.snapshot().busy) == 4)
            faults.hold.set()
        assert counter(rt, "llamactor:prefix_tokens_shared") == 0
        assert counter(rt, "llamacpp:prompt_tokens") == 4 * len(PROMPTS[0])
    assert all(o.n_cached == 0 for o in out)


async def test_shared_prefix_over_http(make_config):
    """Through the bundled server: concurrent /completion requests with one system text report
    the shared tokens in ``timings.cache_n`` and /metrics counts them."""
    system = "You are a careful assistant. " * 40
    async with open_server(make_config(parallel=4, cache_ram_mib=0)) as (rt, url):  # no host cache: slots only
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            first = await client.post("/completion", json={"prompt": system + "Hello there", "n_predict": 4})
            n_system = first.json()["timings"]["prompt_n"]

            async def one(i: int) -> dict:
                r = await client.post(
                    "/v1/completions", json={"prompt": system + f"Question {i}?", "max_tokens": 4, "temperature": 0}
                )
                assert r.status_code == 200, r.text
                return r.json()

            results: list[dict] = []
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(lambda i=i: _append(results, one(i)))
            metrics = (await client.get("/metrics")).text
    cached = [r["timings"]["cache_n"] for r in results]
    assert all(c >= n_system - 8 for c in cached), (cached, n_system)
    assert re.search(r"^llamactor:prefix_tokens_shared_total\{group=\"0\"\} [1-9]", metrics, re.MULTILINE)


async def _append(results: list[dict], coro) -> None:
    results.append(await coro)


def test_choose_borrows_only_same_lora_whole_prefixes_worth_a_copy():
    """The donor rules (``prefixshare.choose``): a slot under another LoRA set never lends (its KV
    was computed with other weights); n > 1 children and waiting followers never lend; a share
    must save MIN_SHARE tokens over what the slot keeps; a slot still prefilling a longer common
    prefix is waited for."""
    import numpy as np

    from llamactor.actors.prefixshare import MIN_SHARE, choose
    from llamactor.runtime.engine.slot import Phase, Slot

    prompt = np.asarray([*PREFIX, 7, 8], dtype=np.int32)
    me = Slot(0, 0)
    idle = Slot(1, 1)
    idle.cache = list(PREFIX[:200])
    assert choose(me, prompt, 0, [me, idle], ()) == (idle, 200, False)
    assert choose(me, prompt, 200 - MIN_SHARE + 1, [me, idle], ()) == (None, 0, False)  # not worth a copy
    assert choose(me, prompt, 0, [me, idle], ((0, 1.0),)) == (None, 0, False)  # another LoRA set
    child = Slot(2, 2)
    child.cache, child.parent = list(PREFIX), idle
    follower = Slot(3, 3)
    follower.cache, follower.follows = list(PREFIX), idle
    assert choose(me, prompt, 0, [me, child, follower], ()) == (None, 0, False)
    leader = Slot(4, 4)
    leader.phase, leader.task = Phase.PREFILL, object()  # type: ignore[assignment]
    leader.prompt = np.asarray([*PREFIX, 9], dtype=np.int32)
    leader.cache, leader.n_past = list(PREFIX[:64]), 64
    assert choose(me, prompt, 0, [me, idle, leader], ()) == (leader, len(PREFIX), True)
