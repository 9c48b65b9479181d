"""Streaming knobs as llama-server has them: SSE keep-alive pings (``sse_ping_interval``
and ``--sse-ping-interval``), ``t_max_predict_ms`` and ``post_sampling_probs`` with ``n_probs``;
each through HTTP and through the embedding API ``Runtime``."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import anyio
import httpx
import pytest
from conftest import open_server

from llamactor.protocol.errors import RequestError
from llamactor.protocol.events import Token
from llamactor.runtime import Runtime

PROMPT = "the quick brown fox jumps over the lazy dog"


class SlowTokens:
    """GroupHooks: sleep ``delay`` seconds before sampling the token number ``at`` (0: every token)."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.at = 0
        self._n = 0

    def on_assign(self, group: int, task: Any) -> None:
        self._n = 0

    def before_decode(self, group: int, n_prompt: int, n_generate: int) -> None:
        pass

    def before_sample(self, group: int, task: Any) -> None:
        self._n += 1
        if self.delay and (self.at == 0 or self._n == self.at):
            time.sleep(self.delay)

    def before_send(self, group: int, task: Any) -> None:
        pass

    def after_step(self, group: Any, result: Any) -> None:
        pass


async def _sse(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> bytes:
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return b"".join([chunk async for chunk in r.aiter_raw()])


@pytest.mark.slow
async def test_sse_pings_while_silent(make_config: Any) -> None:
    """A stream silent longer than the interval gets ``:`` comment frames (llama-server's
    ping); the server flag sets the default, the request field overrides it, -1 turns it off."""
    hooks = SlowTokens()
    hooks.delay, hooks.at = 1.5, 2  # a 1.5 s silence after the first token
    async with open_server(make_config(parallel=1, sse_ping_interval=1), hooks=hooks) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            body = {"prompt": PROMPT, "n_predict": 3, "temperature": 0, "ignore_eos": True}
            by_flag = await _sse(client, "/completion", body)
            assert b":\n\n" in by_flag and b'"stop":true' in by_flag
            off = await _sse(client, "/v1/completions", {**body, "max_tokens": 3, "sse_ping_interval": -1})
            assert b":\n\n" not in off and off.endswith(b"data: [DONE]\n\n")
            hooks.delay = 0.0
            quick = await _sse(client, "/completion", body)  # never silent for a second: no ping
            assert b":\n\n" not in quick
            hooks.delay = 1.5
            chat = await _sse(
                client,
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3,
                    "temperature": 0,
                    "sse_ping_interval": 1,
                },
            )
            assert chat.count(b":\n\n") >= 1 and chat.endswith(b"data: [DONE]\n\n")


async def test_sse_ping_bad_input(make_config: Any) -> None:
    """A non-integer sse_ping_interval is a 400 naming the field."""
    async with open_server(make_config(parallel=1)) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.post("/completion", json={"prompt": PROMPT, "stream": True, "sse_ping_interval": "x"})
            assert r.status_code == 400 and "sse_ping_interval" in r.text


@pytest.mark.slow
async def test_t_max_predict_ms(make_config: Any) -> None:
    """llama-server's rule: past ``t_max_predict_ms`` of prediction the generation stops
    at a token whose text holds a newline (stop_type "limit"); without a newline it runs on."""
    hooks = SlowTokens()
    hooks.delay = 0.005  # 5 ms per token
    async with open_server(make_config(parallel=1), hooks=hooks) as (rt, url):
        nl = await rt.tokenize("\n", add_special=False)
        assert len(nl) == 1
        base = {"prompt": PROMPT, "n_predict": 40, "temperature": 0, "ignore_eos": True}
        newline = {str(nl[0]): 100.0}
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            r = (await client.post("/completion", json={**base, "logit_bias": newline, "t_max_predict_ms": 12})).json()
            assert r["stop_type"] == "limit" and 2 <= r["tokens_predicted"] < 40 and r["content"].endswith("\n")
            r = (await client.post("/completion", json={**base, "logit_bias": newline})).json()
            assert r["tokens_predicted"] == 40  # no limit asked
            r = (
                await client.post("/completion", json={**base, "logit_bias": [[nl[0], False]], "t_max_predict_ms": 1})
            ).json()
            assert r["tokens_predicted"] == 40 and "\n" not in r["content"]  # never a newline: no stop
            r = await client.post("/completion", json={**base, "t_max_predict_ms": -5})
            assert r.status_code == 400 and "t_max_predict_ms" in r.text
        c = await rt.complete(
            PROMPT, max_tokens=40, temperature=0, ignore_eos=True, logit_bias={nl[0]: 100.0}, t_max_predict_ms=12
        )
        assert c.choices[0].finish_reason == "length" and len(c.choices[0].tokens) < 40


async def test_post_sampling_probs(make_config: Any) -> None:
    """``post_sampling_probs`` reports probabilities after the sampler chain as
    llama-server names them (``prob``/``top_probs``): top_k cuts the list, they sum to 1 over
    what is left; without it ``logprob``/``top_logprobs`` of the raw distribution."""
    async with open_server(make_config(parallel=1)) as (rt, url):
        body = {
            "prompt": PROMPT,
            "n_predict": 4,
            "temperature": 1.0,
            "top_k": 3,
            "top_p": 1.0,
            "min_p": 0.0,
            "seed": 5,
            "n_probs": 5,
            "ignore_eos": True,
        }
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            post = (await client.post("/completion", json={**body, "post_sampling_probs": True})).json()
            pre = (await client.post("/completion", json=body)).json()
            assert post["tokens"] == pre["tokens"]  # asking for probabilities changes no token
            for entry in post["completion_probabilities"]:
                assert set(entry) == {"id", "token", "bytes", "prob", "top_probs"}
                tops = entry["top_probs"]
                assert all(bytes(t["bytes"]).decode() == t["token"] for t in tops)  # as llama-server adds them
                assert 1 <= len(tops) <= 3 and math.isclose(sum(t["prob"] for t in tops), 1.0, rel_tol=1e-4)
                assert [t["prob"] for t in tops] == sorted((t["prob"] for t in tops), reverse=True)
                assert any(
                    t["id"] == entry["id"] and math.isclose(t["prob"], entry["prob"], rel_tol=1e-5) for t in tops
                )
            for entry in pre["completion_probabilities"]:
                assert "logprob" in entry and len(entry["top_logprobs"]) == 5
                assert isinstance(entry["bytes"], list) and all("bytes" in t for t in entry["top_logprobs"])
            stream = await _sse(client, "/completion", {**body, "post_sampling_probs": True})
            assert b'"top_probs"' in stream and b'"top_logprobs"' not in stream
            greedy = (
                await client.post("/completion", json={**body, "temperature": 0, "post_sampling_probs": True})
            ).json()
            assert all(e["prob"] == 1.0 and len(e["top_probs"]) == 1 for e in greedy["completion_probabilities"])
            r = await client.post("/completion", json={**body, "post_sampling_probs": "yes"})
            assert r.status_code == 400 and "post_sampling_probs" in r.text
        c = await rt.complete(
            PROMPT,
            max_tokens=4,
            temperature=1.0,
            top_k=3,
            top_p=1.0,
            min_p=0.0,
            seed=5,
            n_probs=5,
            ignore_eos=True,
            post_sampling_probs=True,
        )
        assert list(c.choices[0].tokens) == post["tokens"]
        for ev in c.choices[0].logprobs:
            assert len(ev.top) <= 3 and math.isclose(sum(math.exp(t.logprob) for t in ev.top), 1.0, rel_tol=1e-4)


def test_embedding_api_rejects_bad_t_max(make_config: Any) -> None:
    """The embedding API refuses a bad t_max_predict_ms with the field's name."""

    async def run() -> None:
        async with Runtime.open(make_config(parallel=1)) as rt:
            with pytest.raises(RequestError, match="t_max_predict_ms"):
                await rt.complete(PROMPT, max_tokens=2, t_max_predict_ms=-3)

    anyio.run(run)


async def test_return_progress_streams_prompt_progress(make_config):
    """return_progress: while a long prompt is prefilled in several chunks, the stream
    carries llama-server's ``prompt_progress`` chunks (total, cache, processed, time_ms), ending
    at processed == total; native, OpenAI completions and chat; off by default; through the
    embedding API as Progress events."""
    import json as _json

    import httpx as _httpx
    from conftest import open_server as _open_server

    from llamactor.protocol.events import Progress

    prompt = [5, 6, 7, 8] * 100  # 400 tokens, 64-token chunks
    config = make_config(parallel=1, n_ctx=1024, n_batch=64, n_ubatch=64)
    async with _open_server(config) as (rt, url):
        async with _httpx.AsyncClient(base_url=url, timeout=30) as client:
            for path, body in (
                ("/completion", {"prompt": prompt, "n_predict": 2}),
                ("/v1/completions", {"prompt": [9] + prompt[1:], "max_tokens": 2}),
            ):
                r = await client.post(path, json={**body, "stream": True, "return_progress": True, "temperature": 0})
                frames = [_json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
                progress = [f["prompt_progress"] for f in frames if "prompt_progress" in f]
                assert len(progress) >= 400 // 64, path
                assert [p["processed"] for p in progress] == sorted(p["processed"] for p in progress)
                assert progress[-1]["processed"] == progress[-1]["total"] == 400
                assert progress[0]["processed"] == progress[0]["cache"] and progress[0]["time_ms"] == 0  # started
                assert all(p["cache"] >= 0 and p["time_ms"] >= 0 for p in progress)
                body = {**body, "prompt": [10 + len(path)] + prompt[1:]}  # a prompt not cached yet
                r = await client.post(path, json={**body, "stream": True, "temperature": 0})
                assert r.status_code == 200 and "prompt_progress" not in r.text  # off by default
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "hello " * 100}],
                    "max_tokens": 2,
                    "stream": True,
                    "return_progress": True,
                    "temperature": 0,
                },
            )
            assert r.status_code == 200 and '"prompt_progress"' in r.text and r.text.strip().endswith("[DONE]")
        events = [
            e async for e in rt.stream(prompt[:-4] + [9, 9, 9, 9], max_tokens=2, temperature=0, return_progress=True)
        ]
        assert any(isinstance(e, Progress) for e in events)
        out = await rt.complete(prompt, max_tokens=2, temperature=0, return_progress=True)
        assert out.n_predicted == 2  # collect() skips progress events


async def test_unicode_line_breaks_stay_inside_one_sse_line(make_config: Any) -> None:
    """Generated U+0085, U+2028 and U+2029 go out JSON-escaped: a client reading the stream with
    ``str.splitlines`` semantics (httpx ``iter_lines``) gets whole ``data:`` lines and the same text.
    (Seen first in the fuzz run: a sampled token decoded to one of them and cut a frame in two.)"""
    text = "a\u2028b\x85c\u2029d"
    grammar = 'root ::= "a\\u2028b\\x85c\\u2029d"'
    async with open_server(make_config(parallel=1)) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for path, body in (
                ("/completion", {"prompt": PROMPT}),
                ("/v1/completions", {"prompt": PROMPT}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
            ):
                raw = await _sse(client, path, {**body, "grammar": grammar, "max_tokens": 16, "n_predict": 16})
                assert "\u2028".encode() not in raw and b"\\u2028" in raw, raw
                async with client.stream(
                    "POST", path, json={**body, "grammar": grammar, "max_tokens": 16, "n_predict": 16, "stream": True}
                ) as r:
                    lines = [line async for line in r.aiter_lines()]
                frames = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
                assert all(line.startswith(("data: ", ":")) or not line for line in lines), lines
                if path == "/completion":
                    got = "".join(f["content"] for f in frames)
                elif path == "/v1/completions":
                    got = "".join(c["text"] for f in frames for c in f["choices"])
                else:
                    got = "".join(c["delta"].get("content") or "" for f in frames for c in f["choices"])
                assert got == text, (path, got)


def _sse_data(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_timings_per_token(make_config):
    """timings_per_token: every streamed token's chunk carries the request's timings so far
    (predicted_n counting up, prompt figures fixed once the prompt is in), progress chunks their
    prompt timings from the first (nothing decoded yet) on, never going backwards; native,
    OpenAI completions, chat and Responses; off by default; through the embedding API as
    ``Token.clock``."""
    prompt = [5, 6, 7, 8] * 40  # 160 tokens, 64-token chunks
    config = make_config(parallel=1, n_ctx=1024, n_batch=64, n_ubatch=64)
    async with open_server(config) as (rt, url), httpx.AsyncClient(base_url=url, timeout=30) as client:
        body = {"prompt": prompt, "n_predict": 4, "stream": True, "temperature": 0, "ignore_eos": True}
        r = await client.post("/completion", json={**body, "timings_per_token": True, "return_progress": True})
        frames = _sse_data(r.text)
        progress = [f["timings"] for f in frames if "prompt_progress" in f]
        assert len(progress) > 1 and progress[0]["prompt_n"] == 0 and progress[0]["prompt_ms"] == 0.0
        assert progress[0]["predicted_n"] == 0 and progress[0]["predicted_ms"] == 0.0
        assert [t["prompt_ms"] for t in progress] == sorted(t["prompt_ms"] for t in progress)
        assert all(v >= 0 for t in progress for v in t.values())
        tokens = [f["timings"] for f in frames if f.get("tokens")]
        assert [t["predicted_n"] for t in tokens] == [1, 2, 3, 4]
        assert len({t["prompt_ms"] for t in tokens}) == 1 and tokens[0]["prompt_n"] == 160
        assert tokens[-1]["predicted_ms"] >= tokens[0]["predicted_ms"]
        assert "timings" not in _sse_data((await client.post("/completion", json=body)).text)[0]  # off by default

        r = await client.post(
            "/v1/completions", json={**body, "prompt": prompt[1:], "max_tokens": 3, "timings_per_token": True}
        )
        chunks = [f for f in _sse_data(r.text) if f["choices"] and f["choices"][0]["text"]]
        assert chunks and all("predicted_per_second" in f["timings"] for f in chunks)

        chat = {"messages": [{"role": "user", "content": "test"}], "max_tokens": 6, "stream": True}
        r = await client.post("/v1/chat/completions", json={**chat, "timings_per_token": True, "ignore_eos": True})
        frames = _sse_data(r.text)
        assert "timings" not in frames[0]  # the role chunk
        counts = [f["timings"]["predicted_n"] for f in frames[1:-1] if "timings" in f]
        assert counts and counts == sorted(counts) and counts[-1] <= 6

        r = await client.post(
            "/v1/responses",
            json={
                "input": "This is a test " * 10,
                "max_output_tokens": 4,
                "stream": True,
                "timings_per_token": True,
                "return_progress": True,
            },
        )
        events = _sse_data(r.text)
        in_progress = [e for e in events if "prompt_progress" in e]
        assert in_progress and all(e["type"] == "response.in_progress" for e in in_progress)
        assert any(e["type"] == "response.output_text.delta" and "timings" in e for e in events)
        (completed,) = [e for e in events if e["type"] == "response.completed"]
        assert "usage" in completed["response"] and completed["timings"]["predicted_n"] >= 1

        events = [e async for e in rt.stream(prompt[2:], max_tokens=2, temperature=0, timings_per_token=True)]
        assert [e.clock[2] for e in events if isinstance(e, Token) and e.clock is not None] == [1, 2]


async def test_chat_logprobs_by_n_probs_and_with_token_ids(make_config: Any) -> None:
    """On chat, llama-server's ``n_probs`` asks for logprobs as ``logprobs`` + ``top_logprobs``
    do (streamed and not); each entry and each alternative carries its token ``id`` too."""
    async with open_server(make_config(parallel=1)) as (rt, url):
        base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            by_n = (await client.post("/v1/chat/completions", json={**base, "n_probs": 3})).json()
            openai = (
                await client.post("/v1/chat/completions", json={**base, "logprobs": True, "top_logprobs": 3})
            ).json()
            content = by_n["choices"][0]["logprobs"]["content"]
            assert content == openai["choices"][0]["logprobs"]["content"] and len(content) == 3
            for entry in content:
                assert set(entry) == {"id", "token", "logprob", "bytes", "top_logprobs"}
                assert len(entry["top_logprobs"]) == 3 and all("id" in t for t in entry["top_logprobs"])
                assert entry["id"] == entry["top_logprobs"][0]["id"]  # greedy: the most likely one
            none = (await client.post("/v1/chat/completions", json=base)).json()
            assert "logprobs" not in none["choices"][0]  # as llama-server: no key when not asked
            stream = await _sse(client, "/v1/chat/completions", {**base, "n_probs": 2, "stream": True})
            chunks = [json.loads(line[6:]) for line in stream.split(b"\n") if line.startswith(b"data: {")]
            streamed = [
                e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]
            ]
            assert [e["id"] for e in streamed] == [e["id"] for e in content]
