"""The request shapes and arrival processes of ``llamactor bench --capacity`` (pure, seeded).

A shape says how long prompts and answers are, drawn from parameters (no data set is
downloaded): ``sharegpt`` stands in for chat traffic, ``rag`` for retrieval-augmented prompts,
``multiturn`` for conversations whose history grows. An arrival process says when requests
come, at a mean rate: ``poisson`` (exponential gaps) or ``bursty`` (gamma gaps with shape
``BURST_SHAPE`` < 1, BurstGPT's model of real LLM traffic: the same mean rate, clustered).

Everything is drawn at unit rate from the seed alone and scaled by 1 / rate when a rate is
measured, so every rate, and both servers at one rate, see the same request sequence: the
same lengths, the same conversations, the same relative arrival pattern.

The requests are ``randomworkload.Item``s in a ``RandomWorkload``, so ``randomrun.RandomRun`` (the
harness's open-loop runner with conversations) sends them: through ``/v1/chat/completions``,
streamed, ``ignore_eos`` with ``max_tokens`` fixing each answer's length, a later turn sent
once its previous turn has ended, with the server's answer in its history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llamactor.ops.bench.lengths import LengthDist
from llamactor.ops.bench.random.randomfamily import slot_context_for
from llamactor.ops.bench.random.randomworkload import Item, RandomWorkload
from llamactor.ops.bench.traffic import ARRIVAL_STREAM, LENGTH_STREAM

ARRIVALS = ("poisson", "bursty")
# gamma shape of bursty gaps: coefficient of variation 1/sqrt(0.25) = 2 (Poisson's is 1), in the
# range BurstGPT fitted to its bursty conversation traces
BURST_SHAPE = 0.25
REFERENCE_STREAM = 3  # RNG stream of the unloaded reference requests (apart from the measured ones)
OPEN_CONVERSATIONS = 4  # multiturn: conversations interleaved, so a turn follows its previous 4 arrivals later
API = "chat"


@dataclass(frozen=True)
class Shape:
    """Lengths of one workload shape: each request's new message and its answer, clamped."""

    name: str
    npp: LengthDist  # the new message (the whole prompt for single-turn shapes), tokens
    ntg: LengthDist  # the answer, tokens (forced with ignore_eos)
    npp_max: int
    ntg_max: int
    turns: int = 1  # > 1: conversations of this many turns, each prompt the whole history
    about: str = ""

    def lengths(self, rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
        npp = [min(self.npp_max, x) for x in self.npp.draw(rng, n)]
        ntg = [min(self.ntg_max, x) for x in self.ntg.draw(rng, n)]
        return list(zip(npp, ntg))


# Lengths are scaled for a CPU: ShareGPT's own prompts and answers run to a few hundred tokens
# each, which a 2-core machine serves at well under one request per second; these keep the
# shapes' proportions (rag: long prompt, short answer; sharegpt: long-tailed both ways).
SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape(
            "sharegpt",
            LengthDist("lognormal", 200, 0.9),
            LengthDist("lognormal", 80, 0.7),
            npp_max=1024,
            ntg_max=256,
            about="lognormal prompts (median 200 tokens) and answers (median 80), no shared prefix",
        ),
        Shape(
            "rag",
            LengthDist("uniform", 1000, 3000),
            LengthDist("uniform", 32, 128),
            npp_max=3000,
            ntg_max=128,
            about="1,000-3,000 prompt tokens (retrieved passages), 32-128 out",
        ),
        Shape(
            "multiturn",
            LengthDist("lognormal", 64, 0.6),
            LengthDist("lognormal", 64, 0.5),
            npp_max=256,
            ntg_max=192,
            turns=4,
            about="conversations of 4 turns, each prompt the earlier turns and answers plus a new "
            "message (median 64 tokens), answers median 64",
        ),
    )
}


def unit_arrivals(n: int, seed: int, arrivals: str) -> list[float]:
    """``n`` arrival times at a mean rate of one per second, the first at 0: exponential gaps
    (poisson) or gamma gaps of shape ``BURST_SHAPE`` and mean 1 (bursty)."""
    if arrivals not in ARRIVALS:
        raise ValueError(f"unknown arrival process {arrivals!r}: expected one of {', '.join(ARRIVALS)}")
    rng = np.random.default_rng([seed, ARRIVAL_STREAM])
    m = max(n - 1, 0)
    gaps = rng.gamma(BURST_SHAPE, 1.0 / BURST_SHAPE, size=m) if arrivals == "bursty" else rng.exponential(1.0, m)
    return [0.0, *(float(t) for t in np.cumsum(gaps))] if n > 0 else []


def arrival_times(n: int, rate: float, seed: int, arrivals: str) -> list[float]:
    """``n`` arrival times at ``rate`` requests per second (the unit-rate times / rate)."""
    return [t / rate for t in unit_arrivals(n, seed, arrivals)]


def items(shape: Shape, n: int, seed: int, *, stream: int = LENGTH_STREAM) -> list[Item]:
    """The ``n`` requests of ``shape`` in arrival order (``unit_at`` left 0).

    Multiturn: blocks of ``OPEN_CONVERSATIONS`` conversations x ``turns`` turns, interleaved
    round-robin, so request ``i``'s previous turn is request ``i - OPEN_CONVERSATIONS``; its
    ``context`` is the previous turn's context and answer plus its own message.
    """
    sizes = shape.lengths(np.random.default_rng([seed, stream]), n)
    out: list[Item] = []
    for i, (npp, ntg) in enumerate(sizes):
        turn = (i % (OPEN_CONVERSATIONS * shape.turns)) // OPEN_CONVERSATIONS if shape.turns > 1 else 0
        follows = i - OPEN_CONVERSATIONS if turn > 0 else None
        context = npp if follows is None else out[follows].context + out[follows].ntg + npp
        out.append(Item(npp=npp, ntg=ntg, prefix=None, follows=follows, context=context, unit_at=0.0, user=i))
    return out


def workload(shape: Shape, arrivals: str, n: int, seed: int, *, closed: bool = False) -> RandomWorkload:
    """``n`` requests of ``shape`` as a workload ``RandomRun`` sends: open loop (arrival times =
    ``unit_at`` / the rate given to ``RandomRun`` as its capacity) or, ``closed``, one user
    sending them one at a time (the unloaded reference)."""
    if closed:
        reqs = [it for it in items(shape, n * shape.turns, seed, stream=REFERENCE_STREAM) if it.follows is None][:n]
    else:
        reqs = [
            Item(it.npp, it.ntg, None, it.follows, it.context, round(t, 6), it.user)
            for it, t in zip(items(shape, n, seed), unit_arrivals(n, seed, arrivals))
        ]
    largest = max(it.context + it.ntg for it in reqs)
    return RandomWorkload(
        seed=seed,
        arrival="closed" if closed else "poisson",  # poisson: times scale with the rate; bursty's too
        users=1 if closed else 0,
        requests_per_user=len(reqs) if closed else 0,
        stagger_s=0.0,
        load=1.0,  # the rate handed to RandomRun is the rate measured
        burst_requests=0.0,
        off_factor=0.0,
        npp=shape.npp,
        ntg=shape.ntg,
        prefix_share=0.0,
        prefix_lengths=(),
        turn_share=sum(it.follows is not None for it in reqs) / len(reqs),
        api=API,
        np=1,  # one warm-up request (RandomRun sends one per slot); the servers keep their own sizes
        slot_context=slot_context_for(largest),
        duration_s=0.0,
        estimated_capacity_rps=0.0,
        estimated_s=0.0,
        items=tuple(reqs),
    )


def mean_lengths(shape: Shape, seed: int, n: int = 256) -> tuple[float, float]:
    """Mean prompt (whole context) and answer tokens of ``shape``: the start rate's estimate."""
    its = items(shape, n, seed)
    return math.fsum(it.context for it in its) / n, math.fsum(it.ntg for it in its) / n


__all__ = ["ARRIVALS", "BURST_SHAPE", "SHAPES", "Shape", "arrival_times", "items", "mean_lengths", "workload"]
