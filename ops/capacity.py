"""Capacity at an SLO, as serving papers measure it (DistServe, Sarathi-Serve, ``vllm bench serve
--goodput``): ``llamactor bench --capacity``.

The question: what is the highest request rate at which at least ``TARGET`` (90 %) of requests
meet both their time-to-first-token SLO and their time-per-output-token SLO (*attainment*)?

- **SLOs relative to the machine.** Each server's unloaded latency is measured once: a warm-up
  request, then ``REFERENCE_REQUESTS`` requests of the shape one at a time; the medians of TTFT
  per prompt token and of TPOT. The faster server's figures are the reference for both, so both
  are held to the same SLOs: ``--slo-scale`` (5) times the reference. A request's TTFT SLO is
  ``TTFT_FLOOR_MS`` + scale x reference-per-token x its prompt tokens (the floor covers what a
  per-token figure misses: HTTP, the chat template, the first sample, and jitter that would
  decide a short prompt's fate); the TPOT SLO is scale x the reference TPOT.
- **The search.** Each server keeps a bracket: the rate is doubled (or halved) from the start
  rate until attainment crosses the target, then bisected on a log scale until the bracket's
  ends are within ``--capacity-precision``; at most ``MAX_POINTS`` rates per server. At each
  step A then B measure their next rate, each rate with ``--capacity-requests`` requests of the
  same seeded sequence (lengths and arrival pattern from the seed, scaled by 1 / rate; prompts
  from the seed and the rate, so a server never sees a prompt twice). While the brackets agree
  the servers measure the same rates.
- **A rate's outcome is known early when it fails.** Once more requests missed than the target
  allows, the point stops (``phase.measure``'s ``stop``): the requests in flight are cut and
  count as misses, and the next point waits until the server is idle.

Reported: each server's capacity (the bracket's low end: the highest rate measured to meet the
target), its bracket, the ratio B/A, and the attainment curve (rate -> attainment per server).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from llamactor.ops.apis import Vocabulary
from llamactor.ops.capacity_shapes import SHAPES, Shape, mean_lengths, workload
from llamactor.ops.client import BenchClient
from llamactor.ops.phase import Request
from llamactor.ops.prompts import run_seed
from llamactor.ops.randomrun import RandomRun
from llamactor.ops.runner import Common
from llamactor.ops.stats import MS_PER_S, RequestRecord
from llamactor.ops.suite import run_random

TARGET = 0.9  # the share of requests that must meet both SLOs (DistServe's and vLLM's 90 %)
# 5x the unloaded latency: a request that waits behind about four others of its size still
# meets it, so the search finds where queueing and batching, not the model, decide
DEFAULT_SLO_SCALE = 5.0
TTFT_FLOOR_MS = 50.0  # added to every TTFT SLO: per-request costs a per-token figure misses
# Requests per rate. A search costs about 6 rates a server, and a rate that is met costs
# requests / rate seconds: in the worst case (capacity near one request per unloaded latency T0
# of a mean request) about 12 x requests x T0 for two servers. gemma3-270m on 2 cores (~3,000
# prompt and ~28 single-stream generated tokens/s) serves a mean sharegpt request in T0 ~ 3 s:
# 12 requests take ~7.5 minutes, leaving room under 15 for a slower or shared machine; 90 % of
# 12 still tells one miss from two
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
        if not rec.ok or rec.ttft_s is None or rec.ttft_s * MS_PER_S > self.ttft_ms(prompt_tokens(rec)):
            return False
        return rec.tpot_s is None or rec.tpot_s * MS_PER_S <= self.tpot_ms


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

    def as_json(self) -> dict[str, Any]:
        return {
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

    async def reference(self, name: str) -> tuple[float, float]:
        """(TTFT ms per prompt token, TPOT ms) of one server unloaded: medians over requests sent
        one at a time after a warm-up request."""
        wl = workload(self.shape, self.arrivals, REFERENCE_REQUESTS, self.common.seed, closed=True)
        run = RandomRun(wl, None, replace(self.common, warmup=1))
        res = await run_random(self.urls[name], run, self.vocab, self.ids, run_seed(self.common.seed, 0, 1 << 20))
        self.check_refused(name, res.records)
        done = [r for r in res.records if r.ok and r.ttft_s is not None]
        if not done:
            raise RuntimeError(f"{name} ({self.urls[name]}): no unloaded request completed: {res.errors}")
        ttft = statistics.median(r.ttft_s * MS_PER_S / max(prompt_tokens(r), 1) for r in done if r.ttft_s)
        tpots = [r.tpot_s * MS_PER_S for r in done if r.tpot_s is not None]
        return ttft, statistics.median(tpots) if tpots else 0.0

    async def point(self, name: str, rate: float, slo: Slo) -> Point:
        """``requests`` requests at ``rate`` on one server; stopped once too many missed."""
        n = self.workload.n_requests
        allowed = n - math.ceil(TARGET * n - 1e-9)
        misses = 0
        stop = anyio.Event()

        def judge(_: Request, rec: RequestRecord) -> None:
            nonlocal misses
            if not slo.met(rec):
                misses += 1
                if misses > allowed:
                    stop.set()

        seed = run_seed(self.common.seed, round(rate * 1e6), 0)  # same at one rate, new at the next
        run = RandomRun(self.workload, rate, self.common)
        res = await run_random(self.urls[name], run, self.vocab, self.ids, seed, on_record=judge, stop=stop)
        if stop.is_set():
            await self.wait_idle(self.urls[name])
        self.check_refused(name, res.records)
        met = sum(slo.met(r) for r in res.records)
        point = Point(rate, met / n, met, n, stop.is_set(), res.lag_max_ms, res.failed)
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

    brackets = await search(list(urls), attainment, start_rate, precision)
    caps = {name: b.capacity for name, b in brackets.items()}
    names = list(urls)
    return {
        "shape": shape,
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
    lines.append(f"took {figures['elapsed_s']:.0f} s")
    return "\n".join(lines)


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
    "render",
    "run_capacity",
    "search",
]
