"""Supervision: a failing group fails its requests, restarts, and the runtime goes on."""

from __future__ import annotations

import threading

import anyio
import httpx
import pytest
from conftest import open_server, wait_until
from faults import Faults

from llamactor.runtime import EngineError, Runtime
from llamactor.runtime.service.handles import collect


async def _start_streams(rt: Runtime, n: int):
    handles = [await rt.submit(f"stream {i}", max_tokens=5000, temperature=0, ignore_eos=True) for i in range(n)]
    for h in handles:
        await h.first()
    return handles


async def test_decode_failure_fails_inflight_restarts_group(make_config):
    """An injected decode failure fails every in-flight request (none hangs),
    the group restarts with a fresh context, and the next request succeeds."""
    faults = Faults()
    async with open_server(make_config(parallel=4, n_ctx=4 * 8192), hooks=faults) as (rt, url):
        old_group = rt.engine.supervisor.groups[0]
        handles = await _start_streams(rt, 3)
        faults.fail_decode = 1
        for h in handles:
            with anyio.fail_after(10), pytest.raises(EngineError, match="injected decode failure"):
                async for _ in h:
                    pass
        await wait_until(
            lambda: rt.engine.supervisor.groups[0] is not old_group and rt.engine.supervisor.groups[0].engine
        )
        assert rt.engine.supervisor.restarts[0] == 1
        assert not any(s.busy for s in rt.engine.slot_states())
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/health")).status_code == 200
            r = await client.post("/completion", json={"prompt": "after", "n_predict": 6, "temperature": 0})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 6


async def test_streaming_client_sees_error_event(make_config):
    """Supervision through HTTP: a streaming request whose group fails ends with an error event, not a hang."""
    faults = Faults()
    async with open_server(make_config(parallel=2, n_ctx=2 * 8192), hooks=faults) as (rt, url):
        async with (
            httpx.AsyncClient(base_url=url, timeout=20) as client,
            client.stream(
                "POST",
                "/completion",
                json={
                    "prompt": "x",
                    "n_predict": 5000,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                },
            ) as resp,
        ):
            lines = []
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 3:
                        faults.fail_decode = 1
        assert '"server_error"' in lines[-1] and "injected decode failure" in lines[-1]


async def test_restart_intensity_limit_reports_unhealthy(make_config):
    """Past max_restarts within the window the group stays down and /health is 503."""
    faults = Faults()
    async with open_server(make_config(parallel=2, max_restarts=1, restart_window_s=60), hooks=faults) as (rt, url):
        for _ in range(2):
            group = rt.engine.supervisor.groups[0]
            faults.fail_decode = 1
            with pytest.raises(EngineError):
                await rt.complete("boom", max_tokens=4, temperature=0)
            await wait_until(lambda g=group: rt.engine.supervisor.groups[0] is not g)
        assert rt.health() == "unhealthy"
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.get("/health")
            assert r.status_code == 503
            r = await client.post("/completion", json={"prompt": "x", "n_predict": 2})
            assert r.status_code == 503 and "unhealthy" in r.json()["error"]["message"]


async def test_slot_erase_waits_only_for_owning_group(make_config):
    """Supervision helper check of the test hook: a held step blocks its own group's commands only."""
    faults = Faults()
    async with Runtime.open(make_config(parallel=2), hooks=faults) as rt:
        hold = faults.hold = threading.Event()
        h = await rt.submit("x", max_tokens=4, temperature=0)
        with anyio.move_on_after(0.2) as scope:
            await rt.slot_action(1, "erase")
        assert scope.cancelled_caught  # group 0 is inside a held step: its slots must wait
        hold.set()
        await rt.slot_action(1, "erase")
        async with h:
            async for _ in h:
                pass


async def test_slot_command_does_not_free_a_busy_slot(make_config):
    """Slot table integrity: an erase queued ahead of an Assign for the same slot must not mark
    that slot free while it serves the new request (no double assignment, nothing hangs)."""
    faults = Faults()
    async with Runtime.open(make_config(parallel=2, n_ctx=2 * 1024), hooks=faults) as rt:
        group = rt.engine.supervisor.groups[0]
        hold = faults.hold = threading.Event()
        try:
            a = await rt.submit([1, 2, 3, 4], max_tokens=200, temperature=0, ignore_eos=True)
            await wait_until(lambda: group.slots[0].busy)
            async with anyio.create_task_group() as tg:
                tg.start_soon(rt.slot_action, 1, "erase")
                await wait_until(lambda: group.statistics().mailbox_used >= 1)  # the erase waits in the mailbox
                b = await rt.submit([5, 6, 7, 8], max_tokens=200, temperature=0, ignore_eos=True)
                await wait_until(lambda: rt.engine.supervisor.table[1].busy)
                hold.set()
        finally:
            hold.set()
        await wait_until(lambda: group.slots[1].busy or not rt.engine.supervisor.table[1].busy)
        assert rt.engine.supervisor.table[1].busy == group.slots[1].busy
        c = await rt.submit([9, 10, 11], max_tokens=5, temperature=0, ignore_eos=True)
        with anyio.fail_after(20):
            results = [await collect(h) for h in (a, b, c)]
        assert [r.n_predicted for r in results] == [200, 200, 5]


async def test_slot_command_flood_is_refused_not_fatal(make_config):
    """A flood of slot commands while the group is busy gets 409/503 answers; the runtime survives."""
    faults = Faults()
    async with Runtime.open(make_config(parallel=1, n_ctx=1024), hooks=faults) as rt:
        group = rt.engine.supervisor.groups[0]
        hold = faults.hold = threading.Event()
        outcomes: list[str] = []
        try:
            h = await rt.submit([1, 2, 3, 4], max_tokens=4, temperature=0)
            await wait_until(lambda: group.slots[0].busy)

            async def erase() -> None:
                try:
                    await rt.slot_action(0, "erase")
                    outcomes.append("ok")
                except Exception as exc:
                    outcomes.append(type(exc).__name__)

            async with anyio.create_task_group() as tg:
                for _ in range(200):
                    tg.start_soon(erase)
                await wait_until(lambda: outcomes.count("Overloaded") > 0)
                hold.set()
        finally:
            hold.set()
        assert set(outcomes) <= {"ok", "SlotBusy", "Overloaded"} and "Overloaded" in outcomes
        await collect(h)
        assert (await rt.complete([1, 2, 3], max_tokens=2, temperature=0)).n_predicted == 2
