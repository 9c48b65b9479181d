"""One drawn random workload (``RandomWorkload``) and its requests (``Item``): plain data.

Made by ``ops.bench.random.randomload.draw``; run by ``randomrun`` and replayed by
``ops.replay.replayrandom``. Only the open-loop arrival times wait for the server's measured
capacity (``arrival_times``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from llamactor.ops.bench.lengths import LengthDist

OPEN_LOOP = ("poisson", "onoff")


@dataclass(frozen=True)
class Item:
    """One request of a drawn workload."""

    npp: int  # its new message, tokens
    ntg: int
    prefix: int | None  # the shared prefix its conversation starts with (index), or None
    follows: int | None  # the request whose answer it continues (a later turn), or None
    context: int  # the prompt it sends in all: prefix + earlier turns and answers + message
    unit_at: float  # open loop: arrival time at one request per second of on-time; else 0
    user: int  # closed loop: the user that sends it; open loop: its own index


@dataclass(frozen=True)
class RandomWorkload:
    """One draw of the family: every dimension fixed, every request listed (``items``)."""

    seed: int
    arrival: str
    users: int  # closed and burst: simulated users; open loop: 0
    requests_per_user: int  # closed and burst
    stagger_s: float  # closed: user k starts k * stagger_s after the barrier opens
    load: float  # poisson: the rate as a multiple of the capacity (< 1); onoff: the on periods' rate
    burst_requests: float  # onoff: mean arrivals per on period
    off_factor: float  # onoff: idle time = off_factor x the time the server needs for one on period
    npp: LengthDist  # new message lengths (clamped to the family's npp bounds)
    ntg: LengthDist
    prefix_share: float  # of the conversations (0: none)
    prefix_lengths: tuple[int, ...]
    turn_share: float  # of the requests, drawn (0: none); ``later_turns`` is what it came to
    api: str
    np: int
    slot_context: int
    duration_s: float  # the run length aimed at, on the speed model
    estimated_capacity_rps: float  # the speed model's capacity; the run calibrates the real one
    estimated_s: float  # how long a run takes on the speed model
    items: tuple[Item, ...]

    @property
    def ctx(self) -> int:
        return self.np * self.slot_context

    @property
    def n_requests(self) -> int:
        return len(self.items)

    @property
    def later_turns(self) -> int:
        return sum(it.follows is not None for it in self.items)

    @property
    def open_loop(self) -> bool:
        return self.arrival in OPEN_LOOP

    def with_api(self, api: str) -> RandomWorkload:
        """The same draw sent through another API (``--api`` overrides the drawn one)."""
        return replace(self, api=api)

    def calibration_lengths(self) -> tuple[int, int]:
        """Mean new-message and output lengths: the calibration's closed loop sends these
        (shared prefixes and earlier turns left out: a server has them cached)."""
        n = len(self.items)
        return max(1, round(sum(it.npp for it in self.items) / n)), max(1, round(sum(it.ntg for it in self.items) / n))

    def arrival_times(self, capacity_rps: float | None) -> list[float]:
        """Each request's offset after the barrier, seconds: the user's stagger (closed), 0
        (burst), or the open-loop schedule at the measured ``capacity_rps``."""
        if not self.open_loop:
            return [it.user * self.stagger_s if self.arrival == "closed" else 0.0 for it in self.items]
        if capacity_rps is None or not capacity_rps > 0:
            raise ValueError(f"an open-loop workload ({self.arrival}) needs the server's capacity")
        rate = self.load * capacity_rps
        if self.arrival == "poisson":
            return [it.unit_at / rate for it in self.items]
        on_s = self.burst_requests / rate
        off_s = self.off_factor * self.burst_requests / capacity_rps
        return [it.unit_at / rate + math.floor(it.unit_at / rate / on_s) * off_s for it in self.items]

    def summary(self) -> str:
        """One line naming every drawn dimension."""
        if self.arrival == "closed":
            shape = f"closed loop, {self.users} users x {self.requests_per_user} (started {self.stagger_s:.2f} s apart)"
        elif self.arrival == "burst":
            shape = f"burst, {self.users} users x {self.requests_per_user} released at t=0"
        elif self.arrival == "poisson":
            shape = f"poisson at {self.load:.2f}x capacity"
        else:
            shape = (
                f"on/off at {self.load:.2f}x capacity, ~{self.burst_requests:.0f} per burst, "
                f"idle {self.off_factor:.2f}x"
            )
        prefix = (
            f"prefix {self.prefix_share:.0%} of {len(self.prefix_lengths)} "
            f"({', '.join(str(n) for n in self.prefix_lengths)} tok)"
            if self.prefix_lengths
            else "no prefix"
        )
        turns = f"turns {self.turn_share:.0%} ({self.later_turns} later)" if self.turn_share else "single turns"
        return (
            f"seed {self.seed}: {shape}, {self.n_requests} requests, prompts {self.npp}, outputs {self.ntg}, "
            f"{prefix}, {turns}, api {self.api}, -np {self.np} -c {self.ctx}"
        )

    def describe(self) -> dict[str, Any]:
        """The drawn parameters as plain data (JSON), without the per-request items."""
        out = {k: v for k, v in asdict(self).items() if k != "items"}
        out.update(
            npp=str(self.npp),
            ntg=str(self.ntg),
            ctx=self.ctx,
            n_requests=self.n_requests,
            later_turns=self.later_turns,
            prefixed=sum(it.prefix is not None for it in self.items),
            largest_request=max(it.context + it.ntg for it in self.items),
            summary=self.summary(),
        )
        return out


__all__ = ["OPEN_LOOP", "Item", "RandomWorkload"]
