"""A stream whose prompt holds an image survives the death of its engine byte for byte.

The tiny vision model of ``tinyvision.py`` with its projector, the engine in a child process.
Greedy chat streams with an image (one per request, two requests at once, and a native
/completion with its ``multimodal_data``) are read once without interruption and once with the
engine process SIGKILLed mid-stream: the resumed streams carry the same chunks, content for
content, with nothing missing and nothing twice. The journal keeps each request's media, so the
restarted engine encodes the image again before it replays the delivered tokens.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import tinyvision
from conftest import serve_runtime
from record_vision_golden import IMAGE, OTHER_IMAGE, data_url

from llamactor.runtime import Runtime, RuntimeConfig

pytestmark = pytest.mark.slow  # engine processes killed and restarted

HOOKS = str(Path(__file__).with_name("enginehooks.py"))
N_PREDICT = 120
KILL_AT = 40  # content chunks of the first stream before the kill


def _requests() -> list[tuple[str, dict[str, Any]]]:
    def chat(image: bytes, text: str) -> dict[str, Any]:
        content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        return {"messages": [{"role": "user", "content": content}]}

    native = {
        "prompt": {"prompt_string": "look <__media__> here", "multimodal_data": [data_url(IMAGE).split(",", 1)[1]]}
    }
    return [
        ("/v1/chat/completions", chat(IMAGE, "what is this?")),
        ("/v1/chat/completions", chat(OTHER_IMAGE, "and this one?")),
        ("/completion", native),
    ]


def _payload(line: str) -> Any:
    """A data line's JSON without what differs between two runs of the same request: ids, times,
    and where it ran (a resumed request may be served by another slot, its prompt prefilled anew)."""
    data = json.loads(line[6:])
    if data.get("stop") is True:  # a native stream's last chunk: what was generated, not how
        return {k: data[k] for k in ("content", "tokens", "stop_type", "stopping_word", "tokens_predicted")}
    for key in ("id", "created", "timings", "system_fingerprint"):
        data.pop(key, None)
    return data


async def _run(rt: Runtime, url: str, kill: bool) -> list[list[Any]]:
    out: list[list[Any]] = [[] for _ in _requests()]
    killed = anyio.Event()

    async def one(i: int, path: str, body: dict[str, Any], client: httpx.AsyncClient) -> None:
        fields = {"max_tokens": N_PREDICT, "n_predict": N_PREDICT, "temperature": 0, "ignore_eos": True}
        async with client.stream("POST", path, json={**body, **fields, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                out[i].append(_payload(line))
                if kill and i == 0 and len(out[0]) == KILL_AT and not killed.is_set():
                    killed.set()
                    os.kill(rt.engine.process.pid, signal.SIGKILL)

    async with httpx.AsyncClient(base_url=url, timeout=120) as client, anyio.create_task_group() as tg:
        for i, (path, body) in enumerate(_requests()):
            tg.start_soon(one, i, path, body, client)
    assert killed.is_set() == kill
    return out


async def test_image_streams_resume_byte_for_byte(tmp_path: Path):
    model, mmproj = tinyvision.write_tiny_vision(tmp_path)
    cfg = RuntimeConfig(
        model=model,
        mmproj=mmproj,
        n_ctx=4096,
        parallel=4,
        threads=1,
        engine_hooks=f"{HOOKS}:Slower",  # the streams are still running when the engine dies
        isolate=True,
        endpoint_metrics=True,
    )
    async with Runtime.open(cfg) as rt, serve_runtime(rt) as url:
        reference = await _run(rt, url, kill=False)
    async with Runtime.open(cfg) as rt, serve_runtime(rt) as url:
        resumed = await _run(rt, url, kill=True)
        metrics = (await rt.metrics_text()).decode()
    assert "llamactor:engine_restarts_total 1.0" in metrics
    assert "llamactor:requests_resumed_total 3.0" in metrics
    for i, (ref, got) in enumerate(zip(reference, resumed)):
        assert len(ref) > KILL_AT, i
        assert got == ref, f"stream {i}"
