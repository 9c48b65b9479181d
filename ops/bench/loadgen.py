"""Closed-loop users. K users released together, each sending R requests in turn.

Every request has a prompt of exactly ``npp`` token ids and generates exactly ``ntg`` tokens
(``ignore_eos``). Aggregate throughput is the generated tokens of the measured phase over its
wall time (barrier open to last request ended), so the tail where fewer users remain active is
part of the figure, as it is for a real closed-loop client population.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamactor.ops.bench.latency import latency_of, ratio_keys
from llamactor.ops.bench.phase import WARMUP_NTG, Job, PhaseResult, Request
from llamactor.ops.bench.prompts import PromptSource
from llamactor.ops.bench.runner import Common
from llamactor.ops.bench.slo import LatencyReport
from llamactor.ops.bench.stats import CrossCheck, Distribution, RequestRecord, finite

MAX_ERRORS_SHOWN = 3


def error_sample(records: list[RequestRecord]) -> list[str]:
    """Up to ``MAX_ERRORS_SHOWN`` distinct error messages, in order of first appearance."""
    seen: list[str] = []
    for r in records:
        if r.error is not None and r.error not in seen:
            seen.append(r.error)
            if len(seen) == MAX_ERRORS_SHOWN:
                break
    return seen


def prompt_mismatches(records: list[RequestRecord]) -> int:
    """Completed requests whose server-reported prompt length differs from what was sent."""
    return sum(1 for r in records if r.ok and r.n_prompt_server is not None and r.n_prompt_server != r.n_prompt_sent)


@dataclass(frozen=True)
class ClosedLoop:
    name = "closed"

    users: int = 8
    requests: int = 4  # per user
    npp: int = 128
    ntg: int = 128
    common: Common = Common()

    @property
    def n_requests(self) -> int:
        return self.users * self.requests

    def plan(self, prompts: PromptSource) -> tuple[list[Job], list[Job]]:
        warm = (
            [
                Job("user", tuple(Request(prompts.take(self.npp), WARMUP_NTG) for _ in range(self.common.warmup)))
                for _ in range(self.users)
            ]
            if self.common.warmup > 0
            else []
        )
        jobs = [
            Job("user", tuple(Request(prompts.take(self.npp), self.ntg) for _ in range(self.requests)))
            for _ in range(self.users)
        ]
        return warm, jobs

    def summarize(self, phase: PhaseResult, warmup_failed: int) -> ClosedLoopResult:
        records = phase.all_records()
        ok = [r for r in records if r.ok]
        generated = sum(r.n_generated for r in ok)
        return ClosedLoopResult(
            users=self.users,
            requests_per_user=self.requests,
            npp=self.npp,
            ntg=self.ntg,
            api=self.common.api,
            ok=len(ok),
            failed=len(records) - len(ok),
            warmup_failed=warmup_failed,
            errors=error_sample(records),
            wall_s=phase.wall_s,
            generated_tokens=generated,
            tok_s=finite(generated / phase.wall_s) if phase.wall_s > 0 else None,
            ttft=Distribution.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
            tpot=Distribution.of_seconds([r.tpot_s for r in ok if r.tpot_s is not None]),
            gap=Distribution.of_seconds([g for r in ok for g in r.gaps_s()]),
            latency=Distribution.of_seconds([r.latency_s for r in ok if r.latency_s is not None]),
            prompt_mismatches=prompt_mismatches(records),
            cross_check=phase.cross_check,
            client_cpu_s=phase.client_cpu_s,
            slo=latency_of(records, phase.wall_s, self.common),
            records=records,
            workload=self.name,
        )


@dataclass(frozen=True)
class ClosedLoopResult:
    users: int
    requests_per_user: int
    npp: int
    ntg: int
    api: str
    ok: int
    failed: int
    warmup_failed: int
    errors: list[str]
    wall_s: float
    generated_tokens: int  # by completed requests; the cross-check also counts failed ones
    tok_s: float | None
    ttft: Distribution
    tpot: Distribution
    gap: Distribution  # between consecutive token-carrying stream events of one request
    latency: Distribution
    prompt_mismatches: int
    cross_check: CrossCheck
    client_cpu_s: float  # CPU the harness itself used during the measured phase
    slo: LatencyReport  # TTFT, inter-token, makespan, goodput (ops.bench.slo)
    records: list[RequestRecord] = field(repr=False, compare=False, metadata={"report": False})
    workload: str = "closed"  # or "burst": the same loop with other sizes

    headline = ratio_keys("tok_s", "tpot_p50_ms")

    def notes(self) -> list[str]:
        """Workload-specific reasons to doubt the figures."""
        if self.prompt_mismatches:
            return [f"{self.prompt_mismatches} request(s) were evaluated with another prompt length than sent"]
        return []

    def figures(self) -> dict[str, float | int | None]:
        """Own figures, then the latency ones (TTFT, inter-token gaps = ``gap``, makespan = wall)."""
        return {
            "tok_s": self.tok_s,
            "tpot_p50_ms": self.tpot.p50_ms,
            "ok": self.ok,
            "failed": self.failed,
            "server_tokens": self.cross_check.server_tokens,
            "diff_percent": self.cross_check.diff_percent,
            **self.slo.figures(),
        }


__all__ = ["ClosedLoop", "ClosedLoopResult", "error_sample", "prompt_mismatches"]
