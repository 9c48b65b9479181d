"""``llamactor replay``: pick or write a scheduling policy for your own traffic, offline.

    llamactor serve ... --record-trace run.jsonl      # serve real traffic, then stop the server
    llamactor replay run.jsonl --scheduler continuous --scheduler stall-free \\
                     [--scheduler my_policy:MyPolicy] [--slo-ttft-ms 2000 --slo-itl-ms 150] [--json]
    llamactor replay --workload random --seed 3,17 --costs run.jsonl --scheduler slo ...
    llamactor replay --capacity-run capacity.json --costs run.jsonl [--server B] [--scheduler slo]

Replays the recorded arrivals (submit times, prompt lengths, cached prefixes, tokens generated)
against each policy on a fake engine whose step cost is fitted from the recorded step timings
(``ops.replay.costfit``), and prints per policy the benchmark's figures (``ops.bench.slo``): TTFT mean/p50/p99,
inter-token p50/p99 (ms), makespan (s) and goodput. The first row is what the server recorded.
Without ``--scheduler`` the recorded policy is replayed, which checks the model itself.
``--workload random`` replays the random workloads of ``llamactor bench --workload random``
instead of a recorded run, with the step cost of the ``--costs`` trace (``ops.replay.replayrandom``);
``--capacity-run`` predicts the attainment of a ``bench --capacity --json`` run at each rate it
measured, the front end's measured cost included (``ops.replay.replaycapacity``).
Exit status: 0; 1 when a policy made an invalid plan or left requests unfinished; 2 for bad
input (a missing or foreign file, an unknown scheduler).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from llamactor.actors.policies import resolve_policy
from llamactor.actors.policy import Policy
from llamactor.ops.bench.report import fmt, grid
from llamactor.ops.bench.slo import DEFAULT_SLO_ITL_MS, DEFAULT_SLO_TTFT_MS, LatencyReport, Sample
from llamactor.ops.replay.costfit import CostModel, FitError, fit_costs
from llamactor.ops.replay.simgroup import SimulationError
from llamactor.ops.replay.simresult import SimResult
from llamactor.ops.replay.simulate import simulate
from llamactor.ops.replay.tracefile import Trace, TraceError, load_trace
from llamactor.protocol.errors import ConfigError

EXIT_OK, EXIT_POLICY_FAILED, EXIT_USAGE = 0, 1, 2
RECORDED = "recorded"
COLUMNS = {
    "ttft_mean_ms": "TTFT mean ms",
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
    "itl_p50_ms": "ITL p50 ms",
    "itl_p99_ms": "ITL p99 ms",
    "makespan_s": "makespan s",
    "goodput": "goodput",
    "goodput_rps": "good/s",
}
# a recorded trace's table also counts the requests that ended badly: a random workload has none
TRACE_COLUMNS = {**COLUMNS, "ended_badly": "cancelled"}
_OPTIONS = ("prefill_budget", "target_itl_ms", "target_ttft_ms", "cohort_max_generate_ms")


def add_replay_parser(sub: Any) -> None:
    """Add the ``replay`` subcommand to ``llamactor``'s subparsers (called once at start-up)."""
    p = sub.add_parser(
        "replay",
        help="replay a --record-trace file against scheduling policies, offline",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", metavar="FILE", nargs="?", help="a trace written by llamactor serve --record-trace FILE")
    g = p.add_argument_group("random workloads (--workload random)")
    g.add_argument(
        "--workload", choices=("trace", "random"), default="trace", help="replay FILE (default) or random workloads"
    )
    g.add_argument("--seed", default=None, metavar="S[,S2...]", help="the random workloads' seeds (as the bench's)")
    g.add_argument("--family", default=None, metavar="JSON|FILE", help="the family's bounds, as for the bench")
    g.add_argument(
        "--costs", default=None, metavar="FILE", help="a --record-trace file from this machine: its step costs"
    )
    g.add_argument(
        "--capacity",
        type=float,
        default=None,
        metavar="RPS",
        help="open loops: the capacity the bench measured (default: measured on the first --scheduler)",
    )
    c = p.add_argument_group("capacity runs (--capacity-run)")
    c.add_argument(
        "--capacity-run", default=None, metavar="FILE", help="the JSON of llamactor bench --capacity --json to predict"
    )
    c.add_argument("--server", default="B", help="whose curve to predict: A or B (default %(default)s)")
    c.add_argument(
        "--front-ms",
        type=float,
        default=None,
        help="the front end's cost per request added to every TTFT (default: the run's own, measured at its "
        "lowest rate)",
    )
    p.add_argument(
        "--scheduler",
        action="append",
        default=None,
        metavar="NAME|module:Class",
        help="a policy to replay (repeat for several); default: the recorded one",
    )
    p.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=DEFAULT_SLO_TTFT_MS,
        help=f"goodput: time to first token target (default {DEFAULT_SLO_TTFT_MS:g})",
    )
    p.add_argument(
        "--slo-itl-ms",
        type=float,
        default=DEFAULT_SLO_ITL_MS,
        help=f"goodput: time per output token target (default {DEFAULT_SLO_ITL_MS:g})",
    )
    p.add_argument("--prefill-budget", type=int, default=None, help="override the recorded --prefill-budget")
    p.add_argument("--target-itl-ms", type=float, default=None, help="override the recorded --target-itl-ms")
    p.add_argument("--target-ttft-ms", type=float, default=None, help="override the recorded --target-ttft-ms")
    p.add_argument(
        "--cohort-max-generate-ms", type=float, default=None, help="override the recorded --cohort-max-generate-ms"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


@dataclasses.dataclass(frozen=True)
class Replayed:
    scheduler: str
    result: SimResult
    report: LatencyReport


def recorded_report(trace: Trace, slo_ttft_ms: float, slo_itl_ms: float) -> LatencyReport:
    """The recorded run's own figures, from the trace. It holds each request's first and last
    token but not every token's time, so its goodput uses each request's mean time per token
    and its inter-token percentiles are not known (None)."""
    samples = []
    for r in trace.requests:
        ttft = None if r.first_token is None else r.first_token - r.submitted
        gaps: list[float] = []
        if r.first_token is not None and r.finished is not None:
            for k in r.per_choice:
                if k > 1:
                    gaps += [(r.finished - r.first_token) / (k - 1)] * (k - 1)
        samples.append(Sample(r.ok, ttft, gaps, r.generated))
    ends = [r.finished for r in trace.requests if r.finished is not None]
    start = min((r.submitted for r in trace.requests), default=0.0)
    report = LatencyReport.of(
        samples, max(ends) - start if ends else 0.0, slo_ttft_ms, slo_itl_ms, latency_of_ended=True
    )
    return dataclasses.replace(report, itl_p50_ms=None, itl_p99_ms=None)


def replay(
    trace: Trace,
    policy_cls: type[Policy],
    cost: CostModel,
    options: dict[str, float],
    slo_ttft_ms: float,
    slo_itl_ms: float,
    spec: str,
) -> Replayed:
    result = simulate(trace, policy_cls, cost, options)
    report = LatencyReport.of(result.samples(), result.makespan_s, slo_ttft_ms, slo_itl_ms, latency_of_ended=True)
    return Replayed(spec, result, report)


def run_replay(args: argparse.Namespace) -> int:
    """Load, fit, replay every ``--scheduler``, print; see the module docstring for the exit status."""
    if args.workload == "random":
        return run_replay_random(args)
    if args.capacity_run is not None:
        return run_replay_capacity(args)
    try:
        if args.trace is None:
            raise TraceError("give a trace FILE to replay, or --workload random")
        trace = load_trace(args.trace)
        if not trace.requests:
            raise TraceError(f"{args.trace} holds no requests: nothing to replay")
        cost = fit_costs(trace.steps)
        specs = args.scheduler or [trace.header.policy]
        classes = [(spec, resolve_policy(spec)) for spec in specs]
        if args.slo_ttft_ms <= 0 or args.slo_itl_ms <= 0:
            raise ValueError("--slo-ttft-ms and --slo-itl-ms must be positive")
    except (TraceError, FitError, ConfigError, ValueError) as exc:
        print(f"llamactor replay: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    options = with_overrides(trace.header.policy_options, args)
    runs: list[Replayed] = []
    failures: list[str] = []
    for spec, cls in classes:
        try:
            runs.append(replay(trace, cls, cost, options, args.slo_ttft_ms, args.slo_itl_ms, spec))
        except Exception as exc:
            failures.append(f"{spec}: {failure(exc)}")
    failures += [f"{r.scheduler}: {stalled(r.result)}" for r in runs if r.result.unfinished]
    recorded = recorded_report(trace, args.slo_ttft_ms, args.slo_itl_ms)
    if args.json:
        json.dump(to_json(trace, cost, recorded, runs, options, failures), sys.stdout, indent=2)
        print()
    else:
        print(render(trace, cost, recorded, runs, options))
        for line in trace.notes:
            print(f"note: {line}")
        for line in failures:
            print(f"error: {line}", file=sys.stderr)
    return EXIT_POLICY_FAILED if failures else EXIT_OK


def run_replay_random(args: argparse.Namespace) -> int:
    """``--workload random``: every seed against every ``--scheduler`` with the ``--costs`` trace's step cost."""
    from llamactor.ops.replay import replayrandom

    try:
        if args.trace is not None:
            raise ValueError("--workload random replays drawn workloads: give --costs FILE, not a trace to replay")
        if args.seed is None or args.costs is None:
            raise ValueError("--workload random needs --seed S[,S2...] and --costs FILE (a --record-trace file)")
        seeds = replayrandom.parse_seeds(args.seed)
        family = replayrandom.parse_family(args.family)
        costs = load_trace(args.costs)
        cost = fit_costs(costs.steps)
        specs = args.scheduler or [costs.header.policy]
        classes = [(spec, resolve_policy(spec)) for spec in specs]
        if args.slo_ttft_ms <= 0 or args.slo_itl_ms <= 0:
            raise ValueError("--slo-ttft-ms and --slo-itl-ms must be positive")
        if args.capacity is not None and not args.capacity > 0:
            raise ValueError("--capacity must be positive")
    except (TraceError, FitError, ConfigError, ValueError, OSError) as exc:
        print(f"llamactor replay: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    recorded = {**costs.header.policy_options, "slo_ttft_ms": args.slo_ttft_ms, "slo_itl_ms": args.slo_itl_ms}
    options = with_overrides(recorded, args)
    runs: list[replayrandom.RandomReplay] = []
    failures: list[str] = []
    for seed in seeds:
        try:
            runs += replayrandom.replay_random(
                seed, family, costs, cost, classes, options, args.slo_ttft_ms, args.slo_itl_ms, args.capacity
            )
        except Exception as exc:
            failures.append(f"seed {seed}: {failure(exc)}")
    failures += [f"seed {r.seed}, {r.scheduler}: {stalled(r.result)}" for r in runs if r.result.unfinished]
    replayrandom.print_random(args, runs, COLUMNS)
    for line in failures:
        print(f"error: {line}", file=sys.stderr)
    return EXIT_POLICY_FAILED if failures else EXIT_OK


def run_replay_capacity(args: argparse.Namespace) -> int:
    """``--capacity-run``: each rate of the run, measured against predicted, per ``--scheduler``."""
    from llamactor.ops.replay import replaycapacity

    try:
        if args.costs is None:
            raise ValueError("--capacity-run needs --costs FILE (a --record-trace file from the same machine)")
        run = replaycapacity.CapacityRun.load(args.capacity_run, args.server)
        costs = load_trace(args.costs)
        cost = fit_costs(costs.steps)
        classes = [(spec, resolve_policy(spec)) for spec in args.scheduler or [costs.header.policy]]
        front_ms = run.front_ms() if args.front_ms is None else args.front_ms
        if front_ms < 0:
            raise ValueError(f"--front-ms must be >= 0, got {front_ms}")
        options = with_overrides(dict(costs.header.policy_options), args)
        points = replaycapacity.replay_capacity(run, costs, cost, classes, options, front_ms)
    except (TraceError, FitError, ConfigError, ValueError, KeyError, OSError) as exc:
        why = f"{args.capacity_run} lacks the field {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"llamactor replay: error: {why}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(replaycapacity.to_json(run, points, front_ms), indent=2))
    else:
        print(replaycapacity.render(run, points, front_ms))
    return EXIT_OK


def with_overrides(recorded: dict[str, float], args: argparse.Namespace) -> dict[str, float]:
    """The recorded policy options with the command line's overrides."""
    options = dict(recorded)
    for name in _OPTIONS:
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    return options


def failure(exc: Exception) -> str:
    """What a replay that raised says: the plan the engine refused, or the policy's exception."""
    return str(exc) if isinstance(exc, SimulationError) else f"the policy raised {type(exc).__name__}: {exc}"


def stalled(result: SimResult) -> str:
    return f"{result.unfinished} request(s) never finished (the policy stalled them)"


# ---- output -------------------------------------------------------------------------------


def figures(report: LatencyReport) -> dict[str, float | int | None]:
    """The benchmark's figures and the requests that ended badly (cancelled or failed in the
    recording; the simulation ends them where the recording did)."""
    return {**report.figures(), "ended_badly": report.ended_badly}


def describe_trace(trace: Trace, options: dict[str, float]) -> str:
    h = trace.header
    ok = sum(r.ok for r in trace.requests)
    opts = ", ".join(f"{k}={v:g}" for k, v in sorted(options.items()) if v) or "defaults"
    return (
        f"trace {trace.path}: {len(trace.requests)} requests ({ok} completed), {trace.generated_tokens} tokens "
        f"generated, {len(trace.steps)} steps; model {h.model or '?'}, {h.groups} group(s) x {h.n_slots} slots, "
        f"n_batch {h.n_batch}; recorded with --scheduler {h.policy}; policy options: {opts}"
    )


def render(
    trace: Trace, cost: CostModel, recorded: LatencyReport, runs: list[Replayed], options: dict[str, float]
) -> str:
    header = ["policy", *TRACE_COLUMNS.values()]
    rows = [[f"{RECORDED} ({trace.header.policy})", *(fmt(v) for v in figures(recorded).values())]]
    rows += [[r.scheduler, *(fmt(v) for v in figures(r.report).values())] for r in runs]
    slo = (
        f"goodput: share of requests with TTFT <= {recorded.slo_ttft_ms:g} ms and time per output token <= "
        f"{recorded.slo_itl_ms:g} ms ({RECORDED}: ITL percentiles not in the trace)"
    )
    lines = [describe_trace(trace, options), cost.describe(), slo, ""]
    lines.append(grid(header, rows, names_left=True))
    return "\n".join(lines)


def to_json(
    trace: Trace,
    cost: CostModel,
    recorded: LatencyReport,
    runs: list[Replayed],
    options: dict[str, float],
    failures: list[str],
) -> dict[str, Any]:
    import msgspec

    return {
        "trace": trace.path,
        "header": msgspec.to_builtins(trace.header),
        "requests": len(trace.requests),
        "generated_tokens": trace.generated_tokens,
        "steps": len(trace.steps),
        "policy_options": options,
        "fit": {
            part: {**dataclasses.asdict(fit), "formula": fit.formula()}
            for part, fit in (("decode", cost.decode), ("loop", cost.loop))
        },
        "slo": {"ttft_ms": recorded.slo_ttft_ms, "itl_ms": recorded.slo_itl_ms},
        "recorded": {"scheduler": trace.header.policy, "figures": figures(recorded), "good": recorded.good},
        "policies": [
            {
                "scheduler": r.scheduler,
                "name": r.result.policy,
                "figures": figures(r.report),
                "good": r.report.good,
                "requests": len(r.result.outcomes),
                "unfinished": r.result.unfinished,
                "generated_tokens": r.result.generated_tokens,
                "prompt_tokens": r.result.prompt_tokens,
                "steps": r.result.steps,
            }
            for r in runs
        ],
        "notes": list(trace.notes),
        "errors": failures,
    }


__all__ = ["add_replay_parser", "recorded_report", "replay", "run_replay"]
