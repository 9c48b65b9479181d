"""The ``/tools`` endpoints (``AgentTools``), the table of built-in tools and the endpoints'
errors: llama-server's built-in agent tools (``--tools``).

The same seven tools as llama-server's ``server-tools.cpp``, with its names, JSON schemas,
results, errors and limits: ``read_file``, ``file_glob_search``, ``grep_search``,
``exec_shell_command``, ``write_file``, ``edit_file``, ``get_info``. ``GET /tools`` lists the
enabled tools (and the MCP servers' tools, ``agent.mcp``); ``POST /tools`` with
``{"tool", "params", "stream"}`` runs one. A tool's own failure is a 200 with ``{"error": ...}``
(what the model reads), as in llama-server; a body that is not a JSON object or lacks a required
field is a 400, an unknown tool a 404, a bad runtime a 500.

Headers, as llama-server reads them: ``x-tool-cwd`` is the directory relative paths resolve
against and commands run in; ``x-tool-runtime`` runs the tool's I/O in an isolate
(``docker-container:<id>``, ``podman-container:<id>``, ``ssh:<target>``) when the operator gave
no ``--tools-runtime`` (with one, a request naming another is a 403: no header overrides an
operator's flag); ``x-resp-type: base64`` makes ``read_file`` answer the raw bytes. The
same keys in ``params`` are dropped: the model cannot choose them.

Every tool runs in a worker thread (file and process I/O block). ``exec_shell_command`` with
``"stream": true`` answers SSE frames ``{"chunk"}`` as the output comes and ``{"done": true}``
last; a client that leaves stops the command.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llamactor.runtime.http.agent.edit import EditFile
from llamactor.runtime.http.agent.files import FileGlobSearch, GrepSearch, ReadFile, WriteFile
from llamactor.runtime.http.agent.isolate import ContainerRuntime, container_spec
from llamactor.runtime.http.agent.params import ToolFailure, ToolForbidden, ToolNotFound, ToolRequestError, _json_type
from llamactor.runtime.http.agent.tools import ExecShellCommand, GetInfo, McpTool, Stream, Tool
from llamactor.runtime.http.body import read_body
from llamactor.runtime.http.errors import BodyTooLarge

if TYPE_CHECKING:
    from llamactor.runtime.service.config import RuntimeConfig

log = structlog.get_logger("llamactor.tools")

JSON_TYPE = "application/json; charset=utf-8"

BUILTIN_TOOLS: tuple[type[Tool], ...] = (ReadFile, FileGlobSearch, GrepSearch, ExecShellCommand, WriteFile, EditFile)
BUILTIN_TOOLS += (GetInfo,)


# ---- the endpoints ----------------------------------------------------------------------------


def feature_disabled(request: Request) -> Response:
    """llama-server's answer on /tools and /cors-proxy when the feature is off."""
    body = {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}
    return Response(_dumps(body), status_code=403, media_type=JSON_TYPE)


def _error(message: str, status: int, kind: str) -> Response:
    """llama-server's /tools errors: ``{"code", "message", "type"}`` with no ``error`` around it
    (its handler writes the body itself), but for the 404 (its HTTP layer's 404 shape)."""
    body: dict[str, Any] = {"code": status, "message": message, "type": kind}
    if status == 404:
        body = {"error": body}
    return Response(_dumps(body), status_code=status, media_type=JSON_TYPE)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class AgentTools:
    """The tools of one server: the built-in ones ``--tools`` enables, then the MCP servers'
    (a name already taken is skipped, with a warning). ``start`` (before serving) starts a
    ``--tools-runtime`` container and lists the MCP servers' tools; ``close`` stops them."""

    def __init__(self, config: RuntimeConfig, stopping: Callable[[], bool] = lambda: False) -> None:
        from llamactor.runtime.http.agent.mcp import McpManager

        enabled = set(config.server_tools)
        self.tools: list[Tool] = [cls() for cls in BUILTIN_TOOLS if cls.name in enabled or "all" in enabled]
        self.mcp = McpManager.from_config(config.mcp_servers_config, config.mcp_servers_json, stopping)
        self.runtime_spec = config.tools_runtime
        self.container: ContainerRuntime | None = None

    async def start(self) -> None:
        spec = self.runtime_spec
        container = container_spec(spec) if spec else None
        if container is not None and not container[2]:
            self.container = ContainerRuntime(container[0], container[1])
            await asyncio.to_thread(self.container.spawn)
        await self.mcp.start()
        seen = {t.name for t in self.tools}
        added = 0
        for server, tool, description, schema in self.mcp.registry:
            name = f"{server}_{tool}"
            if name in seen:
                log.warning("mcp_tool_skipped", tool=name, server=server, reason="collides with an existing tool")
                continue
            seen.add(name)
            self.tools.append(McpTool(self.mcp, server, tool, description, schema))
            added += 1
        if added:
            log.info("mcp_tools_added", count=added)

    async def close(self) -> None:
        await self.mcp.close()
        if self.container is not None:
            await asyncio.to_thread(self.container.stop)

    async def get(self, request: Request) -> Response:
        return Response(_dumps([t.to_json() for t in self.tools]), media_type=JSON_TYPE)

    def _params(self, request: Request, body: Any) -> tuple[Tool, dict[str, Any], bool]:
        if not isinstance(body, dict):
            raise ToolRequestError(f"the request body must be a JSON object, got {_json_type(body)}")
        if "tool" not in body:
            raise ToolRequestError("key 'tool' not found")
        name = body["tool"]
        if not isinstance(name, str):
            raise ToolRequestError(f"'tool': type must be string, but is {_json_type(name)}")
        params = body.get("params", {})
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ToolRequestError(f"'params': type must be object, but is {_json_type(params)}")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ToolRequestError(f"'stream': type must be boolean, but is {_json_type(stream)}")
        params = {k: v for k, v in params.items() if k not in ("cwd", "runtime", "resp_type")}
        if cwd := request.headers.get("x-tool-cwd", ""):
            params["cwd"] = cwd
        runtime = request.headers.get("x-tool-runtime", "")
        if self.runtime_spec:  # the operator's --tools-runtime: no request picks another
            if runtime and runtime not in (self.runtime_spec, self.container.spec() if self.container else ""):
                raise ToolForbidden(
                    f"x-tool-runtime: the tools run in --tools-runtime {self.runtime_spec}; "
                    "a request cannot pick another"
                )
            params["runtime"] = self.container.spec() if self.container is not None else self.runtime_spec
        elif runtime:
            params["runtime"] = runtime
        if resp_type := request.headers.get("x-resp-type", ""):
            params["resp_type"] = resp_type
        tool = next((t for t in self.tools if t.name == name), None)
        if tool is None:
            raise ToolNotFound(f'unknown tool "{name}"')
        if stream and not tool.support_stream:
            raise ToolNotFound(f'tool "{name}" does not support stream = true')
        return tool, params, stream

    async def post(self, request: Request) -> Response:
        try:
            try:
                raw = await read_body(request)
            except BodyTooLarge as exc:
                return _error(str(exc), 413, "invalid_request_error")
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise ToolRequestError(f"malformed JSON: {exc}") from None
            tool, params, stream = await asyncio.to_thread(self._params, request, body)
            if stream:
                return self._stream(request, tool, params)
            if isinstance(tool, McpTool):
                result = await tool.manager.call_tool(tool.server, tool.tool, params)
            else:
                result = await asyncio.to_thread(tool.invoke, params, None)
            return Response(_dumps(result), media_type=JSON_TYPE)
        except ToolRequestError as exc:
            return _error(str(exc), 400, "invalid_request_error")
        except ToolNotFound as exc:
            return _error(str(exc), 404, "not_found_error")
        except ToolForbidden as exc:
            return _error(str(exc), 403, "permission_error")
        except ToolFailure as exc:
            return _error(str(exc), 500, "server_error")

    def _stream(self, request: Request, tool: Tool, params: dict[str, Any]) -> Response:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        gone = threading.Event()

        def push(chunk: str) -> None:
            if chunk:
                loop.call_soon_threadsafe(queue.put_nowait, {"chunk": chunk})

        def work() -> None:
            done: dict[str, Any] = {"done": True}
            try:
                tool.invoke(params, Stream(push, lambda: not gone.is_set()))
            except (ToolRequestError, ToolFailure) as exc:
                done["error"] = str(exc)
            except Exception as exc:
                log.exception("tool_failed", tool=tool.name)
                done["error"] = str(exc) or "An unknown error occurred"
            with contextlib.suppress(RuntimeError):  # the loop may be closing
                loop.call_soon_threadsafe(queue.put_nowait, done)

        async def frames() -> AsyncIterator[bytes]:
            worker = loop.run_in_executor(None, work)
            try:
                while True:
                    item = await queue.get()
                    yield f"data: {_dumps(item)}\n\n".encode()
                    if item.get("done"):
                        break
            finally:
                gone.set()
                await asyncio.shield(worker)

        return StreamingResponse(frames(), media_type="text/event-stream", headers={"X-Accel-Buffering": "no"})
