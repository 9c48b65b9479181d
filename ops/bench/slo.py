"""Latency figures and goodput of one run, shared by the benchmark and replay.

Goodput follows vLLM's benchmark and DistServe: a request is *good* when it completed, its
time to first token is at most ``slo_ttft_ms`` and its time per output token after the first
(TPOT: (last token - first token) / (tokens - 1)) is at most ``slo_itl_ms``. A request with a
single token has no TPOT and is judged on TTFT alone. ``goodput_share`` is good / all requests
(0..1), ``goodput_rps`` good requests per second of makespan.

Pure functions of per-request samples, so the live benchmark (client clocks) and the replay
simulator (simulated clocks) report the same figures the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llamactor.ops.bench.stats import MS_PER_S, finite, percentile, ratio

DEFAULT_SLO_TTFT_MS = 2000.0
DEFAULT_SLO_ITL_MS = 150.0


@dataclass(frozen=True)
class Sample:
    """One request: ``ttft_s`` None when it never produced a token; ``gaps_s`` the gaps between
    its token-carrying events; ``n_generated`` tokens; ``ok`` it completed."""

    ok: bool
    ttft_s: float | None
    gaps_s: Sequence[float]
    n_generated: int

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.n_generated < 2 or not self.gaps_s:
            return None
        return sum(self.gaps_s) / (self.n_generated - 1)

    def good(self, slo_ttft_ms: float, slo_itl_ms: float) -> bool:
        if not self.ok or self.ttft_s is None or self.ttft_s * MS_PER_S > slo_ttft_ms:
            return False
        tpot = self.tpot_s
        return tpot is None or tpot * MS_PER_S <= slo_itl_ms


@dataclass(frozen=True)
class LatencyReport:
    """TTFT mean/p50/p99, inter-token p50/p99, makespan and goodput, in ms / s / 0..1."""

    n: int
    ttft_mean_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    makespan_s: float
    slo_ttft_ms: float
    slo_itl_ms: float
    good: int
    goodput_share: float | None  # good / n, None for no requests
    goodput_rps: float | None  # good requests per second of makespan
    ended_badly: int = 0  # requests that did not complete (cancelled, failed): never good

    @classmethod
    def of(
        cls,
        samples: Sequence[Sample],
        makespan_s: float,
        slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS,
        slo_itl_ms: float = DEFAULT_SLO_ITL_MS,
        *,
        latency_of_ended: bool = False,
    ) -> LatencyReport:
        """``latency_of_ended``: the latency figures also count the requests that ended badly
        after their first token (a client that disconnected had waited for it all the same):
        what replay reports of recorded traffic. The benchmark leaves its failed requests out."""
        counted = [s for s in samples if s.ok or latency_of_ended]
        ttfts = [s.ttft_s * MS_PER_S for s in counted if s.ttft_s is not None]
        gaps = [g * MS_PER_S for s in counted for g in s.gaps_s]
        good = sum(s.good(slo_ttft_ms, slo_itl_ms) for s in samples)
        return cls(
            n=len(samples),
            ttft_mean_ms=finite(sum(ttfts) / len(ttfts)) if ttfts else None,
            ttft_p50_ms=percentile(ttfts, 50.0),
            ttft_p99_ms=percentile(ttfts, 99.0),
            itl_p50_ms=percentile(gaps, 50.0),
            itl_p99_ms=percentile(gaps, 99.0),
            makespan_s=makespan_s,
            slo_ttft_ms=slo_ttft_ms,
            slo_itl_ms=slo_itl_ms,
            good=good,
            goodput_share=ratio(float(good), float(len(samples))) if samples else None,
            goodput_rps=ratio(float(good), makespan_s),
            ended_badly=sum(not s.ok for s in samples),
        )

    def figures(self) -> dict[str, float | int | None]:
        return {
            "ttft_mean_ms": self.ttft_mean_ms,
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p99_ms": self.ttft_p99_ms,
            "itl_p50_ms": self.itl_p50_ms,
            "itl_p99_ms": self.itl_p99_ms,
            "makespan_s": self.makespan_s,
            "goodput": self.goodput_share,
            "goodput_rps": self.goodput_rps,
        }


__all__ = ["DEFAULT_SLO_ITL_MS", "DEFAULT_SLO_TTFT_MS", "LatencyReport", "Sample"]
