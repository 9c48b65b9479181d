"""The embedding API (SPEC section 7): the example app, the public surface, lifecycle misuse."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

import llamactor.runtime as runtime
from llamactor.runtime import ConfigError, Runtime, RuntimeConfig, Unavailable

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


async def test_embed_example_app(make_config):
    """SPEC 7: examples/embed_app.py runs the runtime in the app's lifespan; both routes work."""
    app = _load_example("embed_app").create_app(make_config())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            r = await client.get("/hello", params={"name": "Ada"})
            assert r.status_code == 200 and r.json()["tokens"] == 16
            r = await client.post("/llm/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            })
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_public_surface_is_exact():
    """STYLE: the public surface of ``runtime`` is explicit and asserted."""
    assert sorted(runtime.__all__) == [
        "ChatResult", "Choice", "Closed", "Completion", "ConfigError", "EmbeddingResult", "EngineError",
        "ExceedContextSize", "LlamactorError", "NotFound", "NotSupported", "Overloaded", "Ranked", "RequestError",
        "RequestHandle", "Runtime", "RuntimeConfig", "RuntimeState", "SlotBusy", "Unauthorized", "Unavailable",
    ]
    for name in runtime.__all__:
        assert hasattr(runtime, name)


async def test_stream_and_complete_agree(make_config):
    """SPEC 7: rt.stream yields the tokens rt.complete returns."""
    async with Runtime.open(make_config()) as rt:
        full = await rt.complete("Hello", max_tokens=10, temperature=0)
        events = [e async for e in rt.stream("Hello", max_tokens=10, temperature=0)]
    tokens = tuple(e.token for e in events if hasattr(e, "token"))
    assert tokens == full.choices[0].tokens
    assert "".join(getattr(e, "text", "") for e in events if hasattr(e, "token")) == full.text


async def test_misuse_raises_clear_errors(make_config, tmp_path):
    """Lifecycle misuse: submit before open; bad config refused at open with a message naming the value."""
    rt = Runtime(make_config())
    with pytest.raises(Unavailable, match="Loading model"):
        await rt.complete("x")
    with pytest.raises(ConfigError, match="model file not found"):
        async with Runtime.open(RuntimeConfig(model=tmp_path / "missing.gguf")):
            pass
    with pytest.raises(ConfigError, match="--parallel"):
        async with Runtime.open(make_config(parallel=0)):
            pass
