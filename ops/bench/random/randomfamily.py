"""The random workloads' family (``Family``): the bounds every dimension is drawn within, and the speed model.

``ops.bench.random.randomload.draw`` draws one workload within these; a suite's JSON file can
override them (``Family.from_dict``). The per-slot context rule (``fits_limit``,
``slot_context_for``) lives here too: the family's largest request must fit the context it sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from llamactor.ops.bench.apis import API_NAMES

ARRIVALS = ("closed", "burst", "poisson", "onoff")
TEMPLATE_MARGIN_TOKENS = 64  # a chat template's tokens around the messages
RETOKENIZE_MARGIN = 1.1  # text dialects: the server re-tokenizes the text of the pieces
MIN_SLOT_CONTEXT = 1024


@dataclass(frozen=True)
class Family:
    """The bounds every dimension is drawn within, and the speed model the sizes aim at."""

    npp: tuple[int, int] = (16, 1500)  # the new message of a request, tokens
    ntg: tuple[int, int] = (8, 256)
    prefix_npp: tuple[int, int] = (200, 1000)
    prefixes: tuple[int, int] = (1, 3)
    prefix_share: tuple[float, float] = (0.3, 1.0)
    turn_share: tuple[float, float] = (0.2, 0.6)
    users: tuple[int, int] = (2, 32)
    requests_per_user: tuple[int, int] = (1, 4)
    rate_fraction: tuple[float, float] = (0.3, 1.0)  # poisson: of the measured capacity
    on_multiple: tuple[float, float] = (1.5, 3.0)  # onoff: the on periods' rate, of the capacity
    nps: tuple[int, ...] = (4, 8, 16, 32)
    apis: tuple[str, ...] = API_NAMES
    arrivals: tuple[str, ...] = ARRIVALS
    duration_s: tuple[float, float] = (15.0, 40.0)  # a run's target length on the speed model
    min_requests: int = 4
    max_requests: int = 160
    max_slot_context: int = 4096  # a later turn that would not fit in this starts a conversation
    prompt_tok_s: float = 3000.0  # prefill speed of the speed model
    gen_tok_s: float = 70.0  # aggregate decode speed at many users; c users: gen_tok_s * c / (c + 1.5)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Family:
        """Defaults overridden by ``obj`` (lists for the pairs); a ValueError naming a bad key."""
        known = {f.name: f for f in fields(cls)}
        kw: dict[str, Any] = {}
        for key, value in obj.items():
            if key not in known:
                raise ValueError(f"unknown family setting {key!r}; known: {', '.join(known)}")
            kw[key] = tuple(value) if isinstance(value, list) else value
        fam = cls(**kw)
        fam.check()
        return fam

    def check(self) -> None:
        for name in (
            "npp",
            "ntg",
            "prefix_npp",
            "prefixes",
            "users",
            "requests_per_user",
            "prefix_share",
            "turn_share",
            "rate_fraction",
            "on_multiple",
            "duration_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, tuple) and len(value) == 2):
                raise ValueError(f"family {name} must be a pair [LO, HI], got {value!r}")
        for name in ("npp", "ntg", "prefix_npp", "prefixes", "users", "requests_per_user"):
            lo, hi = getattr(self, name)
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(f"family {name} must be two integers 1 <= LO <= HI, got {[lo, hi]}")
        for name in ("prefix_share", "turn_share", "rate_fraction", "on_multiple", "duration_s"):
            lo, hi = getattr(self, name)
            if not (0 < lo <= hi and math.isfinite(hi)):
                raise ValueError(f"family {name} must be two numbers 0 < LO <= HI, got {[lo, hi]}")
        if self.prefix_share[1] > 1 or self.turn_share[1] > 1:
            raise ValueError("family prefix_share and turn_share are shares: at most 1")
        if not self.nps or min(self.nps) < 1:
            raise ValueError(f"family nps must list slot counts >= 1, got {list(self.nps)}")
        for name, allowed in (("apis", API_NAMES), ("arrivals", ARRIVALS)):
            values = getattr(self, name)
            if not values or any(v not in allowed for v in values):
                raise ValueError(f"family {name} must list some of {', '.join(allowed)}, got {list(values)}")
        if not 1 <= self.min_requests <= self.max_requests:
            raise ValueError("family needs 1 <= min_requests <= max_requests")
        if self.prompt_tok_s <= 0 or self.gen_tok_s <= 0:
            raise ValueError("family prompt_tok_s and gen_tok_s must be > 0")
        if fits_limit(self.max_slot_context) < self.prefix_npp[0] + self.npp[0] + self.ntg[0]:
            raise ValueError(f"family max_slot_context {self.max_slot_context} is too small for the shortest request")

    def gen_rate(self, concurrency: int) -> float:
        """Aggregate decode tokens per second of the speed model with ``concurrency`` streams."""
        c = max(1, concurrency)
        return self.gen_tok_s * c / (c + 1.5)


DEFAULT_FAMILY = Family()


def fits_limit(max_slot_context: int) -> int:
    """The largest prompt + output (in token ids) that fits a slot of ``max_slot_context``."""
    return int((max_slot_context - TEMPLATE_MARGIN_TOKENS) / RETOKENIZE_MARGIN)


def slot_context_for(largest: int) -> int:
    """The per-slot context for a largest request of ``largest`` tokens: a power of two >= 1024."""
    need = math.ceil(largest * RETOKENIZE_MARGIN) + TEMPLATE_MARGIN_TOKENS
    return max(MIN_SLOT_CONTEXT, 1 << (need - 1).bit_length())


__all__ = ["ARRIVALS", "DEFAULT_FAMILY", "Family", "fits_limit", "slot_context_for"]
