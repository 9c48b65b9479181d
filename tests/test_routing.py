"""The replica router's rule and the replica set's merged live view, without Ray."""

from __future__ import annotations

import random

import numpy as np

from llamactor.protocol.live import LiveGroup, LiveHistogram, LiveSlot, LiveSnapshot, merge_replicas
from llamactor.runtime.service.routing import BLOCK, ReplicaLoad, Route, block_hashes, choose

SYSTEM = list(range(1000, 1000 + 3 * BLOCK))


def test_block_hashes_name_whole_prefixes():
    a = block_hashes(SYSTEM + [1, 2, 3] * 40)
    b = block_hashes(SYSTEM + [4, 5, 6] * 40)
    assert a[:3] == b[:3] and a[3] != b[3]  # shared blocks alike, the first different one not
    c = block_hashes([7] + SYSTEM[1:] + [1, 2, 3] * 40)
    assert not set(a) & set(c)  # chained: a different first token changes every block
    assert len(block_hashes(np.arange(BLOCK - 1, dtype=np.int32))) == 0  # only full blocks


def _loads(**reported: tuple[list[int], int]) -> dict[str, ReplicaLoad]:
    loads = {}
    for rid, (tokens, busy) in reported.items():
        load = ReplicaLoad()
        load.report({"at": 1.0, "slots": 2, "busy": busy, "blocks": block_hashes(tokens)}, 1.0)
        load.in_flight = busy  # the router's own count of what it sent there
        loads[rid] = load
    return loads


def test_the_longest_cached_prefix_wins():
    route = Route(1, tuple(block_hashes(SYSTEM + [9] * 70)))
    loads = _loads(a=(list(range(5000, 5300)), 0), b=(SYSTEM + [8] * 70, 1))
    ranks = choose(route, loads, 2.0, random.Random(0))
    assert ranks[0] == ["b"] and ranks[1] == ["a"]


def test_a_full_replica_gives_way_to_one_with_a_slot_free():
    route = Route(1, tuple(block_hashes(SYSTEM)))
    loads = _loads(a=([], 1), b=(SYSTEM, 2))  # b: both slots busy
    assert choose(route, loads, 2.0, random.Random(0))[0] == ["a"]
    loads["a"].in_flight = 2  # none has a slot free: the cache decides
    assert choose(route, loads, 2.0, random.Random(0))[0] == ["b"]


def test_what_was_just_sent_counts_until_the_replica_reports_it():
    route = Route(1, tuple(block_hashes(SYSTEM)))
    loads = _loads(a=([], 0), b=([], 0))
    loads["b"].sent(route.blocks, 2.0)  # a burst's first request went to b
    assert choose(route, loads, 2.1, random.Random(0))[0] == ["b"]
    loads["b"].report({"at": 5.0, "slots": 2, "blocks": []}, 5.0)  # b reports it lost them since
    assert loads["b"].cached(route.blocks, 5.1) == 0


def test_no_cached_prefix_means_the_less_loaded_of_two():
    loads = _loads(a=([], 1), b=([], 0))
    assert choose(Route(1), loads, 2.0, random.Random(0))[0] == ["b"]


def _snapshot(slots: int, queue: int) -> LiveSnapshot:
    hist = LiveHistogram(bounds_s=(0.1, 1.0), counts=(1, 2, 0), sum_s=1.5)
    group = LiveGroup(
        id=0,
        up=True,
        restarts=0,
        phase="slo",
        cohort=0,
        waiting=0,
        tokens_predicted=10,
        prompt_tokens=20,
        n_decode=5,
        requests_failed=0,
        slots=tuple(LiveSlot(id=i, group=0, state="idle") for i in range(slots)),
    )
    return LiveSnapshot(
        at=1.0,
        state="ready",
        healthy=True,
        model="m",
        scheduler="slo",
        uptime_s=1.0,
        queue_depth=queue,
        queue_size=8,
        groups=(group,),
        ttft=hist,
    )


def test_replicas_live_views_merge_into_one():
    merged = merge_replicas([("r1", _snapshot(2, 1)), ("r2", _snapshot(3, 2))])
    assert [g.replica for g in merged.groups] == ["r1", "r2"]
    assert [g.id for g in merged.groups] == [0, 1]
    assert [s.id for g in merged.groups for s in g.slots] == [0, 1, 2, 3, 4]
    assert merged.queue_depth == 3 and merged.ttft is not None and merged.ttft.counts == (2, 4, 0)


def test_equally_loaded_the_replica_holding_less_takes_a_new_prompt():
    loads = _loads(a=(SYSTEM, 0), b=([], 0))  # a holds one prompt already, b nothing
    new = Route(1, tuple(block_hashes(list(range(9000, 9000 + 2 * BLOCK)))))
    assert choose(new, loads, 2.0, random.Random(0))[0] == ["b"]


def test_a_request_that_ended_frees_its_slot_before_the_next_report():
    """A conversation's next turn, sent as its last one ends, finds its replica with a slot free
    (the report saying so comes later, the last one still shows every slot busy): it stays on
    the replica holding its cache."""
    route = Route(1, tuple(block_hashes(SYSTEM + [9] * 70)))
    loads = _loads(a=(SYSTEM + [9] * 70, 2), b=([], 1))  # a: both slots busy, b: one free
    loads["a"].in_flight, loads["b"].in_flight = 2, 1
    assert choose(route, loads, 2.0, random.Random(0))[0] == ["b"]
    loads["a"].ended()
    assert choose(route, loads, 2.0, random.Random(0))[0] == ["a"]
