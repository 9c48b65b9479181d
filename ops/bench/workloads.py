"""The two workloads for comparing scheduling policies.

Mixed: ``streams`` requests generate ``ntg`` tokens each while long prompts of ``arrival_npp``
tokens arrive at set offsets after the barrier. A policy that prefills an arrival in one go
stalls the streams (large gap max/p99); one that chunks it trades arrival TTFT for smoother
streams. ``arrivals_during_streams`` says how many arrivals actually met running streams: if
the streams were already done, the gap figures say nothing about the policy.

Cohort: prompts of unequal length (several n_batch chunks each) arrive together, then each
generates ``ntg`` tokens. ``all_prefilled_s`` is the time until every prompt has produced its
first token; ``gen_tok_s`` counts tokens received after that instant over the time after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamactor.ops.bench.latency import latency_of, ratio_keys
from llamactor.ops.bench.loadgen import error_sample
from llamactor.ops.bench.phase import WARMUP_NTG, Job, PhaseResult, Request
from llamactor.ops.bench.prompts import PromptSource
from llamactor.ops.bench.runner import Common
from llamactor.ops.bench.slo import LatencyReport
from llamactor.ops.bench.stats import MS_PER_S, CrossCheck, Distribution, RequestRecord, finite, ratio

DEFAULT_ARRIVALS_S = (1.0, 2.5, 4.0)
DEFAULT_COHORT_NPP = (600, 1100, 1600, 2100)


def _warmup(common: Common, lengths: list[int], prompts: PromptSource) -> list[Job]:
    """One warm-up job per measured job, with its prompt length, so big batches are warm too."""
    return (
        [Job("warmup", tuple(Request(prompts.take(n), WARMUP_NTG) for _ in range(common.warmup))) for n in lengths]
        if common.warmup > 0
        else []
    )


@dataclass(frozen=True)
class Mixed:
    name = "mixed"

    streams: int = 4
    npp: int = 32  # prompt of each stream
    ntg: int = 192  # tokens each stream generates
    arrival_npp: int = 768
    arrival_ntg: int = 16
    arrivals_s: tuple[float, ...] = DEFAULT_ARRIVALS_S
    common: Common = Common()

    @property
    def n_requests(self) -> int:
        return self.streams + len(self.arrivals_s)

    def plan(self, prompts: PromptSource) -> tuple[list[Job], list[Job]]:
        warm = _warmup(self.common, [self.npp] * self.streams + [self.arrival_npp] * len(self.arrivals_s), prompts)
        jobs = [Job("stream", (Request(prompts.take(self.npp), self.ntg),)) for _ in range(self.streams)]
        jobs += [
            Job("arrival", (Request(prompts.take(self.arrival_npp), self.arrival_ntg),), offset_s=a)
            for a in self.arrivals_s
        ]
        return warm, jobs

    def summarize(self, phase: PhaseResult, warmup_failed: int) -> MixedResult:
        streams, arrivals = phase.of_kind("stream"), phase.of_kind("arrival")
        records = streams + arrivals
        ok_arrivals = [r for r in arrivals if r.ok]
        ttfts = [r.ttft_s for r in ok_arrivals if r.ttft_s is not None]
        last_stream_token = max((r.event_times[-1] for r in streams if r.event_times), default=phase.t0_s)
        return MixedResult(
            streams=self.streams,
            npp=self.npp,
            ntg=self.ntg,
            arrival_npp=self.arrival_npp,
            arrival_ntg=self.arrival_ntg,
            arrivals_s=list(self.arrivals_s),
            api=self.common.api,
            ok=sum(r.ok for r in records),
            failed=sum(not r.ok for r in records),
            warmup_failed=warmup_failed,
            errors=error_sample(records),
            stream_gap=Distribution.of_seconds([g for r in streams if r.ok for g in r.gaps_s()]),
            arrival_ttft=Distribution.of_seconds(ttfts),
            arrival_ttft_ms=[finite(r.ttft_s * MS_PER_S) if r.ok and r.ttft_s is not None else None for r in arrivals],
            prefill_tok_s=ratio(float(sum(r.n_prompt_sent for r in ok_arrivals if r.ttft_s is not None)), sum(ttfts)),
            makespan_s=phase.wall_s,
            arrivals_during_streams=sum(1 for r in arrivals if r.sent_s < last_stream_token),
            cross_check=phase.cross_check,
            client_cpu_s=phase.client_cpu_s,
            slo=latency_of(records, phase.wall_s, self.common),
            records=records,
        )


@dataclass(frozen=True)
class MixedResult:
    streams: int
    npp: int
    ntg: int
    arrival_npp: int
    arrival_ntg: int
    arrivals_s: list[float]
    api: str
    ok: int
    failed: int
    warmup_failed: int
    errors: list[str]
    stream_gap: Distribution  # every inter-token gap of every stream
    arrival_ttft: Distribution
    arrival_ttft_ms: list[float | None]  # per arrival, in arrival order; None: failed
    prefill_tok_s: float | None  # arrival prompt tokens / sum of arrival TTFTs
    makespan_s: float
    arrivals_during_streams: int
    cross_check: CrossCheck
    client_cpu_s: float
    slo: LatencyReport  # over streams and arrivals together
    records: list[RequestRecord] = field(repr=False, compare=False, metadata={"report": False})

    workload = "mixed"
    headline = ratio_keys("gap_p99_ms", "gap_max_ms", "arrival_ttft_p50_ms", "makespan_s")

    def notes(self) -> list[str]:
        """Workload-specific reasons to doubt the figures."""
        if self.arrivals_during_streams < len(self.arrivals_s):
            return [
                f"only {self.arrivals_during_streams} of {len(self.arrivals_s)} arrivals met running streams; "
                "raise --ntg or move --arrivals earlier"
            ]
        return []

    def figures(self) -> dict[str, float | int | None]:
        return {
            "gap_p50_ms": self.stream_gap.p50_ms,
            "gap_p99_ms": self.stream_gap.p99_ms,
            "gap_max_ms": self.stream_gap.max_ms,
            "arrival_ttft_p50_ms": self.arrival_ttft.p50_ms,
            "arrival_ttft_max_ms": self.arrival_ttft.max_ms,
            "prefill_tok_s": self.prefill_tok_s,
            "makespan_s": self.makespan_s,
            "overlap": self.arrivals_during_streams,
            "ok": self.ok,
            "failed": self.failed,
            "server_tokens": self.cross_check.server_tokens,
            "diff_percent": self.cross_check.diff_percent,
            **self.slo.figures(),
        }


@dataclass(frozen=True)
class Cohort:
    name = "cohort"

    npps: tuple[int, ...] = DEFAULT_COHORT_NPP
    ntg: int = 64
    common: Common = Common()

    @property
    def n_requests(self) -> int:
        return len(self.npps)

    def plan(self, prompts: PromptSource) -> tuple[list[Job], list[Job]]:
        warm = _warmup(self.common, list(self.npps), prompts)
        return warm, [Job("cohort", (Request(prompts.take(n), self.ntg),)) for n in self.npps]

    def summarize(self, phase: PhaseResult, warmup_failed: int) -> CohortResult:
        records = phase.of_kind("cohort")
        firsts = [r.event_times[0] for r in records if r.ok and r.event_times]
        all_prefilled = max(firsts) if len(firsts) == len(records) else None
        after = None
        if all_prefilled is not None:
            after = sum(n for r in records for t, n in zip(r.event_times, r.event_tokens) if t > all_prefilled)
        return CohortResult(
            npps=list(self.npps),
            ntg=self.ntg,
            api=self.common.api,
            ok=sum(r.ok for r in records),
            failed=sum(not r.ok for r in records),
            warmup_failed=warmup_failed,
            errors=error_sample(records),
            ttft_ms=[finite(r.ttft_s * MS_PER_S) if r.ok and r.ttft_s is not None else None for r in records],
            all_prefilled_s=None if all_prefilled is None else all_prefilled - phase.t0_s,
            gen_tok_s=None if all_prefilled is None else ratio(float(after or 0), phase.end_s - all_prefilled),
            makespan_s=phase.wall_s,
            cross_check=phase.cross_check,
            client_cpu_s=phase.client_cpu_s,
            slo=latency_of(records, phase.wall_s, self.common),
            records=records,
        )


@dataclass(frozen=True)
class CohortResult:
    npps: list[int]
    ntg: int
    api: str
    ok: int
    failed: int
    warmup_failed: int
    errors: list[str]
    ttft_ms: list[float | None]  # per prompt, in the order of npps; None: failed
    all_prefilled_s: float | None  # None when a prompt failed
    gen_tok_s: float | None
    makespan_s: float
    cross_check: CrossCheck
    client_cpu_s: float
    slo: LatencyReport
    records: list[RequestRecord] = field(repr=False, compare=False, metadata={"report": False})

    workload = "cohort"
    headline = ratio_keys("all_prefilled_s", "gen_tok_s", "makespan_s")

    def notes(self) -> list[str]:
        return []

    def figures(self) -> dict[str, float | int | None]:
        return {
            "all_prefilled_s": self.all_prefilled_s,
            "gen_tok_s": self.gen_tok_s,
            "makespan_s": self.makespan_s,
            "ok": self.ok,
            "failed": self.failed,
            "server_tokens": self.cross_check.server_tokens,
            "diff_percent": self.cross_check.diff_percent,
            **self.slo.figures(),
        }


__all__ = ["DEFAULT_ARRIVALS_S", "DEFAULT_COHORT_NPP", "Cohort", "CohortResult", "Mixed", "MixedResult"]
