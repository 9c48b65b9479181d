"""Build the live view's snapshot from what the actors already report.

Called by ``InProcessEngine.live_snapshot()``, on the event loop, a few times a second while at
least one ``/live`` client is connected (one call per tick, whatever the number of clients).
It only reads: the supervisor's frozen ``TableSnapshot`` and slot states, each policy's frozen
``PolicyStatus``, the per-group counters and the latency histograms of the metrics registry.
Nothing is recorded for it on the decode path, so groups do no work for the live view.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from llamactor.actors.coordinator import PhaseCoordinator
from llamactor.actors.policies import policy_name
from llamactor.actors.supervisor import Supervisor
from llamactor.protocol.live import LiveGroup, LiveHistogram, LiveSlot, LiveSnapshot
from llamactor.protocol.slots import SlotState
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.metrics import Metrics

TTFT_METRIC = "llamactor:time_to_first_token_seconds"
GAP_METRIC = "llamactor:inter_token_seconds"


def idle_snapshot(cfg: RuntimeConfig, state: str, *, healthy: bool = False, uptime_s: float = 0.0) -> LiveSnapshot:
    """What a runtime shows while its engine has no snapshot for it (loading, stopping, closed,
    restarting its engine): its state and health, no groups."""
    return LiveSnapshot(
        at=time.time(),
        state=state,
        healthy=healthy,
        model=cfg.model_name,
        scheduler=policy_name(cfg.scheduler),
        uptime_s=uptime_s,
        queue_depth=0,
        queue_size=cfg.queue_size,
    )


def build_snapshot(
    cfg: RuntimeConfig, state: str, started_at: float, sup: Supervisor, coord: PhaseCoordinator, metrics: Metrics
) -> LiveSnapshot:
    table = sup.snapshot()
    by_group: dict[int, list[LiveSlot]] = {}
    for slot_state in sup.slot_states():
        slot = _slot(slot_state)
        by_group.setdefault(slot.group, []).append(slot)
    groups = []
    for g, counters in enumerate(metrics.groups):
        status = coord.status(g)
        groups.append(
            LiveGroup(
                id=g,
                up=g not in table.groups_down,
                restarts=table.restarts[g],
                phase=status.phase,
                cohort=status.cohort,
                waiting=status.waiting,
                tokens_predicted=counters.tokens_predicted,
                prompt_tokens=counters.prompt_tokens,
                n_decode=counters.n_decode,
                requests_failed=counters.requests_failed,
                slots=tuple(by_group.get(g, ())),
            )
        )
    ttft, gap = _histograms(metrics, (TTFT_METRIC, GAP_METRIC))
    now = time.time()
    return LiveSnapshot(
        at=now,
        state=state,
        healthy=table.healthy,
        model=cfg.model_name,
        scheduler=policy_name(cfg.scheduler),
        uptime_s=max(0.0, now - started_at),
        queue_depth=table.queue_depth,
        queue_size=cfg.queue_size,
        groups=tuple(groups),
        ttft=ttft,
        inter_token=gap,
    )


def _slot(s: SlotState) -> LiveSlot:
    return LiveSlot(
        id=s.id,
        group=s.group,
        state=s.phase,
        cohort=s.cohort,
        task=s.task if s.busy else -1,  # the live view shows what a slot does now, not its last request
        n_prompt=s.n_prompt if s.busy else 0,
        n_decoded=s.n_decoded if s.busy else 0,
        n_remain=max(0, s.n_remain),
        age_s=s.age_s,
    )


def _histograms(metrics: Metrics, names: Iterable[str]) -> list[LiveHistogram | None]:
    """The named Prometheus histograms, summed over their ``group`` label, as per-bucket counts."""
    wanted = list(names)
    found: dict[str, LiveHistogram] = {}
    # Only these families' bucket and sum samples: collecting the whole registry costs ten times more.
    only = metrics.registry.restricted_registry(
        [f"{name}{suffix}" for name in wanted for suffix in ("_bucket", "_sum")]
    )
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
        found[family.name] = LiveHistogram(
            bounds_s=tuple(b for b in bounds if b != float("inf")), counts=tuple(counts), sum_s=total
        )
    return [found.get(name) for name in wanted]
