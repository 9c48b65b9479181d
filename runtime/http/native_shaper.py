"""llama-server's native ``/completion`` answer: ``NativeShaper``.

Its bodies and chunks carry what llama-server's do: ``timings``, ``generation_settings``
(made by ``generation_settings``), ``tokens_cached``, ``truncated``, ``stop_type`` and the
``completion_probabilities`` of each token. It only formats: no I/O, no waiting.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from llamactor.protocol.events import Done, Progress, Token
from llamactor.protocol.wire import NativeChunk, NativeResult
from llamactor.runtime.http.shaper import Shaper
from llamactor.runtime.http.timings import done_timings, progress_json, progress_timings, token_timings
from llamactor.runtime.service.results import Completion

STOP_TYPES = {"length": "limit"}


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
            timings=done_timings(d),
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
