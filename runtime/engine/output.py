"""What a step gives back, and how one sampled token becomes events: text, stops, finishes.

``StepResult`` is the output of one decode step: the (task, event) pairs the group sends, the
choices that ended, the prompts that wait for their cohort, and the step's counts.

``Output.emit`` is the per-token tail of the hot path: draw the slot's token (``logits``), turn
its bytes into text (``TextStream``: incremental UTF-8 and stop strings) and decide whether the
choice ends, and why:

- ``"stop"``: an end-of-generation token (unless ``ignore_eos``) or a stop string;
- ``"length"``: ``n_predict`` tokens, the end of the slot's context (unless the context can
  shift), or past ``t_max_predict_ms`` once the token's text holds a newline (llama-server's).

A resumed request first replays the tokens it delivered before the engine died: each goes
through its sampler chain (penalties, grammar) and its text stream again, without an event.
Runs in the group's worker thread; allocates nothing per token beyond the events it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import llama_cpp
import numpy as np

from llamactor.protocol.events import Done, Event, Token, TopProb
from llamactor.protocol.messages import Task
from llamactor.runtime.engine.logits import RowSampler
from llamactor.runtime.engine.model import Model
from llamactor.runtime.engine.profiler import GroupProfile
from llamactor.runtime.engine.slot import Slot


@dataclass
class StepResult:
    events: list[tuple[Task, Event]] = field(default_factory=list)  # (task, event) to send on task.sink
    finished: list[Slot] = field(default_factory=list)  # choices that ended this step
    ready: list[Slot] = field(default_factory=list)  # prompts that finished and wait (READY)
    first: list[Slot] = field(default_factory=list)  # requests (their first choice) whose first token came now
    n_prompt: int = 0
    n_generated: int = 0
    n_rows: int = 0  # slots that took part
    gaps: list[float] = field(default_factory=list)  # inter-token gaps of streams that generated
    failed: list[tuple[Slot, Exception]] = field(default_factory=list)  # request-scoped failures
    n_draft: int = 0  # draft tokens verified this step (speculation)
    accepted: list[int] = field(default_factory=list)  # per verified draft: its tokens accepted


class Output:
    """Turns each sampled token of a context's slots into events.

    ``sample`` is the token draw the emitter calls (``RowSampler.sample``); a context with
    ``GroupHooks`` replaces it with a hooked one, and the engine blackbox replaces ``emit``.
    """

    def __init__(self, model: Model, rows: RowSampler, n_ctx_seq: int, shift: Callable[[Slot], bool]) -> None:
        self.model = model
        self.rows = rows
        self.n_ctx_seq = n_ctx_seq
        self.shift = shift  # context shift at the end of a slot's context (``SequenceKV.shift``)
        self.sample: Callable[[Slot, int, np.ndarray | None], int] = rows.sample

    def emit(self, s: Slot, i: int, res: StepResult, logits: np.ndarray | None, prof: GroupProfile | None) -> None:
        """Sample one token for ``s`` from row ``i`` (or ``logits``) and turn it into events."""
        task = s.task
        assert task is not None and s.stream is not None
        if task.n_predict == 0:  # the prompt alone: it is in the cache now, and nothing is sampled
            s.finished = True
            res.finished.append(s)
            res.events.append((task, done(s, "length")))
            return
        if prof is not None:
            ta = time.perf_counter()
        params = task.params
        if task.lora and params.grammar:
            self.rows.check_lora_logits(i, logits)
        logprob: float | None
        top: tuple[TopProb, ...]
        replayed = bool(s.replay)
        if replayed:  # resume: the token delivered before; the sampler still sees it (penalties, grammar)
            token = s.replay.pop()
            llama_cpp.llama_sampler_accept(s.sampler, token)
            logprob, top = None, ()
        elif params.n_probs and params.post_sampling_probs:
            token, logprob, top = self.rows.sample_post(s, i, logits, params.n_probs)
        else:
            token = self.sample(s, i, logits)
            logprob, top = self.rows.probs(i, logits, token, params.n_probs) if params.n_probs else (None, ())
        s.n_decoded += 1
        s.next_token = token
        res.n_generated += 1
        if prof is not None:
            tb = time.perf_counter()
            prof.sample += tb - ta
            prof.tokens += 1
        finish = ""
        if self.model.is_eog(token) and not task.ignore_eos:
            # with -sp the end-of-generation token's text is output too, as llama-server's
            text = s.stream.push(self.model.piece(token)) if self.model.special else ""
            text, finish = text + s.stream.flush(), "stop"
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
            elif s.n_decoded >= task.n_predict or (s.n_past + 1 >= self.n_ctx_seq and not self.shift(s)):
                text += s.stream.flush()
                finish = "length"
        now = time.perf_counter()
        if (
            params.t_max_predict_ms > 0
            and not finish
            and "\n" in text
            and (now - s.t_prompt_done) * 1e3 > params.t_max_predict_ms
        ):
            # llama-server's rule: past the time limit, stop once this token's text has a newline
            text += s.stream.flush()
            finish = "length"
        if s.n_decoded > 1 and not replayed:
            res.gaps.append(now - s.t_last)
        elif s.n_decoded == 1 and s.index == 0 and s.parent is None:
            res.first.append(s)
        s.t_last = now
        if not replayed:  # a replayed token's text went out before; its Done (if it ends) is sent again
            clock = None
            if task.timings_per_token:
                prompt_ms, predicted_ms = s.prompt_ms, (now - s.t_prompt_done) * 1e3
                clock = (len(s.prompt), s.n_cached, s.n_decoded, prompt_ms, predicted_ms)
            first_cached = s.n_cached if s.n_decoded == 1 else -1
            res.events.append((task, Token(s.index, text, token, logprob, top, clock, s.id, first_cached)))
        if finish:
            s.finished = True
            res.finished.append(s)
            res.events.append((task, done(s, finish)))


def done(s: Slot, finish: str) -> Done:
    """The final event of a choice that ended with ``finish``."""
    assert s.task is not None and s.stream is not None
    return Done(
        index=s.index,
        finish_reason=finish,
        text=s.stream.text,
        stopping_word=s.stream.stopped_by,
        n_prompt=len(s.prompt),
        n_cached=s.n_cached,
        n_predicted=s.n_decoded,
        prompt_ms=s.prompt_ms,
        predicted_ms=(s.t_last - s.t_prompt_done) * 1e3,
        slot=s.id,
        truncated=s.truncated,
        n_draft=s.spec.n_draft if s.spec is not None else 0,
        n_draft_accepted=s.spec.n_accepted if s.spec is not None else 0,
    )
