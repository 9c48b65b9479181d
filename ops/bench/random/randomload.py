"""A family of random workloads (``llamactor bench --workload random``): ``draw(seed)``.

Pure and seeded: the same seed draws the same workload on every machine (numpy's PCG64 from a
``SeedSequence``; nothing read from the clock, the host or the server). A drawn workload fixes
every dimension and every request's lengths, its shared prefix and its conversation; only the
open-loop arrival *times* wait for the server's measured capacity (``arrival_times``).

The dimensions, each drawn independently:

- arrival process: ``closed`` (users start staggered over one request's expected latency, each
  sends its requests one after another), ``burst`` (the same users all released at t=0),
  ``poisson`` (open loop at a fraction of the measured capacity) and ``onoff`` (Poisson bursts
  at a multiple of the capacity, separated by idle periods);
- prompt (the new message of each request) and output lengths: ``fixed``, ``uniform`` or
  ``lognormal`` (clamped to the family's bounds), each with drawn parameters;
- a shared-prefix share: none, or a share of the conversations start with one of 1-3 common
  prefixes (a system text, sent with ``cache_prompt``);
- a multi-turn share: none, or a share of requests are a conversation's later turn (the previous
  turn's prompt, its answer and a new message, built during the run);
- the API: native ``/completion``, OpenAI ``/v1/completions`` or ``/v1/chat/completions``;
- the server's size: ``-np`` from the family's list and ``-c = np x`` a per-slot context, the
  smallest power of two (at least 1024) that holds the largest request with a margin for a chat
  template and re-tokenized text, so no request is refused.

The request count is sized from a speed model (``Family.prompt_tok_s``, ``gen_tok_s``: gemma3-
270m on 2 cores by default) so a run takes about a drawn ``duration_s``; a faster or slower
machine runs the same requests in another time. Closed-loop users and requests per user start
from their drawn values and are scaled (within bounds) towards that duration.

The family's bounds are ``randomfamily.Family``; what a draw gives is ``randomworkload.RandomWorkload``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from llamactor.ops.bench.lengths import LengthDist
from llamactor.ops.bench.random.randomfamily import DEFAULT_FAMILY, Family, fits_limit, slot_context_for
from llamactor.ops.bench.random.randomworkload import OPEN_LOOP, Item, RandomWorkload

LENGTH_KINDS = ("fixed", "uniform", "lognormal")
FAMILY_STREAM, LENGTH_STREAM, LINK_STREAM = 0x66616D, 0x6C656E, 0x6C6E6B  # RNG streams of one seed
NONE_SHARE_P = 0.5  # chance that the shared-prefix (and the multi-turn) dimension is "none"
LOGNORMAL_SIGMA = (0.3, 1.2)
ONOFF_BURST_REQUESTS = (4.0, 16.0)  # mean arrivals per on period
ONOFF_OFF_FACTOR = (0.5, 1.5)  # idle time / the time the server needs for one on period's requests
OPEN_LOOP_TURN_LAG = 4  # a later turn follows a request at least this many arrivals earlier
OPEN_LOOP_TURN_WINDOW = 16  # ... and at most this many (a user comes back soon)
MAX_TURNS = 4  # turns of one conversation at most
PREFIX_COST_SHARE = 0.25  # of a prefix's tokens counted as prefill per request (mostly cached)
CALIBRATION_USERS = 8
SIZE_PREFERENCE_WEIGHT = 0.25  # closed loops: how much staying near the drawn users counts against duration


def _log_uniform_int(rng: np.random.Generator, lo: int, hi: int) -> int:
    """An integer in [lo, hi], log-uniformly: as many below 100 as from 100 to 1000."""
    return int(min(hi, max(lo, math.floor(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))


def _length_dist(rng: np.random.Generator, bounds: tuple[int, int]) -> LengthDist:
    lo, hi = bounds
    kind = LENGTH_KINDS[int(rng.integers(len(LENGTH_KINDS)))]
    a, b = _log_uniform_int(rng, lo, hi), _log_uniform_int(rng, lo, hi)
    sigma = float(rng.uniform(*LOGNORMAL_SIGMA))
    if kind == "fixed":
        return LengthDist("fixed", a)
    if kind == "uniform":
        return LengthDist("uniform", min(a, b), max(a, b))
    return LengthDist("lognormal", float(a), round(sigma, 2))


def _lengths(dist: LengthDist, rng: np.random.Generator, n: int, bounds: tuple[int, int]) -> list[int]:
    return [min(bounds[1], max(bounds[0], x)) for x in dist.draw(rng, n)]


def _pick(rng: np.random.Generator, options: tuple[Any, ...]) -> Any:
    return options[int(rng.integers(len(options)))]


def draw(seed: int, family: Family = DEFAULT_FAMILY) -> RandomWorkload:
    """The workload of ``seed`` (pure; the same on every machine for the same family)."""
    rng = np.random.default_rng([seed, FAMILY_STREAM])
    # Every value is drawn whether its dimension uses it or not, so one dimension's choice
    # never shifts the draws of another.
    arrival = _pick(rng, family.arrivals)
    api = _pick(rng, family.apis)
    n_slots = int(_pick(rng, family.nps))
    npp_dist, ntg_dist = _length_dist(rng, family.npp), _length_dist(rng, family.ntg)
    has_prefix = rng.random() >= NONE_SHARE_P
    prefix_share = float(rng.uniform(*family.prefix_share))
    n_prefixes = int(rng.integers(family.prefixes[0], family.prefixes[1] + 1))
    prefix_lengths = tuple(_log_uniform_int(rng, *family.prefix_npp) for _ in range(n_prefixes))
    has_turns = rng.random() >= NONE_SHARE_P
    turn_share = float(rng.uniform(*family.turn_share))
    rate_fraction = float(rng.uniform(*family.rate_fraction))
    on_multiple = float(rng.uniform(*family.on_multiple))
    burst_requests = float(rng.uniform(*ONOFF_BURST_REQUESTS))
    off_factor = float(rng.uniform(*ONOFF_OFF_FACTOR))
    users = int(rng.integers(family.users[0], family.users[1] + 1))
    per_user = int(rng.integers(family.requests_per_user[0], family.requests_per_user[1] + 1))
    duration_s = float(rng.uniform(*family.duration_s))
    if not has_prefix:
        prefix_share, prefix_lengths = 0.0, ()
    if not has_turns:
        turn_share = 0.0

    m = family.max_requests
    lrng = np.random.default_rng([seed, LENGTH_STREAM])
    npps, ntgs = _lengths(npp_dist, lrng, m, family.npp), _lengths(ntg_dist, lrng, m, family.ntg)
    prefix_draw, prefix_pick = lrng.random(m), lrng.integers(0, max(1, len(prefix_lengths)), size=m)
    unit_gaps = lrng.exponential(1.0, size=m)

    mean_prefix = sum(prefix_lengths) / len(prefix_lengths) if prefix_lengths else 0.0
    prefill_s = (sum(npps) / m + prefix_share * mean_prefix * PREFIX_COST_SHARE) / family.prompt_tok_s
    mean_ntg = sum(ntgs) / m

    def server_s(concurrency: int) -> float:
        """Server time one request takes of the speed model at ``concurrency`` streams."""
        return prefill_s + mean_ntg / family.gen_rate(concurrency)

    calib_c = min(CALIBRATION_USERS, n_slots)
    capacity = 1.0 / server_s(calib_c)
    stagger_s, load = 0.0, 0.0
    if arrival in OPEN_LOOP:
        load = rate_fraction if arrival == "poisson" else on_multiple
        if arrival == "poisson":
            rate = load * capacity
        else:
            period = burst_requests / (load * capacity) + off_factor * burst_requests / capacity
            rate = burst_requests / period
        latency_s = server_s(1)  # the last arrival's own time, alone on the server
        n = min(m, max(family.min_requests, 1 + round(max(0.0, duration_s - latency_s) * rate)))
        users, per_user = 0, 0
        estimated_s = (n - 1) / rate + latency_s
    else:
        min_per_user = min(2, family.requests_per_user[1]) if turn_share > 0 else 1  # room for a later turn
        per_user = max(per_user, min_per_user)
        users, per_user = _closed_sizes(users, per_user, duration_s, family, n_slots, server_s, min_per_user)
        n = users * per_user
        c = min(users, n_slots)
        estimated_s = n * server_s(c)
        if arrival == "closed":
            stagger_s = (prefill_s + mean_ntg * c / family.gen_rate(c)) / users
    items = _link(
        seed, family, arrival, n, users, turn_share, prefix_share, prefix_lengths, npps, ntgs, prefix_draw, prefix_pick
    )
    items = _with_times(items, arrival, list(unit_gaps[:n]))
    largest = max(it.context + it.ntg for it in items)
    return RandomWorkload(
        seed=seed,
        arrival=arrival,
        users=users,
        requests_per_user=per_user,
        stagger_s=round(stagger_s, 4),
        load=round(load, 3),
        burst_requests=round(burst_requests, 2),
        off_factor=round(off_factor, 3),
        npp=npp_dist,
        ntg=ntg_dist,
        prefix_share=round(prefix_share, 3),
        prefix_lengths=prefix_lengths,
        turn_share=round(turn_share, 3),
        api=api,
        np=n_slots,
        slot_context=slot_context_for(largest),
        duration_s=round(duration_s, 1),
        estimated_capacity_rps=round(capacity, 4),
        estimated_s=round(estimated_s, 1),
        items=tuple(items),
    )


def _closed_sizes(
    users: int, per_user: int, duration_s: float, family: Family, n_slots: int, server_s: Any, min_per_user: int
) -> tuple[int, int]:
    """The users and requests per user, within bounds, whose run lasts about ``duration_s`` on
    the speed model, nearest to the drawn ``users`` and ``per_user`` among those that do."""
    (u_lo, u_hi), (r_lo, r_hi) = family.users, family.requests_per_user
    r_lo = max(r_lo, min_per_user)

    def cost(u: int, r: int) -> float:
        est = u * r * server_s(min(u, n_slots))
        drift = abs(math.log(u / users)) + abs(math.log(r / per_user))
        return abs(math.log(est / duration_s)) + SIZE_PREFERENCE_WEIGHT * drift

    options = [
        (u, r) for u in range(u_lo, u_hi + 1) for r in range(r_lo, r_hi + 1) if u * r <= family.max_requests
    ] or [(u_lo, r_lo)]
    return min(options, key=lambda ur: cost(*ur))


def _link(
    seed: int,
    family: Family,
    arrival: str,
    n: int,
    users: int,
    turn_share: float,
    prefix_share: float,
    prefix_lengths: tuple[int, ...],
    npps: list[int],
    ntgs: list[int],
    prefix_draw: Any,
    prefix_pick: Any,
) -> list[Item]:
    """Requests in send order (closed loop: round-robin over users), each a new conversation or
    a later turn of one whose last turn came earlier, fitting ``family.max_slot_context``."""
    rng = np.random.default_rng([seed, LINK_STREAM])
    limit = fits_limit(family.max_slot_context)
    closed = arrival not in OPEN_LOOP
    eligible = n - users if closed else n
    q = min(1.0, turn_share * n / eligible) if eligible > 0 and turn_share > 0 else 0.0
    turn_draw = rng.random(n)
    lag = max(1, min(OPEN_LOOP_TURN_LAG, n // 4))  # a short open loop still gets later turns
    items: list[Item] = []
    turns: list[int] = []  # turn number of each request in its conversation (1: first)
    open_tail: set[int] = set()  # requests that no later turn follows yet
    for i in range(n):
        user = i % users if closed else i
        ntg = ntgs[i]
        follows: int | None = None
        if q > 0 and turn_draw[i] < q:
            if closed:
                cands = [i - users] if i >= users else []
            else:
                lo = max(0, i - OPEN_LOOP_TURN_WINDOW)
                cands = [j for j in range(lo, i - lag + 1) if j in open_tail]
            cands = [j for j in cands if turns[j] < MAX_TURNS]
            cands = [j for j in cands if items[j].context + items[j].ntg + npps[i] + ntg <= limit]
            if cands:
                follows = cands[int(rng.integers(len(cands)))]
        if follows is not None:
            prev = items[follows]
            open_tail.discard(follows)
            npp = npps[i]
            prefix, context, turn = prev.prefix, prev.context + prev.ntg + npp, turns[follows] + 1
        else:
            prefix = int(prefix_pick[i]) if prefix_lengths and prefix_draw[i] < prefix_share else None
            head = prefix_lengths[prefix] if prefix is not None else 0
            npp = min(npps[i], max(1, limit - head - ntg))
            context, turn = head + npp, 1
        items.append(Item(npp=npp, ntg=ntg, prefix=prefix, follows=follows, context=context, unit_at=0.0, user=user))
        turns.append(turn)
        open_tail.add(i)
    return items


def _with_times(items: list[Item], arrival: str, gaps: list[float]) -> list[Item]:
    """Open loop: unit-rate Poisson arrival times (the first at 0), in request order."""
    if arrival not in OPEN_LOOP:
        return items
    at = [0.0] + [float(t) for t in np.cumsum(gaps[1:])]
    return [replace(it, unit_at=round(t, 6)) for it, t in zip(items, at)]


__all__ = ["CALIBRATION_USERS", "LENGTH_KINDS", "draw"]
