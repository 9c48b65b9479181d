"""``llamactor replay --workload random``: a drawn random workload against policies, offline.

    llamactor replay --workload random --seed 3,17 --costs run.jsonl \\
                     --scheduler slo --scheduler continuous [--capacity 0.8] [--family JSON] [--json]

The workload is ``ops.bench.random.randomload.draw(seed)``, the one ``llamactor bench --workload random``
sends; ``--costs`` is any ``--record-trace`` file recorded on the machine and model to predict
for (its steps give the step cost, as for a trace replay; its header the batch size and the
number of groups). The replay sends what the bench's client sends:

- **closed loops and bursts**: each user sends its next request when its previous one ended
  (``Simulation``'s ``after``), the first ones at the user's stagger;
- **open loops**: arrivals at ``load x capacity`` with the bench's schedule. The capacity is
  ``--capacity`` (the bench prints the one it measured, and keeps it with ``--calibration``),
  or else the replay measures it as the bench does: a closed loop of the workload's mean
  lengths on the first ``--scheduler``;
- **later turns**: sent when the turn they continue ended (and not before their own arrival),
  with that conversation's previous prompt and answer cached in their slot;
- **shared prefixes**: cached for a request when an earlier one with the same prefix ended
  before it was sent (closed loops: a previous round; open loops: an arrival at least the
  prefix's prefill time earlier). The simulator has no cache of its own: this is the rule.

A row per policy and seed, with the trace replay's columns (``ops.replay.cli``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping
from typing import Any

from msgspec.structs import replace

from llamactor.actors.policy import Policy
from llamactor.ops.bench.random.randomfamily import DEFAULT_FAMILY, Family
from llamactor.ops.bench.random.randomload import draw
from llamactor.ops.bench.random.randomworkload import RandomWorkload
from llamactor.ops.bench.report import fmt, grid
from llamactor.ops.bench.slo import LatencyReport
from llamactor.ops.replay.costfit import CostModel
from llamactor.ops.replay.simresult import SimResult
from llamactor.ops.replay.simulate import simulate
from llamactor.ops.replay.tracefile import Header, Request, Trace

CALIBRATION_USERS = 8  # the bench's calibration: up to 8 users x 2 requests of the mean lengths
CALIBRATION_REQUESTS = 2
OPEN_LOOP_CACHE_S = 0.5  # open loop: a prefix sent this long before is taken to be cached


@dataclasses.dataclass(frozen=True)
class RandomReplay:
    seed: int
    scheduler: str
    summary: str
    capacity_rps: float | None
    result: SimResult
    report: LatencyReport


def workload_trace(wl: RandomWorkload, costs: Trace, capacity_rps: float | None) -> tuple[Trace, dict[int, int]]:
    """``wl`` as a trace the simulator replays, and which request waits for which to end."""
    times = wl.arrival_times(capacity_rps)
    after: dict[int, int] = {}
    requests: list[Request] = []
    for i, it in enumerate(wl.items):
        if it.follows is not None:
            cached = wl.items[it.follows].context + wl.items[it.follows].ntg
        elif it.prefix is not None and _prefix_cached(wl, i, times):
            cached = wl.prefix_lengths[it.prefix]
        else:
            cached = 0
        if not wl.open_loop and i >= wl.users:
            after[i] = i - wl.users  # the same user's previous request
        elif it.follows is not None:
            after[i] = it.follows
        requests.append(
            Request(
                group=0,
                submitted=times[i],
                prompt=it.context,
                generated=it.ntg,
                cached=min(cached, it.context - 1),
                n_predict=it.ntg,
                finish="length",
            )
        )
    trace = Trace(f"random seed {wl.seed}", _header(costs.header, wl), tuple(requests), ())
    return trace, after


def _header(recorded: Header, wl: RandomWorkload) -> Header:
    """The recorded server's header, sized as the bench sizes the server for ``wl``."""
    groups = max(1, recorded.groups)
    return replace(recorded, groups=groups, n_slots=max(1, wl.np // groups), n_ctx_slot=wl.slot_context)


def _prefix_cached(wl: RandomWorkload, i: int, times: list[float]) -> bool:
    it = wl.items[i]
    earlier = [j for j in range(i) if wl.items[j].prefix == it.prefix]
    if not earlier:
        return False
    if not wl.open_loop:
        return any(j <= i - wl.users for j in earlier)  # sent in an earlier round: it ended before
    return any(times[j] <= times[i] - OPEN_LOOP_CACHE_S for j in earlier)


def simulated_capacity(
    wl: RandomWorkload, costs: Trace, policy_cls: type[Policy], cost: CostModel, options: Mapping[str, float]
) -> float:
    """Requests per second of the bench's calibration loop on the simulated server."""
    npp, ntg = wl.calibration_lengths()
    users = min(CALIBRATION_USERS, wl.np)
    n = users * CALIBRATION_REQUESTS
    requests = tuple(
        Request(group=0, submitted=0.0, prompt=npp, generated=ntg, n_predict=ntg, finish="length") for _ in range(n)
    )
    trace = Trace(f"calibration of seed {wl.seed}", _header(costs.header, wl), requests, ())
    result = simulate(trace, policy_cls, cost, options, {i: i - users for i in range(users, n)})
    return n / result.makespan_s if result.makespan_s > 0 else float("inf")


def replay_random(
    seed: int,
    family: Family,
    costs: Trace,
    cost: CostModel,
    classes: list[tuple[str, type[Policy]]],
    options: Mapping[str, float],
    slo_ttft_ms: float,
    slo_itl_ms: float,
    capacity_rps: float | None = None,
) -> list[RandomReplay]:
    """Every policy of ``classes`` on the workload of ``seed`` (open loops at one capacity)."""
    wl = draw(seed, family)
    if wl.open_loop and capacity_rps is None:
        capacity_rps = simulated_capacity(wl, costs, classes[0][1], cost, options)
    trace, after = workload_trace(wl, costs, capacity_rps if wl.open_loop else None)
    out = []
    for spec, cls in classes:
        result = simulate(trace, cls, cost, options, after)
        report = LatencyReport.of(result.samples(), result.makespan_s, slo_ttft_ms, slo_itl_ms)
        out.append(RandomReplay(seed, spec, wl.summary(), capacity_rps if wl.open_loop else None, result, report))
    return out


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seed takes integers separated by commas, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds):
        raise ValueError(f"--seed takes integers >= 0 separated by commas, got {text!r}")
    return seeds


def parse_family(text: str | None) -> Family:
    if not text:
        return DEFAULT_FAMILY
    from pathlib import Path

    raw = Path(text).read_text(encoding="utf-8") if not text.lstrip().startswith("{") else text
    obj = json.loads(raw)
    if not isinstance(obj, dict):
        raise ValueError("--family takes a JSON object (or a file holding one)")
    return Family.from_dict(obj)


def render_random(runs: list[RandomReplay], columns: Mapping[str, str]) -> str:
    lines: list[str] = []
    for seed in dict.fromkeys(r.seed for r in runs):
        rows = [r for r in runs if r.seed == seed]
        cap = rows[0].capacity_rps
        lines.append(rows[0].summary + (f"; capacity {cap:.3g} req/s" if cap is not None else ""))
        header = ["policy", *columns.values()]
        table = [[r.scheduler, *(fmt(v) for v in r.report.figures().values())] for r in rows]
        lines.append(grid(header, table, names_left=True))
        lines.append("")
    return "\n".join(lines).rstrip()


def random_json(runs: list[RandomReplay]) -> list[dict[str, Any]]:
    return [
        {
            "seed": r.seed,
            "scheduler": r.scheduler,
            "summary": r.summary,
            "capacity_rps": r.capacity_rps,
            "figures": r.report.figures(),
            "good": r.report.good,
            "requests": len(r.result.outcomes),
            "unfinished": r.result.unfinished,
            "prompt_tokens": r.result.prompt_tokens,
            "steps": r.result.steps,
        }
        for r in runs
    ]


def print_random(args: argparse.Namespace, runs: list[RandomReplay], columns: Mapping[str, str]) -> None:
    if args.json:
        json.dump(random_json(runs), sys.stdout, indent=2)
        print()
    else:
        print(render_random(runs, columns))


__all__ = ["RandomReplay", "parse_family", "parse_seeds", "replay_random", "simulated_capacity", "workload_trace"]
