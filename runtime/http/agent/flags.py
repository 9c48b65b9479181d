"""The agent features on the command line: the tool names ``--tools`` accepts, whether
``/tools`` is on (``agent_enabled``), the value parsers and startup checks of ``--tools``,
``--tools-runtime`` and the MCP server flags (``runtime.cliflags``), and the rules
``runtime.serveoptions`` applies to the config: ``localhost_cors`` and ``require_api_key``."""

from __future__ import annotations

import argparse
import csv
import shutil
from typing import TYPE_CHECKING, Any

from llamactor.protocol.errors import ConfigError
from llamactor.runtime.http.agent.isolate import container_spec, make_io
from llamactor.runtime.http.agent.params import ToolFailure

if TYPE_CHECKING:
    from llamactor.runtime.service.config import RuntimeConfig

TOOL_NAMES = (
    "read_file",
    "file_glob_search",
    "grep_search",
    "exec_shell_command",
    "write_file",
    "edit_file",
    "get_info",
)


# ---- command-line values ---------------------------------------------------------------------


def parse_tool_names(text: str) -> tuple[str, ...]:
    """``--tools a,b`` (or ``all``), as llama-server reads a CSV row; an unknown name is an error."""
    row = next(csv.reader([text]), [])
    names = tuple(name.strip() for name in row if name.strip())
    for name in names:
        if name != "all" and name not in TOOL_NAMES:
            raise ValueError(f'unknown tool "{name}". available tools: {", ".join(TOOL_NAMES)}')
    return names


def agent_enabled(config: RuntimeConfig) -> bool:
    """Whether ``/tools`` is on: built-in tools or MCP servers configured."""
    return bool(config.server_tools or config.mcp_servers_config or config.mcp_servers_json)


def check_tools_runtime(spec: str) -> None:
    """``--tools-runtime``'s form (ValueError naming what is wrong)."""
    container = container_spec(spec)
    if container is not None and not container[2]:
        if not container[1]:
            raise ValueError(f"{container[0]}:<image> requires an image name")
        return
    try:
        make_io({"runtime": spec})
    except ToolFailure as exc:
        raise ValueError(str(exc)) from None


def tools_runtime_program(spec: str) -> str:
    """``--tools-runtime``'s program (docker, podman or ssh) must be on PATH: ConfigError if not."""
    container = container_spec(spec)
    program = container[0] if container is not None else "ssh"
    if shutil.which(program) is None:
        raise ConfigError(f"--tools-runtime {spec}: {program} is not installed on this machine (not found on PATH)")
    return spec


# ---- argparse value parsers (runtime.cliflags) --------------------------------------------------


def tools_flag(text: str) -> tuple[str, ...]:
    try:
        return parse_tool_names(text)
    except (ValueError, csv.Error) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def tools_runtime_flag(text: str) -> str:
    try:
        check_tools_runtime(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def mcp_config_file_check(path: str) -> str:
    """``--mcp-servers-config``: the file is read and parsed at startup (ConfigError if it cannot be)."""
    from llamactor.runtime.http.agent.mcpconfig import parse_config, read_config_file

    try:
        parse_config(read_config_file(path), warn=False)
    except ValueError as exc:
        raise ConfigError(f"--mcp-servers-config: {exc}") from None
    return path


def mcp_config_json_flag(text: str) -> str:
    from llamactor.runtime.http.agent.mcpconfig import parse_config

    try:
        parse_config(text, warn=False)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def localhost_cors(fields: dict[str, Any]) -> None:
    """llama-server's rule, widened to the proxy: with tools, MCP servers or the CORS proxy on and
    no --cors-origins given, CORS allows localhost origins only (``fields``: the command line's
    config fields, changed here)."""
    on = any(fields.get(name) for name, _ in _EXPOSING)
    if on and "cors_origins" not in fields:
        fields["cors_origins"] = "localhost"


# the config fields that run something or reach a network for whoever calls the server, and
# the flag that sets each
_EXPOSING = (
    ("server_tools", "--tools"),
    ("mcp_servers_config", "--mcp-servers-config"),
    ("mcp_servers_json", "--mcp-servers-json"),
    ("ui_mcp_proxy", "--ui-mcp-proxy"),
)


def require_api_key(fields: dict[str, Any], spelled: dict[str, str] | None = None) -> None:
    """Tools run commands and read and write files, MCP servers and the CORS proxy reach what
    the server's machine reaches: for any client that reaches the server, unless an API key
    stands in front. So with any of them on and no ``--api-key``, the server refuses to start,
    unless ``--insecure-tools`` says the operator means it (``fields``: the command line's
    config fields; ``spelled``: how each was given, for the message)."""
    spelled = spelled or {}
    on = sorted({spelled.get(name, flag) for name, flag in _EXPOSING if fields.get(name)})
    if on and not (fields.get("api_key") or fields.get("api_keys")) and not fields.get("insecure_tools"):
        raise ConfigError(
            f"{', '.join(on)} without --api-key: every client that reaches the server could run tools or "
            "reach this machine's network through it; give --api-key (or --api-key-file), or "
            "--insecure-tools to allow it without one"
        )
