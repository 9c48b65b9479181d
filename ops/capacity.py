"""Capacity at an SLO, as serving papers measure it (DistServe, Sarathi-Serve, vLLM's goodput).

``llamactor bench --capacity`` asks: what is the highest request rate at which at least 90 % of
requests meet both their time-to-first-token SLO and their time-per-output-token SLO?

- **SLOs relative to the machine.** Each server's unloaded latency is measured first, a few
  requests one at a time: TTFT per prompt token and TPOT. The faster of the two servers is the
  reference for both (so both are held to the same SLO), and the SLOs are ``--slo-scale`` times
  it: a request's TTFT SLO is scale x reference-per-token x its prompt tokens (plus
  ``TTFT_FLOOR_MS``, the fixed cost of a request that a per-token figure misses), the TPOT SLO
  is scale x reference TPOT. The default scale 5 lets a request wait behind about four others of
  its size: loaded enough that scheduling decides, loose enough that a good server meets it.
- **The search.** The rate is bracketed by doubling (or halving) from ``--rate`` (default 1/s),
  then bisected on a log scale until the bracket is within ``--capacity-precision``; each point
  sends ``--capacity-requests`` requests with the same seeded lengths and arrival gaps. With
  ``--vs`` the two servers are measured in turn at each step, each with its own bracket.
- **Shapes.** ``sharegpt``: lognormal prompt and output lengths (conversation-like, no shared
  prefix); ``rag``: 1,000-3,000 prompt tokens, 32-128 out. Arrivals ``poisson`` or ``bursty``:
  gamma-distributed gaps of shape ``BURST_SHAPE`` (BurstGPT's model of bursty traffic: the same
  mean rate, gaps with a coefficient of variation of 1/sqrt(shape)).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llamactor.ops.phase import Job, PhaseResult, Request
from llamactor.ops.prompts import PromptSource
from llamactor.ops.runner import Common, probe_prompt_ids, run_workload
from llamactor.ops.stats import RequestRecord
from llamactor.ops.traffic import ARRIVAL_STREAM, LENGTH_STREAM, LengthDist, Shape

TARGET = 0.9  # the share of requests that must meet both SLOs
DEFAULT_SLO_SCALE = 5.0
TTFT_FLOOR_MS = 50.0  # added to every TTFT SLO: HTTP, tokenizing and the first sample, per request
DEFAULT_CAPACITY_REQUESTS = 40
DEFAULT_PRECISION = 0.15  # stop once the bracket's high end is within 15 % of its low end
MAX_POINTS = 12  # rates measured per server, at most
REFERENCE_REQUESTS = 3  # unloaded requests per server for the reference latencies
REFERENCE_NTG = 32  # tokens each generates: enough gaps for a TPOT median
BURST_SHAPE = 0.25  # gamma shape of bursty gaps: CV 2, as BurstGPT's bursty traces
SHAPES: dict[str, tuple[LengthDist, LengthDist]] = {
    "sharegpt": (LengthDist("lognormal", 250, 0.8), LengthDist("lognormal", 120, 0.7)),
    "rag": (LengthDist("uniform", 1000, 3000), LengthDist("uniform", 32, 128)),
}
ARRIVALS = ("poisson", "bursty")
UNLOADED = Common(warmup=0)  # no warm-up round: the reference requests are the warm-up


def arrival_gaps(n: int, rate: float, seed: int, arrivals: str) -> list[float]:
    """``n`` arrival times at mean ``rate``/s: the first at 0, then exponential (poisson) or
    gamma (bursty) gaps."""
    rng = np.random.default_rng([seed, ARRIVAL_STREAM])
    if arrivals == "bursty":
        gaps = rng.gamma(BURST_SHAPE, 1.0 / (rate * BURST_SHAPE), size=max(n - 1, 0))
    else:
        gaps = rng.exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0, *(float(t) for t in np.cumsum(gaps))] if n > 0 else []


def schedule(shape: str, arrivals: str, rate: float, n: int, seed: int) -> list[Shape]:
    """The requests of one point: seeded lengths of ``shape`` and arrival times."""
    npp, ntg = SHAPES[shape]
    rng = np.random.default_rng([seed, LENGTH_STREAM])
    sizes = zip(npp.draw(rng, n), ntg.draw(rng, n))
    return [Shape(p, g, t) for (p, g), t in zip(sizes, arrival_gaps(n, rate, seed, arrivals))]


@dataclass(frozen=True)
class Slo:
    ttft_ms_per_token: float
    tpot_ms: float
    floor_ms: float = TTFT_FLOOR_MS

    @classmethod
    def scaled(cls, ref_ttft_ms_per_token: float, ref_tpot_ms: float, scale: float) -> Slo:
        return cls(scale * ref_ttft_ms_per_token, scale * ref_tpot_ms)

    def met(self, rec: RequestRecord) -> bool:
        """Both SLOs met by a completed request (a failed one meets neither)."""
        if not rec.ok or rec.ttft_s is None:
            return False
        if rec.ttft_s * 1e3 > self.floor_ms + self.ttft_ms_per_token * rec.n_prompt_sent:
            return False
        return rec.tpot_s is None or rec.tpot_s * 1e3 <= self.tpot_ms


@dataclass(frozen=True)
class Point:
    """One measured point: requests at set times, read as records (a Workload for run_workload)."""

    shapes: tuple[Shape, ...]
    common: Common = field(default_factory=lambda: UNLOADED)

    @property
    def n_requests(self) -> int:
        return len(self.shapes)

    def plan(self, prompts: PromptSource) -> tuple[list[Job], list[Job]]:
        jobs = [Job("arrival", (Request(prompts.take(s.npp), s.ntg),), offset_s=s.at or 0.0) for s in self.shapes]
        return [], jobs

    def summarize(self, phase: PhaseResult, warmup_failed: int) -> list[RequestRecord]:
        return phase.of_kind("arrival")


@dataclass
class Bracket:
    """One server's search: double or halve until the target is crossed, then bisect on a log
    scale until ``hi / lo <= 1 + precision`` (or ``max_points`` rates were measured)."""

    start: float
    precision: float = DEFAULT_PRECISION
    max_points: int = MAX_POINTS
    lo: float | None = None  # highest rate that met the target
    hi: float | None = None  # lowest rate that missed it
    curve: dict[float, float] = field(default_factory=dict)  # rate -> attainment

    @property
    def done(self) -> bool:
        if len(self.curve) >= self.max_points:
            return True
        return self.lo is not None and self.hi is not None and self.hi / self.lo <= 1 + self.precision

    def next_rate(self) -> float:
        if self.lo is None and self.hi is None:
            return self.start
        if self.hi is None:
            assert self.lo is not None
            return self.lo * 2
        if self.lo is None:
            return self.hi / 2
        return math.sqrt(self.lo * self.hi)

    def record(self, rate: float, attainment: float) -> None:
        self.curve[rate] = attainment
        if attainment >= TARGET:
            self.lo = rate if self.lo is None else max(self.lo, rate)
        else:
            self.hi = rate if self.hi is None else min(self.hi, rate)

    @property
    def capacity(self) -> float:
        """The highest rate measured to meet the target (0 when none did)."""
        return self.lo or 0.0


async def search(
    names: list[str], attainment: Callable[[str, float], Awaitable[float]], start: float, precision: float
) -> dict[str, Bracket]:
    """Each server's bracket, the servers measured in turn at every step."""
    brackets = {name: Bracket(start, precision) for name in names}
    while not all(b.done for b in brackets.values()):
        for name, b in brackets.items():
            if not b.done:
                rate = b.next_rate()
                b.record(rate, await attainment(name, rate))
    return brackets


async def reference(url: str, shape: str, ids: list[int], common: Common, seed: int) -> tuple[float, float]:
    """(TTFT ms per prompt token, TPOT ms) of ``url`` unloaded: requests of the shape's median
    prompt length (a short prompt's fixed cost would inflate a per-token figure), one at a time
    after one warm-up request, medians."""
    npp = int(statistics.median(SHAPES[shape][0].draw(np.random.default_rng(seed), 1001)))
    ttft, tpot = [], []
    for i in range(REFERENCE_REQUESTS + 1):
        point = Point((Shape(npp, REFERENCE_NTG, 0.0),), common)
        (rec,) = await run_workload(url, point, seed=seed + i, prompt_ids=ids)
        if not rec.ok or rec.ttft_s is None:
            raise RuntimeError(f"{url}: an unloaded request failed ({rec.error})")
        if i == 0:
            continue  # the warm-up: first-use costs (graph, buffers) are no server's latency
        ttft.append(rec.ttft_s * 1e3 / max(rec.n_prompt_sent, 1))
        if rec.tpot_s is not None:
            tpot.append(rec.tpot_s * 1e3)
    return statistics.median(ttft), statistics.median(tpot) if tpot else 0.0


async def run_capacity(
    urls: dict[str, str],
    *,
    shape: str,
    arrivals: str = "poisson",
    scale: float = DEFAULT_SLO_SCALE,
    requests: int = DEFAULT_CAPACITY_REQUESTS,
    precision: float = DEFAULT_PRECISION,
    start_rate: float = 1.0,
    common: Common = UNLOADED,
) -> dict[str, Any]:
    """Measure the references, set the SLOs, search each server's capacity: the figures."""
    first = next(iter(urls.values()))
    ids = await probe_prompt_ids(first, common.api_key)
    refs = {name: await reference(url, shape, ids, common, common.seed) for name, url in urls.items()}
    ref_ttft = min(r[0] for r in refs.values())
    ref_tpot = min(r[1] for r in refs.values())
    slo = Slo.scaled(ref_ttft, ref_tpot, scale)
    shapes = {}

    async def attainment(name: str, rate: float) -> float:
        if rate not in shapes:
            shapes[rate] = tuple(schedule(shape, arrivals, rate, requests, common.seed))
        records = await run_workload(urls[name], Point(shapes[rate], common), prompt_ids=ids)
        return sum(slo.met(r) for r in records) / max(len(records), 1)

    brackets = await search(list(urls), attainment, start_rate, precision)
    caps = {name: b.capacity for name, b in brackets.items()}
    names = list(urls)
    return {
        "shape": shape,
        "arrivals": arrivals,
        "requests_per_point": requests,
        "slo_scale": scale,
        "slo": {"ttft_ms_per_token": slo.ttft_ms_per_token, "ttft_floor_ms": slo.floor_ms, "tpot_ms": slo.tpot_ms},
        "reference": {n: {"ttft_ms_per_token": r[0], "tpot_ms": r[1]} for n, r in refs.items()},
        "capacity_rps": caps,
        "ratio": caps[names[1]] / caps[names[0]] if len(names) == 2 and caps[names[0]] > 0 else None,
        "curve": {n: sorted(b.curve.items()) for n, b in brackets.items()},
    }


def render(figures: dict[str, Any]) -> str:
    """The figures as text: SLOs, capacity per server and the ratio, then the attainment curve."""
    slo = figures["slo"]
    lines = [
        f"capacity: shape {figures['shape']}, {figures['arrivals']} arrivals, "
        f"{figures['requests_per_point']} requests a point, >= {TARGET:.0%} meeting both SLOs",
        f"SLO (scale {figures['slo_scale']:g} x the faster server unloaded): TTFT <= "
        f"{slo['ttft_floor_ms']:g} ms + {slo['ttft_ms_per_token']:.3f} ms x prompt tokens, "
        f"TPOT <= {slo['tpot_ms']:.1f} ms",
    ]
    for name, rps in figures["capacity_rps"].items():
        lines.append(f"  {name}: {rps:.3f} requests/s")
    if figures["ratio"] is not None:
        lines.append(f"  B/A capacity: {figures['ratio']:.2f}")
    lines.append("attainment curve (rate/s: share meeting both SLOs)")
    for name, curve in figures["curve"].items():
        lines.append(f"  {name}: " + ", ".join(f"{r:.3g}: {a:.2f}" for r, a in curve))
    return "\n".join(lines)
