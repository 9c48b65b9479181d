"""The bundled HTTP server end to end on the tiny model: health, OpenAI client, native API,
slots, metrics, tokenize, errors, sampling."""

from __future__ import annotations

import json
import re

import anyio
import httpx
import openai
from conftest import open_server

from llamactor.runtime import Runtime


async def test_health_503_while_loading_then_200(make_config):
    """503 with the llama-server body while loading, 200 {"status":"ok"} when ready."""
    rt = Runtime(make_config())
    transport = httpx.ASGITransport(app=rt.asgi_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        r = await client.get("/health")
        assert r.status_code == 503
        assert r.json() == {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}
        async with rt:
            r = await client.get("/health")
            assert r.status_code == 200 and r.json() == {"status": "ok"}


async def test_openai_client_chat_streaming_and_not(make_config):
    """The official openai client gets a chat completion, streaming and not."""
    async with open_server(make_config()) as (rt, url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused")
        try:
            messages = [{"role": "user", "content": "Say hello"}]
            full = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
            assert full.object == "chat.completion"
            assert full.choices[0].finish_reason in ("stop", "length")
            assert full.usage.completion_tokens == 12 or full.choices[0].finish_reason == "stop"
            assert full.usage.prompt_tokens > 0
            stream = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True
            )
            pieces, finish = [], None
            async for chunk in stream:
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
            assert "".join(pieces) == full.choices[0].message.content
            assert finish == full.choices[0].finish_reason
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny.gguf"]
        finally:
            await client.close()


async def test_openai_completions_n_logprobs_usage(make_config):
    """n choices, logprobs, usage and stream_options.include_usage on /v1/completions; the choices share one group."""
    async with open_server(make_config()) as (rt, url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused")
        try:
            r = await client.completions.create(
                model="tiny", prompt="Hello", max_tokens=6, temperature=0, n=3, logprobs=2
            )
            assert [c.index for c in r.choices] == [0, 1, 2]
            assert len({c.text for c in r.choices}) == 1  # greedy: the children equal the parent
            assert r.usage.completion_tokens == 18
            lp = r.choices[0].logprobs
            assert len(lp.token_logprobs) == 6 and all(x <= 0 for x in lp.token_logprobs)
            assert all(len(t) <= 2 for t in lp.top_logprobs)
            s = await client.completions.create(
                model="tiny",
                prompt="Hello",
                max_tokens=5,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = None
            text = ""
            async for chunk in s:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage:
                    usage = chunk.usage
            assert usage is not None and usage.completion_tokens == 5
            assert text == r.choices[0].text[: len(text)]
        finally:
            await client.close()


async def test_sampled_n_children_differ_and_seed_repeats(make_config):
    """Sampling seed: the same seed gives the same sampled text; children of n > 1 get their own streams."""
    async with open_server(make_config()) as (rt, url):
        body = {
            "prompt": "Once upon",
            "n_predict": 12,
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "seed": 1234,
            "n": 3,
        }
        async with httpx.AsyncClient(base_url=url) as client:
            a = (await client.post("/completion", json=body)).json()
            b = (await client.post("/completion", json=body)).json()
        assert [x["content"] for x in a] == [x["content"] for x in b]
        assert len({x["content"] for x in a}) > 1


async def test_native_completion_stream_and_stop_string(make_config):
    """Streaming native /completion; a stop string ends the text before it."""
    async with open_server(make_config()) as (rt, url):
        async with httpx.AsyncClient(base_url=url) as client:
            base = (
                await client.post(
                    "/completion", json={"prompt": "Hello world", "n_predict": 16, "temperature": 0, "ignore_eos": True}
                )
            ).json()
            text = base["content"]
            assert len(text) > 4
            stop = text[3:5]
            r = await client.post(
                "/completion", json={"prompt": "Hello world", "n_predict": 16, "temperature": 0, "stop": [stop]}
            )
            body = r.json()
            assert body["content"] == text[: text.index(stop)]
            assert body["stop_type"] == "word" and body["stopping_word"] == stop
            chunks = []
            async with client.stream(
                "POST", "/completion", json={"prompt": "Hello world", "n_predict": 16, "temperature": 0, "stream": True}
            ) as resp:
                assert resp.headers["content-type"].startswith("text/event-stream")
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        chunks.append(json.loads(line[6:]))
        assert chunks[-1]["stop"] is True and chunks[-1]["tokens_predicted"] == 16
        assert "".join(c["content"] for c in chunks[:-1]) == text


async def test_tokenize_detokenize_roundtrip(make_config):
    """/tokenize and /detokenize round-trip UTF-8 text."""
    async with open_server(make_config()) as (rt, url):
        text = "héllo 世界 🙂 fox"
        async with httpx.AsyncClient(base_url=url) as client:
            toks = (await client.post("/tokenize", json={"content": text})).json()["tokens"]
            assert toks and all(isinstance(t, int) for t in toks)
            back = (await client.post("/detokenize", json={"tokens": toks})).json()["content"]
            pieces = (await client.post("/tokenize", json={"content": "fox", "with_pieces": True})).json()["tokens"]
        assert back == text
        assert "".join(p["piece"] for p in pieces) == "fox"


async def test_slots_and_props_fields(make_config):
    """/props sizes; /slots has llama-server's fields plus group and phase."""
    async with open_server(make_config()) as (rt, url):
        async with httpx.AsyncClient(base_url=url) as client:
            props = (await client.get("/props")).json()
            slots = (await client.get("/slots")).json()
        assert props["total_slots"] == 4 and props["n_ctx"] == 1024 and props["pipeline_groups"] == 1
        assert props["scheduler"] == "slo"  # the default (README: scheduling policies)
        assert [s["id"] for s in slots] == [0, 1, 2, 3]
        for s in slots:
            assert {"id", "n_ctx", "is_processing", "group", "phase"} <= set(s)
            assert s["is_processing"] is False and s["phase"] == "idle" and s["group"] == 0


def _metric_sum(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


async def test_tokens_predicted_total_equals_client_tokens(make_config):
    """llamacpp:tokens_predicted_total == completion tokens the clients got."""
    async with open_server(make_config()) as (rt, url):
        received = 0
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def one(i: int) -> None:
                nonlocal received
                r = await client.post(
                    "/v1/completions",
                    json={"prompt": f"item {i}", "max_tokens": 5 + i, "temperature": 0, "n": 1 + i % 2},
                )
                received += r.json()["usage"]["completion_tokens"]

            async with anyio.create_task_group() as tg:
                for i in range(10):
                    tg.start_soon(one, i)
            text = (await client.get("/metrics")).text
        assert _metric_sum(text, "llamacpp:tokens_predicted_total") == received
        assert _metric_sum(text, "llamacpp:n_decode_total") > 0
        assert "llamactor:time_to_first_token_seconds_bucket" in text
        assert "llamactor:inter_token_seconds_bucket" in text


async def test_api_key(make_config):
    """401 without or with a wrong key; /health stays public; the right key works."""
    async with open_server(make_config(api_key="s3cret")) as (rt, url), httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/health")).status_code == 200
        r = await client.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert (await client.get("/v1/models", headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status_code == 200


async def test_json_schema_response_format(make_config):
    """response_format json_schema constrains the output to the schema (grammar)."""
    async with open_server(make_config()) as (rt, url):
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "json please"}],
                    "temperature": 0,
                    "max_tokens": 40,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                },
            )
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        if r.json()["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(content)["ok"], bool)
        else:
            assert content.startswith("{")


async def test_two_runtimes_coexist(make_config):
    """Embedding API: two runtimes in one event loop, each with its own model, metrics and server."""
    async with (
        open_server(make_config(parallel=2)) as (rt_a, url_a),
        open_server(make_config(parallel=4)) as (rt_b, url_b),
    ):
        a = await rt_a.complete("same prompt", max_tokens=8, temperature=0)
        b = await rt_b.complete("same prompt", max_tokens=8, temperature=0)
        assert a.choices[0].tokens == b.choices[0].tokens
        async with httpx.AsyncClient() as client:
            pa = (await client.get(url_a + "/props")).json()
            pb = (await client.get(url_b + "/props")).json()
        assert (pa["total_slots"], pb["total_slots"]) == (2, 4)
        assert rt_a.engine.metrics is not rt_b.engine.metrics
    assert rt_a.state.value == rt_b.state.value == "closed"


async def test_zero_tokens_requested(make_config):
    """n_predict 0 is valid: an empty completion, streaming or not, whose prompt is cached."""
    async with open_server(make_config()) as (rt, url), httpx.AsyncClient(base_url=url) as client:
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0, "stream": True})
        assert r.status_code == 200 and r.text.strip().endswith("data: [DONE]")
        assert '"finish_reason":"length"' in r.text  # a final chunk, as llama-server sends
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 0, "stream": True},
        )
        assert r.status_code == 200 and '"finish_reason":"length"' in r.text
        r = await client.post("/completion", json={"prompt": "x", "n_predict": 0, "stream": True})
        frames = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert frames and frames[-1]["stop"] is True and frames[-1]["content"] == ""
        # as llama-server's README says of n_predict 0: the prompt is evaluated into the cache
        warm = {"prompt": "the prompt to warm up " * 4, "id_slot": 0}
        r = await client.post("/completion", json={**warm, "n_predict": 0})
        assert r.json()["tokens_predicted"] == 0 and r.json()["tokens_evaluated"] > 8
        r = await client.post("/completion", json={**warm, "n_predict": 1})
        assert r.json()["timings"]["cache_n"] == r.json()["tokens_evaluated"] - 1
