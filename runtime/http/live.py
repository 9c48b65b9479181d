"""``GET /live``: the live view's server-sent event stream (for the built-in page).

One snapshot per tick for every connected client, never one per client: the first client
that wants the next frame becomes the tick's producer (it sleeps until the tick is due, pulls
``RuntimeCore.read_live()``, encodes one frame); the others wait for that frame and send
the same bytes. A client that falls behind skips to the newest frame (nothing queues up).
With no client connected nothing ticks at all, and the groups never do any work for the view:
the snapshot only reads what the actors already keep.

Rates and histories need more than one snapshot, so they are kept here, per feed: tok/s and
prompt tok/s over the last ``RATE_WINDOW_S`` (overall and per group), a series of both over the
last ``SERIES_SPAN_S``, and the TTFT / inter-token histograms of the last ``HIST_WINDOW_S``.
They are computed from the counters over the snapshots' own times (``LiveSnapshot.at``, taken
where the counters are read), never over the times the frames were made: a snapshot read late
(an engine in its own process answers a moment later) cannot make a rate jump. A client that
connects gets a frame made after it connected, unless the last one is less than a tick old.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple

import anyio
import msgspec

from llamactor.protocol import sse
from llamactor.protocol.live import LiveHistogram, LiveSnapshot

TICK_S = 0.25  # 4 snapshots a second
RATE_WINDOW_S = 2.0  # the "now" rates are averaged over this
SERIES_STEP_S = 1.0  # one point of the rate series per second
SERIES_SPAN_S = 180.0  # the rate series covers the last three minutes
HIST_WINDOW_S = 60.0  # the "recent" histograms cover the last minute


class Rates(msgspec.Struct, frozen=True):
    tok_s: float
    prompt_tok_s: float


class Series(msgspec.Struct, frozen=True):
    """Rates over time: ``at`` in seconds since the epoch, one point per ``SERIES_STEP_S``."""

    at: list[float]
    tok_s: list[float]
    prompt_tok_s: list[float]


class Recent(msgspec.Struct, frozen=True):
    """Per-bucket counts of the last ``window_s`` (bounds as in the snapshot's histograms)."""

    window_s: float
    ttft: list[int]
    inter_token: list[int]


class LiveFrame(msgspec.Struct, frozen=True):
    snapshot: LiveSnapshot
    rates: Rates
    group_rates: list[Rates]
    series: Series
    recent: Recent
    clients: int
    tick_s: float


class _Sample(NamedTuple):
    t: float  # monotonic seconds
    predicted: tuple[int, ...]  # per group, cumulative
    prompt: tuple[int, ...]


class History:
    """What a series of snapshots adds up to. Pure: fed snapshots and monotonic times."""

    def __init__(self) -> None:
        self._recent: deque[_Sample] = deque()  # the last RATE_WINDOW_S of samples
        self._last_point: _Sample | None = None
        self._series: deque[tuple[float, float, float]] = deque(maxlen=int(SERIES_SPAN_S / SERIES_STEP_S))
        self._hist: deque[tuple[float, tuple[int, ...], tuple[int, ...]]] = deque()

    def add(self, snap: LiveSnapshot, now: float, clients: int, tick_s: float) -> LiveFrame:
        """The frame of ``snap``; ``now`` is when it was taken (the feed's clock): the rates use
        the snapshot's own time ``snap.at``, when its counters were read."""
        now = snap.at
        sample = _Sample(
            now, tuple(g.tokens_predicted for g in snap.groups), tuple(g.prompt_tokens for g in snap.groups)
        )
        if not self._recent or sample.t > self._recent[-1].t:  # the same snapshot again adds nothing
            self._recent.append(sample)
        while len(self._recent) > 1 and now - self._recent[0].t > RATE_WINDOW_S:
            self._recent.popleft()  # after a pause with no viewer: 0 at first, not a long average
        oldest = self._recent[0]
        n = len(sample.predicted)
        group_rates = [Rates(*_rates(oldest, sample, g)) for g in range(n)] if len(oldest.predicted) == n else []
        rates = Rates(sum(r.tok_s for r in group_rates), sum(r.prompt_tok_s for r in group_rates))
        last = self._last_point
        if last is None or len(last.predicted) != n:
            self._last_point = sample
        elif now - last.t >= SERIES_STEP_S:
            per_group = [_rates(last, sample, g) for g in range(n)]
            self._series.append((snap.at, sum(r[0] for r in per_group), sum(r[1] for r in per_group)))
            self._last_point = sample
        return LiveFrame(
            snapshot=snap,
            rates=rates,
            group_rates=group_rates,
            series=Series([p[0] for p in self._series], [p[1] for p in self._series], [p[2] for p in self._series]),
            recent=self._recent_histograms(snap, now),
            clients=clients,
            tick_s=tick_s,
        )

    def _recent_histograms(self, snap: LiveSnapshot, now: float) -> Recent:
        ttft, gap = _counts(snap.ttft), _counts(snap.inter_token)
        if not self._hist or now - self._hist[-1][0] >= SERIES_STEP_S:
            self._hist.append((now, ttft, gap))
        while len(self._hist) > 1 and now - self._hist[1][0] >= HIST_WINDOW_S:
            self._hist.popleft()
        _, ttft0, gap0 = self._hist[0]
        return Recent(min(HIST_WINDOW_S, now - self._hist[0][0]), _minus(ttft, ttft0), _minus(gap, gap0))


def _rates(a: _Sample, b: _Sample, g: int) -> tuple[float, float]:
    dt = b.t - a.t
    if dt <= 0:
        return 0.0, 0.0
    return max(0, b.predicted[g] - a.predicted[g]) / dt, max(0, b.prompt[g] - a.prompt[g]) / dt


def _counts(h: LiveHistogram | None) -> tuple[int, ...]:
    return h.counts if h is not None else ()


def _minus(now: tuple[int, ...], then: tuple[int, ...]) -> list[int]:
    if len(now) != len(then):
        return list(now)
    return [max(0, a - b) for a, b in zip(now, then)]


class LiveFeed:
    """The shared ticker behind ``GET /live`` (one per app)."""

    def __init__(
        self,
        snapshot: Callable[[], Awaitable[LiveSnapshot]],
        *,
        tick_s: float = TICK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._snapshot = snapshot
        self.tick_s = tick_s
        self._clock = clock
        self._history = History()
        self._frame = b""
        self._frame_at = 0.0  # monotonic time the frame was made
        self._seq = 0  # frames produced so far
        self._due = 0.0  # monotonic time the next frame is due
        self._producing = False
        self._ticked: anyio.Event | None = None  # made on first use: the app may be built outside a loop
        self.clients = 0

    @property
    def ticks(self) -> int:
        """Snapshots taken so far: one per tick, whatever the number of clients."""
        return self._seq

    async def frames(self) -> AsyncIterator[bytes]:
        """SSE frames for one client, one per tick (the newest if it fell behind), until it leaves."""
        self.clients += 1
        # The last frame is for a new client only while it is fresh (viewers may have been gone
        # for minutes: nothing ticks then); otherwise the client waits for the next one.
        seen = self._seq if self._clock() - self._frame_at > self.tick_s else max(0, self._seq - 1)
        try:
            while True:
                seen = await self._next(seen)
                yield self._frame
        finally:
            self.clients -= 1

    async def _next(self, seen: int) -> int:
        while self._seq <= seen:
            if self._producing:
                if self._ticked is None:
                    self._ticked = anyio.Event()
                await self._ticked.wait()
                continue
            self._producing = True
            try:
                await anyio.sleep(max(0.0, self._due - self._clock()))
                snap = await self._snapshot()
                self._produce(snap)
            finally:
                # Wake every waiter even if this producer was cancelled: one of them takes over.
                self._producing = False
                ticked, self._ticked = self._ticked, None
                if ticked is not None:
                    ticked.set()
        return self._seq

    def _produce(self, snap: LiveSnapshot) -> None:
        now = self._clock()
        frame = self._history.add(snap, now, self.clients, self.tick_s)
        self._frame = sse.frame(frame)
        self._frame_at = now
        self._seq += 1
        self._due = now + self.tick_s
