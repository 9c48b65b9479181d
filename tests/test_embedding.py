"""The embedding API (the runtime inside a host app): the example app, the public surface, lifecycle misuse."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import anyio
import httpx
import pytest
from conftest import wait_until

from llamactor import runtime
from llamactor.runtime import Closed, ConfigError, LlamactorError, Runtime, RuntimeConfig, Unavailable

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


async def test_embed_example_app(make_config):
    """examples/embed_app.py runs the runtime in the app's lifespan; both routes work."""
    app = _load_example("embed_app").create_app(make_config())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            r = await client.get("/hello", params={"name": "Ada"})
            assert r.status_code == 200 and r.json()["tokens"] == 16
            r = await client.post(
                "/llm/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "temperature": 0,
                },
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


async def test_embed_example_app_streams_refuses_and_cancels(make_config, monkeypatch):
    """The example's streaming route over a real server: a prompt too long for a slot is a 400
    with the reason (before any byte), and a client that leaves mid-stream cancels its request:
    once the app sees the connection close and leaves its loop, the request ends within one
    decode step, far short of the 64 tokens it asked for."""
    from conftest import serve_app, wait_until

    from llamactor.runtime.service.handles import RequestHandle

    app = _load_example("embed_app").create_app(make_config(n_ctx=4096))
    rt = app.state.runtime
    closed_at: list[int] = []
    close = RequestHandle.close

    def recording_close(handle: RequestHandle) -> None:
        if not handle.closed:
            closed_at.append(rt.engine.metrics.groups[0].n_decode)
        close(handle)

    monkeypatch.setattr(RequestHandle, "close", recording_close)
    async with serve_app(app, ready_path="/llm/health") as url:  # hypercorn runs its lifespan
        steps = rt.engine.metrics.groups[0]
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.get("/story", params={"topic": "word " * 2000})
            assert r.status_code == 400 and "slot context" in r.json()["error"]
            r = await client.get("/story", params={"topic": "the sea"})
            assert r.status_code == 200 and r.text
            closed_at.clear()
            started = steps.n_decode
            async with client.stream("GET", "/story", params={"topic": "a long walk"}) as response:
                async for _ in response.aiter_bytes():
                    break  # the client leaves after its first bytes
        await wait_until(lambda: rt.in_flight() == 0)
        assert len(closed_at) == 1  # the app left its loop: the handle closed
        assert steps.n_decode - closed_at[0] <= 1
        assert steps.n_decode - started < 64


def test_public_surface_is_exact():
    """The public surface of ``llamactor.runtime`` is explicit and asserted."""
    assert sorted(runtime.__all__) == [
        "ChatResult",
        "Choice",
        "Closed",
        "Completion",
        "ConfigError",
        "Done",
        "EmbeddingResult",
        "EngineError",
        "EngineStatus",
        "EventStream",
        "ExceedContextSize",
        "GenerationRequest",
        "InfillChunk",
        "InfillParts",
        "LlamactorError",
        "LoraScale",
        "NotFound",
        "NotSupported",
        "Overloaded",
        "Progress",
        "Ranked",
        "RequestError",
        "RequestHandle",
        "Runtime",
        "RuntimeConfig",
        "RuntimeState",
        "SlotActionResult",
        "SlotBusy",
        "SlotState",
        "Token",
        "Unauthorized",
        "Unavailable",
    ]
    for name in runtime.__all__:
        assert hasattr(runtime, name)


async def test_stream_and_complete_agree(make_config):
    """rt.stream yields the tokens rt.complete returns."""
    async with Runtime.open(make_config()) as rt:
        full = await rt.complete("Hello", max_tokens=10, temperature=0)
        events = [e async for e in rt.stream("Hello", max_tokens=10, temperature=0)]
    tokens = tuple(e.token for e in events if hasattr(e, "token"))
    assert tokens == full.choices[0].tokens
    assert "".join(getattr(e, "text", "") for e in events if hasattr(e, "token")) == full.text


async def test_misuse_raises_clear_errors(make_config, tmp_path):
    """Lifecycle misuse: submit before open; bad config refused at open with a message naming the value."""
    rt = Runtime(make_config())
    with pytest.raises(Unavailable, match="not open"):
        await rt.complete("x")
    with pytest.raises(ConfigError, match="model file not found"):
        async with Runtime.open(RuntimeConfig(model=tmp_path / "missing.gguf")):
            pass
    with pytest.raises(ConfigError, match="--parallel"):
        async with Runtime.open(make_config(parallel=0)):
            pass


@pytest.mark.slow
@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolated"])
async def test_shutdown_closes_streams_and_drain_lets_them_finish(make_config, isolate):
    """Leaving ``async with rt`` ends a stream still running with ``Closed`` (as the docs' error
    table says), the engine in this process or its own; ``drain`` first lets it finish and
    refuses new requests with ``Unavailable`` meanwhile."""
    cut: list[BaseException] = []
    got: list[int] = []

    async def consume(rt: Runtime, n: int) -> None:
        try:
            async for event in rt.stream("Hello", max_tokens=n, temperature=0, ignore_eos=True):
                if hasattr(event, "token"):
                    got.append(event.token)
        except LlamactorError as exc:
            cut.append(exc)

    async with anyio.create_task_group() as tg:
        async with Runtime.open(make_config(isolate=isolate, parallel=2)) as rt:
            tg.start_soon(consume, rt, 100_000)
            await wait_until(lambda: len(got) >= 4)
        # the block is left with the stream running
    assert len(cut) == 1 and type(cut[0]) is Closed, cut
    assert "shutting down" in str(cut[0])

    got.clear()
    async with Runtime.open(make_config(isolate=isolate, parallel=2)) as rt:
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, rt, 48)
            await wait_until(lambda: len(got) >= 2)
            finished = await rt.drain(timeout_s=60)
        assert finished and rt.in_flight() == 0
        with pytest.raises(Unavailable, match="shutting down"):
            await rt.complete("Too late", max_tokens=2)
    assert len(got) == 48 and len(cut) == 1  # the drained stream ran to its end


async def test_a_request_the_app_leaves_logs_its_end(make_config):
    """Every request logs one event when it ends: a finished one ``request_done`` with reason
    ``finished``, one the app stopped reading ``request_done`` with reason ``cancelled``."""
    from structlog.testing import capture_logs

    async with Runtime.open(make_config()) as rt:
        with capture_logs() as logs:
            await rt.complete("Hello", max_tokens=3, temperature=0)
            seen = 0
            async for event in rt.stream("Hello", max_tokens=500, temperature=0, ignore_eos=True):
                seen += hasattr(event, "token")
                if seen == 3:
                    break
            await wait_until(lambda: rt.in_flight() == 0)
    ends = [e for e in logs if e["event"] == "request_done"]
    assert [e["reason"] for e in ends] == ["finished", "cancelled"], ends
    assert ends[0]["n_predicted"] == 3 and 3 <= ends[1]["n_predicted"] < 500


@pytest.mark.slow
def test_the_app_sets_the_level_and_format_of_the_engines_logs(tiny_model, tmp_path):
    """An app that logs at WARNING with a renderer of its own, its runtime's engine in a child
    process told ``log_level="warning"``: nothing is printed at info, by either process; the
    app's own line keeps the app's format."""
    import subprocess

    script = tmp_path / "app.py"
    script.write_text(
        "import logging, anyio, structlog\n"
        "from llamactor.runtime import Runtime, RuntimeConfig\n"
        "structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),\n"
        "    processors=[lambda _, __, event: 'APP ' + event['event']])\n"
        "async def main():\n"
        f"    cfg = RuntimeConfig(model={str(tiny_model)!r}, n_ctx=512, parallel=1, threads=1,\n"
        "                        log_level='warning', log_format='text')\n"
        "    async with Runtime.open(cfg, isolate=True) as rt:\n"
        "        done = await rt.complete('Hello', max_tokens=3, temperature=0)\n"
        "        structlog.get_logger().warning('answered')\n"
        "    print('tokens', done.n_predicted)\n"
        "anyio.run(main)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "tokens 3" in proc.stdout and "APP answered" in out
    for info in ("engine_loaded", "engine_ready", "runtime_ready", "request_done", '"level": "info"', "[info"):
        assert info not in out, out[-3000:]
