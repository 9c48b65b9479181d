"""llama-server's server flags that shape the HTTP surface: ``--no-slots``, ``--alias`` with
several names and ``--tags``, ``--api-prefix``, and ``--host`` with several addresses.

Each is read from the command line and from its ``LLAMA_ARG_*`` variable, checked over real
requests to an in-process server, and (the listening addresses above all) with a real
``llamactor serve`` process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import free_port, open_server, wait_healthy
from serveargs import parse_serve as _parse

from llamactor.protocol.errors import ConfigError
from llamactor.runtime import RuntimeConfig
from llamactor.runtime.service.config import route_prefix

LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]
STARTUP_TIMEOUT_S = 30
SLOTS_OFF = {
    "error": {
        "message": "This server does not support slots endpoint. Start it with `--slots`",
        "type": "not_supported_error",
        "code": 501,
    }
}


def _cannot_bind(host: str) -> str | None:
    """Why ``host`` cannot be listened on in this sandbox, or None when it can."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
    except OSError as exc:
        return f"{host} cannot be bound here ({exc.strerror or exc})"
    return None


# ---- the command line and the variables -------------------------------------------------------


def test_slots_switch_and_its_variable():
    """/slots is on by default, as in llama-server; --no-slots, LLAMA_ARG_ENDPOINT_SLOTS=0 and
    LLAMA_ARG_NO_ENDPOINT_SLOTS turn it off; --slots on the command line wins over the variable."""
    assert _parse([]).config.endpoint_slots is True
    assert _parse(["--no-slots"]).config.endpoint_slots is False
    assert _parse([], {"LLAMA_ARG_ENDPOINT_SLOTS": "0"}).config.endpoint_slots is False
    assert _parse([], {"LLAMA_ARG_NO_ENDPOINT_SLOTS": "1"}).config.endpoint_slots is False
    assert _parse(["--slots"], {"LLAMA_ARG_ENDPOINT_SLOTS": "0"}).config.endpoint_slots is True
    assert _parse(["--no-slots"]).ignored == ()


def test_aliases_and_tags_are_sorted_sets():
    """-a/--alias and --tags take comma-separated names (repeatable), kept as llama-server keeps
    them: stripped, without empties or repeats, sorted; the model's id is the first alias."""
    cfg = _parse(["-a", " zeta, alpha,,zeta", "--alias", "beta", "--tags", "t2, t1"]).config
    assert cfg.aliases == ("alpha", "beta", "zeta") and cfg.tags == ("t1", "t2")
    assert cfg.model_name == "alpha" and cfg.model_aliases == ("alpha", "beta", "zeta")
    env = _parse([], {"LLAMA_ARG_ALIAS": "b,a", "LLAMA_ARG_TAGS": "x,y"}).config
    assert (env.aliases, env.tags, env.model_name) == (("a", "b"), ("x", "y"), "a")
    assert _parse(["-a", "flag"], {"LLAMA_ARG_ALIAS": "env"}).config.aliases == ("flag",)
    none = _parse(["-a", " , "]).config  # no name at all: the model file's name, as llama-server
    assert none.aliases == () and RuntimeConfig(model="/models/tiny.gguf").model_name == "tiny.gguf"


def test_embedding_alias_stays_the_models_name():
    """In the embedding API ``alias`` is the model's id; ``aliases`` add names listed with it."""
    cfg = RuntimeConfig(model="/m/tiny.gguf", alias="mine", aliases=("b", "a", "a"))
    assert cfg.model_name == "mine" and cfg.model_aliases == ("a", "b", "mine")
    assert RuntimeConfig(model="/m/tiny.gguf", aliases=("b", " a ")).model_name == "a"


def test_api_prefix_value_forms():
    """--api-prefix and LLAMA_ARG_API_PREFIX set the prefix; it is a path with no trailing
    slash ("api" and "/api/" mean "/api", "/" means none), and a value that is no URL path
    is a ConfigError naming the flag."""
    assert _parse(["--api-prefix", "/api"]).config.api_prefix == "/api"
    assert _parse([], {"LLAMA_ARG_API_PREFIX": "/v2/llm"}).config.api_prefix == "/v2/llm"
    assert _parse(["--api-prefix", "/api"]).ignored == ()
    assert [route_prefix(p) for p in ("", "/", "api", "/api/", "/a/b")] == ["", "", "/api", "/api", "/a/b"]
    for bad in ("/a b", "/a?b", "/{x}", "/a%20b"):
        with pytest.raises(ConfigError, match="--api-prefix"):
            route_prefix(bad)


def test_host_takes_several_addresses():
    """--host (and LLAMA_ARG_HOST) is llama-server's CSV row of addresses: each stripped, the
    empty ones dropped; none left is an error, as is a UNIX socket path (not supported) or
    --port 0 with several addresses (llama-server refuses it too)."""
    assert _parse([]).hosts == ("127.0.0.1",)
    assert _parse(["--host", ' 127.0.0.1,"::1", ,']).hosts == ("127.0.0.1", "::1")
    assert _parse([], {"LLAMA_ARG_HOST": "0.0.0.0"}).hosts == ("0.0.0.0",)
    with pytest.raises(SystemExit):
        _parse(["--host", " , "])
    with pytest.raises(SystemExit):
        _parse([], {"LLAMA_ARG_HOST": ""})
    with pytest.raises(ConfigError, match="UNIX sockets are not supported"):
        _parse(["--host", "/tmp/llamactor.sock"])
    with pytest.raises(ConfigError, match="--port 0"):
        _parse(["--host", "127.0.0.1,127.0.0.2", "--port", "0"])
    assert _parse(["--host", "127.0.0.1", "--port", "0"]).port == 0


# ---- over HTTP, in this process --------------------------------------------------------------


async def test_no_slots_answers_501_and_props_says_so(make_config):
    """With slots off GET /slots is llama-server's 501 ``not_supported_error``, and /props
    reports ``endpoint_slots`` false; slot actions stay (llama-server's --no-slots turns off the
    monitoring endpoint only). On by default."""
    async with open_server(make_config(parallel=1, endpoint_slots=False)) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            r = await client.get("/slots")
            assert r.status_code == 501 and r.json() == SLOTS_OFF
            assert (await client.get("/props")).json()["endpoint_slots"] is False
            assert (await client.post("/slots/0?action=erase")).status_code == 200
    async with open_server(make_config(parallel=1)) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            assert (await client.get("/slots")).status_code == 200
            assert (await client.get("/props")).json()["endpoint_slots"] is True


async def test_aliases_and_tags_over_http(make_config):
    """/v1/models and /models list the model under its first alias with every alias and tag
    (llama-server's get_res_model_info); /props' model_alias is that name; a request's
    ``model`` field is not looked at (single-model llama-server): the answer names the model."""
    cfg = make_config(parallel=1, aliases=("zeta", "alpha", "zeta"), tags=("t2", "t1"))
    async with open_server(cfg) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            for path in ("/v1/models", "/models"):
                model = (await client.get(path)).json()["data"][0]
                assert (model["id"], model["aliases"], model["tags"]) == ("alpha", ["alpha", "zeta"], ["t1", "t2"])
            assert (await client.get("/props")).json()["model_alias"] == "alpha"
            chat = {"model": "something-else", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            r = await client.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200 and r.json()["model"] == "alpha"
    async with open_server(make_config(parallel=1)) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            model = (await client.get("/v1/models")).json()["data"][0]
            assert (model["id"], model["aliases"], model["tags"]) == ("tiny.gguf", [], [])


async def test_api_prefix_serves_every_route_under_it(make_config):
    """With an API prefix every route is under it and nothing outside it: the API (the OpenAI
    client with base_url PREFIX/v1), /health (public), the page and its assets (public), with
    the bare prefix redirecting to the page; errors keep their shape per endpoint."""
    key = {"Authorization": "Bearer k"}
    async with open_server(make_config(parallel=1, api_prefix="/llm/", api_key="k")) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            assert (await client.get("/llm/health")).status_code == 200
            assert (await client.get("/health", headers=key)).status_code == 404
            assert (await client.get("/v1/models", headers=key)).status_code == 404
            assert (await client.get("/llm/v1/models")).status_code == 401
            assert (await client.get("/llm/v1/models", headers=key)).json()["data"][0]["id"] == "tiny.gguf"
            page = await client.get("/llm/")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert 'src="webui/app.js"' in page.text  # relative: it loads from under the prefix
            assert (await client.get("/llm/webui/app.js")).status_code == 200
            assert (await client.get("/", headers=key)).status_code == 404
            bare = await client.get("/llm")
            assert bare.status_code == 307 and bare.headers["location"].endswith("/llm/")
            r = await client.post("/llm/v1/messages/nope", headers=key, json={})
            assert r.status_code == 404 and r.json()["type"] == "error"  # Anthropic's shape under the prefix
            r = await client.post("/llm/v1/messages", json={})
            assert r.status_code == 401 and r.json()["type"] == "error"
            r = await client.post("/llm/completion", headers=key, json={"prompt": "hi", "n_predict": 2})
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
        oai = openai.AsyncOpenAI(base_url=url + "/llm/v1", api_key="k")
        try:
            chat = await oai.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert chat.model == "tiny.gguf" and chat.choices[0].finish_reason in ("stop", "length")
        finally:
            await oai.close()


# ---- llamactor serve, as a user runs it ------------------------------------------------------


def _events(log: str, event: str) -> list[dict[str, Any]]:
    records = (json.loads(line) for line in log.splitlines() if line.startswith("{"))
    return [r for r in records if r.get("event") == event]


@contextmanager
def _serve(argv: list[str], ready_url: str, env: dict[str, str] | None = None) -> Iterator[list[str]]:
    """A ``llamactor serve`` process over the tiny model until ``ready_url`` answers 200; yields
    its log (filled once it stopped), and checks that SIGTERM stops it with exit code 0."""
    proc = subprocess.Popen(
        [*LLAMACTOR, "serve", "-t", "1", "-c", "512", "-np", "1", *argv],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    log: list[str] = []
    try:
        wait_healthy(proc, ready_url, STARTUP_TIMEOUT_S)
        yield log
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        log.append(err.decode())
    assert proc.returncode == 0, log[0]


@pytest.mark.slow
def test_serve_listens_on_each_host_with_the_flags_from_variables(tiny_model: Path):
    """``--host 127.0.0.1,127.0.0.2``: the server answers on both addresses (one ``listening``
    line each); the prefix, the aliases, the tags and slots off come from their variables."""
    for host in ("127.0.0.1", "127.0.0.2"):
        if why := _cannot_bind(host):
            pytest.skip(why)
    port = free_port()
    env = {
        "LLAMA_ARG_API_PREFIX": "/api",
        "LLAMA_ARG_ALIAS": "zeta,alpha",
        "LLAMA_ARG_TAGS": "local",
        "LLAMA_ARG_ENDPOINT_SLOTS": "0",
    }
    argv = ["-m", str(tiny_model), "--host", "127.0.0.1,127.0.0.2", "--port", str(port)]
    with _serve(argv, f"http://127.0.0.2:{port}/api/health", env) as log:
        for host in ("127.0.0.1", "127.0.0.2"):
            base = f"http://{host}:{port}"
            assert httpx.get(base + "/api/health").json() == {"status": "ok"}
            model = httpx.get(base + "/api/v1/models").json()["data"][0]
            assert (model["id"], model["aliases"], model["tags"]) == ("alpha", ["alpha", "zeta"], ["local"])
            slots = httpx.get(base + "/api/slots")
            assert slots.status_code == 501 and slots.json() == SLOTS_OFF
            assert httpx.get(base + "/health").status_code == 404
            r = httpx.post(base + "/api/completion", json={"prompt": "hi", "n_predict": 2}, timeout=60)
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
    listening = _events(log[0], "listening")
    assert sorted((r["host"], r["port"]) for r in listening) == [("127.0.0.1", port), ("127.0.0.2", port)]
    assert not _events(log[0], "flag_ignored")


@pytest.mark.slow
def test_serve_listens_on_ipv4_and_ipv6_loopback(tiny_model: Path):
    """``--host 127.0.0.1,::1``: one server on the IPv4 and the IPv6 loopback (as llama-server,
    the IPv6 socket takes IPv6 only)."""
    if why := _cannot_bind("::1"):
        pytest.skip(f"no IPv6 loopback in this environment: {why}")
    port = free_port()
    argv = ["-m", str(tiny_model), "--host", "127.0.0.1,::1", "--port", str(port)]
    with _serve(argv, f"http://127.0.0.1:{port}/health"):
        assert httpx.get(f"http://[::1]:{port}/health").json() == {"status": "ok"}


@pytest.mark.slow
def test_serve_host_errors_are_one_line_and_exit_2(tiny_model: Path):
    """An address of --host that cannot be bound stops the server before it loads anything:
    one error line naming that address, exit code 2, nothing listening; so does a UNIX socket
    path (not supported)."""
    if why := _cannot_bind("127.0.0.2"):
        pytest.skip(why)
    with socket.socket() as taken:
        taken.bind(("127.0.0.2", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["--host", "127.0.0.1,127.0.0.2"], f"cannot listen on 127.0.0.2:{port}: address already in use"),
            (["--host", "127.0.0.1,127.0.0.1"], f"cannot listen on 127.0.0.1:{port}: address already in use"),
            (["--host", "127.0.0.1,/tmp/llamactor.sock"], "--host /tmp/llamactor.sock: UNIX sockets are not supported"),
        ]
        for flags, message in cases:
            proc = subprocess.run(
                [*LLAMACTOR, "serve", "-m", str(tiny_model), "-t", "1", "--port", str(port), *flags],
                capture_output=True,
                timeout=60,
            )
            err = proc.stderr.decode()
            assert proc.returncode == 2, (flags, err)
            errors = [line for line in err.splitlines() if line.startswith("llamactor: error:")]
            assert len(errors) == 1 and message in errors[0], (flags, err)
            assert "listening" not in err and "Traceback" not in err
