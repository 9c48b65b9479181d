"""``llamactor`` command line: ``serve`` (the bundled server), ``bench``, ``replay`` and ``worker``.

``serve`` takes llama-server's command line: the flag table (what is supported, ignored or
refused, and why) is ``runtime.cliflags``; ``runtime.serveoptions`` turns it into a config, and
``runtime.server`` serves it. This module is the commands: their parsers, and what each runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from importlib import metadata
from typing import Any

import anyio
import structlog

from llamactor.protocol.errors import ConfigError
from llamactor.runtime import cliargs, cliflags
from llamactor.runtime.http import vertex
from llamactor.runtime.serveoptions import DEFAULT_HOST, ServeOptions, dashed, serve_options
from llamactor.runtime.server import bind_listeners, serve
from llamactor.runtime.service.config import RuntimeConfig, route_prefix
from llamactor.runtime.service.logging import configure_from, configure_logging
from llamactor.runtime.service.modelset import ModelSet

log = structlog.get_logger("llamactor.cli")

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
            from llamactor.runtime.service.engineoptions import load_options

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
