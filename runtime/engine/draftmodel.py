"""Draft-model speculation (``draft-simple``, ``-md FILE``): one draft context per group.

The draft model is loaded once per process (like the target) and must share the target's
vocabulary (``check_compatible``, llama.cpp's ``common_speculative_are_compatible``). Each
group makes its own draft context over it, with one sequence per slot of the group (the
slot's ``local`` id), so groups never touch each other's draft state.

Per step, for the slots that speculate (``DraftContext.propose``, in the group's thread):
1. catch up: each slot's draft sequence is brought to the slot's history (prompt and sampled
   tokens): the common prefix stays, the rest is removed and the missing tokens decoded, all
   slots in the same batches (a new request's prompt is prefilled here once);
2. draft: greedy, one token per slot and draft decode, all slots together, until a slot has
   its ``k`` tokens or the draft's top probability (over its top 10, llama-server's draft
   sampler) falls below ``p_min``.
The last drafted token is not decoded: the next step's catch-up decodes what was accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np

from llamactor.protocol.errors import ConfigError, EngineError
from llamactor.runtime.engine.batch import OwnedBatch
from llamactor.runtime.engine.logits import logits_at
from llamactor.runtime.engine.model import Model, open_context
from llamactor.runtime.engine.ngramcache import NgramCacheDrafter
from llamactor.runtime.engine.ngrammod import NgramModDrafter
from llamactor.runtime.engine.promptcache import common_prefix
from llamactor.runtime.engine.speculative import (
    SPEC_CACHE,
    SPEC_MOD,
    SPEC_NGRAM,
    Drafter,
    NgramDrafter,
    SpecOptions,
    SpecSlot,
    draft_room,
)

VOCAB_MAX_SIZE_DIFFERENCE = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE
VOCAB_CHECK_START_TOKEN_ID = 5  # llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID
DRAFT_TOP_K = 10  # llama-server's draft sampler keeps the top 10 before its probability check


def make_drafter(spec: SpecOptions, ctx_opts: Any, target: Model) -> Drafter:
    """The group's draft source for ``spec`` (``ctx_opts``: the target context's options)."""
    if spec.kind == SPEC_NGRAM:
        return NgramDrafter(spec.size_n)
    if spec.kind == SPEC_CACHE:
        return NgramCacheDrafter(spec.static_cache, spec.dynamic_cache)
    if spec.kind == SPEC_MOD:
        return NgramModDrafter(spec.size_n)
    return DraftContext(spec, ctx_opts, target.n_vocab)


def check_compatible(target: Model, draft: Model, path: str) -> None:
    """Raise ConfigError naming ``path`` unless the draft's vocabulary is the target's, as
    llama.cpp checks it: type, BOS/EOS use, size within 128, the same text for every token
    from id 5 on."""
    tv, dv = target.vocab, draft.vocab
    problems = []
    if llama_cpp.llama_vocab_type(tv) != llama_cpp.llama_vocab_type(dv):
        problems.append("its vocabulary type differs")
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        problems.append("its BOS token differs")
    add_eos = llama_cpp.llama_vocab_get_add_eos
    if add_eos(tv) != add_eos(dv) or (add_eos(tv) and target.eos != draft.eos):
        problems.append("its EOS token differs")
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        problems.append(f"it has {draft.n_vocab} tokens, the target {target.n_vocab}")
    elif not problems:
        for t in range(VOCAB_CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
            if llama_cpp.llama_vocab_get_text(tv, t) != llama_cpp.llama_vocab_get_text(dv, t):
                problems.append(f"token {t} is {draft.token_text(t)!r} there, {target.token_text(t)!r} in the target")
                break
    if problems:
        raise ConfigError(
            f"--model-draft {path}: the draft model's vocabulary does not match the target's ({'; '.join(problems)})"
        )


class DraftContext:
    """A group's draft context: one sequence per slot, greedy drafts for all slots at once."""

    def __init__(self, spec: SpecOptions, ctx_opts: Any, n_vocab_target: int) -> None:
        model: Model = spec.draft_model
        self.model = model
        self.n_vocab_target = n_vocab_target  # a draft stops at a token the target does not have
        self.ptr = open_context(
            model,
            "the draft context",
            n_ctx=spec.n_ctx_draft or ctx_opts.n_ctx,
            n_batch=ctx_opts.n_batch,
            n_ubatch=ctx_opts.n_ubatch,
            n_seq_max=ctx_opts.n_seq_max,
            n_threads=ctx_opts.n_threads,
            n_threads_batch=ctx_opts.n_threads_batch,
            kv_unified=ctx_opts.kv_unified,
            flash_attn_type=ctx_opts.flash_attn,
            **ctx_opts.rope.settings(),  # as llama-server's draft context (no control vector: another model)
        )
        self.memory = llama_cpp.llama_get_memory(self.ptr)
        self.n_batch = llama_cpp.llama_n_batch(self.ptr)
        self.n_ctx_seq = llama_cpp.llama_n_ctx_seq(self.ptr)
        self.held: list[list[int]] = [[] for _ in range(ctx_opts.n_seq_max)]  # tokens in each sequence's KV
        self._batch = OwnedBatch(self.n_batch)

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_free(self.ptr)
            self.ptr = None

    def propose(self, slots: Sequence[SpecSlot], room: int, n_ctx_seq: int) -> dict[int, np.ndarray]:
        want: list[tuple[SpecSlot, int, np.ndarray]] = []  # (slot, draft size wanted, its history)
        for s in slots:
            spec = s.spec
            if spec is None or room < 1:
                continue
            hist = spec.history(s)
            k = min(draft_room(s, n_ctx_seq), room, self.n_ctx_seq - len(hist) - 1)
            if k < spec.n_min:
                continue
            want.append((s, k, hist))
            room -= k
        if not want:
            return {}
        rows = self._catch_up(want)
        return self._draft(want, rows)

    def _catch_up(self, want: list[tuple[SpecSlot, int, np.ndarray]]) -> dict[int, int]:
        """Bring each slot's draft sequence to its history; returns the batch row of each
        slot's last history token in the final decode (logits live until the next decode, so
        every earlier token goes first, in batches without outputs, and the last ones last)."""
        last: list[tuple[int, int, int]] = []  # (sequence, last token, its position)
        b = self._batch
        n = 0
        for s, _, hist in want:
            held = self.held[s.local]
            keep = min(common_prefix(np.asarray(held, dtype=np.int32), hist), len(hist) - 1)
            if not llama_cpp.llama_memory_seq_rm(self.memory, s.local, keep, -1):
                llama_cpp.llama_memory_seq_rm(self.memory, s.local, -1, -1)
                keep = 0
            del held[keep:]
            held.extend(hist[keep:].tolist())
            tokens = hist[keep : len(hist) - 1]
            done = 0
            while done < len(tokens):
                if n == self.n_batch:
                    self._decode(n)
                    n = 0
                k = min(len(tokens) - done, self.n_batch - n)
                b.tok[n : n + k] = tokens[done : done + k]
                np.add(b.ramp[:k], keep + done, out=b.pos[n : n + k])
                b.seq[n : n + k] = s.local
                b.out[n : n + k] = 0
                done += k
                n += k
            last.append((s.local, int(hist[-1]), len(hist) - 1))
        if n + len(last) > self.n_batch:
            self._decode(n)
            n = 0
        rows: dict[int, int] = {}
        for seq, token, pos in last:
            b.tok[n], b.pos[n], b.seq[n], b.out[n] = token, pos, seq, 1
            rows[seq] = n
            n += 1
        self._decode(n)
        return rows

    def _draft(self, want: list[tuple[SpecSlot, int, np.ndarray]], rows: dict[int, int]) -> dict[int, np.ndarray]:
        drafts: dict[int, list[int]] = {s.local: [] for s, _, _ in want}
        live = [(s, k) for s, k, _ in want]
        b = self._batch
        while live:
            nxt: list[tuple[SpecSlot, int]] = []
            n = 0
            for s, k in live:
                assert s.spec is not None
                token, p_top = self._pick(rows[s.local], s.spec.p_min)
                if token >= self.n_vocab_target or p_top < s.spec.p_min:
                    continue  # llama-server: only confident drafts; never a token the target lacks
                d = drafts[s.local]
                d.append(token)
                if len(d) >= k:
                    continue
                b.tok[n] = token
                b.pos[n] = len(self.held[s.local])
                b.seq[n] = s.local
                b.out[n] = 1
                self.held[s.local].append(token)
                rows[s.local] = n
                nxt.append((s, k))
                n += 1
            if n:
                self._decode(n)
            live = nxt
        out: dict[int, np.ndarray] = {}
        for s, _, _ in want:
            d = drafts[s.local]
            assert s.spec is not None
            if len(d) >= s.spec.n_min:
                out[s.local] = np.asarray(d, dtype=np.int32)
        return out

    def _pick(self, row: int, p_min: float) -> tuple[int, float]:
        """The draft's greedy token at batch ``row`` and its probability among the top 10
        (computed only when ``p_min`` asks for it)."""
        logits = logits_at(self.ptr, row, self.model.n_vocab)
        token = int(logits.argmax())
        if p_min <= 0.0:
            return token, 1.0
        top = np.partition(logits, -DRAFT_TOP_K)[-DRAFT_TOP_K:] if len(logits) > DRAFT_TOP_K else logits
        return token, float(1.0 / np.exp(top - logits[token]).sum())

    def _decode(self, n: int) -> None:
        self._batch.batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.ptr, self._batch.batch)
        if rc != 0:
            raise EngineError(f"llama_decode on the draft context failed with status {rc}")
