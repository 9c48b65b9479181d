"""One group's llama_context: the facade its GroupActor calls.

A ``Context`` opens the llama_context over the shared model and wires the parts of the engine
that work on it, one concept each, along llama.cpp's own seams:

- ``kv.SequenceKV``: the KV cells of each slot's sequence (``llama_memory_*``): prefix reuse,
  prefix sharing, save/restore, context shift;
- ``logits.RowSampler``: the one logits accessor and the token drawn from a row
  (``llama_get_logits_ith``, ``llama_sampler_*``); the chains are built by ``sampling``;
- ``output.Output``: a sampled token's text, stop strings and finish reasons, as events;
- ``step.DecodeStep``: the batch and ``llama_decode``, the hot path (its design note is there).

Here: per request, ``start`` builds a slot's sampler chain and text stream and ``release``
frees the chain; the group's KV commands and its ``step`` pass through. Test hooks
(``GroupHooks``) and the engine process's blackbox wrap the decode, the token draw and the
start at construction; an unhooked context binds the plain functions and pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from llamactor.protocol.errors import EngineError
from llamactor.protocol.lora import NO_LORA, LoraSet
from llamactor.protocol.plan import StepPlan
from llamactor.protocol.slots import SlotKV
from llamactor.runtime.engine.blackbox import DECODE, SAMPLE, START, WARMUP, Blackbox, engine_blackbox
from llamactor.runtime.engine.controlvector import ControlVector
from llamactor.runtime.engine.draftmodel import make_drafter
from llamactor.runtime.engine.hooks import GroupHooks
from llamactor.runtime.engine.kv import SequenceKV
from llamactor.runtime.engine.logits import RowSampler
from llamactor.runtime.engine.model import Model, open_context
from llamactor.runtime.engine.output import Output, StepResult
from llamactor.runtime.engine.overrides import RopeOptions
from llamactor.runtime.engine.profiler import GroupProfile
from llamactor.runtime.engine.promptcache import PromptCache
from llamactor.runtime.engine.sampling import argmax_biases, build_chain
from llamactor.runtime.engine.slot import Slot
from llamactor.runtime.engine.speculative import Drafter, SpecOptions, SpecState
from llamactor.runtime.engine.step import DecodeStep, KvCacheFull
from llamactor.runtime.engine.textstream import TextStream
from llamactor.runtime.engine.vision import Vision

__all__ = ["Context", "ContextOptions", "KvCacheFull", "StepResult"]


@dataclass(frozen=True)
class ContextOptions:
    n_ctx: int  # KV cells of this context (all its sequences together unless kv_unified)
    n_batch: int
    n_ubatch: int
    n_seq_max: int  # slots of this group
    n_threads: int
    n_threads_batch: int
    kv_unified: bool = False
    swa_full: bool = False  # sliding-window layers sized like the others: no position leaves the cache
    ctx_checkpoints: int = 0  # sliding-window models: window checkpoints kept a slot (``engine.checkpoints``)
    checkpoint_min_step: int = 8192  # ... tokens between two taken at chunk ends
    flash_attn: int = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
    type_k: int = llama_cpp.GGML_TYPE_F16  # KV cache types (-ctk/-ctv)
    type_v: int = llama_cpp.GGML_TYPE_F16
    context_shift: bool = False  # a generation at the end of its context drops old tokens
    spec: SpecOptions | None = None  # speculative decoding; None: off, and the step pays nothing
    vision: Vision | None = None  # --mmproj: the projector a prompt's images are decoded with (shared)
    rope: RopeOptions = RopeOptions()  # --rope-*/--yarn-*: the model's own unless set (its draft context too)
    control_vector: ControlVector | None = None  # --control-vector: set on this context when it is made
    offload_kqv: bool = True  # -nkvo/--no-kv-offload: False keeps the KV cache in host memory
    op_offload: bool = True  # --no-op-offload: False runs host-resident tensors' ops on the CPU
    warmup: bool = True  # --no-warmup: no warm-up decode when the context is made


class Context:
    """A llama_context made from the shared model, its KV, sampling, output and step."""

    def __init__(self, model: Model, opts: ContextOptions, hooks: GroupHooks | None = None, group: int = 0) -> None:
        self.model = model
        self.opts = opts
        self.ptr = open_context(
            model,
            "a context",
            n_ctx=opts.n_ctx,
            n_batch=opts.n_batch,
            n_ubatch=opts.n_ubatch,
            n_seq_max=opts.n_seq_max,
            n_threads=opts.n_threads,
            n_threads_batch=opts.n_threads_batch,
            kv_unified=opts.kv_unified,
            swa_full=opts.swa_full,
            flash_attn_type=opts.flash_attn,
            type_k=opts.type_k,
            type_v=opts.type_v,
            offload_kqv=opts.offload_kqv,
            op_offload=opts.op_offload,
            **opts.rope.settings(),
        )
        if opts.control_vector is not None:
            try:
                opts.control_vector.apply(self.ptr)
            except BaseException:
                self.close()
                raise
        self.n_ctx_seq = llama_cpp.llama_n_ctx_seq(self.ptr)
        # this group's draft source (a draft model gets its own context here, one per group)
        self.drafter: Drafter | None = None
        if opts.spec is not None:
            try:
                self.drafter = make_drafter(opts.spec, opts, model)
            except BaseException:
                self.close()
                raise
        self.kv = SequenceKV(
            self.ptr,
            model,
            n_ctx_seq=self.n_ctx_seq,
            kv_unified=opts.kv_unified,
            context_shift=opts.context_shift,
            checkpoints=0 if opts.swa_full else opts.ctx_checkpoints,  # every position kept: none needed
            checkpoint_min_step=opts.checkpoint_min_step,
            n_batch=opts.n_batch,
            n_ubatch=opts.n_ubatch,
        )
        self.output = Output(model, RowSampler(self.ptr, model), self.n_ctx_seq, self.kv.shift)
        self._step = DecodeStep(self.ptr, model, self.kv, self.output, self.drafter, opts.vision)
        self.n_batch = self._step.n_batch
        if hooks is not None:
            self._bind_hooks(hooks, group)
        box = engine_blackbox()
        if box is not None:
            self._bind_blackbox(box, group)

    @property
    def holds_ready(self) -> bool:
        """Finished prompts wait in READY for their cohort (set by the owning group from its policy)."""
        return self._step.holds_ready

    @holds_ready.setter
    def holds_ready(self, value: bool) -> None:
        self._step.holds_ready = value

    @property
    def lora(self) -> LoraSet:
        """The LoRA adapters active on this context (switched by a step whose plan's set differs)."""
        return self._step.lora

    def _bind_hooks(self, hooks: GroupHooks, group: int) -> None:
        """Route decode and sampling through ``hooks`` (tests); unhooked contexts pay nothing."""
        step, out = self._step, self.output
        decode, sample = step.decode, out.sample

        warm = getattr(hooks, "before_warmup", None)  # optional: most hooks watch requests only

        def hooked_decode(ctx: Any, batch: Any) -> int:
            if not self._warming:
                hooks.before_decode(group, step.n_prompt, step.n_generate)
            elif warm is not None:
                warm(group)
            return decode(ctx, batch)

        def hooked_sample(s: Slot, i: int, logits: np.ndarray | None) -> int:
            assert s.task is not None
            hooks.before_sample(group, s.task)
            return sample(s, i, logits)

        step.decode = hooked_decode
        out.sample = hooked_sample

    def _bind_blackbox(self, box: Blackbox, group: int) -> None:
        """In the engine process: mark what this group's thread is inside (``engine.blackbox``),
        so a death points at the request being sampled or started rather than at all of them."""
        step, out = self._step, self.output
        decode, emit, start = step.decode, out.emit, self.start

        def boxed_decode(ctx: Any, batch: Any) -> int:
            box.enter(group, WARMUP if self._warming else DECODE)
            try:
                return decode(ctx, batch)
            finally:
                box.leave(group)

        def boxed_emit(s: Slot, i: int, res: StepResult, logits: np.ndarray | None, prof: GroupProfile | None) -> None:
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

        step.decode = boxed_decode
        out.emit = boxed_emit  # type: ignore[method-assign]  # sampling, a resume's replay, its text
        self.start = boxed_start  # type: ignore[method-assign]

    _warming = False  # inside ``warmup`` (the blackbox tells the API process a death there apart)

    def warmup(self) -> None:
        """llama-server's warm-up: a decode of the vocabulary's BOS and EOS (a prompt's path
        through the kernels), then one of a single token (a generation's), then the KV cleared.
        Run once per new context, in the group's thread, before the engine says it is ready: a
        build the CPU cannot execute (an instruction set it advertises and traps on) or a GPU
        that cannot run the model fails here, once, at startup, not in every request."""
        vocab = self.model.vocab
        tokens = [t for t in (llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab)) if t >= 0] or [0]
        self._warming = True
        llama_cpp.llama_set_warmup(self.ptr, True)
        try:
            for batch in (tokens, tokens[:1]):
                ids = (llama_cpp.llama_token * len(batch))(*batch)
                rc = self._step.decode(self.ptr, llama_cpp.llama_batch_get_one(ids, len(batch)))
                if rc != 0:
                    raise EngineError(f"the warm-up decode failed (llama_decode returned {rc})")
            llama_cpp.llama_synchronize(self.ptr)
        finally:
            llama_cpp.llama_set_warmup(self.ptr, False)
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ptr), True)
            self._warming = False

    def close(self) -> None:
        drafter, self.drafter = getattr(self, "drafter", None), None
        if drafter is not None:
            drafter.close()
        if self.ptr:
            llama_cpp.llama_free(self.ptr)
            self.ptr = None

    # ---- KV of one sequence (called between steps by the owning group only) ------------

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
        """Keep the longest reusable prefix of the slot's KV for ``prompt``, and with ``reuse_min``
        chunks of its cache past it (``SequenceKV.reuse_prefix``)."""
        return self.kv.reuse_prefix(slot, prompt, cache_prompt, prompt_cache, lora, reuse_min, others)

    def share_prefix(self, dst: Slot, src: Slot, n: int) -> int:
        """Prefix sharing: ``dst`` gets the KV of ``src``'s first ``n`` tokens (``SequenceKV.share_prefix``)."""
        return self.kv.share_prefix(dst, src, n)

    def erase(self, slot: Slot) -> None:
        self.kv.erase(slot)

    def save_slot(self, slot: Slot, path: str) -> int:
        return self.kv.save_file(slot, path)

    def restore_slot(self, slot: Slot, path: str) -> int:
        return self.kv.restore_file(slot, path)

    def export_slot(self, slot: Slot, prefix_of: Sequence[int] = ()) -> SlotKV:
        return self.kv.export_state(slot, prefix_of)

    def import_slot(self, slot: Slot, kv: SlotKV) -> int:
        return self.kv.import_state(slot, kv)

    # ---- a request on a slot, and the step -----------------------------------------------

    def start(self, slot: Slot, parent: Slot | None = None) -> None:
        """Prepare a newly assigned slot's sampler and text stream (in the group's thread)."""
        task = slot.task
        assert task is not None
        prompt = task.prompt
        if task.replay_in_prompt:  # --resume fast: the delivered tokens are accepted below, once
            prompt = prompt[: len(prompt) - len(task.replay[slot.index])]
        if task.media:  # the samplers see the prompt's text: an image's stand-ins are no tokens
            prompt = prompt[prompt >= 0]
        slot.sampler = build_chain(
            self.model,
            task.params,
            n_ctx=self.n_ctx_seq,
            seed_offset=slot.index,
            prompt=prompt if task.params.penalized else (),
            ignore_eos=task.ignore_eos,
        )
        slot.argmax = argmax_biases(self.model, task.params, ignore_eos=task.ignore_eos)
        slot.stream = TextStream(task.stop)
        if task.replay:  # resume: these tokens were delivered before the engine died
            delivered = task.replay[slot.index]
            if task.replay_in_prompt:  # --resume fast: prefilled with the prompt; prime what samples
                for token in delivered:
                    llama_cpp.llama_sampler_accept(slot.sampler, token)
                    slot.stream.push(self.model.piece(token))
                slot.n_decoded = len(delivered)
            else:  # exact: replayed one decode step at a time after the prompt (``Output.emit``)
                slot.replay = list(reversed(delivered))
        # the request's draft settings as admission resolved them, where this group has a drafter;
        # drafts are text: a prompt with images does not speculate
        sp = task.speculation
        slot.spec = (
            SpecState(task.prompt, sp.n_max, sp.n_min, sp.p_min)
            if sp is not None and self.drafter is not None and not task.media
            else None
        )

    def release(self, slot: Slot) -> None:
        if slot.sampler is not None:
            llama_cpp.llama_sampler_free(slot.sampler)
            slot.sampler = None

    def step(self, plan: StepPlan, slots: list[Slot], prof: GroupProfile | None = None) -> StepResult:
        """Decode one batch per ``plan`` and sample/emit every row that needs a token
        (``DecodeStep.run``; in the group's worker thread, once per step)."""
        return self._step.run(plan, slots, prof)
