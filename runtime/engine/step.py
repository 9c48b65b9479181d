"""One group's decode step: the hot path.

Design note for ``DecodeStep.run``. Per step it:
  1. fills the batch arrays (numpy views over buffers we own, ``batch.OwnedBatch``) with one
     slice assignment per slot, never one Python object per token;
  2. switches the context's LoRA adapters if the plan's set differs from the last step's
     (never per token: one tuple compare per step), then calls ``llama_decode`` once (ctypes
     releases the GIL, so other groups and the event loop run meanwhile);
  3. samples each row that needs a token (``output.Output.emit``: the slot's llama.cpp sampler
     chain, cached token pieces, incremental UTF-8, stop strings) and decides finishes.
A prompt with images (``--mmproj``) decodes each image, whole and alone, when its slot's
prefill reaches it, before the shared batch (``_media``: llama-server's process_chunk); its
text goes into the batch up to the next image. Prompts without images pay one falsy test.
With speculation (``speculative``) a generating slot's draft rows follow its own row in step 1
(cut to the batch room the plan left), and step 3 samples them in order while the draft holds
(``_verify``), then drops the rejected drafts' KV cells. Off, the step pays one ``is None``
test (``drafter``) and one falsy test per row.
It runs in the group's worker thread and must never: await, touch another group's slots or
context, send on a stream (anyio streams are not thread-safe: events are returned and sent by
the group's event-loop task), or allocate per token beyond the event it returns.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import llama_cpp
import msgspec
import numpy as np

from llamactor.protocol.errors import EngineError, RequestError
from llamactor.protocol.events import Done, Progress
from llamactor.protocol.lora import NO_LORA, LoraSet
from llamactor.protocol.plan import StepPlan
from llamactor.runtime.engine.batch import OwnedBatch
from llamactor.runtime.engine.kv import SequenceKV
from llamactor.runtime.engine.logits import logits_at
from llamactor.runtime.engine.model import Model
from llamactor.runtime.engine.output import Output, StepResult
from llamactor.runtime.engine.profiler import GroupProfile
from llamactor.runtime.engine.slot import Phase, Slot
from llamactor.runtime.engine.speculative import Drafter
from llamactor.runtime.engine.vision import Vision

DECODE_NO_KV_SLOT = 1  # llama_decode: no KV cells for the batch (unified KV can be overcommitted)


class KvCacheFull(EngineError):
    """Recoverable: the group stops one request to make room and goes on (see GroupActor)."""


class DecodeStep:
    """A context's batch buffers and its step. ``decode`` is ``llama_decode`` unless a test
    hook or the engine blackbox wrapped it; ``n_prompt``/``n_generate`` say what the batch
    being decoded holds (for the hook)."""

    def __init__(
        self, ctx: Any, model: Model, kv: SequenceKV, out: Output, drafter: Drafter | None, vision: Vision | None = None
    ) -> None:
        self.ctx = ctx
        self.model = model
        self.kv = kv
        self.out = out
        self.drafter = drafter
        self.vision = vision  # the multimodal projector (--mmproj) images are decoded with
        self.n_batch = llama_cpp.llama_n_batch(ctx)
        self.n_ctx_seq = kv.n_ctx_seq
        # drafts stay in the step's first physical batch, see ``run``
        self.n_draft_room = min(self.n_batch, llama_cpp.llama_n_ubatch(ctx))
        self.decode: Callable[[Any, Any], int] = llama_cpp.llama_decode
        self.holds_ready = False  # finished prompts wait for their cohort (set from the group's policy)
        self.lora: LoraSet = NO_LORA  # the LoRA adapters active on the context
        self.n_prompt = self.n_generate = 0
        self._owned = OwnedBatch(self.n_batch)
        o = self._owned
        self._tok, self._pos, self._seq, self._out, self._ramp = o.tok, o.pos, o.seq, o.out, o.ramp
        self._batch = o.batch

    def run(self, plan: StepPlan, slots: list[Slot], prof: GroupProfile | None = None) -> StepResult:
        """Decode one batch per ``plan`` and sample/emit for every row that needs a token.

        ``prof`` (the group's profiler, or None) adds timings; off, it costs one branch per section.
        """
        res = StepResult()
        if prof is not None:
            t0 = time.perf_counter()
            prof.wait_engine += t0 - prof.started_step
        rows: list[tuple[Slot, int]] = []  # (slot, batch index of its logits)
        checkpoints = self.kv.checkpoints if self.kv.checkpoints.limit else None  # sliding-window models
        heads = self._checkpoint_heads(plan, slots, res, prof) if checkpoints is not None and plan.prefill else {}
        n = 0
        # Rows go in ascending sequence id: with split KV, llama.cpp decodes a batch whose
        # sequence ids are out of order about 3x slower (measured: 115 vs 345 ms for 32 rows).
        prefill = sorted(plan.prefill)
        generate = sorted(plan.generate)
        filled: list[tuple[Slot, int]] = []  # (slot, its prompt tokens in the batch)
        n_media = 0  # image positions decoded before the batch
        began = time.perf_counter()
        for local, k in prefill:
            s = slots[local]
            if not s.t_prompt_begin:
                s.t_prompt_begin = began
            if s.task is not None and s.task.media:
                try:
                    k, decoded = self._media(s, k)
                except RequestError as exc:  # this request's image: it fails alone
                    res.failed.append((s, exc))
                    continue
                n_media += decoded
            k -= heads.get(local, 0)  # decoded already, up to a checkpoint point
            filled.append((s, k))
            if k <= 0:
                continue
            start = s.n_past
            n = self._put_prompt(s, k, n)
            if start + k == len(s.prompt):
                self._out[n - 1] = 1
                rows.append((s, n - 1))
        res.n_prompt = n + n_media + sum(heads.values())
        drafts = None
        if self.drafter is not None and generate:
            # Drafts fill the room the plan left in the step's first physical batch: a verify
            # that spans two ubatches could, with a sliding-window (SWA) cache, reuse cells the
            # rolled-back positions made look old (llama.cpp masks SWA cells by the highest
            # position decoded so far).
            drafts = self.drafter.propose(
                [slots[local] for local in generate if not slots[local].replay],
                self.n_draft_room - n - len(generate),
                self.n_ctx_seq,
            )
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
            self._decode(plan, n, res.n_prompt - sum(heads.values()), len(generate))
            if prof is not None:
                t2 = time.perf_counter()
                prof.decode += t2 - t1
                llama_cpp.llama_synchronize(self.ctx)
                t3 = time.perf_counter()
                prof.synchronize += t3 - t2
        # The batch is in the KV now: advance positions and record what each sequence holds.
        for s, k in filled:
            s.cache.extend(s.prompt[s.n_past : s.n_past + k].tolist())
            s.n_past += k
            if checkpoints is not None and k > 0 and s.task is not None and not s.task.media:
                checkpoints.after_chunk(s)
            if s.task is not None and s.task.return_progress:  # only when asked: no cost otherwise
                elapsed_ms = (time.perf_counter() - s.t_start) * 1e3
                timed = s.task.timings_per_token
                res.events.append((s.task, Progress(0, len(s.prompt), s.n_cached, s.n_past, elapsed_ms, timed)))
        for local in plan.generate:
            s = slots[local]
            s.cache.append(s.next_token)
            s.n_past += 1
        # A failure while sampling or detokenizing one request is that request's alone: it is
        # recorded and the group goes on (the group ends the request with an error event).
        for local in plan.release:
            try:
                self._sample_kept(slots[local], res, prof)
            except Exception as exc:
                res.failed.append((slots[local], exc))
        for s, i in rows:
            try:
                if s.phase is Phase.PREFILL:
                    self._prompt_done(s, i, res, prof)
                elif drafts and s.local in drafts:
                    self._verify(s, i, drafts[s.local], res, prof)
                else:
                    self.out.emit(s, i, res, None, prof)
            except Exception as exc:
                res.failed.append((s, exc))
        for s in res.finished:  # a request handed over: its KV leaves with its Done
            if s.task is not None and s.task.hand_over:
                self._attach_state(s, res)
        if prof is not None:
            prof.after_decode += time.perf_counter() - (t3 if n else t1)
        return res

    def _put_prompt(self, s: Slot, k: int, n: int) -> int:
        """Put ``s``'s next ``k`` prompt tokens (from ``s.n_past``) at batch row ``n``, no logits;
        return the row after them."""
        start = s.n_past
        self._tok[n : n + k] = s.prompt[start : start + k]
        np.add(self._ramp[:k], start, out=self._pos[n : n + k])
        self._seq[n : n + k] = s.local
        self._out[n : n + k] = 0
        return n + k

    def _decode(self, plan: StepPlan, n: int, n_prompt: int, n_generate: int) -> None:
        """Decode the batch's first ``n`` rows under the plan's adapters."""
        if plan.lora != self.lora:
            self._set_lora(plan.lora)
        self.n_prompt, self.n_generate = n_prompt, n_generate
        self._batch.n_tokens = n
        rc = self.decode(self.ctx, self._batch)
        if rc == DECODE_NO_KV_SLOT:
            raise KvCacheFull("the KV cache has no room for this batch")
        if rc != 0:
            raise EngineError(f"llama_decode failed with status {rc}")

    def _checkpoint_heads(
        self, plan: StepPlan, slots: list[Slot], res: StepResult, prof: GroupProfile | None
    ) -> dict[int, int]:
        """Sliding-window models: a prefill chunk that crosses a checkpoint point of its prompt
        (``Checkpoints.cut``) has its tokens up to that point decoded first, in a decode of
        their own, and the window saved there; the step's main decode takes the rest. The step
        still holds every token its plan gave it (a shorter chunk would cost a policy that
        keeps prompts and generation apart a step in which generation waits). Returns the
        tokens decoded so, by sequence id."""
        cps = self.kv.checkpoints
        done: dict[int, int] = {}
        while True:  # a chunk may cross both of its prompt's points
            n = 0
            heads: list[tuple[Slot, int]] = []
            for local, k in sorted(plan.prefill):
                s = slots[local]
                left = k - done.get(local, 0)
                if s.task is None or s.task.media or left <= 0 or (h := cps.cut(s, left)) == left:
                    continue
                if not s.t_prompt_begin:
                    s.t_prompt_begin = time.perf_counter()
                n = self._put_prompt(s, h, n)
                heads.append((s, h))
            if not heads:
                return done
            t0 = time.perf_counter()
            self._decode(plan, n, n, 0)
            if prof is not None:  # decode time, not the batch's build (``run`` counts from before)
                dt = time.perf_counter() - t0
                prof.decode += dt
                prof.build -= dt
            for s, h in heads:
                s.cache.extend(s.prompt[s.n_past : s.n_past + h].tolist())
                s.n_past += h
                done[s.local] = done.get(s.local, 0) + h
                cps.after_chunk(s)

    def _attach_state(self, s: Slot, res: StepResult) -> None:
        """Put the slot's KV state (prompt and tokens so far) into its Done event: the request
        goes on on another engine (prefill and decode apart), from this state."""
        for k, (task, event) in enumerate(res.events):
            if task is s.task and isinstance(event, Done) and event.index == s.index:
                if event.finish_reason != "length":  # it ended for good (EOS, a stop string): nothing goes on
                    return
                try:
                    state = self.kv.export_state(s)
                except Exception:
                    return  # the other engine prefills it again
                res.events[k] = (task, msgspec.structs.replace(event, kv=state))
                return

    def _verify(self, s: Slot, i: int, draft: np.ndarray, res: StepResult, prof: GroupProfile | None) -> None:
        """Sample rows ``i``, ``i+1``, … of a slot that sent a draft: each accepted draft
        token's row holds the logits after it, so sampling goes on while the slot's own sampler
        picks the drafted token; every sampled token is emitted as without speculation (stop
        strings, n_predict, EOS end it the same way). Then the rejected drafts' KV cells go, so
        the slot's KV holds exactly ``s.cache`` again, whatever happened."""
        drafted = draft.tolist()
        k = len(drafted)
        accepted = 0
        try:
            for j in range(k + 1):
                self.out.emit(s, i + j, res, None, prof)
                if s.finished or j == k or s.next_token != drafted[j]:
                    break
                s.cache.append(drafted[j])  # its cell was decoded at position n_past: it stays
                s.n_past += 1
                accepted += 1
        finally:
            if accepted < k:
                self.kv.drop_from(s, s.n_past)
            res.accepted.append(accepted)
            assert s.spec is not None
            s.spec.record(k, accepted)

    def _media(self, s: Slot, k: int) -> tuple[int, int]:
        """Decode every media chunk (an image, a clip of audio) that starts at ``s``'s next prompt
        position (whole: a chunk is one encode, whatever ``k`` allows), each alone into ``s``'s
        sequence. Returns the text tokens of ``k`` left for the batch (up to the next chunk) and
        the media positions decoded."""
        assert s.task is not None
        if self.vision is None:
            raise RequestError("the prompt has images or audio but this engine has no multimodal projector (--mmproj)")
        decoded = 0
        upto = len(s.prompt)
        for chunk in s.task.media:
            if chunk.end <= s.n_past:
                continue
            if chunk.pos > s.n_past:
                upto = chunk.pos
                break
            if chunk.pos < s.n_past:  # the KV never keeps part of an image (``media_floor``)
                raise EngineError(f"slot {s.id} holds part of a media chunk ({chunk.pos} < {s.n_past} < {chunk.end})")
            rc = self.vision.decode(self.ctx, chunk, s.local, self.n_batch)
            if rc != 0:
                self.kv.drop_from(s, chunk.pos)  # whatever part of it went in
                if rc == DECODE_NO_KV_SLOT:
                    raise KvCacheFull("the KV cache has no room for an image or audio chunk")
                raise EngineError(f"llama_decode failed with status {rc} (an image or audio chunk)")
            s.cache.extend(s.prompt[chunk.pos : chunk.end].tolist())
            s.n_past = chunk.end
            decoded += chunk.n_pos
        return max(0, min(k - decoded, upto - s.n_past)), decoded

    def _set_lora(self, lora: LoraSet) -> None:
        """Make ``lora`` the context's active adapters. llama.cpp rebuilds its graph after a
        change, so the group batches requests of one set together (``actors.loraturns``)."""
        n = len(lora)
        adapters = (llama_cpp.llama_adapter_lora_p_ctypes * n)(*(self.model.adapters[i] for i, _ in lora))
        scales = (ctypes.c_float * n)(*(scale for _, scale in lora))
        llama_cpp.llama_set_adapters_lora(self.ctx, adapters if n else None, n, scales if n else None)
        self.lora = lora

    def _prompt_done(self, s: Slot, i: int, res: StepResult, prof: GroupProfile | None) -> None:
        now = time.perf_counter()
        s.t_prompt_done = now
        for child in s.children:  # n > 1: the prompt was prefilled once
            self.kv.copy_all(s, child)
            child.n_past = s.n_past
            child.n_cached = s.n_cached
            child.t_prompt_begin, child.t_prompt_done = s.t_prompt_begin, now
        if self.holds_ready:
            s.kept_logits = logits_at(self.ctx, i, self.model.n_vocab).copy()  # the next decode overwrites the view
            s.phase = Phase.READY
            for child in s.children:
                child.phase = Phase.READY
            res.ready.append(s)
            return
        for member in (s, *s.children):
            member.phase = Phase.GENERATE
            self.out.emit(member, i, res, None, prof)

    def _sample_kept(self, s: Slot, res: StepResult, prof: GroupProfile | None) -> None:
        """Sample the first token of a READY prompt from its kept logits (cohort released)."""
        logits = s.kept_logits
        s.kept_logits = None
        for member in (s, *s.children):
            member.phase = Phase.GENERATE
            self.out.emit(member, -1, res, logits, prof)
