"""MCP servers (``--mcp-servers-config``, ``--mcp-servers-json``) as llama-server runs them.

The configuration is Cursor's ``{"mcpServers": {"<name>": {"command", "args", "env", "cwd",
"timeout_ms"}}}`` (read by ``agent.mcpconfig``); an entry without a command is skipped, a name
given twice keeps the first.
Each server is a child process speaking JSON-RPC 2.0 over stdio, one JSON message a line
(MCP's stdio transport, protocol version 2024-11-05, the one transport llama-server has).

At startup every server is started once, initialized, asked for its tools (``tools/list``, at
most 10 s each) and stopped: its tools are listed by ``GET /tools`` as ``<server>_<tool>``.
A call starts the server again if it is not running (a server that fails to start is not
tried again for 5 s), sends ``tools/call`` and answers, as llama-server does,
``{"plain_text_response"}`` (the result's text parts joined by newlines) or ``{"error"}`` (an
RPC error, ``isError``, a timeout after the server's ``timeout_ms``, a server that died). Calls
to one server wait for each other; a reply whose id is not the request's (a notification, a
late reply) is skipped. The child's stderr is drained and its last 4 KiB kept for the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from llamactor.runtime.http.agent.mcpconfig import McpServerConfig, load_configs

log = structlog.get_logger("llamactor.mcp")

PROTOCOL_VERSION = "2024-11-05"
COOLDOWN_S = 5.0
WARMUP_TIMEOUT_S = 10.0
MAX_LINE = 8 * 1024 * 1024
ERR_TAIL_MAX = 4096
QUEUE_MAX = 65536
POLL_S = 0.05  # how often a waiting call looks at the server's state (draining: it returns "cancelled")
FIRST = asyncio.FIRST_COMPLETED


def _rpc_error_message(resp: dict[str, Any]) -> str:
    err = resp.get("error")
    if isinstance(err, dict):
        message = err.get("message", "unknown error")
        return message if isinstance(message, str) else "unknown error"
    if isinstance(err, str):
        return err
    return "unknown error"


def result_to_response(result: Any) -> dict[str, Any]:
    """A ``tools/call`` result as /tools answers it: the text parts joined, or the error."""
    parts = result.get("content") if isinstance(result, dict) else None
    texts = [
        p.get("text", "") if isinstance(p.get("text", ""), str) else ""
        for p in (parts if isinstance(parts, list) else [])
        if isinstance(p, dict) and p.get("type") == "text"
    ]
    text = "\n".join(texts)
    if isinstance(result, dict) and result.get("isError") is True:
        return {"error": text or "MCP tool returned an error"}
    return {"plain_text_response": text}


class StdioTransport:
    """One MCP server process and its JSON-RPC session."""

    def __init__(self, cfg: McpServerConfig, stopping: asyncio.Event, should_stop: Callable[[], bool]) -> None:
        self.cfg = cfg
        self.stopping = stopping
        self.should_stop = should_stop  # the server is draining: calls in flight return at once
        self.proc: asyncio.subprocess.Process | None = None
        self.frames: asyncio.Queue[str | None] = asyncio.Queue(QUEUE_MAX)
        self.lock = asyncio.Lock()  # one RPC at a time, held across the wait for its reply
        self.next_id = 1
        self.initialized = False
        self.last_error = ""
        self.err_tail = ""
        self.tasks: list[asyncio.Task[None]] = []
        self.running = False

    async def start(self) -> bool:
        env = None
        if self.cfg.env:
            env = {**os.environ, **dict(self.cfg.env)}
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.cfg.command,
                *self.cfg.args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self.cfg.cwd or None,
                env=env,
                start_new_session=True,  # its children go with it when it is stopped
            )
        except (OSError, ValueError) as exc:
            self.last_error = f"failed to spawn '{self.cfg.command}': {exc}"
            return False
        self.running = True
        self.tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._drain_stderr())]
        return True

    @property
    def alive(self) -> bool:
        return self.running and self.proc is not None and self.proc.returncode is None

    def diagnostics(self) -> str:
        out = self.last_error
        if self.err_tail:
            out += ("; " if out else "") + "last stderr: " + self.err_tail
        return out

    async def _lines(self, stream: asyncio.StreamReader) -> Any:
        buf, skipping = b"", False
        while True:
            chunk = await stream.read(4096)
            if not chunk:
                return
            buf += chunk
            if skipping:
                nl = buf.find(b"\n")
                if nl < 0:
                    buf = b"" if len(buf) > MAX_LINE else buf
                    continue
                buf, skipping = buf[nl + 1 :], False
            *lines, buf = buf.split(b"\n")
            for line in lines:
                line = line.rstrip(b"\r")
                if line:
                    yield line.decode("utf-8", "replace")
            if len(buf) > MAX_LINE:
                log.warning("mcp_line_dropped", server=self.cfg.name, reason=f"a line longer than {MAX_LINE} bytes")
                buf, skipping = b"", True

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            async for line in self._lines(self.proc.stdout):
                if self.frames.full():
                    continue  # unsolicited notifications must not grow it without bound
                self.frames.put_nowait(line)
        except (OSError, ValueError):
            pass
        finally:
            self.running = False
            with contextlib.suppress(asyncio.QueueFull):
                self.frames.put_nowait(None)  # end of stream: a waiting call returns

    async def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        with contextlib.suppress(OSError, ValueError):
            async for line in self._lines(self.proc.stderr):
                log.debug("mcp_stderr", server=self.cfg.name, line=line)
                self.err_tail = (self.err_tail + line + "\n")[-ERR_TAIL_MAX:]

    async def _send(self, message: dict[str, Any]) -> bool:
        if not self.alive:
            return False
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            await self.proc.stdin.drain()
        except (OSError, RuntimeError):
            return False
        return True

    async def _rpc(self, request: dict[str, Any], deadline: float) -> dict[str, Any]:
        def failure(message: str) -> dict[str, Any]:
            return {"error": {"code": -32603, "message": message}}

        if not await self._send(request):
            return failure("transport closed")
        stop = asyncio.ensure_future(self.stopping.wait())
        get: asyncio.Future[str | None] | None = None
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return failure("request timed out")
                if get is None:
                    get = asyncio.ensure_future(self.frames.get())
                done, _ = await asyncio.wait((get, stop), timeout=min(left, POLL_S), return_when=FIRST)
                if stop in done or self.should_stop():
                    return failure("cancelled")
                if get not in done:
                    continue
                frame, get = get.result(), None
                if frame is None:
                    with contextlib.suppress(asyncio.QueueFull):
                        self.frames.put_nowait(None)  # stays at the end for the next caller
                    return failure("transport closed")
                try:
                    reply = json.loads(frame)
                except ValueError:
                    continue  # a malformed frame is skipped
                if not isinstance(reply, dict):
                    continue
                if "id" not in request or reply.get("id") == request["id"]:
                    return reply
                # a notification, or a late reply to a request that timed out
        finally:
            stop.cancel()
            if get is not None:
                get.cancel()

    def _request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        req: dict[str, Any] = {"jsonrpc": "2.0", "id": self.next_id, "method": method}
        self.next_id += 1
        if params is not None:
            req["params"] = params
        return req

    async def _ensure_init(self, deadline: float) -> bool:
        if self.initialized:
            return True
        params = {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "llama.cpp", "version": "1.0"},
        }
        resp = await self._rpc(self._request("initialize", params), deadline)
        if "result" not in resp:
            self.last_error = "initialize failed: " + _rpc_error_message(resp)
            return False
        await self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        self.initialized = True
        return True

    def _deadline(self, limit_s: float | None = None) -> float:
        timeout = self.cfg.timeout_ms / 1000
        return time.monotonic() + (min(timeout, limit_s) if limit_s is not None else timeout)

    async def list_tools(self, limit_s: float) -> list[tuple[str, str, str, Any]]:
        async with self.lock:
            if not await self._ensure_init(self._deadline(limit_s)):
                return []
            resp = await self._rpc(self._request("tools/list"), self._deadline(limit_s))
            if "result" not in resp:
                self.last_error = "tools/list failed: " + _rpc_error_message(resp)
                return []
            result = resp["result"]
            tools = result.get("tools") if isinstance(result, dict) else None
            out = []
            for t in tools if isinstance(tools, list) else []:
                if not isinstance(t, dict):
                    continue
                name = t.get("name", "")
                description = t.get("description", "")
                out.append(
                    (
                        self.cfg.name,
                        name if isinstance(name, str) else "",
                        description if isinstance(description, str) else "",
                        t.get("inputSchema"),
                    )
                )
            return out

    async def call_tool(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        async with self.lock:
            if not await self._ensure_init(self._deadline()):
                return {"error": self.last_error}
            params = {"name": tool, "arguments": arguments}
            resp = await self._rpc(self._request("tools/call", params), self._deadline())
            if "error" in resp:
                return {"error": _rpc_error_message(resp)}
            if "result" in resp:
                return result_to_response(resp["result"])
            return {"error": "invalid response from MCP server"}

    async def close(self) -> None:
        self.running = False
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # and any child that holds its pipes
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                await proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()


@dataclass
class McpManager:
    configs: list[McpServerConfig] = field(default_factory=list)
    registry: list[tuple[str, str, str, Any]] = field(default_factory=list)  # (server, tool, description, schema)
    transports: dict[str, StdioTransport] = field(default_factory=dict)
    dead_until: dict[str, float] = field(default_factory=dict)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one start of a server at a time
    should_stop: Callable[[], bool] = lambda: False

    @classmethod
    def from_config(
        cls, config_path: str, config_json: str, should_stop: Callable[[], bool] = lambda: False
    ) -> McpManager:
        return cls(configs=load_configs(config_path, config_json), should_stop=should_stop)

    def __bool__(self) -> bool:
        return bool(self.configs)

    async def start(self) -> None:
        """Start each server once, list its tools, stop it (a server that fails is logged)."""
        for cfg in self.configs:
            t = StdioTransport(cfg, self.stopping, self.should_stop)
            if not await t.start():
                log.warning("mcp_warmup_failed", server=cfg.name, error=t.diagnostics())
                continue
            tools = await t.list_tools(WARMUP_TIMEOUT_S)
            if not tools and t.last_error:
                log.warning("mcp_warmup_failed", server=cfg.name, error=t.diagnostics())
            log.info("mcp_warmup", server=cfg.name, tools=len(tools))
            self.registry += tools
            await t.close()

    async def _transport(self, name: str) -> StdioTransport | None:
        if self.stopping.is_set() or self.should_stop():
            return None
        now = time.monotonic()
        if self.dead_until.get(name, 0) > now:
            return None
        self.dead_until.pop(name, None)
        t = self.transports.get(name)
        if t is not None:
            if t.alive:
                return t
            log.warning("mcp_server_died", server=name, error=t.diagnostics())
            del self.transports[name]
            await t.close()
        cfg = next((c for c in self.configs if c.name == name), None)
        if cfg is None:
            return None
        fresh = StdioTransport(cfg, self.stopping, self.should_stop)
        if await fresh.start() and fresh.alive:
            self.transports[name] = fresh
            return fresh
        log.warning("mcp_start_failed", server=name, error=fresh.diagnostics())
        await fresh.close()
        self.dead_until[name] = now + COOLDOWN_S
        return None

    async def call_tool(self, server: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        async with self.lock:
            transport = await self._transport(server)
        if transport is None:
            return {"error": f"MCP server unavailable: {server}"}
        return await transport.call_tool(tool, arguments)

    async def close(self) -> None:
        self.stopping.set()
        transports, self.transports = list(self.transports.values()), {}
        for t in transports:
            await t.close()
