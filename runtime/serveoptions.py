"""``llamactor serve``'s command line as options: the runtime's config and the process's own settings.

The flags are read by ``runtime.cliargs`` from the table in ``runtime.cliflags``; this module
refuses what is not built, notes what is ignored, and builds the ``RuntimeConfig``.
``runtime.cli`` runs the result.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import msgspec

from llamactor.protocol.errors import ConfigError
from llamactor.protocol.sampling import SamplingParams
from llamactor.runtime import cliargs, cliflags
from llamactor.runtime.http.agent.flags import localhost_cors, require_api_key
from llamactor.runtime.http.deadlines import DEFAULT_TIMEOUT_S
from llamactor.runtime.service.config import RuntimeConfig, size_per_slot, unified_without_slots
from llamactor.runtime.service.egress import host_names
from llamactor.runtime.service.modeltable import DEFAULT_MODELS_MAX

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


@dataclass(frozen=True)
class ServeOptions:
    """``llamactor serve``'s command line: the runtime's config and the process's own options."""

    config: RuntimeConfig
    hosts: tuple[str, ...] = (DEFAULT_HOST,)  # --host a,b: one listening socket each
    port: int = DEFAULT_PORT
    timeout: int = DEFAULT_TIMEOUT_S  # -to/--timeout: a request body's deadline, one write's limit
    ssl_cert_file: str | None = None
    ssl_key_file: str | None = None
    log_format: str = "auto"
    list_devices: bool = False
    version: bool = False
    completion_bash: bool = False  # --completion-bash: print the script and exit
    ignored: tuple[tuple[str, str], ...] = ()  # (flag as given, why): one log line each
    # the router mode (many models): without -m, the models of --models-dir and --models-preset
    models_dir: str | None = None
    models_preset: str | None = None
    models_max: int = DEFAULT_MODELS_MAX
    models_autoload: bool = True
    given: cliargs.Parsed = field(default_factory=cliargs.Parsed)  # as given: each model's flags go under it
    argv: tuple[str, ...] = ()  # serve's words as given (the router shows them with each model's flags)

    @property
    def router(self) -> bool:
        """Whether the server runs in router mode: no -m, and a models folder or preset file."""
        return self.config.model is None and bool(self.models_dir or self.models_preset)


ROUTER_OPTIONS = ("models_dir", "models_preset", "models_max", "models_autoload")


def serve_options(a: argparse.Namespace) -> ServeOptions:
    """Raise ConfigError naming every refused flag (llama-server options not built); sampling flags become the server's
    defaults (``RuntimeConfig.sampling``)."""
    parsed = cliargs.read(a, cliflags.GROUPS)
    if parsed.refused:
        raise ConfigError("; ".join(f"{flag} is not supported: {why}" for flag, why in parsed.refused))
    kw = dict(parsed.config)
    require_api_key(kw, parsed.spelled)  # tools, MCP servers, the proxy: an API key or --insecure-tools
    localhost_cors(kw)  # tools, MCP servers or the proxy on: CORS for localhost unless --cors-origins says
    if parsed.sampling:
        kw["sampling"] = msgspec.structs.replace(SamplingParams(), **parsed.sampling)
    process = dict(parsed.process)
    if ("ssl_cert_file" in process) != ("ssl_key_file" in process):
        raise ConfigError("--ssl-cert-file and --ssl-key-file must be given together")
    hosts = process.get("hosts", (DEFAULT_HOST,))
    for host in hosts:
        if host.endswith(".sock"):
            raise ConfigError(f"--host {host}: UNIX sockets are not supported; give IP addresses to listen on")
    if len(hosts) > 1 and process.get("port") == 0:
        raise ConfigError("--port 0 is not supported with several --host addresses")  # as llama-server
    # the names the server listens under are names /tools and /cors-proxy answer to (Host header)
    kw["allowed_hosts"] = host_names([*kw.get("allowed_hosts", ()), *hosts])
    ignored = list(parsed.ignored)
    if kw.get("model") is not None or not (process.get("models_dir") or process.get("models_preset")):
        for name in ROUTER_OPTIONS:  # one model: the router's flags mean nothing (llama-server's too)
            if name in process:
                del process[name]
                why = "only for the router mode (--models-dir or --models-preset, without -m)"
                ignored.append((parsed.spelled[name], why))
    if kw.get("reasoning_budget", -1) > 0:  # 0 turns thinking off, -1 leaves it; a count is not applied
        ignored.append(
            (
                parsed.spelled.get("reasoning_budget", "--reasoning-budget"),
                "thinking is not cut at a token count here: "
                "0 (no thinking) and -1 (unrestricted) are applied, other values are taken as -1",
            )
        )
    unified_without_slots(kw)
    size_per_slot(kw)
    return ServeOptions(config=RuntimeConfig(**kw), ignored=tuple(ignored), given=parsed, **process)


def dashed(word: str) -> str:
    """A long option with ``_`` for ``-`` (``--backend_sampling``), as llama-server reads it: its
    parser replaces every underscore of a ``--`` word; a value after ``=`` is left as it is."""
    if not word.startswith("--"):
        return word
    name, eq, value = word.partition("=")
    return name.replace("_", "-") + eq + value


__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "ROUTER_OPTIONS", "ServeOptions", "dashed", "serve_options"]
