"""Shared fixtures: the tiny generated GGUF model, runtimes over it, and an in-process server.

No network beyond loopback, no downloads: the model is written at test time (tinymodel.py).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from tinymodel import write_tiny_model

from llamactor.runtime import Runtime, RuntimeConfig

TEST_THREADS = 1  # one thread: no spin-barrier stalls when the 2 cores are shared
TEST_N_CTX = 4096


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf")


@pytest.fixture
def make_config(tiny_model: Path):
    """``make_config(parallel=8, ...)``: a RuntimeConfig over the tiny model with test sizes."""

    def make(**overrides: Any) -> RuntimeConfig:
        base = RuntimeConfig(
            model=tiny_model,
            n_ctx=TEST_N_CTX,
            parallel=4,
            threads=TEST_THREADS,
            n_batch=512,
            n_ubatch=512,
            isolate=False,
            endpoint_metrics=True,
        )  # in this process: hooks reach it; engine-isolation tests isolate; /metrics on (--metrics)
        return replace(base, **overrides)

    return make


# pytest-xdist workers' loopback ports: 2,000 each from 20000, below Linux's ephemeral range
# (32768 on), which bind(0) and outgoing connections take from
XDIST_PORTS, XDIST_PORTS_EACH = 20_000, 2_000
_ports = random.Random()  # its own: a test that seeds the module's generator does not steer it


def free_port() -> int:
    """A free loopback port. Under pytest-xdist (``make test``) each worker takes its ports from a
    range of its own below the kernel's ephemeral ports (which ``bind`` to port 0 hands out), so
    two workers never pick one port between a pick and its server's bind."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker[2:].isdigit():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    low = XDIST_PORTS + int(worker[2:]) * XDIST_PORTS_EACH
    for _ in range(1000):
        port = _ports.randrange(low, low + XDIST_PORTS_EACH)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken: another
            return port
    raise RuntimeError(f"no free port in {low}..{low + XDIST_PORTS_EACH - 1}")


def wait_healthy(proc: subprocess.Popen, health_url: str, timeout_s: float) -> None:
    """Wait until a server process answers 200 at ``health_url``; fail with its stderr if it exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "exited"
        assert time.monotonic() < deadline, "server did not become ready"
        try:
            if httpx.get(health_url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)


@asynccontextmanager
async def serve_runtime(rt: Runtime) -> AsyncIterator[str]:
    """Serve an open runtime with Hypercorn on a free loopback port; yields the base URL."""
    async with serve_app(rt.asgi_app()) as url:
        yield url


@asynccontextmanager
async def serve_app(app: Any, ready_path: str = "/health") -> AsyncIterator[str]:
    """Serve any ASGI app with Hypercorn on a free loopback port (really streaming, unlike
    httpx's ASGITransport, which collects a whole response first); yields the base URL."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    port = free_port()
    cfg = Config()
    cfg.bind = [f"127.0.0.1:{port}"]
    cfg.accesslog = None
    cfg.errorlog = None
    cfg.graceful_timeout = 0.5
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve(app, cfg, shutdown_trigger=stop.wait))
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient() as client:
            with anyio.fail_after(10):
                while True:
                    try:
                        await client.get(url + ready_path)
                        break
                    except httpx.TransportError:
                        await anyio.sleep(0.01)
        try:
            yield url
        finally:
            stop.set()


@asynccontextmanager
async def open_server(config: RuntimeConfig, *, hooks: Any = None) -> AsyncIterator[tuple[Runtime, str]]:
    async with Runtime.open(config, hooks=hooks) as rt, serve_runtime(rt) as url:
        yield rt, url


async def greedy_over_http(url: str, prompts: list[str], n_predict: int) -> list[list[int]]:
    """Greedy token ids for each prompt, all requests concurrent, through /completion."""
    out: list[list[int]] = [[] for _ in prompts]
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def one(i: int) -> None:
            r = await client.post(
                "/completion", json={"prompt": prompts[i], "n_predict": n_predict, "temperature": 0, "ignore_eos": True}
            )
            assert r.status_code == 200, r.text
            out[i] = r.json()["tokens"]

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    return out


async def past_first_event(response: Any) -> Any:
    """An SSE response's lines read up to its first ``data:`` line (the request is being
    served); the rest of them."""
    lines = response.aiter_lines()
    while not (await anext(lines)).startswith("data: "):
        pass
    return lines


async def wait_until(predicate, timeout_s: float = 10.0, poll_s: float = 0.005) -> None:
    """Wait for a condition (never a sleep guess): poll ``predicate`` until true or time out."""
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(poll_s)


async def slots_free(rt: Runtime, timeout_s: float = 10.0) -> None:
    """Wait until no slot serves a request (``await rt.slots()``: an engine in its own process too)."""
    with anyio.fail_after(timeout_s):
        while any(s.busy for s in await rt.slots()):
            await anyio.sleep(0.005)


async def greedy_together(
    config: RuntimeConfig, prompts: list[str], n_predict: int, groups_used: set[int] | None = None
) -> list[list[int]]:
    """``greedy_over_http`` with every request in its group before decoding goes on.

    Decode steps wait (test hooks) until the supervisor has assigned all the requests, so the
    batches a run decodes do not depend on how the requests happened to arrive: llama.cpp's
    CPU kernels are not batch-invariant, and on a loaded machine a different arrival order
    once made a greedy comparison differ by one token.
    """
    import threading

    from faults import Faults

    faults = Faults()
    faults.hold = threading.Event()
    groups_used = set() if groups_used is None else groups_used  # filled: the groups that served
    async with open_server(config, hooks=faults) as (rt, url):
        out: list[list[int]] = []

        async def run() -> None:
            out.extend(await greedy_over_http(url, prompts, n_predict))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            try:
                # the supervisor marks a slot busy when it assigns it, its group when the assignment
                # arrives: wait for both, so the groups that serve are known
                await wait_until(
                    lambda: (
                        sum(rt.engine.supervisor.snapshot().busy) == len(prompts)
                        and sum(s.busy for s in rt.engine.slot_states()) == len(prompts)
                    ),
                    timeout_s=30,
                )
                groups_used.update(s.group for s in rt.engine.slot_states() if s.busy)
            finally:
                faults.hold.set()
        return out
