"""Routing requests over replicas by what each one has cached: the rule, without Ray.

A prompt is cut into blocks of ``BLOCK`` tokens, each named by a hash chained over every block
before it (so a block's hash names the whole prefix up to its end, as vLLM's prefix-cache block
hashes do). A replica reports the hashes of what its slots and its RAM prompt cache hold; the
router adds what it sent there since the replica's last report (a prompt is cached from the
moment its prefill starts). ``choose`` then ranks the replicas for one request:

1. the replica holding the longest cached prefix of the prompt, unless it has no slot free
   while another replica has one (a request that would wait there starts at once elsewhere;
   measured: a burst sharing one system prompt, all sent after it, waited behind one replica's
   slots while the other stood idle);
2. otherwise the less loaded of two replicas picked at random (power of two choices), among
   those with a slot free (all of them when none has); equally loaded, the one holding fewer
   blocks (a new prompt evicts least there);
3. the rest, least loaded first, for Ray Serve to fall back on.

A conversation's later turn starts with the earlier turn's prompt and answer, so it follows
its own cache back to its replica without any session key.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

BLOCK = 16  # tokens per hashed block (vLLM's default KV block): a chat turn of ~80 tokens spans
# several, so the blocks that tell two conversations apart are whole (at 64 a turn's own tokens
# mostly sat in a partial block, and conversations sharing a system prompt looked alike)
RECENT_S = 10.0  # what the router sent to a replica counts as cached there at most this long
SETTLE_S = 2.0  # ... and until a report taken this long after it (it is in the replica's slots by then)


def block_hashes(tokens: npt.NDArray[np.int32] | list[int], limit: int = 1 << 30) -> list[int]:
    """The chained hashes of the full ``BLOCK``-token blocks of ``tokens`` (at most ``limit``)."""
    data = np.ascontiguousarray(tokens, dtype=np.int32)
    out: list[int] = []
    prev = b""
    for start in range(0, min(len(data) // BLOCK, limit) * BLOCK, BLOCK):
        digest = hashlib.blake2b(prev + data[start : start + BLOCK].tobytes(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little", signed=True))
        prev = digest
    return out


class Placed(msgspec.Struct, frozen=True, tag=True):
    """The first frame of a replica's events stream: whose it is. ``epoch`` counts the
    replica's events streams that ended before it: a request's events go on the stream of the
    epoch it came in."""

    replica: str
    pid: int
    epoch: int = 0


class Served(msgspec.Struct, frozen=True, tag=True):
    """A replica's answer to a request it served: ``delivered`` False when its events were
    lost (the events stream of its ``epoch`` ended first: the ingress resumes it elsewhere)."""

    replica: str
    pid: int
    epoch: int
    delivered: bool


@dataclass(frozen=True)
class Route:
    """What a router sees of one request (beside the request itself, which it never decodes)."""

    task_id: int
    blocks: tuple[int, ...] = ()  # ``block_hashes`` of the prompt
    prompt: str = ""  # the prompt's token ids as text: what Ray's prefix-tree router matches characters of
    replica: str = ""  # a call meant for this replica (slots, metrics): it goes there or fails
    lora: tuple[tuple[int, float], ...] = ()  # the adapters the request uses (id, scale)


@dataclass
class ReplicaLoad:
    """One replica as the router knows it: its last report plus what was sent there since."""

    slots: int = 1
    busy: int = 0  # slots serving a request (reported)
    queued: int = 0  # requests waiting for a slot (reported)
    kv_used: float = 0.0  # 0-1 (reported)
    pid: int = 0
    at: float = 0.0  # when the last report was taken (the replica's clock)
    blocks: frozenset[int] = frozenset()  # reported cached block hashes
    loras: tuple[int, ...] = ()
    prefill_ms_per_token: float = 0.0  # what one more prompt token costs a step there (reported; 0: unknown)
    recent: list[tuple[float, frozenset[int]]] = field(default_factory=list)  # (when, blocks) sent
    in_flight: int = 0  # requests this router sent there that have not ended

    def report(self, stats: dict[str, Any], now: float) -> None:
        """A replica's routing stats: what it holds now replaces what was known."""
        self.slots = max(1, int(stats.get("slots", self.slots)))
        self.busy = int(stats.get("busy", 0))
        self.queued = int(stats.get("queued", 0))
        self.kv_used = float(stats.get("kv_used", 0.0))
        self.pid = int(stats.get("pid", 0))
        self.at = float(stats.get("at", now))
        self.blocks = frozenset(stats.get("blocks", ()))
        self.loras = tuple(stats.get("loras", ()))
        self.prefill_ms_per_token = float(stats.get("prefill_ms_per_token", 0.0))
        self._forget(now)

    def ended(self) -> None:
        """A request this router sent here ended."""
        self.in_flight = max(0, self.in_flight - 1)

    def sent(self, blocks: tuple[int, ...], now: float) -> None:
        self.recent.append((now, frozenset(blocks)))

    def unsent(self, at: float) -> None:
        """The request counted as sent here at ``at`` went elsewhere."""
        self.recent = [(t, b) for t, b in self.recent if t != at]

    def _forget(self, now: float) -> None:
        # a request sent just before a report may not be in it yet (in transit): kept a while
        self.recent = [(t, b) for t, b in self.recent if t > self.at - SETTLE_S and now - t < RECENT_S]

    def cached(self, blocks: tuple[int, ...], now: float) -> int:
        """How many leading blocks of a prompt this replica holds (or was just sent)."""
        if not blocks:
            return 0
        self._forget(now)
        held = [self.blocks, *(b for _, b in self.recent)]
        n = 0
        for h in blocks:
            if not any(h in s for s in held):
                break
            n += 1
        return n

    @property
    def requests(self) -> int:
        """Requests there: those this router has in flight there. Exact: a replica set's
        replicas serve its one ingress, and the router hears of each request's start and end at
        once (a report is up to half a second old: taken as a turn starts, it still showed the
        replica full when the conversation's next turn came)."""
        return self.in_flight

    @property
    def held(self) -> int:
        """Blocks it holds (reported, and sent since)."""
        return len(self.blocks) + sum(len(b) for _, b in self.recent)

    @property
    def load(self) -> float:
        return self.requests / self.slots

    def full(self) -> bool:
        """No slot free for one more request (never before its first report: its slots are unknown)."""
        return self.at > 0 and self.requests >= self.slots


@dataclass(frozen=True)
class Pull:
    """A prefix to pull: ``holder`` holds ``blocks`` more leading blocks of the prompt than
    ``target``, where the request goes; prefilling one token there costs ``prefill_ms_per_token``."""

    holder: str
    target: str
    blocks: int
    prefill_ms_per_token: float


def pull_plan(route: Route, loads: dict[str, ReplicaLoad], target: str, now: float, min_blocks: int) -> Pull | None:
    """Where the request bound for ``target`` could pull at least ``min_blocks`` more blocks
    of its prompt from (the replica holding the most), or None."""
    if target not in loads or not route.blocks:
        return None
    held = {rid: load.cached(route.blocks, now) for rid, load in loads.items()}
    holder = max(sorted(held), key=lambda rid: held[rid])
    gain = held[holder] - held[target]
    if holder == target or gain < min_blocks:
        return None
    rate = loads[target].prefill_ms_per_token or loads[holder].prefill_ms_per_token
    return Pull(holder, target, gain, rate)


def choose(
    route: Route, loads: dict[str, ReplicaLoad], now: float, rng: random.Random | None = None
) -> list[list[str]]:
    """Replica ids in ranks, the most preferred first (see the module's rule)."""
    if not loads:
        return []
    sample = rng.sample if rng is not None else random.sample
    ids = sorted(loads)
    best, best_n = "", 0
    for rid in ids:
        n = loads[rid].cached(route.blocks, now)
        if n > best_n:
            best, best_n = rid, n
    first = [best] if best_n and not (loads[best].full() and any(not loads[r].full() for r in ids if r != best)) else []
    ranks = [first] if first else []
    fine = [r for r in ids if r not in first and not loads[r].full()] or [r for r in ids if r not in first]
    two = sample(fine, 2) if len(fine) >= 2 else fine
    if two:  # equally loaded: the one holding less, whose cache loses least to a new prompt
        ranks.append([min(two, key=lambda r: (loads[r].load, loads[r].held, r))])
    taken = {r for rank in ranks for r in rank}
    rest = sorted((r for r in ids if r not in taken), key=lambda r: (loads[r].load, r))
    if rest:
        ranks.append(rest)
    return ranks
