"""The MCP servers' configuration (``--mcp-servers-config``, ``--mcp-servers-json``), as
llama-server reads it: Cursor's ``{"mcpServers": {"<name>": {...}}}`` parsed into
``McpServerConfig``s (an entry without a command skipped, a name given twice keeping the
first), the file's and the inline JSON's servers together. ``agent.mcp`` runs them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("llamactor.mcp")


@dataclass(frozen=True)
class McpServerConfig:
    name: str
    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # merged over the server's own environment
    cwd: str = ""
    timeout_ms: int = 30000  # per call


def _typed(value: Any, type_: type, default: Any) -> Any:
    if value is None:
        return default
    if type_ is int and isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    return value if isinstance(value, type_) and not (type_ is int and isinstance(value, bool)) else default


def parse_config(text: str, *, warn: bool = True) -> list[McpServerConfig]:
    """The servers of one JSON text (ValueError naming what is wrong). A text without an
    ``mcpServers`` object has none."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"failed to parse MCP config JSON: {exc}") from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        return []
    out = []
    for name, cfg in servers.items():
        if not isinstance(cfg, dict):
            raise ValueError(f"failed to parse MCP config JSON: server {name!r} must be an object")
        args = cfg.get("args")
        env = cfg.get("env")
        if isinstance(args, list) and not all(isinstance(a, str) for a in args):
            raise ValueError(f"failed to parse MCP config JSON: server {name!r}: args must be strings")
        if isinstance(env, dict) and not all(isinstance(v, str) for v in env.values()):
            raise ValueError(f"failed to parse MCP config JSON: server {name!r}: env values must be strings")
        command = _typed(cfg.get("command"), str, "")
        if not command:
            if warn:
                log.warning("mcp_server_skipped", server=name, reason="it has no command")
            continue
        out.append(
            McpServerConfig(
                name=name,
                command=command,
                args=tuple(args) if isinstance(args, list) else (),
                env=tuple(env.items()) if isinstance(env, dict) else (),
                cwd=_typed(cfg.get("cwd"), str, ""),
                timeout_ms=_typed(cfg.get("timeout_ms"), int, 30000),
            )
        )
    return out


def read_config_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        raise ValueError(f"failed to open MCP config file: {path}") from None


def load_configs(config_path: str, config_json: str) -> list[McpServerConfig]:
    """The servers of the file, then of the inline JSON; a name already taken is skipped."""
    configs: list[McpServerConfig] = []
    for text in (read_config_file(config_path) if config_path else None, config_json or None):
        if text is None:
            continue
        parsed = parse_config(text)
        if not parsed:
            log.warning("mcp_config_empty", reason="no servers found in JSON")
        for cfg in parsed:
            if any(c.name == cfg.name for c in configs):
                log.warning("mcp_server_skipped", server=cfg.name, reason="duplicate server name")
                continue
            configs.append(cfg)
    return configs
