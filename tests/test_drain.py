"""Graceful drain of the isolated engine: SIGTERM during streams lets them finish, refuses new
requests with 503, and exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from pathlib import Path

import anyio
import httpx
import pytest
from conftest import free_port, wait_until
from test_cli import _wait_ready, serve_argv

from llamactor.protocol.errors import Unavailable
from llamactor.protocol.events import Token
from llamactor.runtime import Runtime

pytestmark = pytest.mark.slow  # a server subprocess drained by a signal

N_STREAMS = 8
N_PREDICT = 900


def _stream(url: str, out: list, started: threading.Barrier) -> None:
    body = {"prompt": "tell me", "n_predict": N_PREDICT, "temperature": 0, "ignore_eos": True, "stream": True}
    tokens, final = 0, None
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/completion", json=body) as r:
        first = True
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if first:
                first = False
                started.wait()
            tokens += len(chunk.get("tokens") or [])
            if chunk.get("stop"):
                final = chunk
    out.append((tokens, final))


def test_sigterm_drains_streams_refuses_new_requests_and_exits_0(tiny_model: Path):
    port = free_port()
    proc = subprocess.Popen(
        serve_argv(tiny_model, port, str(N_STREAMS), str(N_STREAMS * 1024), "--shutdown-timeout", "60"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    results: list = []
    started = threading.Barrier(N_STREAMS + 1)
    try:
        _wait_ready(url, proc)
        threads = [threading.Thread(target=_stream, args=(url, results, started)) for _ in range(N_STREAMS)]
        for t in threads:
            t.start()
        started.wait(timeout=30)  # every stream has its first chunk
        proc.send_signal(signal.SIGTERM)
        refused = httpx.post(url + "/completion", json={"prompt": "late", "n_predict": 4}, timeout=10)
        health = httpx.get(url + "/health", timeout=10)
        for t in threads:
            t.join(timeout=60)
        _, err = proc.communicate(timeout=60)  # the drain ends the process by itself
    finally:
        if proc.poll() is None:
            proc.kill()
    logs = err.decode()
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert refused.headers.get("retry-after")
    assert health.status_code == 503
    assert len(results) == N_STREAMS
    for tokens, final in results:
        assert final is not None and final["tokens_predicted"] == N_PREDICT, logs[-2000:]
    assert proc.returncode == 0, logs[-2000:]
    assert '"event": "drained"' in logs


async def test_runtime_drain_in_an_embedding_app(make_config):
    """``Runtime.drain``: requests in flight finish, new ones raise Unavailable (503), health says so."""
    async with Runtime.open(make_config(parallel=2)) as rt:
        handle = await rt.submit("drain me", max_tokens=300, temperature=0, ignore_eos=True)
        await handle.first()
        async with anyio.create_task_group() as tg:
            done: list[bool] = []

            async def drain() -> None:
                done.append(await rt.drain(30))

            tg.start_soon(drain)
            await wait_until(lambda: rt.draining)
            assert rt.health() == "draining"
            with pytest.raises(Unavailable):
                await rt.submit("too late", max_tokens=2)
            async with handle:
                tokens = [e async for e in handle if isinstance(e, Token)]
        assert done == [True] and len(tokens) == 299 and rt.in_flight() == 0
