"""Capacity at an SLO, as serving papers measure it (DistServe, Sarathi-Serve, ``vllm bench serve
--goodput``): ``llamactor bench --capacity`` (docs/benchmarking.md says it for users).

The question: what is the highest request rate at which at least ``TARGET`` (90 %) of requests
meet both their time-to-first-token SLO and their time-per-output-token SLO (*attainment*)?

- **SLOs relative to the machine**: ``--slo-scale`` (5) times the faster server's unloaded TTFT
  per prompt token (plus ``TTFT_FLOOR_MS``: HTTP, the template, the first sample, jitter) and
  TPOT, medians over ``REFERENCE_REQUESTS`` requests sent one at a time after a warm-up.
- **The search**: each server's bracket doubles (or halves) the rate until attainment crosses
  the target, then bisects on a log scale to ``--capacity-precision`` (at most ``MAX_POINTS``
  rates); A then B at each step, each rate with the same seeded requests (lengths and arrivals
  from the seed, scaled by 1 / rate; prompts from the seed, the rate and a number drawn per
  run, so that no server answers from an earlier run's cache).
- **A rate's outcome is known early when it fails**: once more requests missed than the target
  allows, the point stops (``phase.measure``'s ``stop``); the requests in flight are cut and
  count as misses, and the next point waits until the server is idle.

Reported: each server's capacity (the highest rate measured to meet the target), its bracket,
the ratio B/A, the attainment curve, and per point the front end's share of TTFT.
"""

from __future__ import annotations

import math
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import numpy as np

from llamactor.ops.bench.apis import Vocabulary
from llamactor.ops.bench.capacity_shapes import SHAPES, Shape, mean_lengths, workload
from llamactor.ops.bench.client import BenchClient
from llamactor.ops.bench.phase import Request
from llamactor.ops.bench.prompts import run_seed
from llamactor.ops.bench.random.randomrun import RandomRun
from llamactor.ops.bench.random.suite import run_random
from llamactor.ops.bench.runner import Common
from llamactor.ops.bench.stats import MS_PER_S, RequestRecord

TARGET = 0.9  # the share of requests that must meet both SLOs (DistServe's and vLLM's 90 %)
# 5x the unloaded latency: a request that waits behind about four others of its size still
# meets it, so the search finds where queueing and batching, not the model, decide
DEFAULT_SLO_SCALE = 5.0
TTFT_FLOOR_MS = 50.0  # added to every TTFT SLO: per-request costs a per-token figure misses
# Requests per rate: a search costs about 6 rates a server, each requests / rate seconds; at
# worst ~12 x requests x T0 for two servers (T0: one mean request unloaded; sharegpt on
# gemma3-270m and 2 cores ~3 s: 7.5 minutes). 90 % of 12 still tells one miss from two
DEFAULT_CAPACITY_REQUESTS = 12
DEFAULT_PRECISION = 0.10  # stop once the bracket's high end is within 10 % of its low end
MAX_POINTS = 12  # rates measured per server, at most (doubling 6 times and bisecting 6)
REFERENCE_REQUESTS = 4  # unloaded requests per server, after one warm-up request
IDLE_WAIT_S = 60.0  # after a point cut short: how long to wait for the server to drop its requests
IDLE_POLL_S = 0.2
IDLE_FALLBACK_S = 2.0  # a server without /metrics: a fixed pause instead


@dataclass(frozen=True)
class Slo:
    """The two SLOs every request is judged by; built once from the reference latencies."""

    ttft_ms_per_token: float
    tpot_ms: float
    floor_ms: float = TTFT_FLOOR_MS

    @classmethod
    def scaled(cls, ref_ttft_ms_per_token: float, ref_tpot_ms: float, scale: float) -> Slo:
        return cls(scale * ref_ttft_ms_per_token, scale * ref_tpot_ms)

    def ttft_ms(self, prompt_tokens: int) -> float:
        """The TTFT SLO of a request of ``prompt_tokens``."""
        return self.floor_ms + self.ttft_ms_per_token * prompt_tokens

    def met(self, rec: RequestRecord) -> bool:
        """Both SLOs met by a completed request (a failed one meets neither; a one-token answer
        has no TPOT and is judged on TTFT alone)."""
        ttft, tpot = rec.ttft_s, rec.tpot_s
        return rec.ok and self.met_by(ttft * MS_PER_S if ttft is not None else None, tpot, prompt_tokens(rec))

    def met_by(self, ttft_ms: float | None, tpot_s: float | None, n_prompt: int) -> bool:
        """Both SLOs met by a request that completed with these figures (the replay's too)."""
        if ttft_ms is None or ttft_ms > self.ttft_ms(n_prompt):
            return False
        return tpot_s is None or tpot_s * MS_PER_S <= self.tpot_ms


def reference_slo(refs: dict[str, tuple[float, float]], scale: float) -> tuple[dict[str, str], Slo]:
    """The SLOs both servers are held to: ``scale`` x the faster server's unloaded TTFT per
    prompt token and TPOT (each figure from the server faster at it), and which server that was."""
    ttft = min(refs, key=lambda n: refs[n][0])
    tpot = min(refs, key=lambda n: refs[n][1])
    return {"ttft": ttft, "tpot": tpot}, Slo.scaled(refs[ttft][0], refs[tpot][1], scale)


def prompt_tokens(rec: RequestRecord) -> int:
    """The request's prompt tokens as the server counted them (chat: the template and the whole
    history included), else the ids the client sent."""
    return rec.n_prompt_server if rec.n_prompt_server else rec.n_prompt_sent


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

    @classmethod
    def measured(cls, points: list[Point]) -> Bracket:
        """The bracket of rates given, not searched: what they met and missed."""
        b = cls(points[0].rate if points else 0.0)
        for p in points:
            b.record(p.rate, p.attainment)
        return b

    @property
    def capacity(self) -> float:
        """The highest rate measured to meet the target (0 when none did)."""
        return self.lo or 0.0

    @property
    def bounded(self) -> bool:
        """Both ends found: the capacity is within ``precision`` of the truth unless cut by
        ``max_points``."""
        return self.lo is not None and self.hi is not None


def max_points_needed(start: float, capacity: float, precision: float) -> int:
    """Rates a bracket measures at most for a step at ``capacity``: doubling or halving until
    crossed (and one past), then log bisection from a factor of 2 down to ``1 + precision``."""
    doubling = math.ceil(abs(math.log2(capacity / start))) + 1
    return doubling + max(0, math.ceil(math.log2(math.log(2) / math.log1p(precision))))


async def search(
    names: list[str], attainment: Callable[[str, float], Awaitable[float]], start: float, precision: float
) -> dict[str, Bracket]:
    """Each server's bracket; at every step each unfinished server measures its next rate, in
    the order of ``names`` (A then B)."""
    brackets = {name: Bracket(start, precision) for name in names}
    while not all(b.done for b in brackets.values()):
        for name, b in brackets.items():
            if not b.done:
                rate = b.next_rate()
                b.record(rate, await attainment(name, rate))
    return brackets


@dataclass(frozen=True)
class Point:
    """One server at one rate."""

    rate: float
    attainment: float  # met / requests; requests cut or failed count as misses
    met: int
    requests: int
    stopped: bool  # cut short once the target was out of reach
    lag_max_ms: float | None  # the client's latest send against the schedule
    failed: int = 0  # requests that ended in an error (a timeout, a dropped connection), not cut
    # client TTFT minus the server's own prompt time (``timings.prompt_ms``), ms: what the front
    # end (HTTP, template, tokenizer, queues) and waiting for a first batch add; p50, p99
    front_ms: tuple[float, float] | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "front_ms": {"p50": self.front_ms[0], "p99": self.front_ms[1]} if self.front_ms else None,
            "rate": self.rate,
            "attainment": self.attainment,
            "met": self.met,
            "requests": self.requests,
            "stopped": self.stopped,
            "lag_max_ms": self.lag_max_ms,
            "failed": self.failed,
        }


class Session:
    """The servers, the shape and the probed vocabulary of one ``--capacity`` run."""

    def __init__(
        self, urls: dict[str, str], shape: Shape, arrivals: str, requests: int, common: Common, vocab: Vocabulary
    ) -> None:
        self.urls, self.shape, self.arrivals, self.requests = urls, shape, arrivals, requests
        self.common = replace(common, warmup=0)
        self.vocab = vocab
        self.ids = sorted(vocab.pieces)
        self.workload = workload(shape, arrivals, requests, common.seed)
        self.points: dict[str, list[Point]] = {name: [] for name in urls}
        # prompts differ from run to run (lengths, arrivals do not): no answer from an old cache
        self.nonce = secrets.randbits(31)

    async def reference(self, name: str) -> tuple[float, float]:
        """(TTFT ms per prompt token, TPOT ms) of one server unloaded: medians over requests sent
        one at a time after a warm-up request."""
        wl = workload(self.shape, self.arrivals, REFERENCE_REQUESTS, self.common.seed, closed=True)
        run = RandomRun(wl, None, replace(self.common, warmup=1))
        seed = run_seed(self.common.seed, self.nonce, 1 << 31)
        res = await run_random(self.urls[name], run, self.vocab, self.ids, seed)
        self.check_refused(name, res.records)
        done = [r for r in res.records if r.ok and r.ttft_s is not None]
        if not done:
            raise RuntimeError(f"{name} ({self.urls[name]}): no unloaded request completed: {res.errors}")
        ttft = statistics.median(r.ttft_s * MS_PER_S / max(prompt_tokens(r), 1) for r in done if r.ttft_s)
        tpots = [r.tpot_s * MS_PER_S for r in done if r.tpot_s is not None]
        return ttft, statistics.median(tpots) if tpots else 0.0

    async def point(self, name: str, rate: float, slo: Slo, *, stop_early: bool = True) -> Point:
        """``requests`` requests at ``rate`` on one server; stopped once too many missed
        (unless not ``stop_early``: every request measured)."""
        n = self.workload.n_requests
        allowed = n - math.ceil(TARGET * n - 1e-9)
        misses = 0
        stop = anyio.Event()

        def judge(_: Request, rec: RequestRecord) -> None:
            nonlocal misses
            if not slo.met(rec):
                misses += 1
                if misses > allowed and stop_early:
                    stop.set()

        seed = run_seed(self.common.seed, round(rate * 1e6), self.nonce)  # same at one rate, new at the next
        run = RandomRun(self.workload, rate, self.common)
        res = await run_random(self.urls[name], run, self.vocab, self.ids, seed, on_record=judge, stop=stop)
        if stop.is_set():
            await self.wait_idle(self.urls[name])
        self.check_refused(name, res.records)
        met = sum(slo.met(r) for r in res.records)
        point = Point(rate, met / n, met, n, stop.is_set(), res.lag_max_ms, res.failed, front_end_ms(res.records))
        self.points[name].append(point)
        return point

    def check_refused(self, name: str, records: list[RequestRecord]) -> None:
        """Stop the search when the server refuses requests (HTTP 4xx): a setting, not load,
        decides that, most often a context per slot too small for the shape's largest request."""
        refused = [r.error for r in records if r.error and r.error.startswith("HTTP 4")]
        if refused:
            raise RuntimeError(
                f"{name} ({self.urls[name]}) refused {len(refused)} request(s): {refused[0]} (a server needs "
                f"{self.workload.slot_context} tokens of context per slot for --shape {self.shape.name})"
            )

    async def wait_idle(self, url: str) -> None:
        """Until the server runs and queues nothing (the cut requests dropped), at most
        ``IDLE_WAIT_S``; a fixed pause where /metrics is off."""
        async with BenchClient(url, "native", timeout_s=self.common.timeout_s, api_key=self.common.api_key) as c:
            deadline = time.monotonic() + IDLE_WAIT_S
            while time.monotonic() < deadline:
                busy = await c.in_flight()
                if busy is None:
                    await anyio.sleep(IDLE_FALLBACK_S)
                    return
                if busy == 0:
                    return
                await anyio.sleep(IDLE_POLL_S)


def front_end_ms(records: list[RequestRecord]) -> tuple[float, float] | None:
    """p50 and p99 of client TTFT minus the server's prompt time, over the completed requests
    whose final event gave ``timings.prompt_ms``."""
    gaps = [
        r.ttft_s * MS_PER_S - r.server_prompt_ms
        for r in records
        if r.ok and r.ttft_s is not None and r.server_prompt_ms is not None
    ]
    if not gaps:
        return None
    return float(np.percentile(gaps, 50)), float(np.percentile(gaps, 99))


async def probe_vocabulary(url: str, common: Common) -> Vocabulary:
    """The token pieces chat prompts are made of (``/tokenize`` with pieces), from ``url``."""
    async with BenchClient(url, "native", timeout_s=common.timeout_s, api_key=common.api_key) as probe:
        vocab = await probe.vocabulary()
    if vocab is None:
        raise RuntimeError(f"{url} gives no text pieces of tokens (/tokenize with_pieces): chat prompts need them")
    return vocab


async def run_capacity(
    urls: dict[str, str],
    *,
    shape: str = "sharegpt",
    arrivals: str = "poisson",
    scale: float = DEFAULT_SLO_SCALE,
    requests: int = DEFAULT_CAPACITY_REQUESTS,
    precision: float = DEFAULT_PRECISION,
    start_rate: float | None = None,
    rates: tuple[float, ...] = (),
    common: Common | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Measure the references, set the SLOs, search each server's capacity: the figures.

    ``start_rate`` None: one request per unloaded latency of a mean request, the rate a server
    serving one request at a time would just keep up with; a batching server's capacity is
    above it, and doubling finds it."""
    common = common or Common()
    began = time.monotonic()
    spec = SHAPES[shape]
    session = Session(urls, spec, arrivals, requests, common, await probe_vocabulary(next(iter(urls.values())), common))
    refs = {}
    for name in urls:
        refs[name] = await session.reference(name)
        say(f"{name} unloaded: TTFT {refs[name][0]:.3f} ms per prompt token, TPOT {refs[name][1]:.1f} ms")
    ref_names, slo = reference_slo(refs, scale)
    if start_rate is None:
        npp, ntg = mean_lengths(spec, common.seed)
        unloaded_s = (slo.ttft_ms_per_token * npp + slo.tpot_ms * max(ntg - 1, 0)) / scale / MS_PER_S
        start_rate = float(f"{1.0 / max(unloaded_s, 1e-3):.3g}")

    async def attainment(name: str, rate: float) -> float:
        p = await session.point(name, rate, slo)
        say(f"{name} at {rate:.3g} req/s: {p.attainment:.0%} met both SLOs{' (stopped early)' if p.stopped else ''}")
        return p.attainment

    if rates:  # the given rates only, every request measured (A then B at each)
        for rate in rates:
            for name in urls:
                p = await session.point(name, rate, slo, stop_early=False)
                say(f"{name} at {rate:.3g} req/s: {p.attainment:.0%} met both SLOs")
        brackets = {name: Bracket.measured(session.points[name]) for name in urls}
    else:
        brackets = await search(list(urls), attainment, start_rate, precision)
    caps = {name: b.capacity for name, b in brackets.items()}
    names = list(urls)
    return {
        "shape": shape,
        "seed": common.seed,
        "shape_about": spec.about,
        "arrivals": arrivals,
        "requests_per_point": requests,
        "target": TARGET,
        "slo_scale": scale,
        "precision": precision,
        "start_rate": start_rate,
        "reference_server": ref_names,
        "slo": {"ttft_ms_per_token": slo.ttft_ms_per_token, "ttft_floor_ms": slo.floor_ms, "tpot_ms": slo.tpot_ms},
        "reference": {n: {"ttft_ms_per_token": r[0], "tpot_ms": r[1]} for n, r in refs.items()},
        "servers": {
            n: {"url": urls[n], "capacity_rps": caps[n], "bracket": [b.lo, b.hi], "bounded": b.bounded}
            for n, b in brackets.items()
        },
        "capacity_rps": caps,
        "ratio": caps[names[1]] / caps[names[0]] if len(names) == 2 and caps[names[0]] > 0 else None,
        "curve": {n: [p.as_json() for p in sorted(session.points[n], key=lambda p: p.rate)] for n in names},
        "elapsed_s": time.monotonic() - began,
    }


__all__ = [
    "DEFAULT_CAPACITY_REQUESTS",
    "DEFAULT_PRECISION",
    "DEFAULT_SLO_SCALE",
    "MAX_POINTS",
    "TARGET",
    "TTFT_FLOOR_MS",
    "Bracket",
    "Point",
    "Slo",
    "max_points_needed",
    "reference_slo",
    "run_capacity",
    "search",
]
