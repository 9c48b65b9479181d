"""The tool base and the tools that are no file tools: ``Tool`` (name, permissions, JSON schema,
its entry in ``GET /tools``) and ``Stream`` (where a streaming tool's output goes), the two tools
that run commands (``exec_shell_command``, ``get_info``) and ``McpTool`` (one tool of an MCP
server). The file tools are ``agent.files`` and ``agent.edit``; the table of the built-in tools
is ``agent.endpoints``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from llamactor.runtime.http.agent.isolate import make_io
from llamactor.runtime.http.agent.params import opt_value, required_str

if TYPE_CHECKING:
    from llamactor.runtime.http.agent.mcp import McpManager

EXEC_MAX_OUTPUT_SIZE = 16 * 1024
EXEC_MAX_TIMEOUT = 60
GET_INFO_MAX_OUTPUT = 4096
GET_INFO_TIMEOUT = 5


# ---- the tools -----------------------------------------------------------------------------------


class Stream:
    """Where a streaming tool's output goes: ``push`` from the worker thread; ``alive`` False
    once the client has left."""

    def __init__(self, push: Callable[[str], None], alive: Callable[[], bool]) -> None:
        self.push, self.alive = push, alive


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str] | None) -> dict[str, Any]:
    params: dict[str, Any] = {"type": "object", "properties": properties}
    if required is not None:
        params["required"] = required
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def _prop(type_: str, description: str) -> dict[str, Any]:
    return {"type": type_, "description": description}


class Tool:
    name = ""
    display_name = ""
    permission_write = False
    support_stream = False
    uses_cwd = True
    kind = "server"

    def definition(self) -> dict[str, Any]:
        raise NotImplementedError

    def invoke(self, params: dict[str, Any], stream: Stream | None = None) -> Any:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        return {
            "display_name": self.display_name,
            "tool": self.name,
            "type": self.kind,
            "permissions": {"write": self.permission_write},
            "uses_cwd": self.uses_cwd,
            "definition": self.definition(),
        }


class ExecShellCommand(Tool):
    name, display_name = "exec_shell_command", "Execute shell command"
    permission_write = True
    support_stream = True

    def definition(self) -> dict[str, Any]:
        return _fn(
            self.name,
            "Execute a shell command and return its output (stdout and stderr combined).",
            {
                "command": _prop("string", "Shell command to execute"),
                "timeout": _prop("integer", f"Timeout in seconds (default 10, max {EXEC_MAX_TIMEOUT})"),
                "max_output_size": _prop("integer", f"Maximum output size in bytes (default {EXEC_MAX_OUTPUT_SIZE})"),
            },
            ["command"],
        )

    def invoke(self, params: dict[str, Any], stream: Stream | None = None) -> Any:
        command = required_str(params, "command")
        timeout = min(opt_value(params, "timeout", 10), EXEC_MAX_TIMEOUT)
        max_output = opt_value(params, "max_output_size", EXEC_MAX_OUTPUT_SIZE)
        max_output = EXEC_MAX_OUTPUT_SIZE if max_output < 0 else min(max_output, EXEC_MAX_OUTPUT_SIZE)
        io = make_io(params)
        args = ["sh", "-c", command]
        if stream is not None:

            def on_chunk(chunk: str) -> bool:
                stream.push(chunk)
                return stream.alive()

            res = io.run(args, max_output, timeout, on_chunk)
            if not stream.alive():
                return None
            tail = f"\n[exit code: {res.exit_code}]" + (" [exit due to timed out]" if res.timed_out else "")
            stream.push(tail)
            return None
        res = io.run(args, max_output, timeout)
        text = res.output + f"\n[exit code: {res.exit_code}]"
        if res.timed_out:
            text += " [exit due to timed out]"
        return {"plain_text_response": text}


class GetInfo(Tool):
    name, display_name = "get_info", "Get Runtime Info"

    def definition(self) -> dict[str, Any]:
        return _fn(self.name, "Returns runtime info: the OS name/version and the current working directory", {}, None)

    def invoke(self, params: dict[str, Any], stream: Stream | None = None) -> Any:
        io = make_io(params)
        res = io.run(["uname", "-a"], GET_INFO_MAX_OUTPUT, GET_INFO_TIMEOUT)
        os_info = res.output.strip() if res.exit_code == 0 and not res.timed_out else "unknown"
        cwd = opt_value(params, "cwd", "")
        if not cwd:
            if not opt_value(params, "runtime", ""):
                cwd = os.getcwd()
            else:
                pwd = io.run(["pwd"], GET_INFO_MAX_OUTPUT, GET_INFO_TIMEOUT)
                cwd = pwd.output.strip() if pwd.exit_code == 0 and not pwd.timed_out else "unknown"
        return {"os": os_info, "cwd": cwd}


class McpTool(Tool):
    """One tool of an MCP server, named ``<server>_<tool>``."""

    kind = "mcp"
    uses_cwd = False

    def __init__(self, manager: McpManager, server: str, tool: str, description: str, schema: Any) -> None:
        self.manager, self.server, self.tool = manager, server, tool
        self.name = self.display_name = f"{server}_{tool}"
        self.description, self.schema = description, schema if isinstance(schema, dict) else {}

    def definition(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.schema}
        return {"type": "function", "function": fn}
