"""One group's llama_context and its decode step: the hot path (AC-4, AC-5, AC-6).

Design note for ``Context.step`` — per step it:
  1. fills the batch arrays (numpy views over buffers we own) with one slice assignment per
     slot, never one Python object per token;
  2. switches the context's LoRA adapters if the plan's set differs from the last step's
     (EN-1; never per token: one tuple compare per step), then calls ``llama_decode`` once
     (ctypes releases the GIL, so other groups and the event loop run meanwhile);
  3. samples each row that needs a token with the slot's llama.cpp sampler chain, turns the
     token into text (cached pieces, incremental UTF-8, stop strings) and decides finishes.
With speculation (EN-2, ``runtime.engine.speculative``) a generating slot's draft rows follow
its own row in step 1 (cut to the batch room the plan left), and step 3 samples them in order
while the draft holds (``_verify``), then drops the rejected drafts' KV cells. Off, the step
pays one ``is None`` test (``drafter``) and one falsy test per row.
It runs in the group's worker thread and must never: await, touch another group's slots or
context, send on a stream (anyio streams are not thread-safe: events are returned and sent by
the group's event-loop task), or allocate per token beyond the event it returns.
"""

from __future__ import annotations

import ctypes
import math
import time
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import numpy as np

from llamactor.runtime.engine.batch import OwnedBatch
from llamactor.runtime.engine.blackbox import DECODE, SAMPLE, START, Blackbox, engine_blackbox
from llamactor.protocol.plan import StepPlan
from llamactor.protocol.events import Done, Event, Progress, Token, TopProb
from llamactor.protocol.messages import Task
from llamactor.protocol.errors import EngineError, RequestError
from llamactor.protocol.lora import NO_LORA, LoraSet
from llamactor.runtime.engine.hooks import GroupHooks
from llamactor.runtime.engine.model import Model, open_context
from llamactor.runtime.engine.profiler import GroupProfile
from llamactor.runtime.engine.promptcache import PromptCache, common_prefix
from llamactor.runtime.engine.sampling import argmax_biases, biased_argmax, build_chain
from llamactor.runtime.engine.slot import Phase, Slot
from llamactor.runtime.engine.draftmodel import make_drafter
from llamactor.runtime.engine.speculative import Drafter, SpecOptions, SpecState
from llamactor.runtime.engine.textstream import TextStream


@dataclass(frozen=True)
class ContextOptions:
    n_ctx: int  # KV cells of this context (all its sequences together unless kv_unified)
    n_batch: int
    n_ubatch: int
    n_seq_max: int  # slots of this group
    n_threads: int
    n_threads_batch: int
    kv_unified: bool = False
    flash_attn: int = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
    type_k: int = llama_cpp.GGML_TYPE_F16  # KV cache types (EN-3, -ctk/-ctv)
    type_v: int = llama_cpp.GGML_TYPE_F16
    context_shift: bool = False  # a generation at the end of its context drops old tokens (EN-4)
    spec: SpecOptions | None = None  # speculative decoding (EN-2); None: off, and the step pays nothing


@dataclass
class StepResult:
    events: list[tuple[Task, Event]] = field(default_factory=list)  # (task, event) to send on task.sink
    finished: list[Slot] = field(default_factory=list)  # choices that ended this step
    ready: list[Slot] = field(default_factory=list)  # prompts that finished and wait (READY)
    n_prompt: int = 0
    n_generated: int = 0
    n_rows: int = 0  # slots that took part
    gaps: list[float] = field(default_factory=list)  # inter-token gaps of streams that generated
    failed: list[tuple[Slot, Exception]] = field(default_factory=list)  # request-scoped failures
    n_draft: int = 0  # draft tokens verified this step (EN-2)
    accepted: list[int] = field(default_factory=list)  # per verified draft: its tokens accepted


DECODE_NO_KV_SLOT = 1  # llama_decode: no KV cells for the batch (unified KV can be overcommitted)


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data


class KvCacheFull(EngineError):
    """Recoverable: the group stops one request to make room and goes on (see GroupActor)."""


class Context:
    """A llama_context made from the shared model, its batch buffers and its step."""

    def __init__(self, model: Model, opts: ContextOptions, hooks: GroupHooks | None = None, group: int = 0) -> None:
        self.model = model
        self.opts = opts
        self.ptr = open_context(model, "a context", n_ctx=opts.n_ctx, n_batch=opts.n_batch, n_ubatch=opts.n_ubatch,
                                n_seq_max=opts.n_seq_max, n_threads=opts.n_threads,
                                n_threads_batch=opts.n_threads_batch, kv_unified=opts.kv_unified,
                                flash_attn_type=opts.flash_attn, type_k=opts.type_k, type_v=opts.type_v)
        self.memory = llama_cpp.llama_get_memory(self.ptr)
        self.n_batch = llama_cpp.llama_n_batch(self.ptr)
        self.n_ctx_seq = llama_cpp.llama_n_ctx_seq(self.ptr)
        self.n_draft_room = min(self.n_batch, llama_cpp.llama_n_ubatch(self.ptr))  # EN-2, see step()
        self._decode = llama_cpp.llama_decode
        if hooks is not None:
            self._bind_hooks(hooks, group)
        box = engine_blackbox()
        if box is not None:
            self._bind_blackbox(box, group)
        self.holds_ready = False  # set by the owning group from its policy: finished prompts wait (PH-4)
        self.lora: LoraSet = NO_LORA  # the LoRA adapters active on this context (EN-1)
        self._alloc_batch(self.n_batch)
        # EN-2: this group's draft source (a draft model gets its own context here, PG-11)
        self.drafter: Drafter | None = None
        if opts.spec is not None:
            try:
                self.drafter = make_drafter(opts.spec, opts, model)
            except BaseException:
                self.close()
                raise

    def _alloc_batch(self, n: int) -> None:
        self._owned = OwnedBatch(n)
        o = self._owned
        self._tok, self._pos, self._nseq, self._seq, self._out, self._ramp = o.tok, o.pos, o.nseq, o.seq, o.out, o.ramp
        self._batch = o.batch

    def _bind_hooks(self, hooks: GroupHooks, group: int) -> None:
        """Route decode and sampling through ``hooks`` (tests); unhooked contexts pay nothing."""
        decode, sample = self._decode, self._sample

        def hooked_decode(ctx: Any, batch: Any) -> int:
            hooks.before_decode(group, self._n_prompt, self._n_generate)
            return decode(ctx, batch)

        def hooked_sample(s: Slot, i: int, logits: np.ndarray | None) -> int:
            assert s.task is not None
            hooks.before_sample(group, s.task)
            return sample(s, i, logits)

        self._decode = hooked_decode
        self._sample = hooked_sample  # type: ignore[method-assign]

    def _bind_blackbox(self, box: Blackbox, group: int) -> None:
        """In the engine process: mark what this group's thread is inside (``engine.blackbox``),
        so a death points at the request being sampled or started rather than at all of them."""
        decode, emit, start = self._decode, self._emit, self.start

        def boxed_decode(ctx: Any, batch: Any) -> int:
            box.enter(group, DECODE)
            try:
                return decode(ctx, batch)
            finally:
                box.leave(group)

        def boxed_emit(s: Slot, i: int, res: StepResult, logits: np.ndarray | None,
                       prof: GroupProfile | None) -> None:
            assert s.task is not None
            box.enter(group, SAMPLE, s.task.id)
            try:
                emit(s, i, res, logits, prof)
            finally:
                box.leave(group)

        def boxed_start(slot: Slot, parent: Slot | None = None) -> None:
            assert slot.task is not None
            box.enter(group, START, slot.task.id)
            try:
                start(slot, parent)
            finally:
                box.leave(group)

        self._decode = boxed_decode
        self._emit = boxed_emit  # type: ignore[method-assign]  # sampling, a resume's replay, its text
        self.start = boxed_start  # type: ignore[method-assign]

    def close(self) -> None:
        drafter, self.drafter = getattr(self, "drafter", None), None
        if drafter is not None:
            drafter.close()
        if self.ptr:
            llama_cpp.llama_free(self.ptr)
            self.ptr = None

    # ---- KV of one sequence (called between steps by the owning group only) ------------

    def reuse_prefix(self, slot: Slot, prompt: np.ndarray, cache_prompt: bool,
                     prompt_cache: PromptCache | None = None, lora: LoraSet = NO_LORA) -> int:
        """Keep the longest common prefix of the slot's KV and ``prompt``; return its length.

        With a host-memory prompt cache (EN-5): if the new prompt loses part of what the slot
        holds (``PromptCache.worth_saving``: another conversation takes the slot), the slot's
        state is saved first;
        then a cached state that serves the prompt better is restored into the slot.
        KV computed under another LoRA set than the request's ``lora`` is never reused (EN-1,
        llama-server clears a slot's cache when its adapters change).
        At least the last prompt token is always decoded again, so its logits exist.
        """
        same = slot.lora == lora
        if cache_prompt and prompt_cache is not None:
            held = np.asarray(slot.cache, dtype=np.int32)
            if len(held) and (not same or prompt_cache.worth_saving(len(held), common_prefix(held, prompt))):
                prompt_cache.save(self.ptr, slot.local, held, slot.lora)
            restored = prompt_cache.restore(self.ptr, slot.local, prompt, held if same else held[:0], lora)
            if restored is not None:
                slot.cache[:] = restored.tolist()
                same = True
        slot.lora = lora
        keep = 0
        if cache_prompt and slot.cache and same:
            # at most len(prompt) - 1: the last prompt token is decoded again for its logits
            keep = common_prefix(np.asarray(slot.cache, dtype=np.int32), prompt[: len(prompt) - 1])
        if not llama_cpp.llama_memory_seq_rm(self.memory, slot.local, keep, -1) or not self._window_kept(slot, keep):
            # Some memories (recurrent) cannot cut a sequence in the middle; a sliding window
            # may have lost what the kept prefix needs.
            llama_cpp.llama_memory_seq_rm(self.memory, slot.local, -1, -1)
            keep = 0
        del slot.cache[keep:]
        return keep

    def _window_kept(self, slot: Slot, keep: int) -> bool:
        """With a sliding-window (SWA) cache, llama.cpp reuses the cells of positions that fell
        out of a sequence's window, oldest first; a kept prefix of ``keep`` tokens is usable
        only if the window before ``keep`` is still there (llama-server's ``pos_min`` test).
        Always true without SWA."""
        n_swa = self.model.n_swa
        if n_swa <= 0 or keep == 0:
            return True
        pos_min = llama_cpp.llama_memory_seq_pos_min(self.memory, slot.local)
        return 0 <= pos_min <= max(0, keep - n_swa)

    def share_prefix(self, dst: Slot, src: Slot, n: int) -> int:
        """EN-6: make ``dst`` hold the KV of the first ``n`` tokens ``src`` holds; return how
        many it holds after (``n``, or 0 when a sliding window lost what they need).

        Unified KV (one stream): the cells get ``dst``'s sequence id too; nothing is copied and
        no cell is used twice. Split KV: llama.cpp copies ``src``'s whole stream at the next
        decode (it copies streams only whole), then the tail past ``n`` is dropped."""
        mem = self.memory
        llama_cpp.llama_memory_seq_rm(mem, dst.local, -1, -1)
        dst.cache.clear()
        if self.opts.kv_unified:
            llama_cpp.llama_memory_seq_cp(mem, src.local, dst.local, 0, n)
        else:
            llama_cpp.llama_memory_seq_cp(mem, src.local, dst.local, -1, -1)
            llama_cpp.llama_memory_seq_rm(mem, dst.local, n, -1)
        if not self._window_kept(dst, n):
            llama_cpp.llama_memory_seq_rm(mem, dst.local, -1, -1)
            return 0
        dst.cache.extend(src.cache[:n])
        dst.lora = src.lora
        return n

    def erase(self, slot: Slot) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, slot.local, -1, -1)
        slot.cache.clear()

    def save_slot(self, slot: Slot, path: str) -> int:
        toks = (llama_cpp.llama_token * len(slot.cache))(*slot.cache)
        n = llama_cpp.llama_state_seq_save_file(self.ptr, path.encode(), slot.local, toks, len(slot.cache))
        if n == 0:
            raise EngineError(f"could not save slot {slot.id} to {path}")
        return len(slot.cache)

    def restore_slot(self, slot: Slot, path: str) -> int:
        cap = self.n_ctx_seq
        toks = (llama_cpp.llama_token * cap)()
        n_out = ctypes.c_size_t(0)
        llama_cpp.llama_memory_seq_rm(self.memory, slot.local, -1, -1)
        n = llama_cpp.llama_state_seq_load_file(self.ptr, path.encode(), slot.local, toks, cap, ctypes.byref(n_out))
        if n == 0:
            slot.cache.clear()
            raise EngineError(f"could not restore slot {slot.id} from {path}")
        slot.cache[:] = toks[: n_out.value]
        slot.lora = NO_LORA  # a slot file does not say which adapters made it: taken as the base model's
        return n_out.value

    # ---- the step ----------------------------------------------------------------------

    def start(self, slot: Slot, parent: Slot | None = None) -> None:
        """Prepare a newly assigned slot's sampler and text stream (in the group's thread)."""
        task = slot.task
        assert task is not None
        prompt = task.prompt
        if task.replay_in_prompt:  # --resume fast: the delivered tokens are accepted below, once
            prompt = prompt[: len(prompt) - len(task.replay[slot.index])]
        slot.sampler = build_chain(
            self.model, task.params, n_ctx=self.n_ctx_seq, seed_offset=slot.index,
            prompt=prompt if task.params.penalized else (), ignore_eos=task.ignore_eos,
        )
        slot.argmax = argmax_biases(self.model, task.params, ignore_eos=task.ignore_eos)
        slot.stream = TextStream(task.stop)
        if task.replay:  # resume (issue 14): these tokens were delivered before the engine died
            delivered = task.replay[slot.index]
            if task.replay_in_prompt:  # --resume fast: prefilled with the prompt; prime what samples
                for token in delivered:
                    llama_cpp.llama_sampler_accept(slot.sampler, token)
                    slot.stream.push(self.model.piece(token))
                slot.n_decoded = len(delivered)
            else:  # exact: replayed one decode step at a time after the prompt (``_emit``)
                slot.replay = list(reversed(delivered))
        spec = self.opts.spec
        if spec is not None:  # EN-2: the request's speculative.* fields over the server's
            p = task.params
            n_max = spec.n_max if p.speculative_n_max is None else min(p.speculative_n_max, spec.n_max)
            slot.spec = SpecState(
                task.prompt, n_max, spec.n_min if p.speculative_n_min is None else p.speculative_n_min,
                spec.p_min if p.speculative_p_min is None else p.speculative_p_min,
            ) if n_max > 0 else None

    def release(self, slot: Slot) -> None:
        if slot.sampler is not None:
            llama_cpp.llama_sampler_free(slot.sampler)
            slot.sampler = None

    def step(self, plan: StepPlan, slots: list[Slot], prof: GroupProfile | None = None) -> StepResult:
        """Decode one batch per ``plan`` and sample/emit for every row that needs a token.

        ``prof`` (the group's profiler, or None) adds timings; off, it costs one branch per section.
        """
        res = StepResult()
        if prof is not None:
            t0 = time.perf_counter()
            prof.wait_engine += t0 - prof.started_step
        rows: list[tuple[Slot, int]] = []  # (slot, batch index of its logits)
        n = 0
        # Rows go in ascending sequence id: with split KV, llama.cpp decodes a batch whose
        # sequence ids are out of order about 3x slower (measured: 115 vs 345 ms for 32 rows).
        prefill = sorted(plan.prefill)
        generate = sorted(plan.generate)
        for local, k in prefill:
            s = slots[local]
            start = s.n_past
            self._tok[n : n + k] = s.prompt[start : start + k]
            np.add(self._ramp[:k], start, out=self._pos[n : n + k])
            self._seq[n : n + k] = local
            self._out[n : n + k] = 0
            n += k
            if start + k == len(s.prompt):
                self._out[n - 1] = 1
                rows.append((s, n - 1))
        res.n_prompt = n
        drafts = None
        if self.drafter is not None and generate:
            # EN-2: drafts fill the room the plan left in the step's first physical batch: a
            # verify that spans two ubatches could, with a sliding-window (SWA) cache, reuse cells
            # the rolled-back positions made look old (llama.cpp masks SWA cells by the highest
            # position decoded so far).
            drafts = self.drafter.propose([slots[local] for local in generate if not slots[local].replay],
                                          self.n_draft_room - n - len(generate), self.n_ctx_seq)
        for local in generate:
            s = slots[local]
            self._tok[n] = s.next_token
            self._pos[n] = s.n_past
            self._seq[n] = local
            self._out[n] = 1
            rows.append((s, n))
            n += 1
            if drafts and local in drafts:  # its draft's rows follow its own (ascending sequence ids)
                draft = drafts[local]
                k = len(draft)
                self._tok[n : n + k] = draft
                np.add(self._ramp[:k], s.n_past + 1, out=self._pos[n : n + k])
                self._seq[n : n + k] = local
                self._out[n : n + k] = 1
                n += k
                res.n_draft += k
        res.n_rows = len(plan.prefill) + len(plan.generate)
        if prof is not None:
            t1 = time.perf_counter()
            prof.build += t1 - t0
        if n:
            if plan.lora != self.lora:
                self._set_lora(plan.lora)
            self._n_prompt, self._n_generate = res.n_prompt, len(generate)
            self._batch.n_tokens = n
            rc = self._decode(self.ptr, self._batch)
            if rc == DECODE_NO_KV_SLOT:
                raise KvCacheFull("the KV cache has no room for this batch")
            if rc != 0:
                raise EngineError(f"llama_decode failed with status {rc}")
            if prof is not None:
                t2 = time.perf_counter()
                prof.decode += t2 - t1
                llama_cpp.llama_synchronize(self.ptr)
                t3 = time.perf_counter()
                prof.synchronize += t3 - t2
        # The batch is in the KV now: advance positions and record what each sequence holds.
        for local, k in plan.prefill:
            s = slots[local]
            s.cache.extend(s.prompt[s.n_past : s.n_past + k].tolist())
            s.n_past += k
            if s.task is not None and s.task.return_progress:  # only when asked: no cost otherwise
                res.events.append((s.task, Progress(0, len(s.prompt), s.n_cached, s.n_past,
                                                    (time.perf_counter() - s.t_start) * 1e3)))
        for local in plan.generate:
            s = slots[local]
            s.cache.append(s.next_token)
            s.n_past += 1
        # A failure while sampling or detokenizing one request is that request's alone: it is
        # recorded and the group goes on (the group ends the request with an error event).
        for local in plan.release:
            try:
                self._sample_kept(slots[local], res, prof)
            except Exception as exc:  # noqa: BLE001 - request-scoped, see above
                res.failed.append((slots[local], exc))
        for s, i in rows:
            try:
                if s.phase is Phase.PREFILL:
                    self._prompt_done(s, i, res, prof)
                elif drafts and s.local in drafts:
                    self._verify(s, i, drafts[s.local], res, prof)
                else:
                    self._emit(s, i, res, None, prof)
            except Exception as exc:  # noqa: BLE001 - request-scoped, see above
                res.failed.append((s, exc))
        if prof is not None:
            prof.after_decode += time.perf_counter() - (t3 if n else t1)
        return res

    def _verify(self, s: Slot, i: int, draft: np.ndarray, res: StepResult, prof: GroupProfile | None) -> None:
        """Sample rows ``i``, ``i+1``, … of a slot that sent a draft (EN-2): each accepted draft
        token's row holds the logits after it, so sampling goes on while the slot's own sampler
        picks the drafted token; every sampled token is emitted as without speculation (stop
        strings, n_predict, EOS end it the same way). Then the rejected drafts' KV cells go, so
        the slot's KV holds exactly ``s.cache`` again, whatever happened."""
        drafted = draft.tolist()
        k = len(drafted)
        accepted = 0
        try:
            for j in range(k + 1):
                self._emit(s, i + j, res, None, prof)
                if s.finished or j == k or s.next_token != drafted[j]:
                    break
                s.cache.append(drafted[j])  # its cell was decoded at position n_past: it stays
                s.n_past += 1
                accepted += 1
        finally:
            if accepted < k:
                llama_cpp.llama_memory_seq_rm(self.memory, s.local, s.n_past, -1)
            res.accepted.append(accepted)
            assert s.spec is not None
            s.spec.record(k, accepted)

    def _check_lora_logits(self, i: int, logits: np.ndarray | None) -> None:
        """EN-1: a LoRA scale far too large makes the logits NaN, and llama.cpp's grammar sampler
        then accepts a token its grammar forbids and throws through C, aborting the process. That
        request fails alone (400) instead. Only grammar requests with adapters pay this scan."""
        if logits is None:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ptr, i), shape=(self.model.n_vocab,))
        if np.isnan(logits).any():
            raise RequestError("lora: the adapter scales made the model's logits NaN (not a number); "
                               "use smaller scales")

    def _set_lora(self, lora: LoraSet) -> None:
        """Make ``lora`` the context's active adapters (EN-1). llama.cpp rebuilds its graph
        after a change, so the group batches requests of one set together (``loraturns``)."""
        n = len(lora)
        adapters = (llama_cpp.llama_adapter_lora_p_ctypes * n)(*(self.model.adapters[i] for i, _ in lora))
        scales = (ctypes.c_float * n)(*(scale for _, scale in lora))
        llama_cpp.llama_set_adapters_lora(self.ptr, adapters if n else None, n, scales if n else None)
        self.lora = lora

    def _prompt_done(self, s: Slot, i: int, res: StepResult, prof: GroupProfile | None) -> None:
        now = time.perf_counter()
        s.t_prompt_done = now
        for child in s.children:  # n > 1: the prompt was prefilled once (PG-10)
            llama_cpp.llama_memory_seq_rm(self.memory, child.local, -1, -1)
            llama_cpp.llama_memory_seq_cp(self.memory, s.local, child.local, -1, -1)
            child.cache[:] = s.cache
            child.lora = s.lora
            child.n_past = s.n_past
            child.n_cached = s.n_cached
            child.t_prompt_done = now
        if self.holds_ready:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ptr, i), shape=(self.model.n_vocab,))
            s.kept_logits = logits.copy()
            s.phase = Phase.READY
            for child in s.children:
                child.phase = Phase.READY
            res.ready.append(s)
            return
        for member in (s, *s.children):
            member.phase = Phase.GENERATE
            self._emit(member, i, res, None, prof)

    def _sample_kept(self, s: Slot, res: StepResult, prof: GroupProfile | None) -> None:
        """Sample the first token of a READY prompt from its kept logits (cohort released)."""
        logits = s.kept_logits
        s.kept_logits = None
        for member in (s, *s.children):
            member.phase = Phase.GENERATE
            self._emit(member, -1, res, logits, prof)

    def _sample(self, s: Slot, i: int, logits: np.ndarray | None) -> int:
        if s.argmax is not None:  # greedy without a stateful sampler: no candidate array
            if logits is None:
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ptr, i), shape=(self.model.n_vocab,))
            return biased_argmax(logits, s.argmax)
        if logits is None:
            assert s.task is not None
            if not s.task.params.grammar:
                return llama_cpp.llama_sampler_sample(s.sampler, self.ptr, i)
            # A grammar's accept throws through C (the process aborts) on a token it forbids:
            # grammar requests sample over an array we own and check the token first.
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ptr, i), shape=(self.model.n_vocab,))
        return self._apply_chain(s, logits)[0]

    def _apply_chain(self, s: Slot, logits: np.ndarray) -> tuple[int, np.ndarray, int]:
        """Sample as ``llama_sampler_sample`` does, over an array we own: (token, the
        candidates after the chain as a numpy view (id, logit, p), their count)."""
        n_vocab = self.model.n_vocab
        data = (llama_cpp.llama_token_data * n_vocab)()
        view = np.ctypeslib.as_array(data).view(_TOKEN_DATA)
        view["id"] = np.arange(n_vocab, dtype=np.int32)
        view["logit"] = logits
        view["p"] = 0.0
        arr = llama_cpp.llama_token_data_array(data, n_vocab, -1, False)
        llama_cpp.llama_sampler_apply(s.sampler, ctypes.byref(arr))
        token = int(data[arr.selected].id)
        assert s.task is not None
        if s.task.params.grammar and not data[arr.selected].logit > -math.inf:
            token = self._grammar_allowed(view[: arr.size])
        llama_cpp.llama_sampler_accept(s.sampler, token)
        return token, view[: arr.size], int(arr.size)

    @staticmethod
    def _grammar_allowed(cand: np.ndarray) -> int:
        """The chain picked a token its grammar sampler had set to -inf (forbidden): accepting it
        would throw through C and abort the process. Found by fuzzing: a ``logit_bias`` that
        bans every token the grammar allows leaves only -inf candidates, and the draw then
        lands on any of them (a draw over non-finite probabilities can too). The most likely
        token the grammar allows is taken instead; when it allows none, the request fails alone."""
        logit = cand["logit"]
        allowed = np.flatnonzero(logit > -np.inf)
        if not len(allowed):
            raise RequestError("the grammar allows no token here (every token it allows is banned by "
                               "logit_bias or the sampling settings)")
        values = logit[allowed]
        best = allowed[int(np.argmax(np.where(np.isnan(values), -np.inf, values)))]
        return int(cand["id"][best])

    def _sample_post(self, s: Slot, i: int, logits: np.ndarray | None, n_probs: int,
                     ) -> tuple[int, float, tuple[TopProb, ...]]:
        """API-14 ``post_sampling_probs``: sample, then read the ``n_probs`` most likely
        candidates after the whole chain (llama-server's ``populate_token_probs``: sorted by
        probability, zero ones left out; the sampled token's probability, 1 if it has none).
        Returned as log-probabilities, like ``_probs``. Only requests that ask pay for this."""
        if logits is None:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ptr, i), shape=(self.model.n_vocab,))
        token, cand, size = self._apply_chain(s, logits)
        assert s.task is not None
        if s.task.params.greedy:  # our greedy chain ends in `greedy` (no probabilities): llama-server's
            return token, 0.0, (TopProb(token, self.model.piece(token).decode("utf-8", "replace"), 0.0),)
        order = np.argsort(-cand["p"], kind="stable")
        hit = np.flatnonzero(cand["id"] == token)
        prob = float(cand["p"][hit[0]]) if len(hit) and cand["p"][hit[0]] > 0 else 1.0
        top = []
        for j in order[: min(n_probs, size)]:
            p = float(cand["p"][j])
            if p == 0.0:
                break
            t = int(cand["id"][j])
            top.append(TopProb(t, self.model.piece(t).decode("utf-8", "replace"), math.log(p)))
        return token, math.log(prob), tuple(top)

    def _emit(self, s: Slot, i: int, res: StepResult, logits: np.ndarray | None, prof: GroupProfile | None) -> None:
        """Sample one token for ``s`` and turn it into events (the per-token hot path)."""
        task = s.task
        assert task is not None and s.stream is not None
        if prof is not None:
            ta = time.perf_counter()
        params = task.params
        if task.lora and params.grammar:
            self._check_lora_logits(i, logits)
        logprob: float | None
        top: tuple[TopProb, ...]
        replayed = bool(s.replay)
        if replayed:  # resume: the token delivered before; the sampler still sees it (penalties, grammar)
            token = s.replay.pop()
            llama_cpp.llama_sampler_accept(s.sampler, token)
            logprob, top = None, ()
        elif params.n_probs and params.post_sampling_probs:
            token, logprob, top = self._sample_post(s, i, logits, params.n_probs)
        else:
            token = self._sample(s, i, logits)
            logprob, top = self._probs(i, logits, token, params.n_probs) if params.n_probs else (None, ())
        s.n_decoded += 1
        s.next_token = token
        res.n_generated += 1
        if prof is not None:
            tb = time.perf_counter()
            prof.sample += tb - ta
            prof.tokens += 1
        finish = ""
        if self.model.is_eog(token) and not task.ignore_eos:
            text, finish = s.stream.flush(), "stop"
        else:
            if prof is None:
                text = s.stream.push(self.model.piece(token))
            else:
                decoded = s.stream.decode(self.model.piece(token))
                tc = time.perf_counter()
                text = s.stream.accept(decoded)
                prof.detokenize += tc - tb
                prof.stop_strings += time.perf_counter() - tc
            if s.stream.stopped_by:
                finish = "stop"
            elif s.n_decoded >= task.n_predict or (s.n_past + 1 >= self.n_ctx_seq and not self._shift(s)):
                text += s.stream.flush()
                finish = "length"
        now = time.perf_counter()
        if params.t_max_predict_ms > 0 and not finish and "\n" in text and (
                now - s.t_prompt_done) * 1e3 > params.t_max_predict_ms:
            # API-14, llama-server's rule: past the time limit, stop once this token's text has a newline
            text += s.stream.flush()
            finish = "length"
        if s.n_decoded > 1 and not replayed:
            res.gaps.append(now - s.t_last)
        s.t_last = now
        if not replayed:  # a replayed token's text went out before; its Done (if it ends) is sent again
            res.events.append((task, Token(s.index, text, token, logprob, top)))
        if finish:
            s.finished = True
            res.finished.append(s)
            res.events.append((task, self._done(s, finish)))

    def _shift(self, s: Slot) -> bool:
        """Context shift (EN-4, llama-server's): drop ``n_discard`` tokens after the first
        ``n_keep`` and move the rest down, so the generation goes on. False when it is off, for
        n > 1 (the choices share the prompt's cells) or when the memory cannot shift (then the
        choice ends with "length", as without shift)."""
        task = s.task
        if not self.opts.context_shift or task is None or task.n > 1:
            return False
        if not llama_cpp.llama_memory_can_shift(self.memory):
            return False
        n_keep = len(s.prompt) if task.n_keep < 0 else task.n_keep
        if self.model.add_bos:
            n_keep += 1
        n_keep = min(self.n_ctx_seq - 4, n_keep)
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

    def _done(self, s: Slot, finish: str) -> Done:
        assert s.task is not None and s.stream is not None
        return Done(
            index=s.index,
            finish_reason=finish,
            text=s.stream.text,
            stopping_word=s.stream.stopped_by,
            n_prompt=len(s.prompt),
            n_cached=s.n_cached,
            n_predicted=s.n_decoded,
            prompt_ms=(s.t_prompt_done - s.t_start) * 1e3,
            predicted_ms=(s.t_last - s.t_prompt_done) * 1e3,
            slot=s.id,
            truncated=s.truncated,
            n_draft=s.spec.n_draft if s.spec is not None else 0,
            n_draft_accepted=s.spec.n_accepted if s.spec is not None else 0,
        )

    def _probs(
        self, i: int, logits: np.ndarray | None, token: int, n_probs: int
    ) -> tuple[float, tuple[TopProb, ...]]:
        """Log-probability of ``token`` and the ``n_probs`` most likely tokens (only when asked)."""
        if logits is None:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ptr, i), shape=(self.model.n_vocab,))
        m = float(logits.max())
        lse = m + math.log(float(np.exp(logits - m).sum()))
        top_ids = np.argpartition(-logits, n_probs - 1)[:n_probs]
        top_ids = top_ids[np.argsort(-logits[top_ids])]
        top = tuple(
            TopProb(int(t), self.model.piece(int(t)).decode("utf-8", "replace"), float(logits[t]) - lse)
            for t in top_ids
        )
        return float(logits[token]) - lse, top
