"""Lookup decoding from n-gram caches: llama.cpp's ``common/ngram-cache.cpp`` (``--spec-type
ngram-cache`` with ``-lcs/--lookup-cache-static`` and ``-lcd/--lookup-cache-dynamic``).

An n-gram cache maps each n-gram (1 to 4 tokens) to the tokens that followed it and how often.
A draft is built one token at a time from three caches, as llama.cpp does: the request's own
context (its prompt and output so far; loose thresholds), the dynamic cache (what earlier
requests produced; strict thresholds) and the static cache (a large corpus, 2-grams only; its
counts also weigh the other two's candidates). The dynamic cache is read from its file at
startup when the file exists, every finished request's context is merged into it, and it is
written back when the engine stops (llama.cpp's ``llama-lookup`` does the same per run;
llama-server reads it but never writes it). The static cache is only read.

The files are llama.cpp's: each entry is the n-gram (4 int32 tokens, -1 past its length), the
number of followers (int32), then (token, count) int32 pairs; little-endian as written on the
machines llama.cpp runs on. ``llama-lookup-create`` and ``llama-lookup-merge`` make and merge them.

``NgramCacheDrafter`` is the speculation ``Drafter`` for it: it runs in the group's thread; the
dynamic cache is shared by every group (a lock around merges and the save).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llamactor.protocol.errors import ConfigError
from llamactor.runtime.engine.speculative import draft_room

NGRAM_MIN = 1  # LLAMA_NGRAM_MIN
NGRAM_MAX = 4  # LLAMA_NGRAM_MAX
NGRAM_STATIC = 2  # LLAMA_NGRAM_STATIC
N_DRAFT = 8  # llama-server's fixed draft length for ngram-cache
TOKEN_NULL = -1

# below these sample sizes or shares (percent) of the best follower, no token is drafted
_MIN_SAMPLE_LAX = (2, 2, 1, 1)
_MIN_PERCENT_LAX = (66, 50, 50, 50)
_MIN_SAMPLE_STRICT = (4, 3, 2, 2)
_MIN_PERCENT_STRICT = (75, 66, 66, 66)

Ngram = tuple[int, int, int, int]
Cache = dict[Ngram, dict[int, int]]

_HEAD = struct.Struct("<5i")  # the n-gram and its number of followers
_PAIR = struct.Struct("<2i")


def ngram(tokens: Sequence[int]) -> Ngram:
    """An n-gram key: the tokens, padded with -1 to four."""
    padded = (*tokens, TOKEN_NULL, TOKEN_NULL, TOKEN_NULL, TOKEN_NULL)
    return (padded[0], padded[1], padded[2], padded[3])


def update(cache: Cache, tokens: Sequence[int], n_new: int) -> None:
    """Count the n-grams ending at each of the last ``n_new`` tokens of ``tokens`` and the token
    after them (``common_ngram_cache_update``)."""
    n = len(tokens)
    for size in range(NGRAM_MIN, NGRAM_MAX + 1):
        for i in range(max(n - n_new, size), n):
            part = cache.setdefault(ngram(tokens[i - size : i]), {})
            token = int(tokens[i])
            part[token] = part.get(token, 0) + 1


def merge(target: Cache, add: Cache) -> None:
    """Add ``add``'s counts to ``target`` (``common_ngram_cache_merge``)."""
    for key, part in add.items():
        into = target.get(key)
        if into is None:
            target[key] = dict(part)
            continue
        for token, count in part.items():
            into[token] = into.get(token, 0) + count


def _best_static(static: Cache, key: Ngram) -> int:
    part = static.get(key)
    if not part:
        return TOKEN_NULL
    best, best_count = max(part.items(), key=lambda item: item[1])
    total = sum(part.values())
    i = NGRAM_STATIC - 1
    if total < _MIN_SAMPLE_LAX[i] or 100 * best_count < _MIN_PERCENT_LAX[i] * total:
        return TOKEN_NULL
    return best


def _best_primary(
    primary: Cache,
    keys: list[Ngram],
    part_static: dict[int, int],
    min_sample: tuple[int, ...],
    min_percent: tuple[int, ...],
) -> int:
    """The best follower of the longest n-gram in ``primary`` that clears the thresholds, each
    candidate weighed by its static count (``try_draft``)."""
    for i in range(len(keys) - 1, -1, -1):
        part = primary.get(keys[i])
        if not part:
            continue
        best, best_primary, best_static, total = TOKEN_NULL, 0, 0, 0
        for token, count in part.items():
            static = 100 * part_static[token] if token in part_static else 1
            if count * static > best_primary * best_static:
                best, best_primary, best_static = token, count, static
            total += count
        if total < min_sample[i] or 100 * best_primary < min_percent[i] * total:
            continue
        return best
    return TOKEN_NULL


def draft(tokens: Sequence[int], n_draft: int, context: Cache, dynamic: Cache, static: Cache) -> list[int]:
    """Up to ``n_draft`` tokens to follow ``tokens`` (``common_ngram_cache_draft``)."""
    out: list[int] = []
    seq = list(tokens[-NGRAM_MAX:])  # the tail the n-grams are read from, the draft appended
    if len(tokens) < NGRAM_STATIC:
        return out
    while len(out) < n_draft:
        part_static = static.get(ngram(seq[-NGRAM_STATIC:]), {})
        keys = [ngram(seq[-size:]) for size in range(NGRAM_MIN, NGRAM_MAX + 1) if size <= len(seq)]
        token = _best_primary(context, keys, part_static, _MIN_SAMPLE_LAX, _MIN_PERCENT_LAX)
        if token == TOKEN_NULL:
            token = _best_primary(dynamic, keys, part_static, _MIN_SAMPLE_STRICT, _MIN_PERCENT_STRICT)
        if token == TOKEN_NULL:
            token = _best_static(static, ngram(seq[-NGRAM_STATIC:]))
        if token == TOKEN_NULL:
            break
        out.append(token)
        seq.append(token)
    return out


def load(path: str | Path) -> Cache:
    """A cache file (``common_ngram_cache_load``); ConfigError naming it when it cannot be read
    or is not an n-gram cache."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the lookup cache {path}: {exc.strerror}") from None
    cache: Cache = {}
    at = 0
    try:
        while at < len(data):
            *key, n = _HEAD.unpack_from(data, at)
            at += _HEAD.size
            if n <= 0:
                raise ValueError(f"an n-gram with {n} followers")
            pairs = np.frombuffer(data, dtype="<i4", count=2 * n, offset=at).reshape(n, 2)
            at += n * _PAIR.size
            if (pairs[:, 1] <= 0).any():
                raise ValueError("a count that is not positive")
            cache[(key[0], key[1], key[2], key[3])] = {int(t): int(c) for t, c in pairs}
    except (struct.error, ValueError) as exc:
        raise ConfigError(f"{path} is not a llama.cpp n-gram lookup cache: {exc}") from None
    return cache


def save(cache: Cache, path: str | Path) -> None:
    """Write ``cache`` as llama.cpp's file, atomically (a temporary file renamed over it)."""
    parts = []
    for key, part in cache.items():
        parts.append(_HEAD.pack(*key, len(part)))
        parts.append(np.array(list(part.items()), dtype="<i4").tobytes())
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_bytes(b"".join(parts))
    os.replace(tmp, path)


class DynamicCache:
    """The dynamic cache every group's drafter shares: merged into under a lock, saved to its
    file (when it has one) as each drafter closes."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.cache: Cache = load(path) if path and Path(path).exists() else {}
        self.lock = threading.Lock()

    def add(self, context: Cache) -> None:
        with self.lock:
            merge(self.cache, context)

    def save(self) -> None:
        if self.path:
            with self.lock:
                save(self.cache, self.path)


class _SlotCache:
    __slots__ = ("context", "n_seen", "spec")

    def __init__(self, spec: Any) -> None:
        self.spec = spec  # the request's SpecState: a new one is a new request
        self.context: Cache = {}
        self.n_seen = 0  # tokens of the history counted into ``context``


class NgramCacheDrafter:
    """``--spec-type ngram-cache``: drafts from each slot's context cache, the dynamic cache
    and the static cache. A slot's context goes into the dynamic cache when its next request
    starts, and every slot's when the drafter closes."""

    def __init__(self, static: Cache, dynamic: DynamicCache, n_draft: int = N_DRAFT) -> None:
        self.static = static
        self.dynamic = dynamic
        self.n_draft = n_draft
        self.slots: dict[int, _SlotCache] = {}

    def propose(self, slots: Sequence[Any], room: int, n_ctx_seq: int) -> dict[int, np.ndarray]:
        out: dict[int, np.ndarray] = {}
        for s in slots:
            spec = s.spec
            if spec is None or room < 1:
                continue
            k = min(draft_room(s, n_ctx_seq), room, self.n_draft)
            if k < spec.n_min:
                continue
            hist = spec.history(s)
            state = self._state(s.local, spec)
            update(state.context, hist, len(hist) - state.n_seen)
            state.n_seen = len(hist)
            tokens = draft(hist, k, state.context, self.dynamic.cache, self.static)
            if tokens and len(tokens) >= spec.n_min:
                out[s.local] = np.asarray(tokens, dtype=np.int32)
                room -= len(tokens)
        return out

    def _state(self, local: int, spec: Any) -> _SlotCache:
        state = self.slots.get(local)
        if state is None or state.spec is not spec:
            if state is not None:
                self.dynamic.add(state.context)  # the slot's previous request ended
            state = self.slots[local] = _SlotCache(spec)
        return state

    def close(self) -> None:
        for state in self.slots.values():
            self.dynamic.add(state.context)
        self.slots.clear()
        self.dynamic.save()
