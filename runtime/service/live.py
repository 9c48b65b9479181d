"""Build the live view's snapshot (API-17) from what the actors already report.

Called by ``RuntimeCore.live_snapshot()``, on the event loop, a few times a second while at
least one ``/live`` client is connected (one call per tick, whatever the number of clients).
It only reads: the supervisor's frozen ``TableSnapshot`` and slot rows, each policy's frozen
``PolicyStatus``, the per-group counters and the latency histograms of the metrics registry.
Nothing is recorded for it on the decode path, so groups do no work for the live view.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llamactor.actors.coordinator import PhaseCoordinator
from llamactor.actors.supervisor import Supervisor
from llamactor.protocol.live import LiveGroup, LiveHistogram, LiveSlot, LiveSnapshot
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.metrics import Metrics

TTFT_METRIC = "llamactor:time_to_first_token_seconds"
GAP_METRIC = "llamactor:inter_token_seconds"


def model_name(cfg: RuntimeConfig) -> str:
    return cfg.alias or (Path(str(cfg.model)).name if cfg.model else "default")


def idle_snapshot(cfg: RuntimeConfig, state: str) -> LiveSnapshot:
    """What a runtime that is not serving (loading, stopping, closed) shows: no groups."""
    return LiveSnapshot(at=time.time(), state=state, healthy=False, model=model_name(cfg), scheduler=cfg.scheduler,
                        uptime_s=0.0, queue_depth=0, queue_size=cfg.queue_size)


def build_snapshot(cfg: RuntimeConfig, state: str, started_at: float, sup: Supervisor, coord: PhaseCoordinator,
                   metrics: Metrics) -> LiveSnapshot:
    table = sup.snapshot()
    by_group: dict[int, list[LiveSlot]] = {}
    for row in sup.slot_rows():
        slot = _slot(row)
        by_group.setdefault(slot.group, []).append(slot)
    groups = []
    for g, counters in enumerate(metrics.groups):
        status = coord.status(g)
        groups.append(LiveGroup(
            id=g, up=g not in table.groups_down, restarts=table.restarts[g], phase=status.phase,
            cohort=status.cohort, waiting=status.waiting, tokens_predicted=counters.tokens_predicted,
            prompt_tokens=counters.prompt_tokens, n_decode=counters.n_decode,
            requests_failed=counters.requests_failed, slots=tuple(by_group.get(g, ())),
        ))
    ttft, gap = _histograms(metrics, (TTFT_METRIC, GAP_METRIC))
    now = time.time()
    return LiveSnapshot(
        at=now, state=state, healthy=table.healthy, model=model_name(cfg), scheduler=cfg.scheduler,
        uptime_s=max(0.0, now - started_at), queue_depth=table.queue_depth, queue_size=cfg.queue_size,
        groups=tuple(groups), ttft=ttft, inter_token=gap,
    )


def _slot(row: dict[str, Any]) -> LiveSlot:
    """One /slots row (built by its group, or by the supervisor for a group that is down)."""
    nxt = (row.get("next_token") or [{}])[0]
    return LiveSlot(
        id=row["id"], group=row["group"], state=row.get("phase", "idle"), cohort=row.get("cohort", 0),
        task=row.get("id_task", -1), n_prompt=row.get("n_prompt_tokens", 0), n_decoded=nxt.get("n_decoded", 0),
        n_remain=max(0, nxt.get("n_remain", 0)), age_s=row.get("age_s", 0.0),
    )


def _histograms(metrics: Metrics, names: Iterable[str]) -> list[LiveHistogram | None]:
    """The named Prometheus histograms, summed over their ``group`` label, as per-bucket counts."""
    wanted = list(names)
    found: dict[str, LiveHistogram] = {}
    # Only these families' bucket and sum samples: collecting the whole registry costs ten times more.
    only = metrics.registry.restricted_registry([f"{name}{suffix}" for name in wanted for suffix in ("_bucket", "_sum")])
    for family in only.collect():
        if family.name not in wanted:
            continue
        cumulative: dict[float, float] = {}
        total = 0.0
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                cumulative[le] = cumulative.get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
        bounds = sorted(cumulative)
        counts, below = [], 0.0
        for le in bounds:
            counts.append(int(cumulative[le] - below))
            below = cumulative[le]
        found[family.name] = LiveHistogram(bounds_s=tuple(b for b in bounds if b != float("inf")),
                                           counts=tuple(counts), sum_s=total)
    return [found.get(name) for name in wanted]
