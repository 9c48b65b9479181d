"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` answers: ``OpenAIShaper``.

Its bodies and chunks carry the parts llama-server's do beyond OpenAI's: ``timings``,
``system_fingerprint``, ``usage.prompt_tokens_details.cached_tokens`` and the token ids of
log probabilities. It only formats: no I/O, no waiting (chat answers parsed for tool calls and
reasoning are ``chat_api.ChatShaper``'s, built on it).
"""

from __future__ import annotations

import time
import uuid
from importlib import metadata
from typing import Any

from llamactor.protocol.events import Done, Progress, Token
from llamactor.protocol.wire import Timings
from llamactor.runtime.http.shaper import Shaper
from llamactor.runtime.http.timings import (
    completion_timings,
    done_timings,
    progress_json,
    progress_timings,
    token_timings,
)
from llamactor.runtime.service.results import Completion

# llama-server sends its build ("b1-0c1e570"); ours names the server and its version.
SYSTEM_FINGERPRINT = f"llamactor-{metadata.version('llamactor')}"


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
        env["timings"] = completion_timings(c)
        return env
