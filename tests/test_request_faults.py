"""A failure injected at each point of a request's life.

At every point the failing request gets its error within a second and the next request
succeeds. Points that belong to one request (admission, sampler build, sampling, delivery)
fail that request alone: a stream running beside it is untouched, no group restarts and the
runtime stays healthy however many such requests arrive. A decode failure (prefill or
generate) is the group's: every request it holds, the one being admitted included, gets its
error at once and the group restarts.
"""

from __future__ import annotations

import threading

import anyio
import httpx
import pytest
from conftest import open_server, wait_until
from faults import Faults

from llamactor.protocol.errors import EngineError, LlamactorError
from llamactor.runtime import Runtime
from llamactor.runtime.service.handles import collect

POISON_N = 7  # requests with this n_predict are the ones a request-scoped fault hits
ERROR_WITHIN_S = 1.0


async def _plain_ok(client: httpx.AsyncClient) -> None:
    r = await client.post("/completion", json={"prompt": "after", "n_predict": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["tokens_predicted"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("point", ["assign", "sample", "send"])
async def test_request_scoped_fault_fails_only_that_request(make_config, point):
    faults = Faults()
    faults.poison[point] = lambda task: task.n_predict == POISON_N
    async with open_server(make_config(parallel=4), hooks=faults) as (rt, url):
        bystander = await rt.submit("a bystander", max_tokens=64, temperature=0, ignore_eos=True)
        await bystander.first()
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            for stream in (False, True):
                with anyio.fail_after(ERROR_WITHIN_S):
                    r = await client.post(
                        "/completion",
                        json={
                            "prompt": "poisoned",
                            "n_predict": POISON_N,
                            "temperature": 0,
                            "stream": stream,
                        },
                    )
                if stream:  # a failure after the first event ends the stream with an error event
                    assert r.status_code in (200, 500)
                    assert "injected" in r.text and '"server_error"' in r.text
                else:
                    assert r.status_code == 500, r.text
                    assert "injected" in r.json()["error"]["message"]
            with pytest.raises(EngineError, match="injected"):
                with anyio.fail_after(ERROR_WITHIN_S):
                    await rt.complete("poisoned", max_tokens=POISON_N, temperature=0)
            await _plain_ok(client)
        result = await collect(bystander)
        assert result.n_predicted == 63 or result.n_predicted == 64  # the first token was taken by first()
        assert rt.engine.supervisor.restarts == [0] and rt.health() == "ok"
        assert rt.engine.metrics.groups[0].requests_failed == 3


async def test_many_poisoned_requests_never_make_the_runtime_unhealthy(make_config):
    """Four (here twenty) bad requests within the restart window used to mark the
    runtime unhealthy; request-scoped failures count nothing toward the restart limit."""
    faults = Faults()
    faults.poison["sample"] = lambda task: task.n_predict == POISON_N
    async with open_server(make_config(parallel=2, max_restarts=1, restart_window_s=600), hooks=faults) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            for _ in range(20):
                r = await client.post("/completion", json={"prompt": "x", "n_predict": POISON_N, "repeat_penalty": 1.1})
                assert r.status_code == 500
            assert (await client.get("/health")).status_code == 200
            await _plain_ok(client)
            metrics = (await client.get("/metrics")).text
        assert 'llamactor:group_restarts_total{group="0"} 0.0' in metrics
        assert 'llamactor:requests_failed_total{group="0"} 20.0' in metrics


@pytest.mark.slow
async def test_admission_failure(make_config, monkeypatch):
    """Admission: tokenization raising for one prompt answers that request (500) alone."""
    async with open_server(make_config(parallel=2)) as (rt, url):
        real = rt.model.tokenize

        def tokenize(text: str, **kw):
            if text == "poisoned":
                raise RuntimeError("injected admission failure")
            return real(text, **kw)

        monkeypatch.setattr(rt.model, "tokenize", tokenize)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            with anyio.fail_after(ERROR_WITHIN_S):
                r = await client.post("/completion", json={"prompt": "poisoned", "n_predict": 4})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            await _plain_ok(client)
        assert rt.engine.supervisor.restarts == [0]


@pytest.mark.parametrize("phase", ["prefill", "generate"])
async def test_decode_failure_fails_every_held_request_at_once(make_config, phase):
    """Prefill and generate: a failing decode fails every request of the group, including the
    one whose Assign is still in the group's mailbox, each within a second; the group
    restarts; the next request succeeds."""
    faults = Faults()
    hold = faults.hold = threading.Event()
    if phase == "prefill":
        faults.fail_decode_when = lambda n_prompt, n_generate: n_prompt > 0
    else:
        faults.fail_decode_when = lambda n_prompt, n_generate: n_prompt == 0
    async with open_server(make_config(parallel=4), hooks=faults) as (rt, url):
        group = rt.engine.supervisor.groups[0]
        if phase == "generate":
            hold.set()
            running = await rt.submit("running", max_tokens=500, temperature=0, ignore_eos=True)
            await running.first()
            hold.clear()
        else:
            running = None
        held = await rt.submit("held in the step", max_tokens=8, temperature=0)
        await wait_until(lambda: any(s.busy for s in group.slots))
        await wait_until(lambda: 0 in faults.holding)  # the group is inside its (held) step now
        queued = await rt.submit("in the mailbox", max_tokens=8, temperature=0)
        await wait_until(lambda: group.statistics().mailbox_used >= 1 or queued.task.id in group._tasks)
        faults.fail_decode = 1
        hold.set()
        with anyio.fail_after(ERROR_WITHIN_S):
            for h in [h for h in (running, held, queued) if h is not None]:
                with pytest.raises(LlamactorError, match="injected decode failure"):
                    await collect(h)
        await wait_until(
            lambda: rt.engine.supervisor.groups[0] is not group and rt.engine.supervisor.groups[0].engine is not None
        )
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            await _plain_ok(client)
        assert rt.engine.supervisor.restarts == [1]


async def test_group_failure_is_logged_with_its_requests(make_config):
    from structlog.testing import capture_logs

    faults = Faults()
    async with Runtime.open(make_config(parallel=2), hooks=faults) as rt:
        faults.fail_decode = 1
        with capture_logs() as logs:
            h = await rt.submit("x", max_tokens=4, temperature=0)
            with pytest.raises(EngineError):
                await collect(h)
        failed = [e for e in logs if e["event"] == "group_step_failed"]
        assert failed and failed[0]["tasks"] == [h.task.id]
