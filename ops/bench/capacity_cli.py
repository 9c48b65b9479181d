"""``llamactor bench --capacity``: its flags and the command (the search is ``ops.bench.capacity``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import anyio

from llamactor.ops.bench import capacity
from llamactor.ops.bench.capacity_shapes import ARRIVALS, SHAPES
from llamactor.ops.bench.plot import PlotUnavailable, require_matplotlib, save_capacity_plot
from llamactor.ops.bench.runner import Common

EXIT_OK, EXIT_USAGE = 0, 2
# Flags of other workloads that --capacity does not take (it sets lengths and counts itself)
NOT_FOR_CAPACITY = ("requests", "sweep", "npp", "ntg", "npp_dist", "ntg_dist", "lengths", "users", "serve")


def arrivals_flag(text: str) -> tuple[float, ...] | str:
    """``--arrivals``: an arrival process name (capacity) or times in seconds S1,S2 (mixed)."""
    if text.strip() in ARRIVALS:
        return text.strip()
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {' or '.join(ARRIVALS)} (--capacity) or seconds S1,S2,... (mixed), got {text!r}"
        ) from None


def rates_flag(text: str) -> tuple[float, ...]:
    """``--at-rates``: positive request rates R1,R2,..."""
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        rates = ()
    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected positive rates R1,R2,..., got {text!r}")
    return rates


def add_capacity_flags(p: argparse.ArgumentParser) -> None:
    """The ``--capacity`` options of ``llamactor bench`` (``--arrivals`` is shared with mixed)."""
    p.add_argument(
        "--capacity",
        action="store_true",
        help=f"the highest request rate at which {capacity.TARGET * 100:.0f}%% of requests meet both a TTFT and a TPOT "
        "SLO set from the faster server unloaded (with --vs: both servers and the ratio B/A)",
    )
    p.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default="sharegpt",
        help="capacity: request lengths; "
        + "; ".join(f"{s.name}: {s.about}" for s in SHAPES.values())
        + " (default %(default)s)",
    )
    p.add_argument(
        "--slo-scale",
        type=float,
        default=capacity.DEFAULT_SLO_SCALE,
        help="capacity: SLOs are this many times the unloaded latency (TTFT per prompt token, plus "
        f"{capacity.TTFT_FLOOR_MS:g} ms, and TPOT). Default %(default)s, a common choice in the SLO-scale "
        "literature: a request that waits behind about 4 others of its size still meets it",
    )
    p.add_argument(
        "--capacity-requests",
        type=int,
        default=capacity.DEFAULT_CAPACITY_REQUESTS,
        help="capacity: requests per measured rate (default %(default)s: one shape on two servers in under 10 "
        "minutes with gemma3-270m on 2 cores)",
    )
    p.add_argument(
        "--at-rates",
        type=rates_flag,
        default=(),
        metavar="R1,R2",
        help="capacity: measure only these rates (requests/s), every request of each, A then B at each: "
        "attainment and the front end's share of TTFT at a chosen load, no search",
    )
    p.add_argument(
        "--capacity-precision",
        type=float,
        default=capacity.DEFAULT_PRECISION,
        help="capacity: stop once the bracket's high end is within this fraction of its low end (default %(default)s)",
    )


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with ``args`` for --capacity, or None."""
    if args.url is None:
        return "--capacity needs --url (and --vs URL2 to compare)"
    given = [f"--{n.replace('_', '-')}" for n in NOT_FOR_CAPACITY if getattr(args, n, None)]
    if given:
        return f"--capacity sets lengths and counts itself; drop {', '.join(given)}"
    if isinstance(args.arrivals, tuple):
        return f"--capacity takes --arrivals {' or '.join(ARRIVALS)}, not times"
    if args.seed is not None and len(args.seed) > 1:
        return "--capacity takes one --seed"
    if args.capacity_requests < 1:
        return f"--capacity-requests must be at least 1, got {args.capacity_requests}"
    if not 0 < args.capacity_precision <= 1:
        return f"--capacity-precision must be in (0, 1], got {args.capacity_precision}"
    if not args.slo_scale > 0:
        return f"--slo-scale must be > 0, got {args.slo_scale}"
    if args.rate is not None and not args.rate > 0:
        return f"--rate must be > 0, got {args.rate}"
    return None


def run_capacity_bench(args: argparse.Namespace) -> int:
    """``--capacity``: the search on ``--url`` (and ``--vs``), printed as text or JSON; exit 2 for
    bad options, 1 when a server could not be measured at all."""
    problem = _check(args)
    if problem is None and args.plot:
        try:
            require_matplotlib()  # before any request: a missing extra costs no benchmark
        except PlotUnavailable as exc:
            problem = str(exc)
    if problem is not None:
        print(f"llamactor bench: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    urls = {"A": args.url, **({"B": args.vs} if args.vs else {})}
    common = Common(seed=args.seed[0] if args.seed else 0, timeout_s=args.timeout, api_key=args.api_key)

    async def main() -> dict[str, Any]:
        return await capacity.run_capacity(
            urls,
            shape=args.shape,
            arrivals=args.arrivals or "poisson",
            scale=args.slo_scale,
            requests=args.capacity_requests,
            precision=args.capacity_precision,
            start_rate=args.rate,
            rates=args.at_rates,
            common=common,
            say=lambda line: print(line, file=sys.stderr, flush=True),
        )

    try:
        figures = anyio.run(main)
    except RuntimeError as exc:
        print(f"llamactor bench: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(figures, indent=2) if args.json else render(figures))
    if args.plot:
        print(f"plot written to {save_capacity_plot(figures, args.plot)}", file=sys.stderr)
    return EXIT_OK


def render(figures: dict[str, Any]) -> str:
    """The figures as text: SLOs, capacity per server and the ratio, then the attainment curve."""
    slo, ref = figures["slo"], figures["reference_server"]
    lines = [
        f"capacity: shape {figures['shape']} ({figures['shape_about']}), {figures['arrivals']} arrivals, "
        f"{figures['requests_per_point']} requests a rate, >= {figures['target']:.0%} meeting both SLOs",
        f"SLO ({figures['slo_scale']:g} x the faster unloaded, TTFT of {ref['ttft']}, TPOT of {ref['tpot']}): TTFT <= "
        f"{slo['ttft_floor_ms']:g} ms + {slo['ttft_ms_per_token']:.3f} ms x prompt tokens, "
        f"TPOT <= {slo['tpot_ms']:.1f} ms",
    ]
    for name, srv in figures["servers"].items():
        lo, hi = srv["bracket"]
        if srv["bounded"]:
            where = f"(between {lo:.3g} and {hi:.3g})"
        elif lo is None:
            where = f"(even {hi:.3g} req/s missed the target)"
        else:
            where = f"(at least: no rate up to {lo:.3g} missed the target)"
        lines.append(f"  {name}: {srv['capacity_rps']:.3g} requests/s {where}  {srv['url']}")
    if figures["ratio"] is not None:
        lines.append(f"  B/A capacity: {figures['ratio']:.2f}")
    lines.append("attainment curve (rate req/s: share meeting both SLOs; * stopped once out of reach)")
    for name, curve in figures["curve"].items():
        points = ", ".join(f"{p['rate']:.3g}: {p['attainment']:.2f}{'*' if p['stopped'] else ''}" for p in curve)
        lines.append(f"  {name}: {points}")
    lines.append("client TTFT minus the server's prompt time, ms p50 / p99 (HTTP, template, queues)")
    for name, curve in figures["curve"].items():
        gaps = ", ".join(
            f"{p['rate']:.3g}: {p['front_ms']['p50']:.0f} / {p['front_ms']['p99']:.0f}" for p in curve if p["front_ms"]
        )
        lines.append(f"  {name}: {gaps or '- (no timings.prompt_ms in the answers)'}")
    lines.append(f"took {figures['elapsed_s']:.0f} s")
    return "\n".join(lines)


__all__ = ["add_capacity_flags", "arrivals_flag", "render", "run_capacity_bench"]
