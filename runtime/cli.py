"""``llamactor`` command line: ``serve`` (the bundled server), ``bench``, ``replay`` and ``worker``.

``serve`` takes llama-server's command line: the flag table (what is supported, ignored or
refused, and why) is ``runtime.cliflags``; this module turns it into a config and serves.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from importlib import metadata
from typing import Any

import anyio
import msgspec
import structlog

from llamactor.protocol.errors import ConfigError
from llamactor.protocol.sampling import SamplingParams
from llamactor.runtime import cliargs, cliflags
from llamactor.runtime.http import vertex
from llamactor.runtime.http.agent.flags import localhost_cors, require_api_key
from llamactor.runtime.http.deadlines import DEFAULT_TIMEOUT_S
from llamactor.runtime.service.config import RuntimeConfig, route_prefix, size_per_slot, unified_without_slots
from llamactor.runtime.service.egress import host_names
from llamactor.runtime.service.logging import configure_from, configure_logging
from llamactor.runtime.service.modelset import DEFAULT_MODELS_MAX, ModelSet

log = structlog.get_logger("llamactor.cli")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
# llama-server's keep-alive timeout (cpp-httplib's): an idle connection, or one that has not
# sent a whole request head, is closed after this long
KEEP_ALIVE_TIMEOUT_S = 5
_TRUE = {"1", "true", "yes", "on", "enabled"}


class _EnvDefault(argparse.Action):
    """An option whose default comes from an environment variable when it is set."""

    def __init__(self, env: str, **kw: Any) -> None:
        value = os.environ.get(env)
        if value is not None:
            if kw.get("nargs") == 0:
                kw["default"] = value.lower() in _TRUE
            else:
                kw["default"] = kw.get("type", str)(value)
        super().__init__(**kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def _opt(p: argparse.ArgumentParser, *flags: str, env: str, flag: bool = False, **kw: Any) -> None:
    if flag:
        kw.setdefault("default", False)
        p.add_argument(*flags, action=_EnvDefault, env=env, nargs=0, **kw)
    else:
        p.add_argument(*flags, action=_EnvDefault, env=env, **kw)


def _serve_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "serve",
        allow_abbrev=False,
        help="run the HTTP server (OpenAI-compatible and llama-server native API)",
        description="llama-server's flags (README: Coming from llama-server): supported ones work, ones with no "
        "meaning here are logged and ignored, ones for features not built stop with exit code 2.",
    )
    p.add_argument("--usage", action="help", help=argparse.SUPPRESS)
    cliargs.add_arguments(p, cliflags.GROUPS)
    return p


def _worker_parser(sub: Any) -> None:
    p = sub.add_parser("worker", help="run a ggml-rpc worker that serves layers to a llamactor server")
    _opt(p, "--host", env="LLAMACTOR_WORKER_HOST", default=DEFAULT_HOST)
    _opt(p, "--port", env="LLAMACTOR_WORKER_PORT", type=int, default=50052)
    _opt(p, "-t", "--threads", env="LLAMA_ARG_THREADS", type=int, default=0, help="0 = all cores")
    _opt(p, "--device", env="LLAMA_ARG_DEVICE", default="CPU")
    _opt(p, "--cache-dir", env="LLAMACTOR_WORKER_CACHE", default=None, help="local tensor cache directory")


def run_worker(a: argparse.Namespace) -> int:
    from llamactor.runtime.engine import rpc

    threads = a.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if a.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "worker_exposed",
            host=a.host,
            warning="the ggml-rpc protocol has no authentication: anyone who can reach this port "
            "can use this machine; bind to a private network only",
        )
    log.info("worker_listening", host=a.host, port=a.port, threads=threads, device=a.device)
    try:
        rpc.serve_worker(a.host, a.port, threads, a.device, a.cache_dir)
    except ConfigError as exc:
        print(f"llamactor: error: {exc}", file=sys.stderr)
        return 2
    return 0


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


def completion_script() -> str:
    """``--completion-bash``: a bash completion script for ``llamactor`` (its commands, then every
    ``serve`` option), as llama-server's for its own programs: GGUF files after -m, grammar and
    template files after their flags."""
    words = " ".join(name for _, o in cliargs.entries(cliflags.GROUPS) for name in o.spellings)
    return f"""_llamactor_completions() {{
    local cur prev opts
    COMPREPLY=()
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    prev="${{COMP_WORDS[COMP_CWORD-1]}}"

    if [ "$COMP_CWORD" -eq 1 ]; then
        COMPREPLY=( $(compgen -W "serve bench replay worker" -- "$cur") )
        return 0
    fi
    opts="{words}"

    case "$prev" in
        --model|-m|--model-draft|-md|--spec-draft-model|--mmproj|-mm)
            COMPREPLY=( $(compgen -f -X '!*.gguf' -- "$cur") $(compgen -d -- "$cur") )
            return 0
            ;;
        --grammar-file)
            COMPREPLY=( $(compgen -f -X '!*.gbnf' -- "$cur") $(compgen -d -- "$cur") )
            return 0
            ;;
        --chat-template-file)
            COMPREPLY=( $(compgen -f -X '!*.jinja' -- "$cur") $(compgen -d -- "$cur") )
            return 0
            ;;
        --path|--media-path|--slot-save-path|--models-dir)
            COMPREPLY=( $(compgen -d -- "$cur") )
            return 0
            ;;
        *)
            COMPREPLY=( $(compgen -W "${{opts}}" -- "$cur") )
            return 0
            ;;
    esac
}}

complete -F _llamactor_completions llamactor
"""


def router_models(opts: ServeOptions) -> ModelSet:
    """The router mode's models (ConfigError for a folder or preset that cannot be read, a flag a
    model's preset gives that is refused, a model whose flags are invalid); logs each flag a
    preset gives that is ignored."""
    from llamactor.runtime import presets

    route_prefix(opts.config.api_prefix)  # the router's own: a bad one stops startup here
    found = presets.load_models(opts.models_dir, opts.models_preset, opts.given, opts.argv)
    for name, flag, why in found.ignored:
        log.info("flag_ignored", model=name, flag=flag, reason=why)
    for spec in found.specs:
        if spec.config.model is not None and os.path.isfile(spec.config.model):  # a missing file fails its load
            try:
                spec.config.validated()
            except ConfigError as exc:
                raise ConfigError(f"model {spec.name}: {exc}") from None
    return ModelSet(found.specs, models_max=opts.models_max, autoload=opts.models_autoload)


def _gpu_layers_ignored(cfg: RuntimeConfig) -> bool:
    """-ngl without a GPU or a split: the layers stay on the CPU, as llama-server warns."""
    if cfg.n_gpu_layers <= 0 or cfg.rpc_servers or cfg.devices:
        return False
    from llamactor.runtime.engine import backends

    return not backends.gpus()


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_listener(host: str, port: int, *, v6only: bool = False, timeout_s: int = 0) -> socket.socket:
    """One listening socket of the server, bound as Hypercorn binds one (``SO_REUSEADDR``, IPv6
    for a host with a colon) and listening at once, so that the same address given twice fails
    here too. Bound before the model loads or anything logs "listening", so that an address in
    use is a ConfigError naming it; Hypercorn is handed this socket (``fd://``) rather than
    binding the address a second time. ``v6only``: an IPv6 address takes IPv6 only.

    ``timeout_s`` (--timeout) is also the kernel's limit on data a client leaves unacknowledged
    (``TCP_USER_TIMEOUT``, which the accepted connections inherit): a client that stops reading
    cannot keep a connection, and the answer buffered for it, past it once the server gave up."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if timeout_s > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, timeout_s * 1000)
        if v6only and sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen()  # Hypercorn listens again with its own backlog
    except OSError as exc:
        sock.close()
        why = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        raise ConfigError(f"cannot listen on {_address(host, port)}: {why}") from None
    return sock


def bind_listeners(hosts: Sequence[str], port: int, timeout_s: int = 0) -> list[socket.socket]:
    """A listening socket for each --host address, as llama-server listens on each; with several,
    an IPv6 address takes IPv6 only (as in llama-server: ``::`` must not also claim ``0.0.0.0``).
    The first address that cannot be bound is a ConfigError naming it, the others are closed."""
    sockets: list[socket.socket] = []
    try:
        for host in hosts:
            sockets.append(bind_listener(host, port, v6only=len(hosts) > 1, timeout_s=timeout_s))
    except ConfigError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def serve(
    cfg: RuntimeConfig,
    hosts: Sequence[str],
    port: int,
    ssl: tuple[str, str] | None = None,
    listeners: Sequence[socket.socket] = (),
    models: ModelSet | None = None,
    timeout_s: int = DEFAULT_TIMEOUT_S,
) -> int:
    """Serve until SIGINT/SIGTERM. /health answers 503 while the model loads. ``listeners``
    (``bind_listeners``) are the bound sockets to serve on; without them Hypercorn binds each
    of ``hosts``. With ``models`` (the router mode) it serves those, each loaded when used,
    and ``cfg`` is the command line's (the server's own settings: keys, CORS, prefix).
    ``timeout_s`` (--timeout): a request body's deadline and one write's limit
    (``runtime.http.deadlines``)."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    from llamactor.runtime.api import Runtime
    from llamactor.runtime.http.app import build_app
    from llamactor.runtime.http.deadlines import ClientDeadlines
    from llamactor.runtime.http.router import build_router_app

    rt: Runtime | ModelSet = Runtime(cfg) if models is None else models
    stop = anyio.Event()
    failed: list[BaseException] = []

    async def run_runtime() -> None:
        try:
            async with rt:
                await stop.wait()
        except Exception as exc:
            log.error("startup_failed", error=str(exc))
            failed.append(exc)
            stop.set()

    @asynccontextmanager
    async def lifespan(app: Any):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_runtime)
            yield
            stop.set()

    async def shutdown_trigger() -> None:
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                """The first SIGTERM/SIGINT drains: no new requests (503), the ones in flight get
                up to --shutdown-timeout to finish; a second signal stops at once."""
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        break
                    async with anyio.create_task_group() as drain:

                        async def drain_then_stop() -> None:
                            await rt.drain(cfg.shutdown_timeout)
                            drain.cancel_scope.cancel()

                        drain.start_soon(drain_then_stop)
                        async for _ in signals:
                            log.warning("stopping_now", reason="second signal")
                            drain.cancel_scope.cancel()
                stop.set()

            tg.start_soon(on_signal)
            await stop.wait()
            tg.cancel_scope.cancel()

    # what each socket is bound to, read before it is handed over (--port 0: the port chosen)
    addresses = [sock.getsockname()[:2] for sock in listeners] or [(host, port) for host in hosts]
    hc = Config()
    hc.bind = [f"fd://{sock.detach()}" for sock in listeners] or [_address(host, port) for host in hosts]
    hc.accesslog = None
    hc.errorlog = None
    hc.graceful_timeout = 3.0
    # What a slow or silent client may hold: a connection without a whole request head, or idle
    # between requests, KEEP_ALIVE_TIMEOUT_S; a TLS handshake at most --timeout (and 60 s); a
    # request head at most Hypercorn's 16 KiB; a request body --timeout (ClientDeadlines).
    # Hypercorn's per-read socket timeout (read_timeout) stays off: it would also cut a stream
    # whose client listens in silence.
    hc.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
    hc.ssl_handshake_timeout = min(60, timeout_s)
    if ssl is not None:
        hc.certfile, hc.keyfile = ssl
    for host, bound in addresses:
        if models is None:
            log.info("listening", host=host, port=bound, model=str(cfg.model))
        else:
            log.info("listening", host=host, port=bound, models=len(models.views()), mode="router")
    # an ASGI app; hypercorn's stub names its own scope types
    app: Any = ClientDeadlines(
        build_app(rt, lifespan=lifespan) if isinstance(rt, Runtime) else build_router_app(rt, cfg, lifespan=lifespan),
        timeout_s,
    )
    await hypercorn_serve(app, hc, shutdown_trigger=shutdown_trigger)
    if any(isinstance(exc, ConfigError) for exc in failed):
        return 2  # found only while loading (a model or LoRA file llama.cpp refuses): as a bad flag
    return 1 if failed else 0


def dashed(word: str) -> str:
    """A long option with ``_`` for ``-`` (``--backend_sampling``), as llama-server reads it: its
    parser replaces every underscore of a ``--`` word; a value after ``=`` is left as it is."""
    if not word.startswith("--"):
        return word
    name, eq, value = word.partition("=")
    return name.replace("_", "-") + eq + value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llamactor", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = _serve_parser(sub)
    _worker_parser(sub)
    from llamactor.ops.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from llamactor.ops.replay.cli import add_replay_parser

    add_replay_parser(sub)
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["serve"]:
        words = ["serve", *map(dashed, words[1:])]
    args = parser.parse_args(words)
    if args.command == "bench":
        from llamactor.ops.bench.cli import run_bench

        return run_bench(args)
    if args.command == "replay":
        from llamactor.ops.replay.cli import run_replay

        return run_replay(args)
    if args.command == "worker":
        configure_logging()
        return run_worker(args)
    cliargs.apply_env(serve_parser, args, cliflags.GROUPS)
    try:
        opts = replace(serve_options(args), argv=tuple(words[1:]))
        if opts.version:
            print(
                f"llamactor {metadata.version('llamactor')} (llama-cpp-python {metadata.version('llama_cpp_python')})"
            )
            return 0
        if opts.completion_bash:  # as llama-server: the script, exit 0, nothing loaded
            print(completion_script(), end="")
            return 0
        opts = replace(opts, config=replace(opts.config, log_format=opts.log_format))  # the engine's logs too
        configure_from(opts.config)
        models = router_models(opts) if opts.router else None
        cfg = opts.config if models is not None else opts.config.validated()  # the router loads no model itself
        for flag, why in opts.ignored:
            log.info("flag_ignored", flag=flag, reason=why)
        if _gpu_layers_ignored(cfg):
            log.info("flag_ignored", flag="--n-gpu-layers", reason="no GPU on this machine: the layers stay on the CPU")
        if opts.list_devices:
            from llamactor.runtime.engine import rpc

            rpc.add_servers(list(cfg.rpc_servers))
            for name, description in rpc.list_devices():
                print(f"{name}: {description}")
            return 0
        if cfg.rpc_servers or cfg.devices:
            from llamactor.runtime.service.inprocess import load_options

            load_options(cfg)  # register workers and check device names now: errors before listening
        if vertex.enabled():  # Vertex AI's container contract: AIP_HTTP_PORT overrides --port, as llama-server
            opts = replace(opts, port=vertex.port(opts.port))
        listeners = bind_listeners(opts.hosts, opts.port, opts.timeout)  # a port in use: one line, exit 2
    except ConfigError as exc:
        print(f"llamactor: error: {exc}", file=sys.stderr)
        return 2
    ssl = (opts.ssl_cert_file, opts.ssl_key_file) if opts.ssl_cert_file and opts.ssl_key_file else None
    return anyio.run(serve, cfg, opts.hosts, opts.port, ssl, listeners, models, opts.timeout)


if __name__ == "__main__":
    sys.exit(main())
