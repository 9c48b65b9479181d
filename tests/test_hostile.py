"""Hostile requests against one real server: each row a request and what must hold after it.

One ``llamactor serve`` process (the tiny vision model and its projector, ``--timeout 2``, the
tools, the CORS proxy and Vertex's prediction route on, behind an API key, the default egress
policy) takes, row by row: schema bombs (a string length, an array's items, nested
repetitions, a pattern's repetition, a tool's parameters, a remote ``$ref``), 200 prompts in
one /completion, media URLs at loopback (a test server there, which must never be reached),
at the link-local metadata address, at a private address and at a name for loopback, 200
media URLs in one request, a cross-site ``text/plain`` POST to /tools, a body sent a byte a
second, and bodies over the limit on the three routes that read their own (Vertex's
/predict, /cors-proxy, /tools). Each is refused with a 4xx within a second (the slow body: at
the timeout), and while each runs a stream on the same server keeps its inter-token gap: its
p99 no worse than twice the p99 it had alone (plus 20 ms, the scheduling noise of a 2-core
machine). A redirect from an allowed host to a refused one is a row of
tests/test_vision_urls.py (it needs a policy that allows a host on loopback).
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import tinyvision
from conftest import free_port, wait_healthy

# a server process for the file; alone on the machine (`make test`'s second part): it compares a
# stream's gaps under attack with its gaps unloaded, which another worker's load would blur
pytestmark = [pytest.mark.slow, pytest.mark.serial]

LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]
KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 2
LIMIT = 8 * 1024 * 1024  # the server's body limit


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """An HTTP server on loopback with an image at /a.png: what a fetch refused by address never reaches."""
    png = tinyvision.png_bytes(32, 32)
    fetched: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fetched.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
        assert fetched == [], fetched  # the egress policy refused every address before connecting
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model, mmproj = tinyvision.write_tiny_vision(tmp_path_factory.mktemp("vision"))
    port = free_port()
    env = {**os.environ, "AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(port)}
    argv = [*LLAMACTOR, "serve", "-m", str(model), "--mmproj", str(mmproj), "-t", "1", "-c", "512", "-np", "2"]
    argv += ["--port", str(port)]
    argv += ["--timeout", str(TIMEOUT_S), "--api-key", KEY, "--tools", "read_file", "--ui-mcp-proxy"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base + "/health", 120)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def _gaps(base: str, n: int, out: list[float], started: threading.Event) -> None:
    """Stream ``n`` tokens and record the gaps between them."""
    body = {"prompt": "Once upon a time", "n_predict": n, "ignore_eos": True, "stream": True, "temperature": 0}
    last = None
    with httpx.stream("POST", base + "/completion", json=body, headers=AUTH, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if last is not None:
                out.append(now - last)
            else:
                started.set()
            last = now


def _p99(gaps: list[float]) -> float:
    ordered = sorted(gaps)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _while_streaming(base: str, attack: Callable[[], None], tokens: int = 120) -> list[float]:
    """Run ``attack`` while a stream runs; the stream's gaps."""
    gaps: list[float] = []
    started = threading.Event()
    stream = threading.Thread(target=_gaps, args=(base, tokens, gaps, started))
    stream.start()
    assert started.wait(30)
    try:
        attack()
    finally:
        stream.join(120)
    return gaps


@pytest.fixture(scope="module")
def unloaded_p99(server: str) -> float:
    gaps: list[float] = []
    _gaps(server, 120, gaps, threading.Event())
    return _p99(gaps)


def _post(base: str, path: str, body: Any) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=AUTH, timeout=30)


def _schema_chat(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


BILLION = 10**9
# (row, path, body, status, what the message says)
ROWS: list[tuple[str, str, Any, int, str]] = [
    ("string length", "/completion", {"prompt": "a", "json_schema": {"type": "string", "minLength": BILLION}}, 400,
     "json_schema.minLength: 1000000000 is over 2000"),
    ("array items", "/v1/chat/completions", _schema_chat({"type": "array", "items": {}, "minItems": BILLION}), 400,
     "minItems: 1000000000 is over 2000"),
    ("nested repetitions", "/completion",
     {"prompt": "a", "json_schema": {"type": "array", "minItems": 2, "items": {
         "type": "array", "items": {"type": "string", "maxLength": BILLION}}}}, 400,
     "json_schema.items.items.maxLength: 1000000000 is over 2000"),
    ("many fields at the cap", "/completion",
     {"prompt": "a", "json_schema": {"type": "object", "properties": {
         f"f{i}": {"type": "string", "maxLength": 2000} for i in range(1000)}}}, 400,
     "repetitions add up to more than 20000"),
    ("pattern repetition", "/completion",
     {"prompt": "a", "json_schema": {"type": "string", "pattern": "^a{1000000000}$"}}, 400,
     "json_schema.pattern: the repetition {1000000000} is over 2000"),
    ("remote $ref", "/completion", {"prompt": "a", "json_schema": {"$ref": "http://169.254.169.254/x.json"}}, 400,
     "json_schema.$ref: only references inside the schema"),
    ("tool parameters", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {
          "type": "object", "properties": {"a": {"type": "string", "minLength": BILLION}}}}}]}, 400,
     "tools[0].function.parameters.properties.a.minLength: 1000000000 is over 2000"),
    ("200 prompts", "/completion", {"prompt": [f"p{i}" for i in range(200)], "n_predict": 1}, 400,
     "prompt: at most 128 prompts in one request, got 200"),
]  # fmt: skip


def _image_chat(*urls: str) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}], "max_tokens": 2}


REFUSED_URL = "could not be downloaded: its host is not allowed, or it did not answer"
# media URLs under the default egress policy; "{host}" is the loopback image server's address
MEDIA_ROWS: list[tuple[str, str, Any, int, str]] = [
    ("media at loopback", "/v1/chat/completions", _image_chat("{host}/a.png"), 400, REFUSED_URL),
    ("media at link-local metadata", "/v1/chat/completions",
     _image_chat("http://169.254.169.254/latest/meta-data/"), 400, REFUSED_URL),
    ("media at a private address", "/v1/chat/completions", _image_chat("http://10.0.0.1/a.png"), 400, REFUSED_URL),
    ("media at a name for loopback", "/v1/chat/completions",
     _image_chat("http://localhost:{port}/a.png"), 400, REFUSED_URL),
    ("200 media URLs", "/v1/chat/completions", _image_chat(*[f"http://10.0.0.{i % 250}/{i}.png" for i in range(200)]),
     400, "a request names at most 16 media files by URL (this one names 200)"),
]  # fmt: skip
# a web page's cross-site form post: text/plain needs no CORS preflight, so a browser sends it
TOOLS_ROW = ("tools from a cross-site text/plain POST", "/tools", None, 415, "application/json")


def _send(base: str, host: str, row: tuple[str, str, Any, int, str]) -> httpx.Response:
    name, path, body, _, _ = row
    if name == TOOLS_ROW[0]:
        content = json.dumps({"tool": "read_file", "params": {"path": "/etc/hostname"}})
        headers = {**AUTH, "Content-Type": "text/plain", "Origin": "http://evil.example"}
        return httpx.post(base + path, content=content, headers=headers, timeout=30)
    port = host.rsplit(":", 1)[1]
    text = json.dumps(body).replace("{host}", host).replace("{port}", port)
    return httpx.post(base + path, content=text, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)


ALL_ROWS = [*ROWS, *MEDIA_ROWS, TOOLS_ROW]


@pytest.mark.parametrize("row", ALL_ROWS, ids=[r[0] for r in ALL_ROWS])
def test_hostile_requests_are_refused_and_stall_no_one(server: str, image_host: str, unloaded_p99: float, row) -> None:
    _, path, body, status, says = row
    answers: list[tuple[httpx.Response, float]] = []

    def attack() -> None:
        for _ in range(3):
            started = time.perf_counter()
            answers.append((_send(server, image_host, row), time.perf_counter() - started))
            health = httpx.get(server + "/health", timeout=5)
            assert health.status_code == 200

    gaps = _while_streaming(server, attack)
    for r, took in answers:
        assert r.status_code == status and says in r.text, r.text
        assert took < 1.0, took
    assert _p99(gaps) <= 2 * unloaded_p99 + 0.02, (_p99(gaps), unloaded_p99)


def test_a_body_sent_a_byte_a_second_is_cut_at_the_timeout(server: str, unloaded_p99: float) -> None:
    """Content-Length 100, then a byte a second: 408 at --timeout (2 s), the connection closed;
    /health and a stream are served meanwhile."""
    host, port = server.removeprefix("http://").split(":")
    outcome: dict[str, Any] = {}

    def attack() -> None:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            head = f"POST /completion HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            sock.sendall((head + "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode())
            started = time.perf_counter()
            answer = b""
            sock.settimeout(0.1)
            while time.perf_counter() - started < TIMEOUT_S + 5:
                try:
                    sock.sendall(b" ")
                except OSError:
                    break
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    assert httpx.get(server + "/health", timeout=5).status_code == 200
                    time.sleep(0.9)
                    continue
                if not chunk:
                    break
                answer += chunk
            outcome["answer"], outcome["took"] = answer, time.perf_counter() - started

    gaps = _while_streaming(server, attack, tokens=200)
    assert outcome["answer"].startswith(b"HTTP/1.1 408"), outcome["answer"][:200]
    assert TIMEOUT_S - 0.5 <= outcome["took"] <= TIMEOUT_S + 2.5, outcome["took"]
    assert _p99(gaps) <= 2 * unloaded_p99 + 0.02, (_p99(gaps), unloaded_p99)


@pytest.mark.parametrize("path", ["/predict", "/cors-proxy?url=http://example.invalid/", "/tools"])
def test_bodies_over_the_limit_are_413(server: str, path: str) -> None:
    """The three routes that read their own bodies read them through the one limited reader."""
    big = b'{"x": "' + b"a" * LIMIT + b'"}'
    r = httpx.post(server + path, content=big, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text
    assert "exceeds the limit" in r.text
    assert httpx.get(server + "/health").status_code == 200
    small = httpx.post(server + "/tools", json={"tool": "read_file", "params": {"path": "/nonexistent"}}, headers=AUTH)
    assert small.status_code == 200, small.text
