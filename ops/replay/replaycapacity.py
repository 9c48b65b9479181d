"""``llamactor replay --capacity-run FILE``: a ``bench --capacity --json`` run predicted offline.

    llamactor replay --capacity-run run.json --costs trace.jsonl [--server B] [--scheduler slo ...]

For each rate the run measured on ``--server`` (default B, the server under test), the
simulator serves the same requests (the shape's lengths and arrival times from the run's seed,
scaled by 1 / rate) with the step costs of ``--costs`` (a ``--record-trace`` file from the same
machine and model), and judges each with the run's SLOs: predicted attainment beside measured.

**The front end is part of what the client sees.** The simulator starts a request's clock when
the runtime gets it; the client's starts when it sends the request. The difference, HTTP,
chat template, tokenizer and the hops to the engine, is the run's own measurement: client TTFT
minus the server's prompt time (``front_ms``) at the lowest rate it measured (the least load, so
that queueing, which the simulator models itself, is not counted twice). It is added to every
simulated TTFT; ``--front-ms`` sets it instead (0: leave the front end out).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamactor.actors.policy import Policy
from llamactor.ops.bench.capacity import Slo
from llamactor.ops.bench.capacity_shapes import SHAPES, workload
from llamactor.ops.bench.stats import MS_PER_S
from llamactor.ops.replay.costfit import CostModel
from llamactor.ops.replay.replayrandom import workload_trace
from llamactor.ops.replay.simresult import SimResult
from llamactor.ops.replay.simulate import simulate
from llamactor.ops.replay.tracefile import Trace


@dataclass(frozen=True)
class CapacityRun:
    """What the replay needs of a ``bench --capacity --json`` output."""

    shape: str
    arrivals: str
    requests: int
    seed: int
    slo: Slo
    curve: tuple[dict[str, Any], ...]  # the server's measured points, by rate
    capacity_rps: float

    @classmethod
    def load(cls, path: str, server: str) -> CapacityRun:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or "curve" not in doc or "slo" not in doc:
            raise ValueError(f"{path}: not the JSON of llamactor bench --capacity --json")
        if server not in doc["curve"]:
            raise ValueError(f"{path}: no server {server!r} in the run (it has {', '.join(doc['curve'])})")
        if "seed" not in doc:
            raise ValueError(f"{path}: the run does not say its seed (written by an older llamactor bench)")
        slo = doc["slo"]
        return cls(
            shape=doc["shape"],
            arrivals=doc["arrivals"],
            requests=int(doc["requests_per_point"]),
            seed=int(doc["seed"]),
            slo=Slo(slo["ttft_ms_per_token"], slo["tpot_ms"], slo["ttft_floor_ms"]),
            curve=tuple(sorted(doc["curve"][server], key=lambda p: p["rate"])),
            capacity_rps=float(doc["capacity_rps"][server]),
        )

    def front_ms(self) -> float:
        """The front end's cost per request: ``front_ms`` p50 at the lowest rate that has it."""
        for p in self.curve:
            if p.get("front_ms"):
                return float(p["front_ms"]["p50"])
        return 0.0


@dataclass(frozen=True)
class PredictedPoint:
    rate: float
    measured: float  # attainment the bench measured (a lower bound where it stopped early)
    stopped: bool
    predicted: dict[str, float]  # per policy


def attainment(result: SimResult, prompts: list[int], slo: Slo, front_ms: float) -> float:
    """The share of simulated requests meeting both SLOs, the front end's cost added to TTFT."""
    met = 0
    for o, n_prompt in zip(result.outcomes, prompts):
        if not o.finished or o.ttft_s is None:
            continue
        tpot = (o.ended - o.submitted - o.ttft_s) / (o.n_generated - 1) if o.n_generated > 1 and o.ended else None
        met += slo.met_by(o.ttft_s * MS_PER_S + front_ms, tpot, n_prompt)
    return met / len(result.outcomes) if result.outcomes else 0.0


def replay_capacity(
    run: CapacityRun,
    costs: Trace,
    cost: CostModel,
    classes: list[tuple[str, type[Policy]]],
    options: Mapping[str, float],
    front_ms: float,
) -> list[PredictedPoint]:
    """Every measured rate of ``run`` against every policy of ``classes``."""
    wl = workload(SHAPES[run.shape], run.arrivals, run.requests, run.seed)
    # the server's own slots, as recorded (the bench's workload does not size the server)
    wl = dataclasses.replace(wl, np=costs.header.n_slots * max(1, costs.header.groups))
    prompts = [it.context for it in wl.items]
    out = []
    for p in run.curve:
        trace, after = workload_trace(wl, costs, float(p["rate"]))
        predicted = {
            spec: attainment(simulate(trace, cls, cost, options, after), prompts, run.slo, front_ms)
            for spec, cls in classes
        }
        out.append(PredictedPoint(float(p["rate"]), float(p["attainment"]), bool(p["stopped"]), predicted))
    return out


def render(run: CapacityRun, points: list[PredictedPoint], front_ms: float) -> str:
    specs = list(points[0].predicted) if points else []
    lines = [
        f"capacity run: shape {run.shape}, {run.arrivals} arrivals, {run.requests} requests a rate, seed {run.seed}; "
        f"measured capacity {run.capacity_rps:.3g} req/s; front end {front_ms:.0f} ms a request",
        "rate req/s   measured  " + "  ".join(f"{s:>10}" for s in specs),
    ]
    for p in points:
        measured = f"{p.measured:.2f}{'*' if p.stopped else ' '}"
        lines.append(f"{p.rate:10.3g}   {measured:>8}  " + "  ".join(f"{p.predicted[s]:10.2f}" for s in specs))
    lines.append("(* the bench stopped that rate once it was out of reach: measured is a lower bound)")
    return "\n".join(lines)


def to_json(run: CapacityRun, points: list[PredictedPoint], front_ms: float) -> dict[str, Any]:
    return {
        "shape": run.shape,
        "arrivals": run.arrivals,
        "seed": run.seed,
        "capacity_rps": run.capacity_rps,
        "front_ms": front_ms,
        "points": [
            {"rate": p.rate, "measured": p.measured, "stopped": p.stopped, "predicted": p.predicted} for p in points
        ],
    }


__all__ = ["CapacityRun", "PredictedPoint", "attainment", "render", "replay_capacity", "to_json"]
