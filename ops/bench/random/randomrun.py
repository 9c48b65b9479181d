"""One run of a drawn random workload (``ops.bench.random.randomload``) against one server: plan and figures.

``RandomRun`` is a ``runner.Workload``: ``plan`` draws the prompts (a fresh ``PromptSource``
per run, so servers of one pair get the same prompts and no pair sees another's) and lays the
requests out as jobs: one per closed-loop user, or one per open-loop arrival at its time. A
request is a ``Dialogue`` (``ops.bench.apis``): a shared prefix is its system message, the new text
its user message. A later turn can only be built once its previous turn has ended, so every
job takes its requests through its own ``TurnFeed`` over one conversation book
(``ops.bench.conversations``, as ``ops.bench.chatload`` does), which builds a later turn from
the previous turn's messages, its answer (token ids from the native dialect, text from the
others) and the new message. A later turn whose previous turn is still running waits for it
(an open-loop arrival then leaves late, as a real user's would); one whose previous turn
failed is sent without that answer.

Figures (pure, ``RandomResult``): TTFT mean/p50/p99, inter-token p50/p99, makespan, and
goodput in two forms: the mean form (``ops.bench.slo``: TTFT <= SLO and mean time per output token
<= SLO) and the percentile form (TTFT <= SLO and the request's own inter-token gaps at
``slo_itl_pct`` <= SLO, so a request with one long stall among fast tokens is not good).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from llamactor.ops.bench.conversations import AfterFailure, Conversations, Turn, TurnFeed, conversation_notes
from llamactor.ops.bench.latency import latency_of
from llamactor.ops.bench.loadgen import error_sample
from llamactor.ops.bench.phase import WARMUP_NTG, Job, PhaseResult, Request
from llamactor.ops.bench.prompts import PromptSource
from llamactor.ops.bench.random.randomworkload import RandomWorkload
from llamactor.ops.bench.runner import Common
from llamactor.ops.bench.slo import LatencyReport
from llamactor.ops.bench.stats import MS_PER_S, CrossCheck, RequestRecord, finite, percentile, ratio

WARMUP_NPP = 32  # prompt tokens of each warm-up request
WARMUP_JOBS_MAX = 8  # warm-up requests per round: one per slot, at most this many
DEFAULT_SLO_ITL_PCT = 90.0
LAG_WARN_MS = 50.0


def conversations_of(workload: RandomWorkload, prefixes: list[list[int]], texts: list[list[int]]) -> Conversations:
    """The conversation book of a drawn workload: request ``i`` sends ``texts[i]`` as its new
    message, a first turn after its shared prefix (``prefixes``) as the system message. A later
    turn whose previous turn failed is still sent, without the answer: the drawn load stays
    the same."""
    turns = [
        Turn(
            tuple(text),
            it.ntg,
            it.follows,
            tuple(prefixes[it.prefix]) if it.prefix is not None and it.follows is None else None,
        )
        for it, text in zip(workload.items, texts)
    ]
    return Conversations(turns, AfterFailure.WITHOUT_ANSWER)


def itl_percentile_good(rec: RequestRecord, common: Common, pct: float) -> bool:
    """Goodput's percentile form for one request: it completed, TTFT <= the SLO, and its own
    inter-token gaps at ``pct`` <= the SLO (a request with no gap is judged on TTFT alone)."""
    ttft = rec.ttft_s
    if not rec.ok or ttft is None or ttft * MS_PER_S > common.slo_ttft_ms:
        return False
    gap = percentile(rec.gaps_s(), pct)
    return gap is None or gap * MS_PER_S <= common.slo_itl_ms


@dataclass(frozen=True)
class RandomRun:
    """A drawn workload with its arrival times fixed by the measured capacity (``runner.Workload``)."""

    workload: RandomWorkload
    capacity_rps: float | None  # open loop: the calibrated capacity; None for closed loops
    common: Common = Common()
    slo_itl_pct: float = DEFAULT_SLO_ITL_PCT

    name = "random"

    @property
    def n_requests(self) -> int:
        return self.workload.n_requests

    def plan(self, prompts: PromptSource) -> tuple[list[Job], list[Job]]:
        wl = self.workload
        n_warm = min(wl.np, WARMUP_JOBS_MAX) if self.common.warmup > 0 else 0
        warm = [
            Job("warmup", tuple(Request(prompts.take(WARMUP_NPP), WARMUP_NTG) for _ in range(self.common.warmup)))
            for _ in range(n_warm)
        ]
        prefixes = [prompts.take(n) for n in wl.prefix_lengths]
        texts = [prompts.take(it.npp) for it in wl.items]
        book = conversations_of(wl, prefixes, texts)
        times = wl.arrival_times(self.capacity_rps)
        if wl.open_loop:
            jobs = [Job("arrival", (), offset_s=t, feed=TurnFeed(book, [i])) for i, t in enumerate(times)]
        else:
            jobs = [
                Job("user", (), offset_s=times[u], feed=TurnFeed(book, list(range(u, wl.n_requests, wl.users))))
                for u in range(wl.users)
            ]
        return warm, jobs

    def summarize(self, phase: PhaseResult, warmup_failed: int) -> RandomResult:
        book = cast(TurnFeed, phase.jobs[0].feed).book
        records = [book.records[i] for i in sorted(book.records)]
        ok = [r for r in records if r.ok]
        generated = sum(r.n_generated for r in ok)
        lags = []  # first turns only: a later turn may wait, by design, for its previous one
        for job in phase.jobs:
            i = cast(TurnFeed, job.feed).indices[0]
            rec = book.records.get(i)
            if rec is not None and rec.sent_s > 0 and self.workload.items[i].follows is None:
                lags.append(rec.sent_s - (phase.t0_s + job.offset_s))
        good_pct = sum(itl_percentile_good(r, self.common, self.slo_itl_pct) for r in records)
        return RandomResult(
            seed=self.workload.seed,
            api=self.workload.api,
            requests=len(records),
            ok=len(ok),
            failed=len(records) - len(ok),
            warmup_failed=warmup_failed,
            errors=error_sample(records),
            makespan_s=phase.wall_s,
            generated_tokens=generated,
            tok_s=ratio(float(generated), phase.wall_s),
            capacity_rps=self.capacity_rps,
            later_turns=self.workload.later_turns,
            broken_turns=book.broken,
            short_replies=book.short_replies,
            lag_max_ms=finite(max(lags) * MS_PER_S) if lags else None,
            prompt_tokens_sent=sum(r.n_prompt_sent for r in records),
            prompt_tokens_server=phase.server_prompt_tokens,
            cross_check=phase.cross_check,
            client_cpu_s=phase.client_cpu_s,
            slo=latency_of(records, phase.wall_s, self.common),
            slo_itl_pct=self.slo_itl_pct,
            good_pct=good_pct,
            goodput_pct=ratio(float(good_pct), float(len(records))) if records else None,
            records=records,
        )


@dataclass(frozen=True)
class RandomResult:
    seed: int
    api: str
    requests: int
    ok: int
    failed: int
    warmup_failed: int
    errors: list[str]
    makespan_s: float
    generated_tokens: int
    tok_s: float | None
    capacity_rps: float | None  # the calibrated capacity the open-loop times were set from
    later_turns: int
    broken_turns: int  # later turns sent without the answer of their failed previous turn
    short_replies: int
    lag_max_ms: float | None  # latest send of a first turn against its scheduled time
    prompt_tokens_sent: int  # ids sent (a text answer in a later turn's history not counted)
    prompt_tokens_server: int | None
    cross_check: CrossCheck
    client_cpu_s: float
    slo: LatencyReport  # TTFT, inter-token, makespan, goodput's mean form
    slo_itl_pct: float
    good_pct: int  # requests good in the percentile form
    goodput_pct: float | None
    records: list[RequestRecord] = field(repr=False, compare=False, metadata={"report": False})

    workload = "random"

    def notes(self) -> list[str]:
        out = conversation_notes(broken=self.broken_turns, short_replies=self.short_replies)
        if self.lag_max_ms is not None and self.lag_max_ms > LAG_WARN_MS:
            out.append(f"a request left {self.lag_max_ms:.0f} ms after its arrival time: the client lagged")
        return out

    def figures(self) -> dict[str, float | int | None]:
        return {
            **self.slo.figures(),
            "goodput_pct": self.goodput_pct,
            "tok_s": self.tok_s,
            "ok": self.ok,
            "failed": self.failed,
            "lag_max_ms": self.lag_max_ms,
            "server_tokens": self.cross_check.server_tokens,
            "diff_percent": self.cross_check.diff_percent,
        }


__all__ = ["DEFAULT_SLO_ITL_PCT", "RandomResult", "RandomRun", "conversations_of", "itl_percentile_good"]
