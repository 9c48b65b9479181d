"""``llamactor bench --workload random``: the command line of the random-workload suite.

    llamactor bench --workload random --serve NAME=COMMAND [--serve NAME2=COMMAND2 ...]
                    [--seed S | --seed S1,S2,... | --seeds N] [--pairs 3] [--noise-band]
                    [--band-file FILE | --band-out FILE] [--calibration FILE] [--family JSON]
                    [--slo-ttft-ms 2000] [--slo-itl-ms 150] [--slo-itl-pct 90] [--json]

COMMAND is a template with ``{port}``, ``{np}`` and ``{ctx}``; the first server is the reference.
Text goes to stdout (per seed: its one-line description and a row per server; then the
summary); progress lines go to stderr. ``--json`` prints everything as one JSON document instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio

from llamactor.ops.bench.compare import Run
from llamactor.ops.bench.launch import DEFAULT_START_TIMEOUT_S, ServerCommand, ServerStartError
from llamactor.ops.bench.progress import Progress
from llamactor.ops.bench.random.randomfamily import DEFAULT_FAMILY, Family
from llamactor.ops.bench.random.randomrun import DEFAULT_SLO_ITL_PCT
from llamactor.ops.bench.random.suite import CalibrationCache, SeedRun, SuiteConfig, run_suite, targets_of
from llamactor.ops.bench.random.verdict import (
    METRICS,
    Band,
    SeedTable,
    default_band,
    measure_band,
    render_seed,
    render_summary,
    seed_table,
    table_json,
    tally,
)
from llamactor.ops.bench.report import notes, plain
from llamactor.ops.bench.runner import Common
from llamactor.ops.bench.targets import Target

EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # as a shell reports Ctrl-C
DEFAULT_RANDOM_PAIRS = 3
SEED_RANGE = 1_000_000  # seeds picked at random are below this (short to type back)
BAND_KIND = "llamactor-bench-noise-band"


def add_random_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``--workload random`` (called once, by ``bench.add_bench_parser``)."""
    g = p.add_argument_group("random workloads (--workload random)")
    g.add_argument(
        "--serve",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="a server the bench starts per seed (repeatable; the first is the reference); COMMAND takes "
        "{port}, {np} and {ctx}, e.g. default='llamactor serve -m M --port {port} -np {np} -c {ctx}'",
    )
    g.add_argument("--seeds", type=int, default=None, metavar="N", help="N seeds picked at random (printed); default 1")
    g.add_argument(
        "--noise-band",
        action="store_true",
        help="also run the first server against a second instance of itself on every seed: the band of ties",
    )
    g.add_argument("--band-file", default=None, metavar="FILE", help="reuse a band written by --band-out")
    g.add_argument("--band-out", default=None, metavar="FILE", help="with --noise-band: write the band measured")
    g.add_argument(
        "--slo-itl-pct",
        type=float,
        metavar="P",
        default=DEFAULT_SLO_ITL_PCT,
        help="goodput, percentile form: a request's own inter-token gaps at this percentile must meet "
        "--slo-itl-ms (default %(default)g)",
    )
    g.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="cache of measured capacities (JSON), read and extended: the same seed offers the same load later",
    )
    g.add_argument(
        "--family",
        default=None,
        metavar="JSON|FILE",
        help='bounds of the draw overriding the defaults, e.g. \'{"npp": [16, 64], "nps": [2, 4]}\'',
    )
    g.add_argument(
        "--serve-timeout",
        type=float,
        default=DEFAULT_START_TIMEOUT_S,
        metavar="S",
        help="seconds a started server has to answer /health (default %(default)g)",
    )
    g.add_argument("--serve-logs", default=None, metavar="DIR", help="keep the started servers' logs in DIR")


def _family(spec: str | None) -> Family:
    if spec is None:
        return DEFAULT_FAMILY
    text = spec if spec.lstrip().startswith("{") else None
    if text is None:
        try:
            text = Path(spec).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--family {spec}: cannot read it ({exc})") from None
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--family: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError("--family: expected a JSON object")
    try:
        return Family.from_dict(obj)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--family: {exc}") from None


def pick_seeds(given: tuple[int, ...] | None, count: int | None) -> tuple[list[int], bool]:
    """The seeds to run and whether they were picked at random."""
    if given:
        if count is not None and count != len(given):
            raise ValueError(f"--seed lists {len(given)} seed(s) but --seeds says {count}; give one of them")
        return list(given), False
    n = 1 if count is None else count
    if n < 1:
        raise ValueError(f"--seeds must be at least 1, got {n}")
    rng = random.SystemRandom()
    return sorted(rng.sample(range(SEED_RANGE), n)), True


def load_band(path: str) -> Band:
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--band-file {path}: cannot read it ({exc})") from None
    return Band.from_json(obj.get("band") if isinstance(obj, dict) and obj.get("kind") == BAND_KIND else obj, path)


def config_from_args(a: argparse.Namespace) -> tuple[SuiteConfig, Band | None, bool]:
    """The suite ``a`` asks for, the band given by file (if any) and whether the seeds were
    picked at random; a ValueError naming the flag for bad settings."""
    commands = [ServerCommand.parse(text) for text in a.serve]
    urls = [u for u in (a.url, a.vs) if u]
    targets = targets_of(commands, urls, a.noise_band)
    if a.band_file and a.noise_band:
        raise ValueError("--band-file and --noise-band exclude each other: one gives the band, the other measures it")
    if a.band_out and not a.noise_band:
        raise ValueError("--band-out writes the band --noise-band measures: add --noise-band")
    if not (0 < a.slo_itl_pct <= 100):
        raise ValueError(f"--slo-itl-pct must be within (0, 100], got {a.slo_itl_pct}")
    for flag, ms in (("--slo-ttft-ms", a.slo_ttft_ms), ("--slo-itl-ms", a.slo_itl_ms)):
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"{flag} must be a number of milliseconds > 0, got {ms}")
    pairs = DEFAULT_RANDOM_PAIRS if a.pairs is None else a.pairs
    if pairs < 1:
        raise ValueError(f"--pairs must be at least 1, got {pairs}")
    if a.serve_timeout <= 0:
        raise ValueError(f"--serve-timeout must be > 0, got {a.serve_timeout}")
    seeds, picked = pick_seeds(a.seed, a.seeds)
    band = load_band(a.band_file) if a.band_file else None
    common = Common(
        api="native",
        warmup=a.warmup,
        temperature=a.temperature,
        timeout_s=a.timeout,
        slo_ttft_ms=a.slo_ttft_ms,
        slo_itl_ms=a.slo_itl_ms,
        api_key=a.api_key,
    )
    cfg = SuiteConfig(
        targets=targets,
        seeds=seeds,
        pairs=pairs,
        family=_family(a.family),
        common=common,
        slo_itl_pct=a.slo_itl_pct,
        api=a.api,
    )
    return cfg, band, picked


# ---- output ----------------------------------------------------------------------------------


def _table(seed_run: SeedRun) -> SeedTable:
    figs = {(r.server, r.pair): r.result.figures() for r in seed_run.runs}
    return seed_table(seed_run.seed, [s["name"] for s in seed_run.servers], figs)


def render_seed_run(seed_run: SeedRun) -> str:
    table = _table(seed_run)
    extra: dict[str, dict[str, Any]] = {}
    for r in seed_run.runs:
        e = extra.setdefault(r.server, {"ok": 0, "failed": 0})
        e["ok"] += r.result.ok
        e["failed"] += r.result.failed
    head = [seed_run.workload.summary()]
    if seed_run.calibration is not None:
        head.append("  " + seed_run.calibration.describe())
    return "\n".join([*head, render_seed(table, extra)])


def _compared(targets: list[Target]) -> list[str]:
    return [t.label for t in targets if t.role == "other"]


def _run_notes(seed_runs: list[SeedRun]) -> list[str]:
    """``report.notes`` of every run (failed requests, cross-check, a busy client, ...)."""
    out = []
    for sr in seed_runs:
        targets = {s["name"]: Target(s["name"], s["url"], role=s["role"]) for s in sr.servers}
        runs = [Run(targets[r.server], f"seed {sr.seed}", r.pair, r.result) for r in sr.runs]
        out += notes(runs)
    return out


def to_json(
    cfg: SuiteConfig, seed_runs: list[SeedRun], band: Band, tallies: dict[str, Any], picked: bool
) -> dict[str, Any]:
    tables = [_table(sr) for sr in seed_runs]
    return {
        "reference": cfg.targets[0].label,
        "servers": [
            {"name": t.label, "role": t.role, "template": t.command.template if t.command else None, "url": t.url}
            for t in cfg.targets
        ],
        "seeds": [sr.seed for sr in seed_runs],
        "seeds_picked_at_random": picked,
        "pairs": cfg.pairs,
        "slo": {"ttft_ms": cfg.common.slo_ttft_ms, "itl_ms": cfg.common.slo_itl_ms, "itl_pct": cfg.slo_itl_pct},
        "family": plain(cfg.family),
        "metrics": [{"key": m.key, "label": m.label, "lower_is_better": m.lower_is_better} for m in METRICS],
        "per_seed": [
            {
                "seed": sr.seed,
                "workload": sr.workload.describe(),
                "servers": sr.servers,
                "calibration": plain(sr.calibration),
                "runs": [
                    {"server": r.server, "pair": r.pair, "figures": r.result.figures(), "result": plain(r.result)}
                    for r in sr.runs
                ],
                **table_json(t),
            }
            for sr, t in zip(seed_runs, tables)
        ],
        "band": band.to_json(),
        "summary": {s: {k: vars(v) for k, v in per.items()} for s, per in tallies.items()},
        "notes": _run_notes(seed_runs),
    }


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while the suite runs, so the servers it started are
    stopped on the way out, as on Ctrl-C (the main thread only: signals are delivered there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_random_bench(a: argparse.Namespace) -> int:
    """Run the random-workload suite ``a`` asks for and print its report; exit 1 if any request
    failed, 2 for bad settings or a server that would not start."""
    try:
        cfg, band_given, picked = config_from_args(a)
        cache = CalibrationCache(Path(a.calibration) if a.calibration else None)
    except ValueError as exc:
        print(f"llamactor bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    if picked:
        listed = ",".join(str(s) for s in cfg.seeds)
        line = f"seeds {listed} (picked at random; --seed {listed} repeats them)"
        print(line, file=sys.stderr if a.json else sys.stdout, flush=True)

    def show(seed_run: SeedRun) -> None:
        if not a.json:
            print(render_seed_run(seed_run) + "\n", flush=True)

    with tempfile.TemporaryDirectory(prefix="llamactor-bench-") as tmp:
        log_dir = Path(a.serve_logs) if a.serve_logs else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        cfg = dataclasses.replace(cfg, log_dir=log_dir, start_timeout_s=a.serve_timeout)
        try:
            with _sigterm_interrupts():
                seed_runs: list[SeedRun] = anyio.run(run_suite, cfg, cache, say, Progress, show)
        except (ServerStartError, RuntimeError, ValueError) as exc:
            print(f"llamactor bench: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt:
            print("llamactor bench: interrupted; the servers it started are stopped", file=sys.stderr)
            return EXIT_INTERRUPTED
    tables = [_table(sr) for sr in seed_runs]
    twin = next((t.label for t in cfg.targets if t.role == "self"), None)
    band = measure_band(tables, twin) if twin else band_given or default_band()
    if a.band_out and twin:
        ref = cfg.targets[0].command
        doc = {
            "kind": BAND_KIND,
            "band": band.to_json(),
            "reference": ref.template if ref else None,
            "pairs": cfg.pairs,
            "family": plain(cfg.family),
        }
        Path(a.band_out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        say(f"noise band written to {a.band_out}")
    compared = _compared(cfg.targets)
    tallies = tally(tables, compared, band)
    if a.json:
        json.dump(to_json(cfg, seed_runs, band, tallies, picked), sys.stdout, indent=2)
        print()
    else:
        print(render_summary(tables, compared, cfg.targets[0].label, band, tallies))
        for line in _run_notes(seed_runs):
            print(f"note: {line}")
    failed = any(r.result.failed for sr in seed_runs for r in sr.runs)
    return EXIT_FAILED_REQUESTS if failed else EXIT_OK


__all__ = ["add_random_flags", "config_from_args", "pick_seeds", "run_random_bench"]
