"""More shapes of traffic for ``llamactor bench``: burst, shared prefix, open-loop Poisson.

Burst: ``users`` closed-loop users released together, each sending ``requests`` long distinct
prompts (1,000 tokens by default) one after another; the shape where a policy that shares a
small prefill budget between many waiting prompts gives everyone a late first token.

Shared prefix: the same closed loop, but every prompt is one long common prefix (a system
prompt, ``prefix_npp`` tokens, drawn once per run) followed by a distinct ``npp``-token suffix,
sent with ``cache_prompt`` so a server can prefill the prefix once and share it. The warm-up
uses other prompts, so the measured phase starts with the prefix cached nowhere.
``prompt_processed`` is the server's own count of prompt tokens evaluated.

Poisson: open loop. ``requests`` requests arrive at exponential gaps (mean 1 / ``rate``
seconds, from a seeded RNG; the first at 0), each sent at its arrival time whatever the others
do. Prompt and output lengths are drawn from ``npp_dist`` / ``ntg_dist`` (``fixed:N``,
``uniform:LO:HI``, ``lognormal:MEDIAN:SIGMA``) or read from a JSONL file (``--lengths``), whose
lines may carry their own arrival times (``at``); both are ``ops.bench.lengths``. Arrivals and lengths depend on
``common.seed`` only, so both servers of a ``--vs`` pair, and every pair, get the same trace;
the prompts' ids still differ per run. ``lag_max_ms`` is how late the client sent the latest
request against its schedule: large values mean the client, not the server, set the pace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from llamactor.ops.bench.latency import latency_of, ratio_keys
from llamactor.ops.bench.lengths import DEFAULT_LENGTHS, LengthDist, Shape
from llamactor.ops.bench.loadgen import ClosedLoop, ClosedLoopResult, error_sample
from llamactor.ops.bench.phase import WARMUP_NTG, Job, PhaseResult, Request
from llamactor.ops.bench.prompts import PromptSource
from llamactor.ops.bench.runner import Common
from llamactor.ops.bench.slo import LatencyReport
from llamactor.ops.bench.stats import MS_PER_S, CrossCheck, RequestRecord, finite, ratio

ARRIVAL_STREAM, LENGTH_STREAM = 1, 2  # RNG streams of one seed: arrival gaps, lengths
POISSON_WARMUP_JOBS = 4  # warm-up requests per round (open loop has no users to warm up)
LAG_WARN_MS = 50.0  # a request sent later than this after its arrival time: the client lagged
DEFAULT_POISSON_REQUESTS = 64


# ---- burst and shared prefix (closed loop) --------------------------------------------------


@dataclass(frozen=True)
class Burst(ClosedLoop):
    """``users`` x ``requests`` long distinct prompts, all users released together."""

    name = "burst"

    users: int = 32
    requests: int = 2
    npp: int = 1000
    ntg: int = 64


@dataclass(frozen=True)
class SharedPrefixResult(ClosedLoopResult):
    prefix_npp: int = 0
    prompt_tokens_sent: int = 0  # by every request of the measured phase
    prompt_tokens_server: int | None = None  # delta of llamacpp:prompt_tokens_total; None: not exposed

    headline = ratio_keys("tok_s", "prompt_processed")

    def figures(self) -> dict[str, float | int | None]:
        figs = super().figures()
        own = {
            "prompt_sent": self.prompt_tokens_sent,
            "prompt_processed": self.prompt_tokens_server,
            "processed_share": ratio(self.prompt_tokens_server, self.prompt_tokens_sent),
        }
        return {**own, **figs}


@dataclass(frozen=True)
class SharedPrefix(ClosedLoop):
    """Closed loop over prompts = one shared ``prefix_npp``-token prefix + ``npp`` distinct tokens."""

    name = "shared-prefix"

    users: int = 32
    requests: int = 2
    npp: int = 32  # the distinct suffix of each prompt
    ntg: int = 64
    prefix_npp: int = 1000

    def plan(self, prompts: PromptSource) -> tuple[list[Job], list[Job]]:
        n = self.prefix_npp + self.npp
        warm = (
            [
                Job("user", tuple(Request(prompts.take(n), WARMUP_NTG) for _ in range(self.common.warmup)))
                for _ in range(self.users)
            ]
            if self.common.warmup > 0
            else []
        )
        prefix = prompts.take(self.prefix_npp)
        jobs = [
            Job(
                "user",
                tuple(
                    Request(prefix + prompts.take(self.npp), self.ntg, cache_prompt=True) for _ in range(self.requests)
                ),
            )
            for _ in range(self.users)
        ]
        return warm, jobs

    def summarize(self, phase: PhaseResult, warmup_failed: int) -> SharedPrefixResult:
        base = super().summarize(phase, warmup_failed)
        return SharedPrefixResult(
            **{f.name: getattr(base, f.name) for f in fields(ClosedLoopResult)},
            prefix_npp=self.prefix_npp,
            prompt_tokens_sent=sum(r.n_prompt_sent for r in base.records),
            prompt_tokens_server=phase.server_prompt_tokens,
        )


# ---- open-loop Poisson arrivals ---------------------------------------------------------------


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """``n`` Poisson arrivals at ``rate`` per second: the first at 0, then exponential gaps."""
    gaps = np.random.default_rng([seed, ARRIVAL_STREAM]).exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0] + [float(t) for t in np.cumsum(gaps)] if n > 0 else []


def _cycled(trace: list[Shape], n: int) -> list[Shape]:
    """A timed trace (sorted by ``at``) repeated to ``n`` requests; each repetition starts one
    mean gap (last ``at`` / lines) after the previous one's last arrival."""
    last = trace[-1].at or 0.0
    period = last + last / len(trace)
    return [
        Shape(s.npp, s.ntg, (s.at or 0.0) + (i // len(trace)) * period)
        for i in range(n)
        for s in (trace[i % len(trace)],)
    ]


@dataclass(frozen=True)
class Poisson:
    name = "poisson"

    rate: float | None = None  # requests per second; None only with a timed lengths file
    requests: int = DEFAULT_POISSON_REQUESTS
    npp_dist: LengthDist = DEFAULT_LENGTHS
    ntg_dist: LengthDist = DEFAULT_LENGTHS
    lengths_file: str | None = None
    common: Common = Common()
    lengths: tuple[Shape, ...] | None = field(default=None, repr=False, metadata={"report": False})

    def __post_init__(self) -> None:
        timed = self.lengths is not None and self.lengths[0].at is not None
        if timed and self.rate is not None:
            raise ValueError(
                f'--rate and the arrival times ("at") of --lengths {self.lengths_file} exclude each other; drop one'
            )
        if not timed and (self.rate is None or not math.isfinite(self.rate) or self.rate <= 0):
            raise ValueError(f"--rate must be a number of requests per second > 0, got {self.rate}")
        if self.requests < 1:
            raise ValueError(f"--requests must be at least 1, got {self.requests}")

    @property
    def n_requests(self) -> int:
        return self.requests

    def schedule(self) -> list[Shape]:
        """Every request's lengths and arrival time (seconds after the barrier), in arrival order;
        a function of the settings and ``common.seed`` alone."""
        n, seed = self.requests, self.common.seed
        if self.lengths is not None and self.lengths[0].at is not None:
            return _cycled(sorted(self.lengths, key=lambda s: s.at or 0.0), n)
        if self.lengths is not None:
            sizes = [(s.npp, s.ntg) for i in range(n) for s in (self.lengths[i % len(self.lengths)],)]
        else:
            rng = np.random.default_rng([seed, LENGTH_STREAM])
            sizes = list(zip(self.npp_dist.draw(rng, n), self.ntg_dist.draw(rng, n)))
        assert self.rate is not None  # __post_init__
        return [Shape(npp, ntg, t) for (npp, ntg), t in zip(sizes, arrival_times(n, self.rate, seed))]

    def plan(self, prompts: PromptSource) -> tuple[list[Job], list[Job]]:
        shapes = self.schedule()
        warm = (
            [
                Job("warmup", tuple(Request(prompts.take(s.npp), WARMUP_NTG) for _ in range(self.common.warmup)))
                for s in shapes[:POISSON_WARMUP_JOBS]
            ]
            if self.common.warmup > 0
            else []
        )
        jobs = [Job("arrival", (Request(prompts.take(s.npp), s.ntg),), offset_s=s.at or 0.0) for s in shapes]
        return warm, jobs

    def summarize(self, phase: PhaseResult, warmup_failed: int) -> PoissonResult:
        records = phase.of_kind("arrival")
        lags = [
            rec.sent_s - (phase.t0_s + job.offset_s)
            for job, recs in zip(phase.jobs, phase.records)
            for rec in recs
            if rec.sent_s > 0
        ]
        last_arrival = max((job.offset_s for job in phase.jobs), default=0.0)
        ok = [r for r in records if r.ok]
        generated = sum(r.n_generated for r in ok)
        return PoissonResult(
            rate=self.rate,
            requests=self.requests,
            npp_dist=str(self.npp_dist),
            ntg_dist=str(self.ntg_dist),
            lengths_file=self.lengths_file,
            api=self.common.api,
            ok=len(ok),
            failed=len(records) - len(ok),
            warmup_failed=warmup_failed,
            errors=error_sample(records),
            makespan_s=phase.wall_s,
            offered_rps=ratio(float(len(records) - 1), last_arrival),
            done_rps=ratio(float(len(ok)), phase.wall_s),
            generated_tokens=generated,
            tok_s=ratio(float(generated), phase.wall_s),
            prompt_tokens_sent=sum(r.n_prompt_sent for r in records),
            lag_max_ms=finite(max(lags) * MS_PER_S) if lags else None,
            cross_check=phase.cross_check,
            client_cpu_s=phase.client_cpu_s,
            slo=latency_of(records, phase.wall_s, self.common),
            records=records,
        )


@dataclass(frozen=True)
class PoissonResult:
    rate: float | None
    requests: int
    npp_dist: str
    ntg_dist: str
    lengths_file: str | None
    api: str
    ok: int
    failed: int
    warmup_failed: int
    errors: list[str]
    makespan_s: float
    offered_rps: float | None  # arrivals per second over the span of the schedule
    done_rps: float | None  # completed requests per second of makespan
    generated_tokens: int
    tok_s: float | None
    prompt_tokens_sent: int
    lag_max_ms: float | None  # latest send against its scheduled arrival
    cross_check: CrossCheck
    client_cpu_s: float
    slo: LatencyReport
    records: list[RequestRecord] = field(repr=False, compare=False, metadata={"report": False})

    workload = "poisson"
    headline = ratio_keys("tok_s", "goodput_rps")

    def notes(self) -> list[str]:
        if self.lag_max_ms is not None and self.lag_max_ms > LAG_WARN_MS:
            return [
                f"a request left {self.lag_max_ms:.0f} ms after its arrival time: the client could not keep "
                "the schedule (open loop), arrivals were later than planned"
            ]
        return []

    def figures(self) -> dict[str, float | int | None]:
        return {
            "offered_rps": self.offered_rps,
            "done_rps": self.done_rps,
            "tok_s": self.tok_s,
            "lag_max_ms": self.lag_max_ms,
            "ok": self.ok,
            "failed": self.failed,
            "server_tokens": self.cross_check.server_tokens,
            "diff_percent": self.cross_check.diff_percent,
            **self.slo.figures(),
        }


__all__ = [
    "DEFAULT_POISSON_REQUESTS",
    "Burst",
    "Poisson",
    "PoissonResult",
    "SharedPrefix",
    "SharedPrefixResult",
    "arrival_times",
]
