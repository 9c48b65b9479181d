"""Random workloads on several servers, seed after seed (``llamactor bench --workload random``).

Per seed: draw the workload (``ops.bench.random.randomload``); start every server the bench owns with the
drawn ``-np`` and ``-c``, one after another, each on a free loopback port (``ops.bench.launch``), or
use the fixed ``--url`` servers; probe the prompt vocabulary once, on the first server; for an
open-loop workload, calibrate the first server's capacity (a short closed loop of the drawn mean
lengths, cached per seed and server configuration); then ``pairs`` rounds, each running the
workload on every server in turn (A, B, C, A, B, C, ...), one server under load at a time, with
the same prompts for every server of a round; then stop every server started.

The first server is the reference. ``noise_band`` adds a second instance of it (the same
command, another port) right after it, whose ratio to the reference is the noise band
(``ops.bench.random.verdict``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio

from llamactor.ops.bench.apis import Vocabulary, make_api
from llamactor.ops.bench.client import BenchClient
from llamactor.ops.bench.launch import DEFAULT_START_TIMEOUT_S, ServerCommand, serving
from llamactor.ops.bench.loadgen import ClosedLoop
from llamactor.ops.bench.phase import OnRecord, measure, warm_up
from llamactor.ops.bench.progress import NoProgress, Progress
from llamactor.ops.bench.prompts import PromptSource, run_seed
from llamactor.ops.bench.random.randomfamily import DEFAULT_FAMILY, Family
from llamactor.ops.bench.random.randomload import CALIBRATION_USERS, draw
from llamactor.ops.bench.random.randomrun import DEFAULT_SLO_ITL_PCT, RandomResult, RandomRun
from llamactor.ops.bench.random.randomworkload import RandomWorkload
from llamactor.ops.bench.runner import Common, probe_prompt_ids, run_workload
from llamactor.ops.bench.targets import Target

CALIBRATION_REQUESTS = 2  # per user, unless that is estimated to take longer than:
CALIBRATION_MAX_S = 10.0  # ... on the speed model; then one request per user
CALIBRATION_SEED_POINT = 1 << 20  # prompt seeds of calibration runs: apart from the pairs'
SELF_SUFFIX = "~self"

Say = Callable[[str], None]
ProgressFactory = Callable[[str, int], Progress]


def targets_of(commands: list[ServerCommand], urls: list[str], noise_band: bool) -> list[Target]:
    """The servers in run order: the reference, its second instance (noise band), the others."""
    if commands and urls:
        raise ValueError("--serve and --url/--vs exclude each other with --workload random")
    if not commands and not urls:
        raise ValueError("--workload random needs servers: --serve NAME=COMMAND (repeatable) or --url URL")
    if noise_band and not commands:
        raise ValueError("--noise-band starts a second instance of the first server: it needs --serve")
    names = [c.name for c in commands]
    if len(set(names)) < len(names):
        raise ValueError(f"--serve names must differ, got {', '.join(names)}")
    if any(n.endswith(SELF_SUFFIX) for n in names):
        raise ValueError(f"--serve names ending in {SELF_SUFFIX} are the noise band's second instances")
    if commands:
        ref = commands[0]
        out = [Target(ref.name, role="reference", command=ref)]
        if noise_band:
            twin = ServerCommand(ref.name + SELF_SUFFIX, ref.template)
            out.append(Target(twin.name, role="self", command=twin))
        return out + [Target(c.name, role="other", command=c) for c in commands[1:]]
    return [Target("A", urls[0], role="reference")] + [Target("B", u, role="other") for u in urls[1:]]


class CalibrationCache:
    """Measured capacities by (seed, calibration shape, server configuration), optionally kept in
    a JSON file so a later invocation (a comparison after a band run) offers the same load."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.entries: dict[str, float] = {}
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ValueError(f"--calibration {path}: cannot read it ({exc})") from None
            if not isinstance(data, dict) or not all(isinstance(v, (int, float)) for v in data.values()):
                raise ValueError(f"--calibration {path}: expected an object of capacities")
            self.entries = {str(k): float(v) for k, v in data.items()}

    def get(self, key: str) -> float | None:
        return self.entries.get(key)

    def put(self, key: str, rps: float) -> None:
        self.entries[key] = rps
        if self.path is not None:
            self.path.write_text(json.dumps(self.entries, indent=1, sort_keys=True) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class Calibration:
    server: str
    key: str
    users: int
    requests: int  # per user
    npp: int
    ntg: int
    capacity_rps: float
    cached: bool

    def describe(self) -> str:
        return (
            f"capacity {self.capacity_rps:.3g} req/s on {self.server} ({self.users} users x {self.requests} "
            f"of {self.npp}/{self.ntg} tokens{', cached' if self.cached else ''})"
        )


@dataclass(frozen=True)
class PairRun:
    server: str
    pair: int
    result: RandomResult


@dataclass(frozen=True)
class SeedRun:
    seed: int
    workload: RandomWorkload
    servers: list[dict[str, Any]]  # name, role, url, command (as run)
    calibration: Calibration | None
    runs: list[PairRun] = field(default_factory=list)


@dataclass(frozen=True)
class SuiteConfig:
    targets: list[Target]
    seeds: list[int]
    pairs: int = 3
    family: Family = DEFAULT_FAMILY
    common: Common = Common()
    slo_itl_pct: float = DEFAULT_SLO_ITL_PCT
    api: str | None = None  # overrides the drawn API
    log_dir: Path = Path(".")
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S


def calibration_shape(wl: RandomWorkload, family: Family) -> tuple[int, int, int, int]:
    """(users, requests per user, npp, ntg) of the calibration closed loop."""
    npp, ntg = wl.calibration_lengths()
    users = min(CALIBRATION_USERS, wl.np)
    server_s = npp / family.prompt_tok_s + ntg / family.gen_rate(users)
    requests = CALIBRATION_REQUESTS if users * CALIBRATION_REQUESTS * server_s <= CALIBRATION_MAX_S else 1
    return users, requests, npp, ntg


async def calibrate(
    target: Target,
    url: str,
    wl: RandomWorkload,
    cfg: SuiteConfig,
    ids: list[int],
    cache: CalibrationCache,
    progress: ProgressFactory,
) -> Calibration:
    users, requests, npp, ntg = calibration_shape(wl, cfg.family)
    where = target.command.key(wl.np, wl.ctx) if target.command is not None else f"url={url}"
    key = f"seed={wl.seed} users={users}x{requests} npp={npp} ntg={ntg} {where}"
    cached = cache.get(key)
    if cached is not None:
        return Calibration(target.label, key, users, requests, npp, ntg, cached, True)
    loop = ClosedLoop(users=users, requests=requests, npp=npp, ntg=ntg, common=replace(cfg.common, api="native"))
    res = await run_workload(
        url,
        loop,
        seed=run_seed(wl.seed, CALIBRATION_SEED_POINT, 0),
        prompt_ids=ids,
        progress=progress(f"{target.label} calibration", loop.n_requests),
    )
    if res.ok == 0 or not res.wall_s > 0:
        raise RuntimeError(f"calibration on {target.label} failed: {'; '.join(res.errors) or 'no request completed'}")
    rps = res.ok / res.wall_s
    cache.put(key, rps)
    return Calibration(target.label, key, users, requests, npp, ntg, rps, False)


async def run_random(
    url: str,
    run: RandomRun,
    vocabulary: Vocabulary | None,
    ids: list[int],
    prompt_seed: int,
    progress: Progress | None = None,
    *,
    on_record: OnRecord | None = None,
    stop: anyio.Event | None = None,
) -> RandomResult:
    """Warm up, measure and summarize one run (``runner.run_workload`` with a dialect that may
    need the vocabulary); ``on_record`` and ``stop`` as ``phase.measure`` takes them."""
    common = run.common
    api = make_api(run.workload.api, vocabulary)
    async with BenchClient(url, api, timeout_s=common.timeout_s, api_key=common.api_key) as client:
        warm_jobs, jobs = run.plan(PromptSource(ids, prompt_seed))
        warm = await warm_up(client, warm_jobs, common.temperature)
        phase = await measure(
            client, jobs, common.temperature, progress or NoProgress(), on_record=on_record, stop=stop
        )
    return run.summarize(phase, warmup_failed=sum(not r.ok for r in warm))


@contextlib.asynccontextmanager
async def _servers(cfg: SuiteConfig, wl: RandomWorkload) -> AsyncIterator[list[tuple[Target, str, str]]]:
    """(target, url, how it was started) for every target, started with the drawn sizes."""
    commands = [t.command for t in cfg.targets if t.command is not None]
    if not commands:
        yield [(t, t.url or "", t.url or "") for t in cfg.targets]
        return
    async with serving(commands, np=wl.np, ctx=wl.ctx, log_dir=cfg.log_dir, timeout_s=cfg.start_timeout_s) as up:
        yield [(t, s.url, " ".join(s.argv)) for t, s in zip(cfg.targets, up)]


def needs_text(wl: RandomWorkload) -> bool:
    """Whether the workload sends text (made from token pieces), not only token ids."""
    return wl.api == "chat" or (wl.api == "openai" and wl.later_turns > 0)


async def run_seed_suite(
    seed: int, cfg: SuiteConfig, cache: CalibrationCache, say: Say, progress: ProgressFactory
) -> SeedRun:
    """Everything of one seed, servers started and stopped around it."""
    wl = draw(seed, cfg.family)
    if cfg.api is not None:
        wl = wl.with_api(cfg.api)
    starting = f": starting {len(cfg.targets)} server(s) with -np {wl.np} -c {wl.ctx}" if cfg.targets[0].command else ""
    say(f"seed {seed}{starting}")
    if any(t.command is not None and not t.command.sized for t in cfg.targets):
        say(f"  note: a --serve command without {{np}} and {{ctx}} keeps its own sizes; this seed needs -c {wl.ctx}")
    if any(t.url is not None for t in cfg.targets):
        say(f"  note: fixed servers: this seed needs {wl.slot_context} tokens of context per slot")
    async with _servers(cfg, wl) as up:
        ref_target, ref_url, _ = up[0]
        common = cfg.common
        async with BenchClient(ref_url, "native", timeout_s=common.timeout_s, api_key=common.api_key) as probe:
            vocabulary = await probe.vocabulary()
        if vocabulary is None and needs_text(wl):
            raise RuntimeError(
                f"{ref_target.label} gives no text pieces of tokens (/tokenize with_pieces): "
                f"the {wl.api} dialect cannot be measured on seed {seed}"
            )
        ids = sorted(vocabulary.pieces) if vocabulary is not None else await probe_prompt_ids(ref_url, common.api_key)
        calibration = None
        if wl.open_loop:
            calibration = await calibrate(ref_target, ref_url, wl, cfg, ids, cache, progress)
            say(calibration.describe())
        run = RandomRun(wl, calibration.capacity_rps if calibration else None, cfg.common, cfg.slo_itl_pct)
        out = SeedRun(
            seed,
            wl,
            [{"name": t.label, "role": t.role, "url": url, "command": how} for t, url, how in up],
            calibration,
        )
        for pair in range(cfg.pairs):
            prompt_seed = run_seed(seed, 0, pair)
            for target, url, _ in up:
                label = f"seed {seed} {target.label} pair {pair + 1}/{cfg.pairs}"
                result = await run_random(url, run, vocabulary, ids, prompt_seed, progress(label, run.n_requests))
                out.runs.append(PairRun(target.label, pair, result))
    return out


async def run_suite(
    cfg: SuiteConfig,
    cache: CalibrationCache,
    say: Say,
    progress: ProgressFactory,
    on_seed: Callable[[SeedRun], None] | None = None,
) -> list[SeedRun]:
    """Every seed in turn; ``on_seed`` sees each seed's runs as soon as they are done."""
    done = []
    for seed in cfg.seeds:
        seed_run = await run_seed_suite(seed, cfg, cache, say, progress)
        done.append(seed_run)
        if on_seed is not None:
            on_seed(seed_run)
    return done


__all__ = [
    "SELF_SUFFIX",
    "Calibration",
    "CalibrationCache",
    "PairRun",
    "SeedRun",
    "SuiteConfig",
    "calibrate",
    "calibration_shape",
    "needs_text",
    "run_random",
    "run_suite",
    "targets_of",
]
