"""The live view's data (the built-in page at GET /): one frozen snapshot of a runtime's groups, slots and counters.

``RuntimeCore.live_snapshot()`` builds one from the actors' own frozen reports (the
supervisor's table snapshot and slot rows, each policy's ``PolicyStatus``, the per-group
counters); the HTTP layer's ``/live`` stream takes one per tick, shared by every client, and
adds the rates and histories that need more than one snapshot. Counters are cumulative since
the runtime started, so a reader derives rates from two snapshots and their ``at`` times.
"""

from __future__ import annotations

import msgspec

SLOT_STATES = ("idle", "prefill", "ready", "generate", "down")  # "ready": waiting at the cohort barrier


class LiveSlot(msgspec.Struct, frozen=True, kw_only=True):
    id: int  # global slot id, as in /slots
    group: int
    state: str  # one of SLOT_STATES
    cohort: int = 0  # the policy's cohort id of the request (0: none)
    task: int = -1  # request id, -1 when idle
    n_prompt: int = 0  # prompt tokens of the request
    n_decoded: int = 0  # tokens generated so far
    n_remain: int = 0  # tokens still allowed (n_predict - n_decoded)
    age_s: float = 0.0  # seconds since the request arrived


class LiveGroup(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    up: bool  # False: down past its restart limit
    restarts: int
    phase: str  # the policy's phase ("none" for a policy without phases)
    cohort: int  # the policy's current cohort id
    waiting: int  # requests holding a slot that wait for a phase grant
    tokens_predicted: int  # cumulative
    prompt_tokens: int  # cumulative
    n_decode: int  # cumulative llama_decode calls
    requests_failed: int  # cumulative, failed alone
    slots: tuple[LiveSlot, ...]
    replica: str = ""  # the replica the group runs in (a replica set; "" for one engine)


class LiveHistogram(msgspec.Struct, frozen=True, kw_only=True):
    """Per-bucket counts (not cumulative) summed over groups; the last bucket is ``> bounds_s[-1]``."""

    bounds_s: tuple[float, ...]
    counts: tuple[int, ...]  # len(bounds_s) + 1
    sum_s: float


def merge_replicas(snapshots: list[tuple[str, LiveSnapshot]]) -> LiveSnapshot:
    """The snapshots of a replica set's replicas as one: groups and slots numbered on, replica
    by replica, each group naming its replica; queues and histograms summed."""
    first = snapshots[0][1]
    groups: list[LiveGroup] = []
    n_slots = 0
    for replica, snap in snapshots:
        for g in snap.groups:
            slots = tuple(msgspec.structs.replace(s, id=n_slots + i, group=len(groups)) for i, s in enumerate(g.slots))
            n_slots += len(slots)
            groups.append(msgspec.structs.replace(g, id=len(groups), slots=slots, replica=replica))
    return msgspec.structs.replace(
        first,
        healthy=all(s.healthy for _, s in snapshots),
        queue_depth=sum(s.queue_depth for _, s in snapshots),
        queue_size=sum(s.queue_size for _, s in snapshots),
        groups=tuple(groups),
        ttft=_sum_histograms([s.ttft for _, s in snapshots]),
        inter_token=_sum_histograms([s.inter_token for _, s in snapshots]),
    )


def _sum_histograms(hists: list[LiveHistogram | None]) -> LiveHistogram | None:
    present = [h for h in hists if h is not None]
    if not present or any(h.bounds_s != present[0].bounds_s for h in present):
        return present[0] if present else None
    counts = tuple(sum(c) for c in zip(*(h.counts for h in present), strict=True))
    return LiveHistogram(bounds_s=present[0].bounds_s, counts=counts, sum_s=sum(h.sum_s for h in present))


class LiveSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    at: float  # time.time() of the snapshot
    state: str  # the runtime's lifecycle state: loading, ready, stopping, closed
    healthy: bool
    model: str
    scheduler: str
    uptime_s: float
    queue_depth: int
    queue_size: int
    groups: tuple[LiveGroup, ...] = ()
    ttft: LiveHistogram | None = None  # time to first token
    inter_token: LiveHistogram | None = None  # gap between consecutive tokens of one stream
