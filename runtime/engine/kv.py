"""The KV cells of one context's sequences: every ``llama_memory_*`` call of a group.

One sequence per slot (its ``local`` id). What a sequence holds is mirrored in ``slot.cache``
(the token ids whose KV it has, in order) and ``slot.lora`` (the adapters they were computed
under); every operation here keeps the two in step, so that the supervisor's slot choice, the
prompt cache and prefix sharing can reason about the KV without asking llama.cpp.

The operations are llama-server's: keep the longest common prefix of a new prompt (cache
reuse), copy a prefix from another sequence (prefix sharing, n > 1 choices), save/restore a
sequence to a file, drop rejected draft tokens, and shift the context (drop old tokens after
the first ``n_keep`` so a long generation goes on).

Called by the owning group only: between steps on its event loop (reuse, share, erase, save,
restore) or during its step in its worker thread (copy to n > 1 choices, drafts, shift).
Never for another group's context.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from llamactor.protocol.errors import EngineError, RequestError
from llamactor.protocol.lora import NO_LORA, LoraSet
from llamactor.protocol.media import NO_TOKEN
from llamactor.protocol.slots import SlotKV
from llamactor.runtime.engine.checkpoints import Checkpoints
from llamactor.runtime.engine.model import Model
from llamactor.runtime.engine.promptcache import PromptCache, common_prefix, media_floor
from llamactor.runtime.engine.slot import Slot

# Context shift keeps at least this many cells free below the slot's context (llama-server's).
SHIFT_MARGIN_CELLS = 4


class SequenceKV:
    """The memory of one ``llama_context`` seen as one KV sequence per slot."""

    def __init__(
        self,
        ctx: Any,
        model: Model,
        *,
        n_ctx_seq: int,
        kv_unified: bool,
        context_shift: bool,
        checkpoints: int = 0,
        checkpoint_min_step: int = 8192,
        n_batch: int = 2048,
        n_ubatch: int = 512,
    ) -> None:
        self.ctx = ctx
        self.memory = llama_cpp.llama_get_memory(ctx)
        self.model = model
        self.n_ctx_seq = n_ctx_seq
        self.kv_unified = kv_unified
        self.context_shift = context_shift
        # sliding-window models: the window's cells saved as prompts go in (``checkpoints``)
        self.checkpoints = Checkpoints(
            ctx,
            self.memory,
            n_swa=model.n_swa,
            limit=checkpoints,
            min_step=checkpoint_min_step,
            n_batch=n_batch,
            n_ubatch=n_ubatch,
        )

    # ---- reuse and sharing (between steps) ------------------------------------------------

    def reuse_prefix(
        self,
        slot: Slot,
        prompt: np.ndarray,
        cache_prompt: bool,
        prompt_cache: PromptCache | None = None,
        lora: LoraSet = NO_LORA,
        reuse_min: int = 0,
        others: Sequence[Slot] = (),
    ) -> int:
        """Keep the longest common prefix of the slot's KV and ``prompt``; return its length.

        With a host-memory prompt cache: if the new prompt loses part of what the slot holds
        (``PromptCache.worth_saving``: another conversation takes the slot), the slot's state is
        saved first, with its checkpoints; then a cached state that serves the prompt better is
        restored into the slot, with its own.
        KV computed under another LoRA set than the request's ``lora`` is never reused
        (llama-server clears a slot's cache when its adapters change).
        At least the last prompt token is always decoded again, so its logits exist, and a
        prefix never ends inside an image (``media_floor``).
        With ``reuse_min`` > 0, later chunks of the slot's KV are kept too (``reuse_chunks``;
        ``others``: the group's other slots, whose cells a unified KV may share).
        """
        same = slot.lora == lora
        if cache_prompt and prompt_cache is not None:
            held = np.asarray(slot.cache, dtype=np.int32)
            if len(held) and (not same or prompt_cache.worth_saving(len(held), common_prefix(held, prompt))):
                serving = tuple(c for c in self.checkpoints.of(slot) if c.serves(held, slot.lora, len(held)))
                prompt_cache.save(self.ctx, slot.local, held, slot.lora, serving)
            restored = prompt_cache.restore(self.ctx, slot.local, prompt, held if same else held[:0], lora)
            if restored is not None:
                slot.cache[:] = restored.tokens.tolist()
                self.checkpoints.adopt(slot, restored.checkpoints)
                same = True
        slot.lora = lora
        keep = 0
        if cache_prompt and slot.cache and same:
            # at most len(prompt) - 1: the last prompt token is decoded again for its logits
            keep = common_prefix(np.asarray(slot.cache, dtype=np.int32), prompt[: len(prompt) - 1])
            keep = media_floor(prompt, keep)
            if reuse_min > 0:
                keep = self.reuse_chunks(slot, prompt, keep, reuse_min, others)
        if not llama_cpp.llama_memory_seq_rm(self.memory, slot.local, keep, -1):
            # Some memories (recurrent) cannot cut a sequence in the middle
            llama_cpp.llama_memory_seq_rm(self.memory, slot.local, -1, -1)
            keep = 0
        elif not self.window_kept(slot, keep):
            # a sliding window lost what the kept prefix needs: back to a checkpoint before it
            keep = self.checkpoints.restore(slot, keep)
            if not keep:
                llama_cpp.llama_memory_seq_rm(self.memory, slot.local, -1, -1)
        del slot.cache[keep:]
        return keep

    def reuse_chunks(self, slot: Slot, prompt: np.ndarray, keep: int, n_min: int, others: Sequence[Slot]) -> int:
        """llama-server's cache reuse (``--cache-reuse``, ``n_cache_reuse``): past the common
        prefix of ``keep`` tokens, walk the slot's cache for runs of at least ``n_min`` tokens
        that continue the new prompt where it has got to, and move each run's cells down to its
        place in the prompt (``llama_memory_seq_rm`` of the gap, ``llama_memory_seq_add`` of the
        run) instead of decoding it again; return the tokens the slot now holds for ``prompt``.

        Only where the memory can shift (not M-RoPE, not recurrent). A run is text only: it never
        holds or cuts an image's stand-in tokens, and never takes the last prompt token (decoded
        again for its logits). With a unified KV the cells of a prefix copied to or from another
        slot are shared (``share_prefix``, ``copy_all``): moving one would move it for that slot
        too, so runs start past every other slot's common prefix with this one."""
        cache = np.asarray(slot.cache, dtype=np.int32)
        if keep >= len(cache) or not llama_cpp.llama_memory_can_shift(self.memory):
            return keep
        head_c = keep
        if self.kv_unified:
            for o in others:
                if o is not slot and o.cache:
                    head_c = max(head_c, common_prefix(cache, np.asarray(o.cache, dtype=np.int32)))
        # the prompt's reusable part: before its last token and before its first image after ``keep``
        want = prompt[: len(prompt) - 1]
        images = np.flatnonzero(want[keep:] < 0)
        if len(images):
            want = want[: keep + int(images[0])]
        head_p = keep
        moved: list[int] = []
        while head_c < len(cache) and head_p < len(want):
            starts = np.flatnonzero(cache[head_c:] == want[head_p])
            if not len(starts):
                break
            head_c += int(starts[0])
            n = common_prefix(cache[head_c:], want[head_p:])
            if n < n_min:
                head_c += 1
                continue
            if not llama_cpp.llama_memory_seq_rm(self.memory, slot.local, head_p, head_c):
                break  # a memory that cannot cut in the middle: keep what is in place
            llama_cpp.llama_memory_seq_add(self.memory, slot.local, head_c, head_c + n, head_p - head_c)
            moved.extend(cache[head_c : head_c + n].tolist())
            head_c += n
            head_p += n
        if moved:
            slot.cache[keep:] = moved
        return head_p

    def window_kept(self, slot: Slot, keep: int) -> bool:
        """With a sliding-window (SWA) cache, llama.cpp reuses the cells of positions that fell
        out of a sequence's window, oldest first; a kept prefix of ``keep`` tokens is usable
        only if the window before ``keep`` is still there. Always true without SWA.

        The first token decoded after the prefix sits at position ``keep`` and attends to the
        positions ``p`` with ``keep - p < n_swa``, so the cells from ``keep - n_swa + 1`` on
        must be there. llama-server asks for one more (``pos_min <= keep - n_swa``), which
        refuses the exact case of an exported or restored state: llama.cpp writes a sliding-
        window sequence's state as the window its last position sees, so a state of ``n``
        tokens holds ``n - n_swa`` on, just what decoding its last token again needs."""
        n_swa = self.model.n_swa
        if n_swa <= 0 or keep == 0:
            return True
        pos_min = llama_cpp.llama_memory_seq_pos_min(self.memory, slot.local)
        return 0 <= pos_min <= max(0, keep - n_swa + 1)

    def share_prefix(self, dst: Slot, src: Slot, n: int) -> int:
        """Make ``dst`` hold the KV of the first ``n`` tokens ``src`` holds; return how many it
        holds after (``n``, or 0 when a sliding window lost what they need).

        Unified KV (one stream): the cells get ``dst``'s sequence id too; nothing is copied and
        no cell is used twice. Split KV: llama.cpp copies ``src``'s whole stream at the next
        decode (it copies streams only whole), then the tail past ``n`` is dropped."""
        mem = self.memory
        n = media_floor(dst.prompt, n) if len(dst.prompt) else n
        llama_cpp.llama_memory_seq_rm(mem, dst.local, -1, -1)
        dst.cache.clear()
        if self.kv_unified:
            llama_cpp.llama_memory_seq_cp(mem, src.local, dst.local, 0, n)
        else:
            llama_cpp.llama_memory_seq_cp(mem, src.local, dst.local, -1, -1)
            llama_cpp.llama_memory_seq_rm(mem, dst.local, n, -1)
        if not self.window_kept(dst, n):
            llama_cpp.llama_memory_seq_rm(mem, dst.local, -1, -1)
            return 0
        dst.cache.extend(src.cache[:n])
        dst.lora = src.lora
        return n

    # ---- during a step (worker thread) ----------------------------------------------------

    def copy_all(self, src: Slot, dst: Slot) -> None:
        """``dst`` holds exactly what ``src`` holds (an n > 1 choice gets its prompt, prefilled once)."""
        llama_cpp.llama_memory_seq_rm(self.memory, dst.local, -1, -1)
        llama_cpp.llama_memory_seq_cp(self.memory, src.local, dst.local, -1, -1)
        dst.cache[:] = src.cache
        dst.lora = src.lora

    def drop_from(self, slot: Slot, pos: int) -> None:
        """Remove the cells at positions ``pos`` and after (rejected draft tokens); ``slot.cache``
        already stops before them."""
        llama_cpp.llama_memory_seq_rm(self.memory, slot.local, pos, -1)

    def shift(self, s: Slot) -> bool:
        """Context shift (llama-server's): drop ``n_discard`` tokens after the first ``n_keep``
        and move the rest down, so the generation goes on. False when it is off, for n > 1 (the
        choices share the prompt's cells) or when the memory cannot shift (then the choice ends
        with "length", as without shift)."""
        task = s.task
        if not self.context_shift or task is None or task.n > 1 or task.media:
            return False  # (an image's embeddings cannot move as a whole: llama-server shifts no multimodal prompt)
        if not llama_cpp.llama_memory_can_shift(self.memory):
            return False
        n_keep = len(s.prompt) if task.n_keep < 0 else task.n_keep
        if self.model.add_bos:
            n_keep += 1
        n_keep = min(self.n_ctx_seq - SHIFT_MARGIN_CELLS, n_keep)
        n_left = s.n_past - n_keep
        n_discard = task.n_discard or n_left // 2
        n_discard = min(max(n_discard, 0), max(0, n_left - 1))
        if n_discard <= 0:
            return False
        if not llama_cpp.llama_memory_seq_rm(self.memory, s.local, n_keep, n_keep + n_discard):
            return False
        llama_cpp.llama_memory_seq_add(self.memory, s.local, n_keep + n_discard, s.n_past, -n_discard)
        del s.cache[n_keep : n_keep + n_discard]
        s.n_past -= n_discard
        s.truncated = True
        return True

    # ---- erase, save, restore (slot commands, between steps) ------------------------------

    def erase(self, slot: Slot) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, slot.local, -1, -1)
        slot.cache.clear()
        self.checkpoints.forget(slot)

    def save_file(self, slot: Slot, path: str) -> int:
        """Write the slot's KV and its tokens to ``path``; return the tokens saved. A slot that
        holds an image is not saved: its stand-in tokens mean nothing to another process."""
        if any(t < NO_TOKEN for t in slot.cache):
            raise RequestError(f"slot {slot.id} holds image or audio KV: slots with media cannot be saved")
        toks = (llama_cpp.llama_token * len(slot.cache))(*slot.cache)
        n = llama_cpp.llama_state_seq_save_file(self.ctx, path.encode(), slot.local, toks, len(slot.cache))
        if n == 0:
            raise EngineError(f"could not save slot {slot.id} to {path}")
        return len(slot.cache)

    def restore_file(self, slot: Slot, path: str) -> int:
        """Replace the slot's KV with the one saved in ``path``; return the tokens it holds now.
        Reads both token layouts a slot file has: a plain token list (what this server and
        older llama-servers write) and llama-server's packed one (see ``slot_file_tokens``)."""
        cap = self.n_ctx_seq + PACKED_HEADER_WORDS
        toks = (llama_cpp.llama_token * cap)()
        n_out = ctypes.c_size_t(0)
        llama_cpp.llama_memory_seq_rm(self.memory, slot.local, -1, -1)
        n = llama_cpp.llama_state_seq_load_file(self.ctx, path.encode(), slot.local, toks, cap, ctypes.byref(n_out))
        if n == 0:
            slot.cache.clear()
            raise RequestError(
                f"Unable to restore slot: no available space in KV cache or invalid slot save file {Path(path).name}"
            )
        try:
            tokens = slot_file_tokens(toks[: n_out.value], self.model.n_vocab, self.n_ctx_seq)
        except RequestError:
            llama_cpp.llama_memory_seq_rm(self.memory, slot.local, -1, -1)
            slot.cache.clear()
            raise
        slot.cache[:] = tokens
        slot.lora = NO_LORA  # a slot file does not say which adapters made it: taken as the base model's
        return len(tokens)

    # ---- export, import: a slot's state as a value (moved between servers) ----------------

    def export_state(self, slot: Slot, prefix_of: Sequence[int] = ()) -> SlotKV:
        """The slot's KV state (``llama_state_seq_get_data`` of its sequence), with the tokens
        it holds and the LoRA set that computed them. As for a slot file, a slot that holds an
        image or audio is refused: its stand-in tokens mean nothing to another server.
        ``prefix_of``: the state is wanted for the prefix it shares with these tokens. With a
        sliding window, llama.cpp writes the window the sequence's last position sees, whatever
        the slot still holds before it: such a state serves a prompt that goes on from all its
        tokens (the last one decoded again), not one that leaves them earlier; nothing is
        exported then."""
        if any(t < 0 for t in slot.cache):
            raise RequestError(f"slot {slot.id} holds image or audio KV: slots with media cannot be exported")
        n_swa, n = self.model.n_swa, len(slot.cache)
        window_at, window = 0, b""
        if prefix_of and n_swa > 0 and n > n_swa:
            want = np.asarray(prefix_of[: len(prefix_of) - 1], dtype=np.int32)
            common = common_prefix(np.asarray(slot.cache, dtype=np.int32), want)
            if common < n - 1:  # the window of a checkpoint before ``common``, if one serves
                cp = self.checkpoints.best(slot, common)
                if cp is None:
                    return SlotKV(tokens=(), lora=NO_LORA, state=b"")
                window_at, window = cp.n_tokens, cp.state
        if not slot.cache:
            return SlotKV(tokens=(), lora=NO_LORA, state=b"")
        size = llama_cpp.llama_state_seq_get_size(self.ctx, slot.local)
        buf = (ctypes.c_ubyte * size)()
        if size == 0 or llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, slot.local) != size:
            raise EngineError(f"could not read the KV state of slot {slot.id}")
        return SlotKV(tokens=tuple(slot.cache), lora=slot.lora, state=bytes(buf), window_at=window_at, window=window)

    def import_state(self, slot: Slot, kv: SlotKV) -> int:
        """Replace the slot's KV with ``kv`` (an ``export_state`` of a compatible context: the
        caller checked the model, the KV types and the adapters); return the tokens it holds
        now. llama.cpp checks the state's own layout (layers, cell sizes, V layout) and refuses
        one that does not fit; the positions it holds must then be exactly ``kv.tokens``'.
        A refused import leaves the slot empty."""
        n_vocab = self.model.n_vocab
        if len(kv.tokens) > self.n_ctx_seq:
            raise RequestError(
                f"the state holds {len(kv.tokens)} tokens, more than a slot's context ({self.n_ctx_seq})"
            )
        if any(not 0 <= t < n_vocab for t in kv.tokens):
            raise RequestError(f"the state's tokens must be ids of this model's vocabulary (0..{n_vocab - 1})")
        llama_cpp.llama_memory_seq_rm(self.memory, slot.local, -1, -1)
        slot.cache.clear()
        slot.lora = NO_LORA
        self.checkpoints.forget(slot)
        if not kv.tokens:
            return 0
        data = (ctypes.c_ubyte * len(kv.state)).from_buffer_copy(kv.state)
        ok = llama_cpp.llama_state_seq_set_data(self.ctx, data, len(kv.state), slot.local) == len(kv.state)
        ok = ok and llama_cpp.llama_memory_seq_pos_max(self.memory, slot.local) == len(kv.tokens) - 1
        n = kv.window_at or len(kv.tokens)
        if ok and kv.window_at:  # back to the holder's checkpoint: the window at an earlier prefix
            ok = 0 < n < len(kv.tokens) and self.checkpoints.write(slot, n, kv.window)
        if not ok:
            llama_cpp.llama_memory_seq_rm(self.memory, slot.local, -1, -1)
            raise RequestError(
                "Unable to import slot: the state does not fit this server's KV cache (its layout, "
                "its size or its tokens differ)"
            )
        slot.cache[:] = kv.tokens[:n]
        slot.lora = kv.lora
        return n


# llama-server's packed token layout in a slot file (server_tokens::serialize): a marker word
# (LLAMA_TOKEN_NULL), the layout's version, the token count, the tokens, the count of media
# chunks, then each chunk's start index and bytes
PACKED_MARKER, PACKED_VERSION, PACKED_HEADER_WORDS = NO_TOKEN, 1, 4


def slot_file_tokens(words: list[int], n_vocab: int, n_ctx: int) -> list[int]:
    """The tokens a slot file's token words stand for. llama-server saves its slots with its
    packed layout; the same KV then follows in the file, so once the layout is read the prefix
    is reused as from one of this server's files. A file whose tokens are not this model's, or
    that holds images or audio, is refused as llama-server refuses it."""
    if words and words[0] == PACKED_MARKER:
        if len(words) < PACKED_HEADER_WORDS or words[1] != PACKED_VERSION:
            raise RequestError("Unable to restore slot: unsupported server tokens state version")
        n = words[2]
        if n < 0 or len(words) < 3 + n + 1:
            raise RequestError("Unable to restore slot: the slot file's token list is truncated")
        if words[3 + n] != 0:
            raise RequestError("Unable to restore slot: slots with image or audio KV cannot be restored")
        if len(words) != 3 + n + 1:
            raise RequestError("Unable to restore slot: trailing data in server tokens state")
        words = words[3 : 3 + n]
    if len(words) > n_ctx:
        raise RequestError("Unable to restore slot: restored prompt does not fit in the slot context")
    if any(not 0 <= t < n_vocab for t in words):
        raise RequestError("Unable to restore slot: invalid tokens in slot save file")
    return list(words)
