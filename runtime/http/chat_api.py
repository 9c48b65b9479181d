"""Chat answers with tool calls and reasoning, in OpenAI's chat shape.

``ChatShaper`` is the chat completions shaper with the answer parsed: each choice's text goes
through its ``MessageParser`` (``runtime.service.chatparse``), so a stream carries
``reasoning_content`` and ``content`` deltas and OpenAI-shaped ``tool_calls`` deltas (a call's
first delta has its index, id, type and name; the next one its arguments), and the final chunk
or body has ``finish_reason: "tool_calls"`` when the answer called tools. The envelope, usage
and timings are ``OpenAIShaper``'s.

``ChoiceParsers`` is the same parsing for the other chat-shaped APIs (``runtime.http.anthropic``,
``runtime.http.responses_shaper``).
"""

from __future__ import annotations

from typing import Any

from llamactor.protocol.events import Done, Token
from llamactor.runtime.http.openai_shaper import OpenAIShaper
from llamactor.runtime.http.timings import token_timings
from llamactor.runtime.service.chatparse import MessageDelta, MessageParser, ParsedMessage
from llamactor.runtime.service.chatturn import ChatTurn, finish_reason, parse_completion
from llamactor.runtime.service.results import Completion


class ChoiceParsers:
    """One ``MessageParser`` per choice index, fed the choice's events."""

    def __init__(self, turn: ChatTurn) -> None:
        self.turn = turn
        self._parsers: dict[int, MessageParser] = {}

    def feed(self, ev: Token | Done) -> MessageDelta:
        parser = self._parsers.get(ev.index)
        if parser is None:
            parser = self._parsers[ev.index] = self.turn.parser()
        return parser.feed(ev.text) if isinstance(ev, Token) else parser.finish()

    def message(self, index: int) -> ParsedMessage:
        parser = self._parsers.get(index)
        return parser.message if parser is not None else ParsedMessage()


class ChatShaper(OpenAIShaper):
    """/v1/chat/completions with the answer parsed into content, reasoning and tool calls."""

    def __init__(self, model: str, *, turn: ChatTurn, want_logprobs: bool, include_usage: bool = False) -> None:
        super().__init__(model, chat=True, want_logprobs=want_logprobs, include_usage=include_usage)
        self.turn = turn
        self.parsers = ChoiceParsers(turn)

    def stream(self, ev: Token | Done) -> list[dict[str, Any]]:
        out = super().stream(ev)
        delta = self.parsers.feed(ev)
        if isinstance(ev, Token):
            # The base shaper ends with the raw text's chunk when there was text (or logprobs):
            # it is replaced by what the parser made certain.
            raw = out.pop() if ev.text or self.want_logprobs else None
            logprobs = raw["choices"][0].get("logprobs") if raw is not None else None
            chunks = self._delta_chunks(ev.index, delta, logprobs)
            timings = token_timings(ev)
            if chunks and timings is not None:  # as llama-server: on the token's last chunk
                chunks[-1]["timings"] = timings
            out.extend(chunks)
            return out
        last = out.pop()
        out.extend(self._delta_chunks(ev.index, delta, None))
        last["choices"][0]["finish_reason"] = finish_reason(self.parsers.message(ev.index), ev.finish_reason)
        out.append(last)
        return out

    def _delta_chunks(self, index: int, delta: MessageDelta, logprobs: Any) -> list[dict[str, Any]]:
        obj = self.object + ".chunk"
        out = []
        text: dict[str, Any] = {}
        if delta.reasoning:
            text["reasoning_content"] = delta.reasoning
        if delta.content:
            text["content"] = delta.content
        if text or logprobs is not None:
            out.append(self._envelope([{**self._choice(index, logprobs, None), "delta": text}], obj))
        for i, call in delta.calls:
            head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            args = {"index": i, "function": {"arguments": call.arguments}}
            for part in (head, args):
                out.append(
                    self._envelope(
                        [{**self._choice(index, None, None), "delta": {"tool_calls": [part]}}],
                        obj,
                    )
                )
        return out

    def body(self, c: Completion) -> dict[str, Any]:
        env = super().body(c)
        parsed = parse_completion(self.turn, c)
        for entry, choice in zip(env["choices"], parsed.choices):
            entry["message"] = choice.message.to_openai()
            entry["finish_reason"] = choice.finish_reason
        return env
