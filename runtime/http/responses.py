"""Shape a request's events into llama-server native and OpenAI responses (API-3, API-4).

One ``Shaper`` per API turns ``Token`` / ``Done`` events into stream chunks and a final
body. They only format: no I/O, no waiting.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from llamactor.protocol.events import Done, Token
from llamactor.protocol.wire import NativeChunk, NativeResult, Timings
from llamactor.runtime.service.handles import Completion

STOP_TYPES = {"length": "limit"}


def _timings(n_prompt: int, n_cached: int, n_predicted: int, prompt_ms: float, predicted_ms: float) -> Timings:
    n_eval = n_prompt - n_cached
    return Timings(
        prompt_n=n_eval,
        prompt_ms=prompt_ms,
        prompt_per_second=n_eval / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
        predicted_n=n_predicted,
        predicted_ms=predicted_ms,
        predicted_per_second=n_predicted / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
        cache_n=n_cached,
    )


def _stop_type(finish: str, word: str) -> str:
    if finish == "length":
        return "limit"
    return "word" if word else "eos"


def _native_probs(ev: Token) -> list[dict[str, Any]]:
    return [
        {
            "id": ev.token,
            "token": ev.text,
            "logprob": ev.logprob,
            "top_logprobs": [{"id": t.token, "token": t.piece, "logprob": t.logprob} for t in ev.top],
        }
    ]


class NativeShaper:
    """llama-server's /completion."""

    def __init__(self, model: str, want_probs: bool) -> None:
        self.model = model
        self.want_probs = want_probs

    def chunk(self, ev: Token | Done) -> Any:
        if isinstance(ev, Token):
            return NativeChunk(
                content=ev.text, stop=False, index=ev.index, tokens=[ev.token],
                completion_probabilities=_native_probs(ev) if self.want_probs else None,
            )
        return self._result(ev, "", [])

    def _result(self, d: Done, content: str, tokens: list[int], probs: list[dict[str, Any]] | None = None) -> NativeResult:
        return NativeResult(
            content=content, stop=True, index=d.index, id_slot=d.slot, model=self.model,
            tokens_predicted=d.n_predicted, tokens_evaluated=d.n_prompt, tokens_cached=d.n_cached,
            stop_type=_stop_type(d.finish_reason, d.stopping_word), stopping_word=d.stopping_word,
            truncated=False, timings=_timings(d.n_prompt, d.n_cached, d.n_predicted, d.prompt_ms, d.predicted_ms),
            tokens=tokens, completion_probabilities=probs,
        )

    def body(self, c: Completion) -> Any:
        results = []
        for ch in c.choices:
            d = Done(ch.index, ch.finish_reason, ch.text, c.stopping_word, c.n_prompt, c.n_cached,
                     len(ch.tokens), c.prompt_ms, c.predicted_ms, c.slot)
            probs = [p for ev in ch.logprobs for p in _native_probs(ev)] if self.want_probs else None
            results.append(self._result(d, ch.text, list(ch.tokens), probs))
        return results[0] if len(results) == 1 else results


class OpenAIShaper:
    """/v1/completions (``chat=False``) and /v1/chat/completions (``chat=True``)."""

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
        self.n_completion = 0

    def _envelope(self, choices: list[dict[str, Any]], obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, events: tuple[Token, ...] | list[Token]) -> Any:
        if not self.want_logprobs:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        "token": ev.text,
                        "logprob": ev.logprob,
                        "bytes": list(ev.text.encode()),
                        "top_logprobs": [
                            {"token": t.piece, "logprob": t.logprob, "bytes": list(t.piece.encode())} for t in ev.top
                        ],
                    }
                    for ev in events
                ]
            }
        return {
            "tokens": [ev.text for ev in events],
            "token_logprobs": [ev.logprob for ev in events],
            "top_logprobs": [{t.piece: t.logprob for t in ev.top} for ev in events],
            "text_offset": [],
        }

    def chunks(self, ev: Token | Done) -> list[dict[str, Any]]:
        """Zero or more chunks for one event (chat streams open each choice with a role delta)."""
        obj = self.object + ".chunk" if self.chat else self.object
        out: list[dict[str, Any]] = []
        if self.chat and ev.index not in self._started:
            self._started.add(ev.index)
            out.append(self._envelope(
                [{"index": ev.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}], obj))
        if isinstance(ev, Token):
            if not ev.text and not self.want_logprobs:
                return out
            choice: dict[str, Any] = {"index": ev.index, "logprobs": self._logprobs([ev]), "finish_reason": None}
            if self.chat:
                choice["delta"] = {"content": ev.text}
            else:
                choice["text"] = ev.text
            out.append(self._envelope([choice], obj))
            return out
        self.n_prompt = ev.n_prompt
        self.n_completion += ev.n_predicted
        choice = {"index": ev.index, "logprobs": None, "finish_reason": ev.finish_reason}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        out.append(self._envelope([choice], obj))
        return out

    def usage_chunk(self) -> dict[str, Any] | None:
        if not self.include_usage:
            return None
        env = self._envelope([], self.object + ".chunk" if self.chat else self.object)
        env["usage"] = self._usage(self.n_prompt, self.n_completion)
        return env

    @staticmethod
    def _usage(n_prompt: int, n_completion: int) -> dict[str, int]:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}

    def body(self, c: Completion) -> dict[str, Any]:
        choices = []
        for ch in c.choices:
            entry: dict[str, Any] = {"index": ch.index, "logprobs": self._logprobs(ch.logprobs),
                                     "finish_reason": ch.finish_reason}
            if self.chat:
                entry["message"] = {"role": "assistant", "content": ch.text}
            else:
                entry["text"] = ch.text
            choices.append(entry)
        env = self._envelope(choices, self.object)
        env["usage"] = self._usage(c.n_prompt, c.n_predicted)
        env["timings"] = _timings(c.n_prompt, c.n_cached, c.n_predicted, c.prompt_ms, c.predicted_ms)
        return env
