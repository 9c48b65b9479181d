"""Latency figures and goodput of every workload's records.

The definitions live in ``ops.bench.slo`` (shared with trace replay); this module only turns the
client's ``RequestRecord``s into its ``Sample``s, and names the figure keys every result
reports, so the report and the ``--vs`` ratios treat them alike. Pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from llamactor.ops.bench.runner import Common
from llamactor.ops.bench.slo import LatencyReport, Sample
from llamactor.ops.bench.stats import RequestRecord

# LatencyReport.figures() keys, in their order: the second table of the report
LATENCY_KEYS = (
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "makespan_s",
    "goodput",
    "goodput_rps",
)
# compared B/A under --vs for every workload
RATIO_KEYS = ("ttft_mean_ms", "ttft_p50_ms", "itl_p99_ms", "makespan_s", "goodput")


def sample_of(rec: RequestRecord) -> Sample:
    """One request as ``ops.bench.slo`` sees it: a failed request is a sample that is never good."""
    return Sample(ok=rec.ok, ttft_s=rec.ttft_s, gaps_s=rec.gaps_s(), n_generated=rec.n_generated)


def latency_of(records: Sequence[RequestRecord], makespan_s: float, common: Common) -> LatencyReport:
    """TTFT, inter-token, makespan and goodput of ``records`` under ``common``'s SLO."""
    return LatencyReport.of([sample_of(r) for r in records], makespan_s, common.slo_ttft_ms, common.slo_itl_ms)


def ratio_keys(*own: str) -> tuple[str, ...]:
    """A result's ``--vs`` ratio keys: its own, then ``RATIO_KEYS`` (no key twice)."""
    return tuple(dict.fromkeys(own + RATIO_KEYS))


__all__ = ["LATENCY_KEYS", "RATIO_KEYS", "latency_of", "ratio_keys", "sample_of"]
