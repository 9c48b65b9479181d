"""Slot selection (AC-3): prefix reuse first, then the least busy group, then the lowest id."""

from __future__ import annotations

import anyio

from llamactor.runtime import Runtime


async def _complete_all(rt: Runtime, prompts: list) -> list[int]:
    slots: list[int] = [0] * len(prompts)

    async def one(i: int) -> None:
        slots[i] = (await rt.complete(prompts[i], max_tokens=30, temperature=0, ignore_eos=True)).slot

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return slots


async def test_new_prompts_take_lowest_slots_and_cached_prefix_wins(make_config):
    """AC-3: distinct prompts pack into the lowest slot ids (compact sequence range for llama.cpp's
    split KV), and a prompt extending a cached one goes back to that slot (KV reuse)."""
    async with Runtime.open(make_config(parallel=8, n_ctx=8 * 256)) as rt:
        first = await _complete_all(rt, [[100 + i] * 40 for i in range(8)])
        assert sorted(first) == list(range(8))
        again = await _complete_all(rt, [[200 + i] * 40 for i in range(3)])
        assert sorted(again) == [0, 1, 2]
        reuse = await rt.complete([105] * 40 + [7] * 5, max_tokens=2, temperature=0)
        assert reuse.slot == first[5] and reuse.n_cached == 40


async def test_groups_are_balanced(make_config):
    """AC-3 with pipeline groups: concurrent requests spread over groups before filling one."""
    async with Runtime.open(make_config(parallel=8, n_ctx=8 * 256, pipeline_groups=2)) as rt:
        slots = await _complete_all(rt, [[300 + i] * 20 for i in range(4)])
        assert sorted(s // 4 for s in slots) == [0, 0, 1, 1]
