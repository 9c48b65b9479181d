"""Shape a request's events into llama-server native and OpenAI responses.

One ``Shaper`` per API turns ``Token`` / ``Done`` events into stream chunks and a final
body, with the parts llama-server's bodies carry: ``timings``, ``system_fingerprint``,
``usage.prompt_tokens_details.cached_tokens``, and on the native API ``generation_settings``,
``tokens_cached``, ``truncated`` and ``stop_type``. They only format: no I/O, no waiting.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import msgspec

from llamactor.protocol.events import Done, Progress, Token
from llamactor.protocol.messages import Task
from llamactor.protocol.sampling import SamplingParams
from llamactor.protocol.wire import NativeChunk, NativeResult, Timings
from llamactor.runtime.http.shaper import Shaper
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.results import Completion

STOP_TYPES = {"length": "limit"}
# llama-server sends its build ("b1-0c1e570"); ours names the server and its version.
SYSTEM_FINGERPRINT = f"llamactor-{metadata.version('llamactor')}"


def _timings(
    n_prompt: int,
    n_cached: int,
    n_predicted: int,
    prompt_ms: float,
    predicted_ms: float,
    n_draft: int = 0,
    n_draft_accepted: int = 0,
) -> Timings:
    """llama-server's formulas (server_slot_stats): the first generated token comes from the
    prompt's logits, so generation rates count ``n_predicted - 1`` decode steps. ``draft_n`` and
    ``draft_n_accepted`` only when drafts were verified, as llama-server adds them."""
    n_eval = n_prompt - n_cached
    steps = max(n_predicted - 1, 0)
    return Timings(
        cache_n=n_cached,
        prompt_n=n_eval,
        prompt_ms=prompt_ms,
        prompt_per_token_ms=prompt_ms / n_eval if n_eval > 0 else 0.0,
        prompt_per_second=n_eval / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
        predicted_n=n_predicted,
        predicted_ms=predicted_ms,
        predicted_per_token_ms=predicted_ms / steps if steps > 0 else 0.0,
        predicted_per_second=steps / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
        draft_n=n_draft if n_draft > 0 else None,
        draft_n_accepted=n_draft_accepted if n_draft > 0 else None,
    )


def token_timings(ev: Token) -> Timings | None:
    """timings_per_token: the timings so far that a streamed token carries (None: not asked)."""
    return None if ev.clock is None else _timings(*ev.clock)


def progress_timings(ev: Progress) -> Timings | None:
    """timings_per_token: a progress chunk's timings, the prompt's so far (nothing predicted yet)."""
    return _timings(ev.processed, ev.cache, 0, ev.time_ms, 0.0) if ev.timed else None


def sampling_settings(
    p: SamplingParams,
    *,
    n_predict: int,
    ignore_eos: bool,
    stream: bool | None,
    lora: Sequence[tuple[int, float]] = (),
    reasoning_format: str = "none",
    spec_type: str = "none",
) -> dict[str, Any]:
    """llama-server's ``task_params::to_json(only_metrics=true)``, every key. Its chat-parser
    keys are those of a request whose output is not parsed as a chat ("Content-only")."""
    return {
        "seed": p.seed,
        "temperature": p.temperature,
        "dynatemp_range": p.dynatemp_range,
        "dynatemp_exponent": p.dynatemp_exponent,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "top_n_sigma": p.top_n_sigma,
        "xtc_probability": p.xtc_probability,
        "xtc_threshold": p.xtc_threshold,
        "typical_p": p.typical_p,
        "repeat_last_n": p.repeat_last_n,
        "repeat_penalty": p.repeat_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "dry_multiplier": p.dry_multiplier,
        "dry_base": p.dry_base,
        "dry_allowed_length": p.dry_allowed_length,
        "dry_penalty_last_n": p.dry_penalty_last_n,
        "mirostat": p.mirostat,
        "mirostat_tau": p.mirostat_tau,
        "mirostat_eta": p.mirostat_eta,
        "adaptive_target": p.adaptive_target,
        "adaptive_decay": p.adaptive_decay,
        "max_tokens": n_predict,
        "n_predict": n_predict,
        "n_keep": 0,
        "ignore_eos": ignore_eos,
        "stream": stream,
        "n_probs": p.n_probs,
        "min_keep": p.min_keep,
        "n_discard": 0,
        "chat_format": "Content-only",
        "reasoning_format": reasoning_format,
        "reasoning_in_content": False,
        "generation_prompt": "",
        "samplers": list(p.samplers),
        "speculative.types": spec_type,
        "timings_per_token": False,
        "post_sampling_probs": False,
        "backend_sampling": False,  # llama.cpp's sampling on the GPU backend: not built here
        "lora": [{"id": i, "scale": scale} for i, scale in lora],  # the LoRA adapters it runs with
    }


GRAMMAR_TRIGGER_WORD = 1  # llama.cpp's COMMON_GRAMMAR_TRIGGER_TYPE_WORD


def generation_settings(
    task: Task, *, stream: bool, eog: Sequence[int] = (), spec_type: str = "none"
) -> dict[str, Any]:
    """A native response's ``generation_settings``: the request's effective settings, every key
    of llama-server's ``task_params::to_json``. Its ``logit_bias`` as llama-server writes it
    (``{"bias", "token"}``, null for -inf), with the end-of-generation tokens ``eog`` banned
    when the request ignores EOS, as llama-server adds them. A native completion parses no chat
    output: its chat and reasoning settings are llama-server's for one ("Content-only", "none")."""
    p = task.params
    out = sampling_settings(
        p, n_predict=task.n_predict, ignore_eos=task.ignore_eos, stream=stream, lora=task.lora, spec_type=spec_type
    )
    bias = [*p.logit_bias, *((t, -math.inf) for t in eog if task.ignore_eos)]
    out.update(
        dry_sequence_breakers=list(p.dry_sequence_breakers),
        stop=list(task.stop),
        n_keep=task.n_keep,
        n_discard=task.n_discard,
        logit_bias=[{"bias": b if math.isfinite(b) else None, "token": t} for t, b in bias],
        grammar=p.grammar,
        grammar_lazy=p.grammar_lazy,
        grammar_triggers=[{"type": GRAMMAR_TRIGGER_WORD, "value": w} for w in p.grammar_triggers],
        preserved_tokens=[],
        timings_per_token=task.request.timings_per_token,
        post_sampling_probs=bool(task.request.post_sampling_probs),
    )
    return out


def default_generation_settings(cfg: RuntimeConfig) -> dict[str, Any]:
    """``/props``' ``default_generation_settings``: the server's defaults, set by its flags."""
    params = sampling_settings(
        cfg.sampling,
        n_predict=cfg.n_predict_max,
        ignore_eos=cfg.ignore_eos,
        stream=False,
        reasoning_format=cfg.reasoning_format,
        spec_type=cfg.spec_type,
    )
    return {"params": params, "n_ctx": cfg.ctx_per_request}


def _stop_type(finish: str, word: str) -> str:
    if finish == "length":
        return "limit"
    return "word" if word else "eos"


def _native_probs(ev: Token, post: bool = False) -> list[dict[str, Any]]:
    """One token's ``completion_probabilities`` entry; ``post`` (the request's ``post_sampling_probs``)
    gives probabilities after the sampler chain as llama-server names them: ``prob``/``top_probs``.
    ``bytes``: each token's text as UTF-8 bytes, as llama-server adds them."""
    piece = next((t.piece for t in ev.top if t.token == ev.token), ev.text)
    if post:
        return [
            {
                "id": ev.token,
                "token": ev.text,
                "bytes": list(piece.encode()),
                "prob": 1.0 if ev.logprob is None else math.exp(ev.logprob),
                "top_probs": [
                    {"id": t.token, "token": t.piece, "bytes": list(t.piece.encode()), "prob": math.exp(t.logprob)}
                    for t in ev.top
                ],
            }
        ]
    return [
        {
            "id": ev.token,
            "token": ev.text,
            "bytes": list(piece.encode()),
            "logprob": ev.logprob,
            "top_logprobs": [
                {"id": t.token, "token": t.piece, "bytes": list(t.piece.encode()), "logprob": t.logprob} for t in ev.top
            ],
        }
    ]


class NativeShaper(Shaper):
    """llama-server's /completion."""

    def __init__(
        self,
        model: str,
        want_probs: bool,
        settings: dict[str, Any] | None = None,
        post_sampling_probs: bool = False,
        *,
        prompt: str = "",
        n_prompt: int = 0,
    ) -> None:
        self.model = model
        self.want_probs = want_probs
        self.post = post_sampling_probs
        self.settings = settings or {}  # generation_settings (see ``generation_settings``)
        self.prompt = prompt  # the prompt's text as the model reads it (special tokens rendered)
        self.n_prompt = n_prompt  # its tokens: each stream chunk's tokens_evaluated
        self._predicted: dict[int, int] = {}  # per choice: tokens so far
        self._new_line: set[int] = set()  # choices whose text has had a newline

    def stream(self, ev: Token | Done) -> list[Any]:
        return [self.chunk(ev)]

    def chunk(self, ev: Token | Done) -> Any:
        if isinstance(ev, Token):
            n = self._predicted[ev.index] = self._predicted.get(ev.index, 0) + 1
            if "\n" in ev.text:
                self._new_line.add(ev.index)
            return NativeChunk(
                content=ev.text,
                stop=False,
                index=ev.index,
                id_slot=ev.slot,
                tokens=[ev.token],
                tokens_predicted=n,
                tokens_evaluated=self.n_prompt,
                completion_probabilities=_native_probs(ev, self.post) if self.want_probs else None,
                timings=token_timings(ev),
            )
        return self._result(ev, "", [], new_line=ev.index in self._new_line)

    def progress(self, ev: Progress) -> list[dict[str, Any]]:
        """A return_progress chunk, as llama-server's (no content, ``prompt_progress``)."""
        chunk = {
            "content": "",
            "stop": False,
            "index": ev.index,
            "tokens": [],
            "tokens_predicted": 0,
            "tokens_evaluated": self.n_prompt,
            "prompt_progress": progress_json(ev),
        }
        timings = progress_timings(ev)
        return [chunk if timings is None else {**chunk, "timings": timings}]

    def _result(
        self,
        d: Done,
        content: str,
        tokens: list[int],
        probs: list[dict[str, Any]] | None = None,
        *,
        new_line: bool = False,
    ) -> NativeResult:
        return NativeResult(
            content=content,
            stop=True,
            index=d.index,
            id_slot=d.slot,
            model=self.model,
            tokens_predicted=d.n_predicted,
            tokens_evaluated=d.n_prompt,
            tokens_cached=d.n_prompt
            + max(d.n_predicted - 1, 0),  # in the slot's KV now (the last token is not decoded)
            stop_type=_stop_type(d.finish_reason, d.stopping_word),
            stopping_word=d.stopping_word,
            truncated=d.truncated,
            timings=_timings(
                d.n_prompt, d.n_cached, d.n_predicted, d.prompt_ms, d.predicted_ms, d.n_draft, d.n_draft_accepted
            ),
            generation_settings=self.settings,
            prompt=self.prompt,
            has_new_line=new_line or "\n" in content,
            tokens=tokens,
            completion_probabilities=msgspec.UNSET if probs is None else probs,
        )

    def body(self, c: Completion) -> Any:
        results = []
        for ch in c.choices:
            one = len(c.choices) == 1  # the draft counts are the request's: shown for n = 1
            d = Done(
                ch.index,
                ch.finish_reason,
                ch.text,
                c.stopping_word,
                c.n_prompt,
                c.n_cached,
                len(ch.tokens),
                c.prompt_ms,
                c.predicted_ms,
                c.slot,
                truncated=c.truncated,
                n_draft=c.n_draft if one else 0,
                n_draft_accepted=c.n_draft_accepted if one else 0,
            )
            probs = [p for ev in ch.logprobs for p in _native_probs(ev, self.post)] if self.want_probs else None
            results.append(self._result(d, ch.text, list(ch.tokens), probs))
        return results[0] if len(results) == 1 else results


class OpenAIShaper(Shaper):
    """/v1/completions (``chat=False``) and /v1/chat/completions (``chat=True``)."""

    done = True

    def __init__(self, model: str, *, chat: bool, want_logprobs: bool, include_usage: bool = False) -> None:
        self.model = model
        self.chat = chat
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._started: set[int] = set()
        self.n_prompt = 0
        self.n_cached = 0
        self.n_completion = 0
        self._timings: Timings | None = None
        self._chars: dict[int, int] = {}  # per choice: characters streamed so far (text_offset)

    def _envelope(self, choices: list[dict[str, Any]], obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
        }

    def _logprobs(self, events: tuple[Token, ...] | list[Token], start: int = 0) -> Any:
        """The ``logprobs`` of ``events``; ``start``: the characters of the choice's text before
        the first of them (OpenAI's ``text_offset`` counts from the start of the completion)."""
        if not self.want_logprobs:
            return None
        if self.chat:
            return {
                "content": [
                    {  # as llama-server's: OpenAI's fields and the token ids
                        "id": ev.token,
                        "token": ev.text,
                        "logprob": ev.logprob,
                        "bytes": list(ev.text.encode()),
                        "top_logprobs": [
                            {"id": t.token, "token": t.piece, "logprob": t.logprob, "bytes": list(t.piece.encode())}
                            for t in ev.top
                        ],
                    }
                    for ev in events
                ]
            }
        offsets = []
        for ev in events:  # a token whose text is held back (a partial UTF-8 character) has none
            offsets.append(start)
            start += len(ev.text)
        return {
            "tokens": [ev.text for ev in events],
            "token_logprobs": [ev.logprob for ev in events],
            "top_logprobs": [{t.piece: t.logprob for t in ev.top} for ev in events],
            "text_offset": offsets,
        }

    def progress(self, ev: Progress) -> list[dict[str, Any]]:
        """A return_progress chunk, as llama-server's: an empty choice plus ``prompt_progress``."""
        obj = self.object + ".chunk" if self.chat else self.object
        choice = self._choice(ev.index, None, None)
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": None}
        else:
            choice["text"] = ""
        env = self._envelope([choice], obj)
        env["prompt_progress"] = progress_json(ev)
        timings = progress_timings(ev)
        if timings is not None:
            env["timings"] = timings
        return [env]

    def stream(self, ev: Token | Done) -> list[dict[str, Any]]:
        """Zero or more chunks for one event (chat streams open each choice with a role delta)."""
        obj = self.object + ".chunk" if self.chat else self.object
        out: list[dict[str, Any]] = []
        if self.chat and ev.index not in self._started:
            self._started.add(ev.index)
            out.append(
                self._envelope(
                    [{**self._choice(ev.index, None, None), "delta": {"role": "assistant", "content": None}}],
                    obj,
                )
            )
        if isinstance(ev, Token):
            if not ev.text and not self.want_logprobs:
                return out
            start = self._chars.get(ev.index, 0)
            self._chars[ev.index] = start + len(ev.text)
            choice = self._choice(ev.index, self._logprobs([ev], start), None)
            if self.chat:
                choice["delta"] = {"content": ev.text}
            else:
                choice["text"] = ev.text
            env = self._envelope([choice], obj)
            timings = token_timings(ev)
            if timings is not None:
                env["timings"] = timings
            out.append(env)
            return out
        self.n_prompt, self.n_cached = ev.n_prompt, ev.n_cached
        self.n_completion += ev.n_predicted
        self._timings = done_timings(ev)
        choice = self._choice(ev.index, None, ev.finish_reason)
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        env = self._envelope([choice], obj)
        # As llama-server: /v1/completions' last chunk has usage and timings; a chat stream has
        # timings on its last chunk, or on the usage chunk when one was asked for.
        if not self.chat:
            env["usage"] = self._usage(ev.n_prompt, ev.n_cached, ev.n_predicted)
        if not (self.chat and self.include_usage):
            env["timings"] = self._timings
        out.append(env)
        return out

    def _choice(self, index: int, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        """A choice's common keys. A chat choice without log probabilities has no ``logprobs``
        key, as llama-server writes it; a completions choice has ``logprobs: null``."""
        if logprobs is None and self.chat:
            return {"index": index, "finish_reason": finish_reason}
        return {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}

    def tail(self) -> dict[str, Any] | None:
        if not self.include_usage:
            return None
        env = self._envelope([], self.object + ".chunk" if self.chat else self.object)
        env["usage"] = self._usage(self.n_prompt, self.n_cached, self.n_completion)
        if self.chat and self._timings is not None:
            env["timings"] = self._timings
        return env

    @staticmethod
    def _usage(n_prompt: int, n_cached: int, n_completion: int) -> dict[str, Any]:
        return {
            "completion_tokens": n_completion,
            "prompt_tokens": n_prompt,
            "total_tokens": n_prompt + n_completion,
            "prompt_tokens_details": {"cached_tokens": n_cached},
        }

    def body(self, c: Completion) -> dict[str, Any]:
        choices = []
        for ch in c.choices:
            entry = self._choice(ch.index, self._logprobs(ch.logprobs), ch.finish_reason)
            if self.chat:
                entry["message"] = {"role": "assistant", "content": ch.text}
            else:
                entry["text"] = ch.text
            choices.append(entry)
        env = self._envelope(choices, self.object)
        env["usage"] = self._usage(c.n_prompt, c.n_cached, c.n_predicted)
        env["timings"] = _timings(
            c.n_prompt, c.n_cached, c.n_predicted, c.prompt_ms, c.predicted_ms, c.n_draft, c.n_draft_accepted
        )
        return env


def done_timings(ev: Done) -> Timings:
    """A finished choice's ``timings``."""
    return _timings(
        ev.n_prompt, ev.n_cached, ev.n_predicted, ev.prompt_ms, ev.predicted_ms, ev.n_draft, ev.n_draft_accepted
    )


def progress_json(ev: Progress) -> dict[str, Any]:
    return {"total": ev.total, "cache": ev.cache, "processed": ev.processed, "time_ms": round(ev.time_ms)}
