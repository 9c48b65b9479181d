"""What a user coming from llama-server runs into, sent as real requests or run as real processes:
llama.cpp's built-in chat templates by name (``--chat-template NAME --no-jinja``) and the
startup line naming the template; a port already in use; ``llamactor bench`` against a server
with an API key; ``max_tokens`` past 2**24; ``text_offset`` of /v1/completions' logprobs; and
errors in Anthropic's shape on the Anthropic endpoints.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import anthropic
import anyio
import httpx
import pytest
from conftest import free_port, open_server
from structlog.testing import capture_logs
from test_cli import LLAMACTOR, _wait_ready, serve_argv
from tinymodel import write_tiny_model

from llamactor.runtime import Runtime

SYSTEM_AND_USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
# What llama.cpp's llama_chat_apply_template writes for SYSTEM_AND_USER (its own templates, not Jinja)
LLAMA3_PROMPT = (
    "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
GEMMA_PROMPT = "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
CHATML_PROMPT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
API_KEY = "sekrit"


def _events(logs: list[dict], name: str) -> list[dict]:
    return [e for e in logs if e["event"] == name]


# ---- chat templates --------------------------------------------------------------------------


@pytest.mark.slow
def test_builtin_template_by_name_in_the_serve_process(tiny_model: Path):
    """``llamactor serve --chat-template llama3 --no-jinja``: /apply-template gives llama.cpp's
    llama3 prompt, a chat completion runs that prompt, and the startup log names the template."""
    port = free_port()
    proc = subprocess.Popen(
        serve_argv(tiny_model, port, "1", "1024", "--chat-template", "llama3", "--no-jinja"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        r = httpx.post(url + "/apply-template", json={"messages": SYSTEM_AND_USER})
        assert r.status_code == 200 and r.json()["prompt"] == LLAMA3_PROMPT, r.text
        r = httpx.post(
            url + "/v1/chat/completions", json={"messages": SYSTEM_AND_USER, "max_tokens": 3, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        tokens = httpx.post(url + "/tokenize", json={"content": LLAMA3_PROMPT, "add_special": True}).json()["tokens"]
        assert r.json()["usage"]["prompt_tokens"] == len(tokens)
        assert httpx.get(url + "/props").json()["chat_template"] == "llama3"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err.decode()
    lines = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    (line,) = [e for e in lines if e["event"] == "chat_template"]
    assert line["template"] == "llama3" and "built-in" in line["source"], line


@pytest.mark.slow
async def test_builtin_template_chat_completions_in_process(make_config):
    """Another built-in (gemma folds the system prompt into the first user turn) through both
    endpoints; a streamed chat answers too."""
    async with open_server(make_config(chat_template="gemma", jinja=False)) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            r = await http.post("/apply-template", json={"messages": SYSTEM_AND_USER})
            assert r.json()["prompt"] == GEMMA_PROMPT
            body = {"messages": SYSTEM_AND_USER, "max_tokens": 4, "temperature": 0}
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(await rt.tokenize(GEMMA_PROMPT))
            r = await http.post("/v1/chat/completions", json={**body, "stream": True})
            assert r.status_code == 200 and "data: [DONE]" in r.text


async def test_startup_names_the_chat_template_and_its_source(make_config, tmp_path: Path):
    """One ``chat_template`` log line per start, naming the template and where it came from; a
    built-in name with Jinja on is a warning (and Jinja source, as in llama-server)."""
    template_file = tmp_path / "t.jinja"
    template_file.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}", encoding="utf-8")
    no_template = write_tiny_model(tmp_path / "bare.gguf", chat_template=False)
    cases = [
        ({}, "jinja", "gguf", None),
        ({"chat_template": "chatml"}, "chatml", "--chat-template chatml", CHATML_PROMPT),
        ({"chat_template": "chatml", "jinja": False}, "chatml", "built-in", CHATML_PROMPT),
        ({"chat_template": "llama3", "jinja": False}, "llama3", "built-in", LLAMA3_PROMPT),
        ({"chat_template_file": str(template_file)}, "jinja", "--chat-template-file", "[Be brief.][Hi]"),
        ({"model": no_template}, "chatml", "fallback", CHATML_PROMPT),
        ({"chat_template": "llama3"}, "jinja", "--chat-template", "llama3"),
    ]
    for overrides, name, origin, prompt in cases:
        with capture_logs() as logs:
            async with Runtime.open(make_config(parallel=1, **overrides)) as rt:
                rendered = rt.apply_chat_template(SYSTEM_AND_USER)
        (line,) = _events(logs, "chat_template")
        assert line["template"] == name and origin in line["source"], (overrides, line)
        if prompt is not None:
            assert rendered == prompt, overrides
        warned = _events(logs, "chat_template_is_a_name")
        if overrides == {"chat_template": "llama3"}:
            assert warned and "--no-jinja" in warned[0]["warning"] and warned[0]["log_level"] == "warning"
        else:
            assert not warned, overrides


# ---- a port in use ---------------------------------------------------------------------------


@pytest.mark.slow
def test_port_in_use_is_one_line_and_exit_2(tiny_model: Path):
    """``serve --port P`` with P taken: one error line naming the address, exit 2, nothing
    logged as listening, no traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [*LLAMACTOR, "serve", "-m", str(tiny_model), "--port", str(port), "-t", "1"],
            capture_output=True,
            timeout=60,
        )
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    errors = [line for line in err.splitlines() if line.startswith("llamactor: error:")]
    assert errors == [f"llamactor: error: cannot listen on 127.0.0.1:{port}: address already in use"], err
    assert "listening" not in err and "Traceback" not in err


# ---- bench with an API key -------------------------------------------------------------------


async def _bench(url: str, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [*LLAMACTOR, "bench", "--url", url, "--users", "1", "--requests", "1", "--npp", "8", "--ntg", "4", *flags]
    environ = {k: v for k, v in os.environ.items() if k != "LLAMA_API_KEY"} | (env or {})
    return await anyio.run_process(cmd, check=False, env=environ)


@pytest.mark.slow
async def test_bench_sends_the_api_key(make_config):
    """``bench --api-key`` (or LLAMA_API_KEY) sends the key: every request succeeds, the
    cross-check reads /metrics, exit 0. Without it the run fails with exit 1 and a note naming
    the API key (not the llama-server --metrics advice)."""
    async with open_server(make_config(parallel=2, api_key=API_KEY)) as (_, url):
        without = await _bench(url)
        with_flag = await _bench(url, "--api-key", API_KEY, "--json")
        with_env = await _bench(url, env={"LLAMA_API_KEY": API_KEY})
    out = without.stdout.decode()
    assert without.returncode == 1, (out, without.stderr.decode())
    assert "HTTP 401" in out and "--api-key" in out and "add --metrics" not in out, out
    assert with_flag.returncode == 0, with_flag.stderr.decode()
    report = json.loads(with_flag.stdout)
    (run,) = report["runs"]
    assert (run["figures"]["ok"], run["figures"]["failed"], run["figures"]["diff_percent"]) == (1, 0, 0.0)
    assert API_KEY not in with_flag.stdout.decode()  # the key is sent, never reported
    assert with_env.returncode == 0, with_env.stdout.decode() + with_env.stderr.decode()


# ---- max_tokens past 2**24 -------------------------------------------------------------------


@pytest.mark.slow
async def test_max_tokens_past_2_24_stops_at_the_context(make_config):
    """A count above 16,777,216 is accepted as llama-server accepts it: the answer runs to the
    end of the slot's context, finish reason "length"."""
    ctx = 96
    huge = (1 << 24) + 1
    async with open_server(make_config(n_ctx=ctx, parallel=1)) as (_, url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            r = await http.post("/completion", json={"prompt": "Hi", "n_predict": 1 << 40, "ignore_eos": True})
            assert r.status_code == 200, r.text
            native = r.json()
            assert native["stop_type"] == "limit"
            assert native["tokens_evaluated"] + native["tokens_predicted"] == ctx
            body = {"prompt": "Hi", "max_tokens": huge, "ignore_eos": True}
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["usage"]["total_tokens"] == ctx
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": huge, "ignore_eos": True}
            r = await http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
            r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": -2})
            assert r.status_code == 400  # below -1 is still an error


# ---- text_offset -----------------------------------------------------------------------------


@pytest.mark.slow
async def test_completions_logprobs_text_offset(make_config):
    """/v1/completions' ``logprobs.text_offset``: each token's character offset in the returned
    text (from the start of the completion), in the body and across a stream's chunks."""
    body = {"prompt": "héllo 世界 🙂 The quick", "max_tokens": 12, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    async with open_server(make_config(parallel=1)) as (_, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            streamed = await http.post("/v1/completions", json={**body, "stream": True})
    lp = choice["logprobs"]
    assert len(lp["text_offset"]) == len(lp["tokens"]) == 12
    text, at = choice["text"], 0
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        assert offset == at and text[offset : offset + len(token)] == token
        at += len(token)
    assert at == len(text)
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    pieces, offsets, seen = [], [], 0
    for chunk in chunks:
        c = chunk["choices"][0]
        if c["logprobs"] is not None:
            offsets += c["logprobs"]["text_offset"]
            assert c["logprobs"]["text_offset"] == [seen]
        seen += len(c["text"])
        pieces.append(c["text"])
    assert offsets == lp["text_offset"] and "".join(pieces) == text


# ---- Anthropic errors ------------------------------------------------------------------------


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


@pytest.mark.slow
async def test_anthropic_endpoints_answer_errors_in_anthropic_shape(make_config):
    """/v1/messages and /v1/messages/count_tokens: ``{"type": "error", "error": {"type",
    "message"}}`` with the same status (401, 400, 404, 405, 503); the SDK raises its own classes
    with the message; other endpoints keep OpenAI's shape."""
    headers = {"x-api-key": API_KEY}
    ask = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    async with open_server(make_config(api_key=API_KEY)) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                assert "API key" in _anthropic_error(await http.post(path, json=ask), 401, "authentication_error")
                r = await http.post(path, json={**ask, "messages": []}, headers=headers)
                assert "messages" in _anthropic_error(r, 400, "invalid_request_error")
            r = await http.post("/v1/messages", content=b"{", headers={**headers, "content-type": "application/json"})
            _anthropic_error(r, 400, "invalid_request_error")
            _anthropic_error(await http.post("/v1/messages/nope", json=ask, headers=headers), 404, "not_found_error")
            _anthropic_error(await http.get("/v1/messages", headers=headers), 405, "invalid_request_error")
            r = await http.post("/v1/chat/completions", json={"messages": ask["messages"]})
            assert r.status_code == 401 and r.json()["error"]["code"] == 401  # OpenAI's shape elsewhere
            async with anthropic.AsyncAnthropic(base_url=url, api_key="wrong", max_retries=0, timeout=60) as client:
                with pytest.raises(anthropic.AuthenticationError) as auth:
                    await client.messages.create(**ask)
            assert auth.value.body["error"]["type"] == "authentication_error" and "API key" in auth.value.message
            async with anthropic.AsyncAnthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=60) as client:
                with pytest.raises(anthropic.BadRequestError) as bad:
                    await client.messages.create(**{**ask, "messages": []})
            assert bad.value.body["error"] == {
                "type": "invalid_request_error",
                "message": "messages must be a non-empty array",
            }
            assert await rt.drain(0)  # no new requests: 503, overloaded_error
            r = await http.post("/v1/messages", json=ask, headers=headers)
            assert "shutting down" in _anthropic_error(r, 503, "overloaded_error")
            assert r.headers["retry-after"]
