"""llama-server's agent features on real ``llamactor serve`` processes: the built-in tools at
``/tools`` (``--tools``), MCP servers over stdio (``--mcp-servers-config``, ``--mcp-servers-json``),
``--tools-runtime`` (through a stand-in ``docker`` on PATH), ``/cors-proxy`` (``--ui-mcp-proxy``,
``--agent``) against a loopback HTTP server, and the 403s when they are off.

The cases follow llama-server's own tests (``tools/server/tests/unit/test_tools_builtin.py``,
``test_mcp_servers.py``, ``test_proxy.py``): the same requests, the same answers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import free_port, wait_healthy

LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]
STARTUP_TIMEOUT_S = 60
TOOL_NAMES = [
    "read_file",
    "file_glob_search",
    "grep_search",
    "exec_shell_command",
    "write_file",
    "edit_file",
    "get_info",
]
DISABLED = {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}

# A tiny MCP server (JSON-RPC 2.0 over stdio, one message a line): echo, add, a tool whose
# result is an error, one that fails as an RPC error, one that exits, one that sleeps. It sends
# a notification before every reply (a client must skip it) and logs to stderr.
MCP_SERVER = r"""
import json, sys, time
NAME = sys.argv[1] if len(sys.argv) > 1 else "test"
TOOLS = [
    {"name": "echo", "description": NAME + ": echo back the message",
     "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}},
    {"name": "add", "description": "add two numbers",
     "inputSchema": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}},
    {"name": "fails", "description": "a result with isError", "inputSchema": {"type": "object", "properties": {}}},
    {"name": "rpc_error", "description": "an RPC error"},
    {"name": "crash", "description": "exits without answering"},
    {"name": "sleep", "description": "sleeps",
     "inputSchema": {"type": "object", "properties": {"s": {"type": "number"}}}},
]
def send(msg):
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()
def text(rid, value, error=False):
    result = {"content": [{"type": "text", "text": value}]}
    if error:
        result["isError"] = True
    send({"jsonrpc": "2.0", "id": rid, "result": result})
for line in sys.stdin:
    line = line.strip()
    if not line:
        continue
    req = json.loads(line)
    if "id" not in req:
        continue
    print("got", req["method"], file=sys.stderr, flush=True)
    send({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}})
    rid, method, params = req["id"], req["method"], req.get("params", {})
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": rid, "result": {"protocolVersion": "2024-11-05", "capabilities": {"tools": {}},
              "serverInfo": {"name": NAME, "version": "1"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": rid, "result": {"tools": TOOLS}})
    elif method == "tools/call":
        name, args = params["name"], params.get("arguments", {})
        if name == "echo":
            content = [{"type": "text", "text": "echo: " + args.get("message", "")}, {"type": "image", "data": "x"},
                       {"type": "text", "text": "cwd header: " + str(args.get("cwd"))}]
            send({"jsonrpc": "2.0", "id": rid, "result": {"content": content}})
        elif name == "add":
            text(rid, str(args["a"] + args["b"]))
        elif name == "fails":
            text(rid, "it broke", error=True)
        elif name == "crash":
            sys.exit(3)
        elif name == "sleep":
            time.sleep(args.get("s", 5))
            text(rid, "slept")
        else:
            send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32000, "message": "no such luck: " + name}})
    else:
        send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "Method not found"}})
"""

# A stand-in container engine: ``run --rm -i --cidfile F IMAGE sh`` writes an id and keeps a
# shell reading its stdin (the "container", its pid kept); ``exec [-i] ID CMD...`` runs CMD here.
FAKE_ENGINE = r"""#!/bin/sh
verb=$1; shift
case "$verb" in
  run)
    [ "$5" = "broken" ] && { echo "no such image" >&2; exit 125; }
    echo "$$" > "$FAKE_ENGINE_DIR/container.pid"
    echo "fakecid0123" > "$4"
    exec sh ;;
  exec)
    [ "$1" = "-i" ] && shift
    echo "$1" >> "$FAKE_ENGINE_DIR/exec.log"
    shift
    exec "$@" ;;
esac
exit 99
"""


@contextmanager
def serve(
    model: Path, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[tuple[str, list[str]]]:
    """A ``llamactor serve`` process; yields its base URL and its log (filled once it stopped)."""
    port = free_port()
    if "--api-key" not in argv:  # tools and the proxy refuse to start without a key, unless told
        argv = [*argv, "--insecure-tools"]
    proc = subprocess.Popen(
        [*LLAMACTOR, "serve", "-m", str(model), "-t", "1", "-c", "256", "-np", "1", "--port", str(port), *argv],
        env={**os.environ, **(env or {})},
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    log: list[str] = []
    try:
        wait_healthy(proc, base + "/health", STARTUP_TIMEOUT_S)
        yield base, log
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        log.append(err.decode())
    assert proc.returncode == 0, log[0]


def start_fails(argv: list[str], env: dict[str, str] | None = None) -> str:
    """The stderr of a ``llamactor serve`` that must stop at once with exit code 2."""
    proc = subprocess.run(
        [*LLAMACTOR, "serve", "-m", "/nonexistent.gguf", *argv],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    return proc.stderr


def post(base: str, tool: str, params: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(base + "/tools", json={"tool": tool, "params": params}, headers=headers, timeout=60)


def call(base: str, tool: str, params: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    res = post(base, tool, params, headers)
    assert res.status_code == 200, res.text
    body = res.json()
    assert "error" not in body, body
    return body


def call_error(base: str, tool: str, params: dict[str, Any], headers: dict[str, str] | None = None) -> str:
    res = post(base, tool, params, headers)
    assert res.status_code == 200, res.text
    return res.json()["error"]


def sse(res: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in res.text.splitlines() if line.startswith("data: ")]


# ---- the built-in tools -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tools_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``--tools all``, nothing else: /cors-proxy stays off, CORS goes to localhost."""
    cwd = tmp_path_factory.mktemp("server-cwd")
    with serve(tiny_model, ["--tools", "all"], cwd=cwd) as (base, _):
        yield base


def test_tools_are_listed_as_llama_server_lists_them(tools_server: str):
    tools = httpx.get(tools_server + "/tools").json()
    assert [t["tool"] for t in tools] == TOOL_NAMES
    read = tools[0]
    assert read == {
        "display_name": "Read file",
        "tool": "read_file",
        "type": "server",
        "permissions": {"write": False},
        "uses_cwd": True,
        "definition": {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read the contents of a file. Optionally specify a 1-based line range. "
                'If append_loc is true, each line is prefixed with its line number (e.g. "1\u2192...").',
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "Path to the file"},
                        "start_line": {"type": "integer", "description": "First line to read, 1-based (default: 1)"},
                        "end_line": {
                            "type": "integer",
                            "description": "Last line to read, 1-based inclusive (default: end of file)",
                        },
                        "append_loc": {"type": "boolean", "description": "Prefix each line with its line number"},
                    },
                    "required": ["path"],
                },
            },
        },
    }
    by_name = {t["tool"]: t for t in tools}
    assert [n for n in TOOL_NAMES if by_name[n]["permissions"]["write"]] == [
        "exec_shell_command",
        "write_file",
        "edit_file",
    ]
    assert by_name["get_info"]["definition"]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert by_name["edit_file"]["definition"]["function"]["parameters"]["properties"]["edits"]["items"]["required"] == [
        "old_text",
        "new_text",
    ]


def test_read_file(tools_server: str, tmp_path: Path):
    f = tmp_path / "f.txt"
    f.write_text("one\ntwo\nthree\n")
    assert call(tools_server, "read_file", {"path": str(f)}) == {"plain_text_response": "one\ntwo\nthree\n"}
    ranged = call(tools_server, "read_file", {"path": str(f), "start_line": 2, "end_line": 3, "append_loc": True})
    assert ranged["plain_text_response"] == "2\u2192two\n3\u2192three\n"
    assert call(tools_server, "read_file", {"path": str(f)}, {"x-resp-type": "base64"}) == {
        "base64": "b25lCnR3bwp0aHJlZQo=",
        "size_bytes": 14,
    }
    assert call_error(tools_server, "read_file", {"path": str(tmp_path / "none")}) == (
        f"cannot stat file: {tmp_path / 'none'}"
    )
    big = tmp_path / "big.txt"
    big.write_text("x" * 100 + "\n" + "y" * 20000 + "\n")
    assert call_error(tools_server, "read_file", {"path": str(big)}) == (
        "file too large (20102 bytes, max 16384). Use start_line/end_line to read a portion."
    )
    assert call(tools_server, "read_file", {"path": str(big), "end_line": 1})["plain_text_response"] == "x" * 100 + "\n"
    truncated = call(tools_server, "read_file", {"path": str(big), "end_line": 2})["plain_text_response"]
    assert truncated == "x" * 100 + "\n[output truncated]"


def test_write_then_edit_file(tools_server: str, tmp_path: Path):
    path = str(tmp_path / "sub" / "test.log")
    written = call(tools_server, "write_file", {"path": path, "content": "line1\nline2\nline3\n"})
    assert written == {"result": "file written successfully", "path": path, "bytes": 18}
    edits = [{"old_text": "line2", "new_text": "line2-edited"}, {"old_text": "line3\n", "new_text": "line3\nline4\n"}]
    edited = call(tools_server, "edit_file", {"path": path, "edits": edits})
    assert edited == {"result": "file edited successfully", "path": path, "edits_applied": 2}
    assert Path(path).read_text() == "line1\nline2-edited\nline3\nline4\n"
    # typographic quotes and trailing blanks still match; lines no edit touches stay as they were
    Path(path).write_text("keep  \nsay \u201chi\u201d  \nend\n")
    call(tools_server, "edit_file", {"path": path, "edits": [{"old_text": 'say "hi"', "new_text": "said"}]})
    assert Path(path).read_text() == "keep  \nsaid\nend\n"


def test_edit_file_errors(tools_server: str, tmp_path: Path):
    path = str(tmp_path / "e.txt")
    call(tools_server, "write_file", {"path": path, "content": "dup\ndup\nline1\nline2\n"})

    def edit(*pairs: tuple[str, str]) -> str:
        return call_error(
            tools_server, "edit_file", {"path": path, "edits": [{"old_text": o, "new_text": n} for o, n in pairs]}
        )

    assert edit(("dup", "x")) == f"found 2 occurrences of edits[0].old_text in {path}, it must be unique"
    assert edit(("line1\nline2", "a"), ("line2", "b")) == (
        f"edits[0] and edits[1] overlap in {path}; merge them into one edit or target disjoint regions"
    )
    assert edit(("nowhere", "x")) == (
        f"could not find edits[0].old_text in {path}, it must match the file's current content exactly"
    )
    assert edit(("line1", "line1")) == "no changes made: the replacement(s) produced identical content"
    assert edit(("", "x")) == "edits[0].old_text must not be empty"
    assert call_error(tools_server, "edit_file", {"path": path, "edits": []}) == '"edits" must be a non-empty array'
    assert Path(path).read_text() == "dup\ndup\nline1\nline2\n"


def test_file_glob_search(tools_server: str, tmp_path: Path):
    (tmp_path / "project-alpha" / "src").mkdir(parents=True)
    (tmp_path / "project-alpha" / "README.md").write_text("alpha")
    (tmp_path / "project-alpha" / "src" / "main.cpp").write_text("int main() {}")
    (tmp_path / "project-beta").mkdir()
    (tmp_path / "project-beta" / "notes.txt").write_text("beta")
    (tmp_path / "build" / "nested").mkdir(parents=True)
    (tmp_path / "build" / "artifact.txt").write_text("built")

    res = call(tools_server, "file_glob_search", {"path": str(tmp_path), "type": "dir"})
    types = {e["path"]: e["type"] for e in res["entries"]}
    assert types == {"project-alpha": "dir", "project-alpha/src": "dir", "project-beta": "dir", "build": "dir"}
    assert "project-alpha/src/\n" in res["plain_text_response"]
    assert res["base"] == str(tmp_path)
    # junk directories are listed but never walked
    paths = {
        e["path"] for e in call(tools_server, "file_glob_search", {"path": str(tmp_path), "type": "all"})["entries"]
    }
    assert "project-alpha/src/main.cpp" in paths and "build" in paths and "build/artifact.txt" not in paths
    res = call(tools_server, "file_glob_search", {"path": str(tmp_path), "include": "src/*.cpp"})
    assert [e["path"] for e in res["entries"]] == ["project-alpha/src/main.cpp"]
    res = call(tools_server, "file_glob_search", {"path": str(tmp_path), "max_depth": 2, "exclude": "*.md"})
    assert sorted(e["path"] for e in res["entries"]) == ["project-beta/notes.txt"]
    res = call(tools_server, "file_glob_search", {"path": str(tmp_path), "limit": 1})
    assert len(res["entries"]) == 1
    assert "Total matches: 3\n[1 results limit reached (3 total matches)." in res["plain_text_response"]
    assert call_error(tools_server, "file_glob_search", {"path": str(tmp_path), "type": "bogus"}) == (
        'invalid type: bogus (expected "file", "dir" or "all")'
    )
    assert call_error(tools_server, "file_glob_search", {"path": str(tmp_path), "limit": 0}) == (
        "invalid limit: 0 (expected 1 or more)"
    )
    assert call_error(tools_server, "file_glob_search", {"path": str(tmp_path / "no")}) == (
        f"path does not exist or is not a directory: {tmp_path / 'no'}"
    )


def test_grep_search(tools_server: str, tmp_path: Path):
    (tmp_path / "a.py").write_text("first\nthe marker_grep here\nlast\n")
    (tmp_path / "b.txt").write_text("Marker_Grep too\n")
    (tmp_path / "ignored.py").write_text("marker_grep ignored\n")
    (tmp_path / ".gitignore").write_text("ignored.py\n")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    res = call(tools_server, "grep_search", {"path": str(tmp_path), "pattern": "marker_grep", "include": "*.py"})
    assert res["plain_text_response"] == "a.py:the marker_grep here\n\n---\nTotal matches: 1\n"
    res = call(tools_server, "grep_search", {"path": str(tmp_path), "pattern": "marker_grep", "ignore_case": True})
    assert "Total matches: 2" in res["plain_text_response"] and "ignored.py" not in res["plain_text_response"]
    res = call(
        tools_server, "grep_search", {"path": str(tmp_path / "a.py"), "pattern": "marker.grep", "context_lines": 1}
    )
    assert res["plain_text_response"] == (
        f"{tmp_path / 'a.py'}-1-first\n{tmp_path / 'a.py'}:2:the marker_grep here\n{tmp_path / 'a.py'}-3-last\n--\n"
        "\n---\nTotal matches: 1\n"
    )
    res = call(tools_server, "grep_search", {"path": str(tmp_path), "pattern": "marker.grep", "literal": True})
    assert "Total matches: 0" in res["plain_text_response"]
    assert call_error(tools_server, "grep_search", {"path": str(tmp_path), "pattern": "("}).startswith(
        "invalid regex: "
    )
    assert call_error(tools_server, "grep_search", {"path": str(tmp_path / "no"), "pattern": "x"}) == (
        f"path does not exist: {tmp_path / 'no'}"
    )


def test_exec_shell_command(tools_server: str, tmp_path: Path):
    res = call(tools_server, "exec_shell_command", {"command": "echo out; echo err >&2; exit 3"})
    assert res == {"plain_text_response": "out\nerr\n\n[exit code: 3]"}
    res = call(tools_server, "exec_shell_command", {"command": "echo a; sleep 5", "timeout": 1})
    assert res == {"plain_text_response": "a\n\n[exit code: 1] [exit due to timed out]"}
    res = call(tools_server, "exec_shell_command", {"command": "yes | head -c 100", "max_output_size": 10})
    assert res == {"plain_text_response": "y\ny\ny\ny\ny\n\n[output truncated]\n[exit code: 0]"}
    # the x-tool-cwd header: where the command runs (a model's "cwd" in params is dropped)
    call(
        tools_server,
        "exec_shell_command",
        {"command": "echo hi > marker.txt", "cwd": "/"},
        {"x-tool-cwd": str(tmp_path)},
    )
    assert (tmp_path / "marker.txt").read_text() == "hi\n"
    res = call(tools_server, "exec_shell_command", {"command": "true"}, {"x-tool-cwd": str(tmp_path / "none")})
    assert res == {"plain_text_response": "failed to spawn process\n[exit code: -1]"}


def test_exec_shell_command_streams(tools_server: str, tmp_path: Path):
    body = {"tool": "exec_shell_command", "params": {"command": "echo hello; exit 2"}, "stream": True}
    res = httpx.post(tools_server + "/tools", json=body, timeout=30)
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/event-stream")
    events = sse(res)
    assert events[-1] == {"done": True}
    assert "".join(e["chunk"] for e in events[:-1]) == "hello\n\n[exit code: 2]"
    # a client that leaves stops the command
    ticks = tmp_path / "ticks"
    body["params"] = {"command": f"while true; do echo x; echo x >> {ticks}; sleep 0.1; done", "timeout": 30}
    with httpx.stream("POST", tools_server + "/tools", json=body, timeout=30) as stream:
        next(stream.iter_lines())
    time.sleep(1.0)
    size = ticks.stat().st_size
    time.sleep(1.0)
    assert ticks.stat().st_size == size


def test_relative_paths_resolve_against_the_cwd_header(tools_server: str, tmp_path: Path):
    (tmp_path / "rel.txt").write_text("relative-content")
    headers = {"x-tool-cwd": str(tmp_path)}
    res = call(tools_server, "read_file", {"path": "rel.txt", "cwd": "/definitely/not/here"}, headers)
    assert res["plain_text_response"] == "relative-content\n"
    call(tools_server, "write_file", {"path": "sub/out.txt", "content": "written"}, headers)
    assert (tmp_path / "sub" / "out.txt").read_text() == "written"
    res = call(tools_server, "file_glob_search", {"path": ".", "include": "*.txt"}, headers)
    assert sorted(e["path"] for e in res["entries"]) == ["rel.txt", "sub/out.txt"]
    assert res["base"] == str(tmp_path)


def test_get_info(tools_server: str, tmp_path: Path):
    info = call(tools_server, "get_info", {})
    assert info["os"] == subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip()
    assert info["cwd"] != str(tmp_path) and Path(info["cwd"]).is_dir()  # the server's own
    assert call(tools_server, "get_info", {}, {"x-tool-cwd": str(tmp_path)})["cwd"] == str(tmp_path)


def test_bad_requests(tools_server: str):
    url = tools_server + "/tools"

    def answer(res: httpx.Response) -> tuple[int, Any]:
        return res.status_code, res.json()

    assert answer(httpx.post(url, json={"tool": "nope"})) == (
        404,
        {"error": {"code": 404, "message": 'unknown tool "nope"', "type": "not_found_error"}},
    )
    assert answer(httpx.post(url, json={"tool": "read_file", "params": {"path": "x"}, "stream": True}))[0] == 404
    assert answer(httpx.post(url, json={"params": {}})) == (
        400,
        {"code": 400, "message": "key 'tool' not found", "type": "invalid_request_error"},
    )
    assert answer(httpx.post(url, content=b"not json", headers={"Content-Type": "application/json"}))[0] == 400
    # what a page on another site can send without a CORS preflight: a text/plain or form POST,
    # refused before anything runs; and a page whose name was rebound to this server's address
    # (DNS rebinding) sends its own name as the Host header: refused
    command = json.dumps({"tool": "exec_shell_command", "params": {"command": "echo pwned"}}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        res = httpx.post(url, content=command, headers={"Content-Type": kind} if kind else {})
        assert res.status_code == 415 and "must be sent as application/json" in res.json()["error"]["message"]
    for host in ("evil.example", "evil.example:8080", "rebind.attacker.test."):
        res = httpx.post(url, content=command, headers={"Content-Type": "application/json", "Host": host})
        assert res.status_code == 403 and "does not name this server" in res.json()["error"]["message"], host
        assert httpx.get(url, headers={"Host": host}).status_code == 403
    port = url.rsplit(":", 1)[1].split("/")[0]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "app.localhost", f"[::1]:{port}"):
        assert httpx.get(url, headers={"Host": host}).status_code == 200, host
    assert answer(httpx.post(url, json=["read_file"]))[0] == 400
    assert answer(httpx.post(url, json={"tool": "read_file", "params": {}})) == (
        400,
        {"code": 400, "message": "key 'path' not found", "type": "invalid_request_error"},
    )
    # a tool runtime that is not an isolate, or that smuggles an option, is refused: never the host
    for runtime, message in (
        ("fake:does-not-exist", "unknown tool runtime: fake:does-not-exist"),
        ("ssh:-oProxyCommand=touch /tmp/pwned", "invalid ssh target: -oProxyCommand=touch /tmp/pwned"),
        ("docker-container:--privileged", "invalid container id: --privileged"),
        ("podman:busybox", "tool runtime must name a running container: podman:busybox"),
    ):
        res = post(tools_server, "exec_shell_command", {"command": "echo hi"}, {"x-tool-runtime": runtime})
        assert answer(res) == (500, {"code": 500, "message": message, "type": "server_error"})


def test_cors_proxy_off_and_cors_for_localhost(tools_server: str):
    for method in ("GET", "POST"):
        res = httpx.request(method, tools_server + "/cors-proxy?url=http://127.0.0.1:1/")
        assert (res.status_code, res.json()) == (403, DISABLED)
    assert httpx.get(tools_server + "/props").json()["cors_proxy_enabled"] is False
    # tools on and no --cors-origins: only localhost origins are allowed
    local = httpx.get(tools_server + "/tools", headers={"Origin": "http://localhost:5173"})
    assert local.headers["Access-Control-Allow-Origin"] == "http://localhost:5173"
    other = httpx.get(tools_server + "/tools", headers={"Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in other.headers


# ---- --tools-runtime, through a stand-in container engine ------------------------------------------


def test_tools_runtime_container(tiny_model: Path, tmp_path: Path):
    """``--tools-runtime docker:IMAGE`` starts a container (``docker run --rm -i ... sh``) and runs
    every tool call through ``docker exec``; an x-tool-runtime header naming another container is
    refused (the runtime is the operator's); the container stops when the server does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    engine = bin_dir / "docker"
    engine.write_text(FAKE_ENGINE)
    engine.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_ENGINE_DIR": str(tmp_path)}
    argv = ["--tools", "write_file,read_file,exec_shell_command,file_glob_search,get_info"]
    with serve(tiny_model, [*argv, "--tools-runtime", "docker:busybox"], env=env) as (base, _):
        container = int((tmp_path / "container.pid").read_text())
        os.kill(container, 0)  # running
        headers = {"x-tool-cwd": str(work)}
        assert call(base, "write_file", {"path": "d/t.log", "content": "hello container\n"}, headers)["bytes"] == 16
        assert (work / "d" / "t.log").read_text() == "hello container\n"
        assert call(base, "read_file", {"path": "d/t.log"}, headers)["plain_text_response"] == "hello container\n"
        res = call(base, "exec_shell_command", {"command": "cat d/t.log; pwd"}, headers)
        assert res == {"plain_text_response": f"hello container\n{work}\n\n[exit code: 0]"}
        res = call(base, "file_glob_search", {"path": ".", "type": "all"}, headers)
        assert sorted(e["path"] for e in res["entries"]) == ["d", "d/t.log"]
        assert call(base, "get_info", {})["cwd"] == os.getcwd()  # pwd, run in the "container"
        # no request header overrides the operator's --tools-runtime
        res = post(base, "exec_shell_command", {"command": "true"}, {"x-tool-runtime": "docker-container:other1"})
        assert res.status_code == 403 and "a request cannot pick another" in res.json()["message"], res.text
        used = (tmp_path / "exec.log").read_text().split()
        assert set(used) == {"fakecid0123"}
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(container, 0)
    # a container that does not start stops the server at startup, as llama-server (exit 1)
    proc = subprocess.run(
        [*LLAMACTOR, "serve", "-m", str(tiny_model), "-t", "1", "--port", str(free_port())]
        + ["--tools", "all", "--tools-runtime", "docker:broken", "--insecure-tools"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    failed = [json.loads(line) for line in proc.stderr.splitlines() if '"tools_setup_failed"' in line]
    assert failed[0]["error"] == (
        "failed to start a docker container for the tools runtime (image: broken): 'docker run' exited with code 125"
    )


# ---- MCP servers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """``--agent`` (all tools, the proxy) with MCP servers from a file and inline JSON."""
    root = tmp_path_factory.mktemp("mcp")
    script = root / "mcp_server.py"
    script.write_text(MCP_SERVER)
    from_file = {
        "mcpServers": {
            "echo": {"command": sys.executable, "args": [str(script), "file"]},
            "slow": {"command": sys.executable, "args": [str(script)], "timeout_ms": 500},
            "nocommand": {"args": ["x"]},
        }
    }
    config = root / "mcp.json"
    config.write_text(json.dumps(from_file))
    inline = {
        "mcpServers": {
            "echo": {"command": sys.executable, "args": [str(script), "inline"]},  # taken: skipped
            "env_cwd": {
                "command": "sh",
                "args": ["-c", f'cd sub && exec "{sys.executable}" "{script}" "$MCP_NAME"'],
                "cwd": str(root),
                "env": {"MCP_NAME": "from-env"},
            },
            "bad": {"command": "this_executable_does_not_exist_12345"},
        }
    }
    (root / "sub").mkdir()
    argv = ["--agent", "--mcp-servers-config", str(config), "--mcp-servers-json", json.dumps(inline)]
    argv += ["--cors-origins", "http://app.example"]
    with serve(tiny_model, argv) as (base, log):
        yield base, log


def test_mcp_tools_are_listed(agent_server: tuple[str, list[str]]):
    base, _ = agent_server
    tools = httpx.get(base + "/tools").json()
    names = [t["tool"] for t in tools]
    mcp = ["echo", "add", "fails", "rpc_error", "crash", "sleep"]
    assert names == TOOL_NAMES + [f"{s}_{t}" for s in ("echo", "slow", "env_cwd") for t in mcp]
    echo = next(t for t in tools if t["tool"] == "echo_echo")
    assert echo == {
        "display_name": "echo_echo",
        "tool": "echo_echo",
        "type": "mcp",
        "permissions": {"write": False},
        "uses_cwd": False,
        "definition": {
            "type": "function",
            "function": {
                "name": "echo_echo",
                "description": "file: echo back the message",  # the file's server, not the inline one
                "parameters": {
                    "type": "object",
                    "properties": {"message": {"type": "string"}},
                    "required": ["message"],
                },
            },
        },
    }
    rpc_error = next(t for t in tools if t["tool"] == "echo_rpc_error")
    assert rpc_error["definition"]["function"]["parameters"] == {}
    env_echo = next(t for t in tools if t["tool"] == "env_cwd_echo")
    assert env_echo["definition"]["function"]["description"] == "from-env: echo back the message"


def test_mcp_tool_calls(agent_server: tuple[str, list[str]]):
    base, _ = agent_server
    res = call(base, "echo_echo", {"message": "hello world"})
    assert res == {"plain_text_response": "echo: hello world\ncwd header: None"}
    # the headers' values reach the MCP tool's arguments, as in llama-server
    res = call(base, "echo_echo", {"message": "hi"}, {"x-tool-cwd": "/somewhere"})
    assert res == {"plain_text_response": "echo: hi\ncwd header: /somewhere"}
    assert call(base, "echo_add", {"a": 3, "b": 5}) == {"plain_text_response": "8"}
    assert call_error(base, "echo_fails", {}) == "it broke"
    assert call_error(base, "echo_rpc_error", {}) == "no such luck: rpc_error"
    assert call(base, "env_cwd_echo", {"message": "x"})["plain_text_response"].startswith("echo: x")
    assert post(base, "bad_echo", {}).status_code == 404  # the server that cannot start has no tools


def test_mcp_server_that_dies_is_started_again(agent_server: tuple[str, list[str]]):
    base, _ = agent_server
    assert call_error(base, "echo_crash", {}) == "transport closed"
    assert call(base, "echo_echo", {"message": "again"})["plain_text_response"].startswith("echo: again")


def test_mcp_call_times_out(agent_server: tuple[str, list[str]]):
    base, _ = agent_server
    started = time.monotonic()
    assert call_error(base, "slow_sleep", {"s": 3}) == "request timed out"
    assert time.monotonic() - started < 2.5
    # the late reply is skipped: the next call gets its own
    time.sleep(2.6)
    assert call(base, "slow_add", {"a": 1, "b": 2}) == {"plain_text_response": "3"}


def test_mcp_concurrent_calls(agent_server: tuple[str, list[str]]):
    base, _ = agent_server
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda i: call(base, "echo_echo", {"message": f"m{i}"}), range(16)))
    assert [r["plain_text_response"].split("\n")[0] for r in results] == [f"echo: m{i}" for i in range(16)]


def test_agent_turns_on_the_proxy_and_keeps_explicit_cors(agent_server: tuple[str, list[str]]):
    base, _ = agent_server
    assert httpx.get(base + "/props").json()["cors_proxy_enabled"] is True
    res = httpx.get(base + "/tools", headers={"Origin": "http://localhost:3000"})
    assert res.headers["Access-Control-Allow-Origin"] == "http://app.example"  # --cors-origins as given
    # the proxy's default egress policy: nothing on loopback (this server itself included), the
    # private networks, link-local (cloud metadata) or written inside IPv6; refused before any
    # connection is tried
    for url in (
        f"{base}/health",
        "http://10.0.0.1/",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::ffff:127.0.0.1]:1/",
        "http://localhost:1/",
    ):
        res = httpx.get(base + "/cors-proxy", params={"url": url})
        assert res.status_code == 403 and res.text.startswith("proxy error: the target is not allowed"), url


def test_shutdown_cancels_mcp_calls_in_flight(tiny_model: Path, tmp_path: Path):
    """SIGTERM while an MCP call waits: the call answers "cancelled" at once and the server stops,
    without waiting out the call's timeout."""
    script = tmp_path / "mcp_server.py"
    script.write_text(MCP_SERVER)
    config = {"mcpServers": {"slow": {"command": sys.executable, "args": [str(script)], "timeout_ms": 60000}}}
    port = free_port()
    proc = subprocess.Popen(
        [*LLAMACTOR, "serve", "-m", str(tiny_model), "-t", "1", "-c", "256", "-np", "1", "--port", str(port)]
        + ["--mcp-servers-json", json.dumps(config), "--api-key", "k"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base + "/health", STARTUP_TIMEOUT_S)
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(post, base, "slow_sleep", {"s": 30}, {"Authorization": "Bearer k"})
            time.sleep(1.5)  # the call is waiting for its reply
            assert not pending.done()
            stopped_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            res = pending.result(timeout=10)
            assert time.monotonic() - stopped_at < 2.0
            assert (res.status_code, res.json()) == (200, {"error": "cancelled"})
        proc.wait(timeout=20)
        assert time.monotonic() - stopped_at < 10
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == 0


# ---- the CORS proxy -----------------------------------------------------------------------------


class _Target(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n).decode() if n else ""
        if self.path.startswith("/nocontent"):
            self.send_response(204)
            self.end_headers()
            return
        if self.path.startswith(("/redirect", "/away")):
            self.send_response(302)
            away = f"http://localhost:{self.server.server_address[1]}/echo"  # the same server, another name
            self.send_header("Location", away if self.path.startswith("/away") else "/echo?from=redirect")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        skip = {"host", "user-agent", "accept", "connection", "content-length", "accept-encoding"}
        seen = {k.lower(): v for k, v in self.headers.items() if k.lower() not in skip}
        out = json.dumps({"method": self.command, "path": self.path, "body": body, "headers": seen}).encode()
        self.send_response(418 if self.path.startswith("/teapot") else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Custom", "yes")
        self.send_header("Access-Control-Allow-Origin", "https://evil.example")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Target)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_cors_proxy(tiny_model: Path, target: str):
    """The proxy, opened to this machine's own addresses (the test's target runs on loopback)
    and to the one host 127.0.0.1: a redirect to another name is refused, link-local stays
    refused, a body over the limit is a 413."""
    policy = ["--ui-mcp-proxy-allow-private", "--ui-mcp-proxy-allowed-hosts", "127.0.0.1"]
    with serve(tiny_model, ["--ui-mcp-proxy", *policy]) as (base, _):
        res = httpx.get(f"{base}/cors-proxy", params={"url": f"{target}/echo?a=1"})
        assert res.status_code == 200
        assert res.json() == {"method": "GET", "path": "/echo?a=1", "body": "", "headers": {}}
        assert res.headers["x-custom"] == "yes"
        assert "access-control-allow-origin" not in {k.lower() for k, v in res.headers.items() if v.startswith("https")}
        headers = {
            "X-Llama-Server-Proxy-Header-Authorization": "Bearer key",
            "X-Llama-Server-Proxy-Header-Content-Type": "application/json",
            "X-Not-Forwarded": "no",
        }
        res = httpx.post(f"{base}/cors-proxy?url={target}/echo", headers=headers, content=b'{"x": 1}')
        assert res.json() == {
            "method": "POST",
            "path": "/echo",
            "body": '{"x": 1}',
            "headers": {"authorization": "Bearer key", "content-type": "application/json"},
        }
        res = httpx.post(f"{base}/cors-proxy?url={target}/nocontent", content=b"{}")
        assert (res.status_code, res.content) == (204, b"")
        res = httpx.get(f"{base}/cors-proxy?url={target}/redirect")
        assert res.json()["path"] == "/echo?from=redirect"
        for url in (f"{target}/away", "http://169.254.169.254/", f"http://localhost:{target.rsplit(':', 1)[1]}/"):
            res = httpx.get(f"{base}/cors-proxy", params={"url": url})  # another host; link-local
            assert res.status_code == 403 and res.text.startswith("proxy error: the target is not allowed"), url
        res = httpx.post(f"{base}/cors-proxy?url={target}/echo", content=b"x" * (8 * 1024 * 1024 + 1))
        assert res.status_code == 413 and "exceeds the limit" in res.json()["error"]["message"]
        res = httpx.get(f"{base}/cors-proxy?url={target}/teapot")
        assert res.status_code == 418 and res.json()["path"] == "/teapot"
        res = httpx.get(f"{base}/cors-proxy", params={"url": f"{base}/models"})  # the server itself
        assert res.status_code == 200 and "data" in res.json()
        for url, message in (
            ("", "invalid URL: no scheme"),
            ("ftp://example.com/", "unsupported URL scheme: ftp"),
            ("http:///path", "invalid target URL: missing host"),
            (f"http://user:pw@{target[7:]}/", "authentication in target URL is not supported"),
        ):
            res = httpx.get(f"{base}/cors-proxy", params={"url": url})
            assert (res.status_code, res.json()) == (
                500,
                {"error": {"code": 500, "message": message, "type": "server_error"}},
            )
        res = httpx.get(f"{base}/cors-proxy", params={"url": f"http://127.0.0.1:{free_port()}/"})
        assert (res.status_code, res.text) == (500, "proxy error: Could not establish connection")
        # /tools stays off: no tools, no MCP servers
        for method in ("GET", "POST"):
            res = httpx.request(method, base + "/tools")
            assert (res.status_code, res.json()) == (403, DISABLED)
        # the proxy on and no --cors-origins: CORS for localhost only, as with the tools
        res = httpx.get(base + "/health", headers={"Origin": "https://any.example"})
        assert "Access-Control-Allow-Origin" not in res.headers


def test_router_mode_serves_the_tools_and_the_proxy(tiny_model: Path, tmp_path: Path):
    """In router mode (many models) /tools and /cors-proxy are the router's own, as llama-server's:
    they answer without loading a model."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.gguf").symlink_to(tiny_model)
    port = free_port()
    proc = subprocess.Popen(
        [*LLAMACTOR, "serve", "--models-dir", str(models), "--port", str(port), "-t", "1", "-c", "256"]
        + ["--tools", "read_file,get_info", "--ui-mcp-proxy", "--insecure-tools", "--ui-mcp-proxy-allow-private"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base + "/health", STARTUP_TIMEOUT_S)
        assert [t["tool"] for t in httpx.get(base + "/tools").json()] == ["read_file", "get_info"]
        (tmp_path / "f.txt").write_text("router\n")
        assert call(base, "read_file", {"path": str(tmp_path / "f.txt")}) == {"plain_text_response": "router\n"}
        assert httpx.get(base + "/props").json()["cors_proxy_enabled"] is True
        res = httpx.get(base + "/cors-proxy", params={"url": f"{base}/health"})
        assert (res.status_code, res.json()) == (200, {"status": "ok"})
        assert httpx.get(base + "/models").json()["data"][0]["status"]["value"] == "unloaded"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


# ---- bad flags stop the server at once --------------------------------------------------------------


def test_bad_agent_flags_exit_2(tmp_path: Path):
    assert 'unknown tool "bogus". available tools: read_file, file_glob_search' in start_fails(["--tools", "bogus"])
    assert 'unknown tool "nope"' in start_fails([], env={"LLAMA_ARG_TOOLS": "read_file,nope"})
    assert "unknown tool runtime: fake:x" in start_fails(["--tools", "all", "--tools-runtime", "fake:x"])
    assert "invalid ssh target: -oX" in start_fails(["--tools-runtime", "ssh:-oX"])
    assert "docker:<image> requires an image name" in start_fails(["--tools-runtime", "docker:"])
    no_engine = {"PATH": str(tmp_path)}  # no docker, podman or ssh there
    err = start_fails(["--tools-runtime", "podman:busybox"], env=no_engine)
    assert "podman is not installed on this machine (not found on PATH)" in err
    assert "ssh is not installed" in start_fails(["--tools-runtime", "ssh:host"], env=no_engine)
    assert "failed to parse MCP config JSON" in start_fails(["--mcp-servers-json", "not valid json"])
    assert "failed to open MCP config file: /nonexistent/path.json" in start_fails(
        ["--mcp-servers-config", "/nonexistent/path.json"]
    )
    assert "disagree" in start_fails(["--agent", "--tools", "read_file"])
    # tools, MCP servers and the proxy run for whoever reaches the server: not without an API key
    # unless the operator says so (each starts with --api-key or --insecure-tools: the servers above)
    for argv in (["--tools", "read_file"], ["--agent"], ["--ui-mcp-proxy"], ["--mcp-servers-json", "{}"]):
        err = start_fails(argv)
        assert "without --api-key" in err and "--insecure-tools" in err, err
    assert "without --api-key" in start_fails([], env={"LLAMA_ARG_TOOLS": "all"})
