"""Summary statistics of a benchmark run, computed from client-side records (pure, no I/O).

Every figure is either a finite non-negative float or ``None`` ("not measured": no sample,
or the server did not expose the counter). ``None`` is written ``null`` in JSON and ``-`` in
tables; a NaN never leaves this module, because a NaN in a report reads like a number.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

MS_PER_S = 1000.0
PERCENT = 100.0


@dataclass
class RequestRecord:
    """One request as the client saw it; times are ``time.perf_counter()`` seconds.

    ``event_times`` holds the receive time of every stream event that carried at least one
    token, ``event_tokens`` how many tokens each carried. ``n_generated`` is the server's own
    count from the final event (``tokens_predicted`` or OpenAI ``usage``) when it sent one,
    else the sum of ``event_tokens``: llama-server withholds a token whose text is an
    incomplete UTF-8 sequence from the stream, so counting events alone can fall short.
    """

    sent_s: float
    n_prompt_sent: int
    event_times: list[float] = field(default_factory=list)
    event_tokens: list[int] = field(default_factory=list)
    done_s: float | None = None  # the final event arrived: the request completed
    ended_s: float | None = None  # the client was done with it, completed or failed
    n_generated_server: int | None = None
    n_prompt_server: int | None = None
    error: str | None = None
    token_ids: list[int] | None = None  # the generated ids as streamed, when asked for (chat: the history)
    # the server's own prompt time (``timings.prompt_ms`` of its final event): from the step that
    # first held the prompt to the first token, as llama-server counts it
    server_prompt_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None

    @property
    def n_generated(self) -> int:
        if self.n_generated_server is not None:
            return self.n_generated_server
        return sum(self.event_tokens)

    @property
    def ttft_s(self) -> float | None:
        return self.event_times[0] - self.sent_s if self.event_times else None

    @property
    def latency_s(self) -> float | None:
        return self.done_s - self.sent_s if self.done_s is not None else None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last token time - first token time) / (tokens - 1)."""
        if not self.ok or self.n_generated < 2 or not self.event_times:
            return None
        return (self.event_times[-1] - self.event_times[0]) / (self.n_generated - 1)

    def gaps_s(self) -> list[float]:
        """Gaps between consecutive token-carrying events (one per event after the first)."""
        t = self.event_times
        return [b - a for a, b in zip(t, t[1:])]


def finite(x: float | None) -> float | None:
    """``x`` if it is a finite number, else ``None`` (never NaN or inf in a report)."""
    if x is None or not math.isfinite(x):
        return None
    return float(x)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, linear interpolation) or ``None`` for no samples."""
    if len(values) == 0:
        return None
    return finite(float(np.percentile(np.asarray(values, dtype=np.float64), q)))


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return finite(num / den)


def median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return percentile(kept, 50.0)


@dataclass(frozen=True)
class Distribution:
    """p50 / p99 / max of one latency-like quantity, in milliseconds."""

    n: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> Distribution:
        ms = [v * MS_PER_S for v in values_s]
        return cls(
            n=len(ms),
            p50_ms=percentile(ms, 50.0),
            p99_ms=percentile(ms, 99.0),
            max_ms=finite(max(ms)) if ms else None,
        )


@dataclass(frozen=True)
class CrossCheck:
    """Generated tokens counted by the client against the delta of the server's
    ``llamacpp:tokens_predicted_total`` over the same phase."""

    client_tokens: int
    server_tokens: int | None  # None: /metrics unavailable (llama-server needs --metrics)
    diff_percent: float | None

    @classmethod
    def of(cls, client_tokens: int, before: float | None, after: float | None) -> CrossCheck:
        if before is None or after is None:
            return cls(client_tokens, None, None)
        server = int(round(after - before))
        if server == 0:
            diff = 0.0 if client_tokens == 0 else None
        else:
            diff = finite((client_tokens - server) / server * PERCENT)
        return cls(client_tokens, server, diff)


__all__ = ["CrossCheck", "Distribution", "RequestRecord", "finite", "median", "percentile", "ratio"]
