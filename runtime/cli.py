"""``llamactor`` command line: ``serve`` (the bundled server), ``bench`` and ``worker``.

Flags follow llama-server's names (-m, -c, -np, -b, -ub, -t, -ngl, --host, --port, ...), and
each can also come from its ``LLAMA_ARG_*`` environment variable, as in llama-server.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import structlog

from llamactor.runtime.service.config import DEFAULT_N_BATCH, DEFAULT_N_CTX, DEFAULT_N_UBATCH, DEFAULT_PARALLEL, DEFAULT_QUEUE_SIZE, RuntimeConfig
from llamactor.protocol.errors import ConfigError
from llamactor.runtime.service.logging import configure_logging

log = structlog.get_logger("llamactor.cli")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
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


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the HTTP server (OpenAI-compatible and llama-server native API)")
    _opt(p, "-m", "--model", env="LLAMA_ARG_MODEL", default=None, help="GGUF path (default: embedded SmolLM2-135M)")
    _opt(p, "-a", "--alias", env="LLAMA_ARG_ALIAS", default=None, help="model id shown by /v1/models")
    _opt(p, "-c", "--ctx-size", env="LLAMA_ARG_CTX_SIZE", type=int, default=DEFAULT_N_CTX, help="total context C")
    _opt(p, "-np", "--parallel", env="LLAMA_ARG_N_PARALLEL", type=int, default=DEFAULT_PARALLEL, help="slots P")
    _opt(p, "-b", "--batch-size", env="LLAMA_ARG_BATCH", type=int, default=DEFAULT_N_BATCH)
    _opt(p, "-ub", "--ubatch-size", env="LLAMA_ARG_UBATCH", type=int, default=DEFAULT_N_UBATCH)
    _opt(p, "-t", "--threads", env="LLAMA_ARG_THREADS", type=int, default=0, help="0 = all cores")
    _opt(p, "-tb", "--threads-batch", env="LLAMA_ARG_THREADS_BATCH", type=int, default=0)
    _opt(p, "-ngl", "--n-gpu-layers", "--gpu-layers", env="LLAMA_ARG_N_GPU_LAYERS", type=int, default=0)
    _opt(p, "--no-mmap", env="LLAMA_ARG_NO_MMAP", flag=True)
    _opt(p, "--host", env="LLAMA_ARG_HOST", default=DEFAULT_HOST)
    _opt(p, "--port", env="LLAMA_ARG_PORT", type=int, default=DEFAULT_PORT)
    _opt(p, "--metrics", env="LLAMA_ARG_ENDPOINT_METRICS", flag=True, help="accepted; /metrics is always on")
    _opt(p, "--api-key", env="LLAMA_API_KEY", default=None)
    _opt(p, "--slot-save-path", env="LLAMA_ARG_SLOT_SAVE_PATH", default=None)
    _opt(p, "--pipeline-groups", env="LLAMA_ARG_PIPELINE_GROUPS", type=int, default=1,
         help="N contexts over one model's weights (SPEC section 3)")
    _opt(p, "-kvu", "--kv-unified", env="LLAMA_ARG_KV_UNIFIED", flag=True)
    _opt(p, "--scheduler", env="LLAMACTOR_SCHEDULER", default="stall-free", help="policy name or module:Class")
    _opt(p, "--prefill-budget", env="LLAMACTOR_PREFILL_BUDGET", type=int, default=0,
         help="stall-free: prompt tokens per step while streams generate")
    _opt(p, "--target-itl-ms", env="LLAMACTOR_TARGET_ITL_MS", type=float, default=0.0,
         help="stall-free: derive the prompt budget from this inter-token target")
    _opt(p, "--cohort-max-generate-ms", env="LLAMACTOR_COHORT_MAX_GENERATE_MS", type=float, default=0.0,
         help="cohort: hand the engine to the next cohort's prefill after this long (0 = drain)")
    _opt(p, "--queue-size", env="LLAMACTOR_QUEUE_SIZE", type=int, default=DEFAULT_QUEUE_SIZE)
    _opt(p, "-n", "--n-predict", env="LLAMA_ARG_N_PREDICT", type=int, default=-1)
    _opt(p, "--profile", env="LLAMACTOR_PIPE_PROF", flag=True)
    _opt(p, "--rpc", env="LLAMA_ARG_RPC", default="", help="comma-separated HOST:PORT of ggml-rpc workers")
    _opt(p, "-dev", "--device", env="LLAMA_ARG_DEVICE", default="",
         help="comma-separated devices for the split, e.g. RPC0,CPU (list the local CPU last)")
    _opt(p, "-ts", "--tensor-split", env="LLAMA_ARG_TENSOR_SPLIT", default="", help="layer shares, e.g. 3,1")
    _opt(p, "-sm", "--split-mode", env="LLAMA_ARG_SPLIT_MODE", default="layer", help="none | layer | row")
    _opt(p, "-fa", "--flash-attn", env="LLAMA_ARG_FLASH_ATTN", default="on", choices=["on", "off", "auto"])
    _opt(p, "--list-devices", env="LLAMACTOR_LIST_DEVICES", flag=True, help="print the devices and exit")
    _opt(p, "--log-format", env="LLAMACTOR_LOG_FORMAT", default="auto", choices=["auto", "json", "text"])


def _worker_parser(sub: Any) -> None:
    p = sub.add_parser("worker", help="run a ggml-rpc worker that serves layers to a llamactor server")
    _opt(p, "--host", env="LLAMACTOR_WORKER_HOST", default=DEFAULT_HOST)
    _opt(p, "--port", env="LLAMACTOR_WORKER_PORT", type=int, default=50052)
    _opt(p, "-t", "--threads", env="LLAMA_ARG_THREADS", type=int, default=0, help="0 = all cores")
    _opt(p, "--device", env="LLAMA_ARG_DEVICE", default="CPU")
    _opt(p, "--cache-dir", env="LLAMACTOR_WORKER_CACHE", default=None, help="local tensor cache directory")


def _split_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in _split_list(text))
    except ValueError:
        raise ConfigError(f"--tensor-split must be comma-separated numbers, got {text!r}") from None


def run_worker(a: argparse.Namespace) -> int:
    from llamactor.runtime.engine import rpc

    threads = a.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if a.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("worker_exposed", host=a.host,
                    warning="the ggml-rpc protocol has no authentication: anyone who can reach this port "
                            "can use this machine; bind to a private network only")
    log.info("worker_listening", host=a.host, port=a.port, threads=threads, device=a.device)
    try:
        rpc.serve_worker(a.host, a.port, threads, a.device, a.cache_dir)
    except ConfigError as exc:
        print(f"llamactor: error: {exc}", file=sys.stderr)
        return 2
    return 0


def config_from_args(a: argparse.Namespace) -> RuntimeConfig:
    kw: dict[str, Any] = dict(
        model=a.model, alias=a.alias, n_ctx=a.ctx_size, parallel=a.parallel, n_batch=a.batch_size,
        n_ubatch=a.ubatch_size, threads_batch=a.threads_batch, n_gpu_layers=a.n_gpu_layers,
        use_mmap=not a.no_mmap, api_key=a.api_key, slot_save_path=a.slot_save_path,
        pipeline_groups=a.pipeline_groups, kv_unified=a.kv_unified, scheduler=a.scheduler,
        queue_size=a.queue_size, prefill_budget=a.prefill_budget, target_itl_ms=a.target_itl_ms,
        cohort_max_generate_ms=a.cohort_max_generate_ms, rpc_servers=_split_list(a.rpc),
        devices=_split_list(a.device), tensor_split=_float_list(a.tensor_split), split_mode=a.split_mode,
        flash_attn=a.flash_attn, n_predict_max=a.n_predict, profile=a.profile,
    )
    if a.threads > 0:
        kw["threads"] = a.threads
    return RuntimeConfig(**kw)


async def serve(cfg: RuntimeConfig, host: str, port: int) -> int:
    """Serve until SIGINT/SIGTERM. /health answers 503 while the model loads (API-1)."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    from llamactor.runtime.api import Runtime
    from llamactor.runtime.http.app import build_app

    rt = Runtime(cfg)
    stop = anyio.Event()
    failed: list[BaseException] = []

    async def run_runtime() -> None:
        try:
            async with rt:
                await stop.wait()
        except Exception as exc:  # noqa: BLE001 - a load failure ends the server with its message
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
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        break
                stop.set()

            tg.start_soon(on_signal)
            await stop.wait()
            tg.cancel_scope.cancel()

    hc = Config()
    hc.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    hc.accesslog = None
    hc.errorlog = None
    hc.graceful_timeout = 3.0
    log.info("listening", host=host, port=port, model=str(cfg.model))
    app: Any = build_app(rt, lifespan=lifespan)  # an ASGI app; hypercorn's stub names its own scope types
    await hypercorn_serve(app, hc, shutdown_trigger=shutdown_trigger)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llamactor", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _worker_parser(sub)
    from llamactor.ops.bench import add_bench_parser

    add_bench_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "bench":
        from llamactor.ops.bench import run_bench

        return run_bench(args)
    if args.command == "worker":
        configure_logging()
        return run_worker(args)
    configure_logging(json={"auto": None, "json": True, "text": False}[args.log_format])
    try:
        cfg = config_from_args(args).validated()
        if args.list_devices:
            from llamactor.runtime.engine import rpc

            rpc.add_servers(list(cfg.rpc_servers))
            for name, description in rpc.list_devices():
                print(f"{name}: {description}")
            return 0
        if cfg.rpc_servers or cfg.devices:
            from llamactor.runtime.service.core import load_options

            load_options(cfg)  # register workers and check device names now: errors before listening
    except ConfigError as exc:
        print(f"llamactor: error: {exc}", file=sys.stderr)
        return 2
    return anyio.run(serve, cfg, args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
