"""``llamactor bench``: the command line of the benchmark harness (closed-loop users, scheduling
workloads, chat and more traffic shapes).

    llamactor bench --url URL --users K --requests R --npp N --ntg M [--json] [--plot FILE.png]
                    [--api native|openai] [--warmup W] [--sweep users=8,16,32]
                    [--vs URL2 [--pairs 2]] [--slo-ttft-ms 2000] [--slo-itl-ms 150]
                    [--workload closed|mixed|cohort|burst|shared-prefix|chat|poisson]
    llamactor bench --workload random --serve NAME=COMMAND [--serve ...] [--seeds N | --seed S1,S2]
                    [--pairs 3] [--noise-band [--band-out FILE] | --band-file FILE] [--json]

The harness talks to any llama-server-compatible URL, so llama.cpp's own llama-server is
measured by the same code path as llamactor. Modules: ``client`` (HTTP), ``apis`` (wire
dialects), ``phase`` (warm-up, barrier, measured phase), ``loadgen`` (closed loop),
``workloads`` (mixed, cohort), ``traffic`` (burst, shared-prefix, poisson), ``chatload``
(chat), ``latency`` (TTFT, inter-token, goodput via ``slo``), ``compare`` (sweeps, A/B
pairs), ``report`` (table, JSON). ``--workload random`` is its own command line
(``randombench``): drawn workloads (``randomload``, ``randomrun``) on servers the bench
starts (``launch``), seed after seed (``suite``), judged against a noise band (``verdict``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

import anyio

from llamactor.ops.bench.capacity_cli import add_capacity_flags, arrivals_flag, run_capacity_bench
from llamactor.ops.bench.chatload import Chat
from llamactor.ops.bench.compare import Run, pair_ratios, parse_sweep, run_matrix
from llamactor.ops.bench.lengths import DEFAULT_LENGTHS, LengthDist, load_lengths
from llamactor.ops.bench.loadgen import ClosedLoop
from llamactor.ops.bench.plot import PlotUnavailable, require_matplotlib, save_plot
from llamactor.ops.bench.progress import Progress
from llamactor.ops.bench.random.randombench import DEFAULT_RANDOM_PAIRS, add_random_flags, run_random_bench
from llamactor.ops.bench.report import describe, notes, render_ratios, render_runs, to_json
from llamactor.ops.bench.runner import DEFAULT_TIMEOUT_S, Common, Workload
from llamactor.ops.bench.slo import DEFAULT_SLO_ITL_MS, DEFAULT_SLO_TTFT_MS
from llamactor.ops.bench.targets import Target
from llamactor.ops.bench.traffic import DEFAULT_POISSON_REQUESTS, Burst, Poisson, SharedPrefix
from llamactor.ops.bench.workloads import DEFAULT_ARRIVALS_S, DEFAULT_COHORT_NPP, Cohort, Mixed

WORKLOADS = ("closed", "mixed", "cohort", "burst", "shared-prefix", "chat", "poisson", "random")
EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_USAGE = 0, 1, 2


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _seed_list(text: str) -> tuple[int, ...]:
    try:
        seeds = _ints(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or integers separated by commas, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("no seed given")
    return seeds


def _env_api_key() -> str | None:
    """``LLAMA_API_KEY`` as llama-server reads it (keys separated by commas): its first key."""
    keys = [k.strip() for k in os.environ.get("LLAMA_API_KEY", "").split(",") if k.strip()]
    return keys[0] if keys else None


def add_bench_parser(sub: Any) -> None:
    """Add the ``bench`` subcommand to ``llamactor``'s subparsers (called once at start-up)."""
    p = sub.add_parser(
        "bench",
        help="benchmark a llama-server-compatible URL (throughput, TTFT, inter-token gaps)",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--url", default=None, help="server A, e.g. http://127.0.0.1:8080 (required, but for --workload random --serve)"
    )
    p.add_argument("--vs", metavar="URL2", default=None, help="server B: run A and B alternately, print B/A")
    p.add_argument(
        "--api-key",
        metavar="KEY",
        default=_env_api_key(),
        help="sent as 'Authorization: Bearer KEY' to every server (default: $LLAMA_API_KEY, its first key)",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=None,
        help=f"A-B repetitions per sweep point (default 1; random: rounds over every server, {DEFAULT_RANDOM_PAIRS})",
    )
    p.add_argument("--workload", choices=WORKLOADS, default="closed")
    p.add_argument(
        "--api",
        choices=("native", "openai", "chat"),
        default=None,
        help="native: POST /completion (default); openai: POST /v1/completions; chat: POST "
        "/v1/chat/completions (random only; there it overrides the drawn API)",
    )
    p.add_argument(
        "--users",
        type=int,
        default=None,
        help="concurrent users (closed 8, burst 32, shared-prefix 32); chat: turns in flight (8)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per user (closed 4, burst 2, shared-prefix 2); poisson: requests in all (64)",
    )
    p.add_argument(
        "--npp",
        type=int,
        default=None,
        help="prompt tokens per request (closed 128, mixed streams 32, burst 1000); shared-prefix: the "
        "distinct suffix (32); chat: new user text per turn (64); poisson: same as fixed:N",
    )
    p.add_argument(
        "--ntg",
        type=int,
        default=None,
        help="tokens generated per request (closed 128, mixed 192, cohort 64, burst/shared-prefix/chat 64)",
    )
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds, one short request per user (0: none)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument(
        "--seed",
        type=_seed_list,
        default=None,
        help="prompt seed (default 0); random: the workload's seed, or seeds S1,S2,... (default: one picked at random)",
    )
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds before a request fails")
    p.add_argument("--sweep", default=None, metavar="NAME=V1,V2", help="e.g. users=8,16,32")
    p.add_argument("--streams", type=int, default=4, help="mixed: generating streams")
    p.add_argument(
        "--arrivals",
        type=arrivals_flag,
        default=None,
        metavar="S1,S2|PROCESS",
        help="mixed: arrival times of the long prompts, seconds after the start (1.0,2.5,4.0); "
        "capacity: poisson (default) or bursty",
    )
    p.add_argument("--arrival-npp", type=int, default=768, help="mixed: prompt tokens of each arrival")
    p.add_argument("--arrival-ntg", type=int, default=16, help="mixed: tokens generated by each arrival")
    p.add_argument(
        "--cohort-npp",
        type=_ints,
        default=DEFAULT_COHORT_NPP,
        metavar="N1,N2",
        help="cohort: prompt lengths, all arriving together",
    )
    p.add_argument(
        "--prefix-npp",
        type=int,
        default=None,
        help="shared-prefix: tokens of the common prefix (1000); chat: system text (200)",
    )
    p.add_argument("--conversations", type=int, default=None, help="chat: conversations (24)")
    p.add_argument("--turns", type=int, default=None, help="chat: turns per conversation (4)")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="poisson: mean arrivals per second; capacity: the search's first rate (default: from the "
        "unloaded latency)",
    )
    p.add_argument(
        "--npp-dist",
        default=None,
        metavar="DIST",
        help="poisson: prompt lengths, fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA (fixed:128)",
    )
    p.add_argument("--ntg-dist", default=None, metavar="DIST", help="poisson: output lengths, as --npp-dist")
    p.add_argument(
        "--lengths",
        default=None,
        metavar="FILE.jsonl",
        help='poisson: one {"npp": N, "ntg": M} (optionally "at": seconds) per line, cycled',
    )
    p.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=DEFAULT_SLO_TTFT_MS,
        help="goodput: a good request's time to first token at most this (default %(default)s)",
    )
    p.add_argument(
        "--slo-itl-ms",
        type=float,
        default=DEFAULT_SLO_ITL_MS,
        help="goodput: ... and its time per output token after the first (default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="also draw the runs into a PNG (sweeps, mixed workload, capacity curves; needs matplotlib: "
        "pip install 'llamactor[plot]')",
    )
    add_random_flags(p)
    add_capacity_flags(p)


def _given(a: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The flags among ``names`` given on the command line (the workload's default otherwise)."""
    return {n: getattr(a, n) for n in names if getattr(a, n) is not None}


def _dist(a: argparse.Namespace, which: str) -> LengthDist | None:
    """``--npp-dist``/``--ntg-dist`` (or ``--npp N`` as ``fixed:N``) for poisson."""
    spec, fixed = getattr(a, f"{which}_dist"), getattr(a, which)
    flag = f"--{which}-dist" if spec is not None else f"--{which}"
    if spec is not None and fixed is not None:
        raise ValueError(f"--{which} and --{which}-dist exclude each other (--{which} N is --{which}-dist fixed:N)")
    if (spec is not None or fixed is not None) and a.lengths is not None:
        raise ValueError(f"--lengths gives the lengths; drop {flag}")
    if spec is not None:
        return LengthDist.parse(spec, flag)
    return LengthDist.parse(f"fixed:{fixed}", flag) if fixed is not None else None


def _arrival_times(arrivals: tuple[float, ...] | str | None) -> tuple[float, ...]:
    """``--arrivals`` for the mixed workload: times, not a process name (that is --capacity's)."""
    if isinstance(arrivals, str):
        raise ValueError(f"--arrivals {arrivals} is an arrival process, for --capacity; mixed takes times S1,S2,...")
    return DEFAULT_ARRIVALS_S if arrivals is None else arrivals


def _swept_rate(sweep: str | None) -> float | None:
    """A stand-in for a missing ``--rate`` under ``--sweep rate=...`` (every point sets its own)."""
    name, _, values = (sweep or "").partition("=")
    if name.strip() != "rate":
        return None
    try:
        return float(values.split(",")[0])
    except ValueError:
        return 1.0  # parse_sweep reports the bad values, naming --sweep


def workload_from_args(a: argparse.Namespace) -> Workload[Any]:
    """The workload ``a`` asks for; a ValueError naming the flag for bad settings."""
    if a.api == "chat":
        raise ValueError("--api chat is for --workload random only")
    if a.seed is not None and len(a.seed) > 1:
        raise ValueError("--seed takes one seed; several (S1,S2,...) only with --workload random")
    common = Common(
        api=a.api or "native",
        warmup=a.warmup,
        temperature=a.temperature,
        seed=a.seed[0] if a.seed else 0,
        timeout_s=a.timeout,
        slo_ttft_ms=a.slo_ttft_ms,
        slo_itl_ms=a.slo_itl_ms,
        api_key=a.api_key,
    )
    sizes = _given(a, "npp", "ntg")
    if a.workload == "mixed":
        return Mixed(
            streams=a.streams,
            arrival_npp=a.arrival_npp,
            arrival_ntg=a.arrival_ntg,
            arrivals_s=_arrival_times(a.arrivals),
            common=common,
            **sizes,
        )
    if a.workload == "cohort":
        sizes.pop("npp", None)
        return Cohort(npps=a.cohort_npp, common=common, **sizes)
    if a.workload == "burst":
        return Burst(common=common, **sizes, **_given(a, "users", "requests"))
    if a.workload == "shared-prefix":
        return SharedPrefix(common=common, **sizes, **_given(a, "users", "requests", "prefix_npp"))
    if a.workload == "chat":
        return Chat(common=common, **sizes, **_given(a, "users", "prefix_npp", "conversations", "turns"))
    if a.workload == "poisson":
        return Poisson(
            rate=a.rate if a.rate is not None else _swept_rate(a.sweep),
            requests=a.requests if a.requests is not None else DEFAULT_POISSON_REQUESTS,
            npp_dist=_dist(a, "npp") or DEFAULT_LENGTHS,
            ntg_dist=_dist(a, "ntg") or DEFAULT_LENGTHS,
            lengths_file=a.lengths,
            lengths=load_lengths(a.lengths) if a.lengths is not None else None,
            common=common,
        )
    return ClosedLoop(common=common, **sizes, **_given(a, "users", "requests"))


def _validate(workload: Workload[Any]) -> None:
    common = workload.common
    for flag, ms in (("--slo-ttft-ms", common.slo_ttft_ms), ("--slo-itl-ms", common.slo_itl_ms)):
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"{flag} must be a number of milliseconds > 0, got {ms}")
    for name in (
        "users",
        "requests",
        "npp",
        "ntg",
        "streams",
        "arrival_npp",
        "arrival_ntg",
        "prefix_npp",
        "conversations",
        "turns",
    ):
        value = getattr(workload, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if getattr(workload, "npps", None) is not None and min(workload.npps, default=0) < 1:  # type: ignore[attr-defined]
        raise ValueError("--cohort-npp needs one or more positive prompt lengths")


def run_bench(args: argparse.Namespace) -> int:
    """Run what ``args`` asks for and print the report; the exit status is 1 if any request failed."""
    if args.workload == "random":
        return run_random_bench(args)
    if args.capacity:
        return run_capacity_bench(args)
    try:
        if args.url is None:
            raise ValueError("--url is required (--serve starts servers for --workload random only)")
        if args.serve:
            raise ValueError("--serve is for --workload random only; give a running server with --url")
        workload = workload_from_args(args)
        _validate(workload)
        points = parse_sweep(args.sweep, workload) if args.sweep else [(None, workload)]
        pairs = 1 if args.pairs is None else args.pairs
        if pairs < 1:
            raise ValueError(f"--pairs must be at least 1, got {pairs}")
        if args.plot:
            require_matplotlib()  # before any request: a missing extra costs no benchmark
    except (ValueError, PlotUnavailable) as exc:
        print(f"llamactor bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    targets = [Target("A", args.url, role="reference")] + ([Target("B", args.vs)] if args.vs else [])
    runs: list[Run] = anyio.run(run_matrix, targets, points, pairs, Progress)  # type: ignore[arg-type]
    ratios = pair_ratios(runs) if args.vs else []
    if args.json:
        json.dump(to_json(runs, ratios), sys.stdout, indent=2)
        print()
    else:
        print(describe(workload, targets, args.sweep))
        print(render_runs(runs))
        if ratios:
            print()
            print(render_ratios(ratios))
        for line in notes(runs):
            print(f"note: {line}")
    if args.plot:
        print(f"plot written to {save_plot(runs, args.plot)}", file=sys.stderr)
    return EXIT_FAILED_REQUESTS if any(r.result.failed for r in runs) else EXIT_OK


__all__ = ["add_bench_parser", "run_bench", "workload_from_args"]
