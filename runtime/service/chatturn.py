"""One chat request made ready to run, ``ChatTurn``, and what its run returns parsed, ``ChatResult``.

``chatprepare.prepare_chat`` makes the turn: the prompt rendered, with the media files of its
image and audio parts. The turn carries the sampling additions (a call grammar, lazy or not, and
its trigger words) and makes the ``MessageParser`` of each choice, with which
``parse_completion`` reads a finished run's choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from llamactor.protocol.errors import RequestError
from llamactor.protocol.sampling import SamplingParams
from llamactor.runtime.service.chatparse import MessageParser, ParsedMessage, ToolCall
from llamactor.runtime.service.mediafetch import ImageURL
from llamactor.runtime.service.results import Completion
from llamactor.runtime.service.toolcalls import CallSyntax, ToolChoice, ToolFormat, ToolSpec


@dataclass(frozen=True)
class ChatTurn:
    """A rendered chat request. ``syntax`` is None when no call is to be parsed."""

    prompt: str
    tools: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = ToolChoice("none")
    syntax: CallSyntax | None = None
    grammar: str = ""
    grammar_lazy: bool = False
    grammar_triggers: tuple[str, ...] = ()
    reasoning_format: str = "none"
    thinking_open: bool = False  # the prompt ends inside <think>: the answer starts as reasoning
    # the files of its image and audio parts, one media marker each in ``prompt``; a file named
    # by an http(s):// or file:// URL is fetched at admission (``mediafetch``)
    media: tuple[bytes | ImageURL, ...] = ()
    media_where: tuple[str, ...] = ()  # the part each came from (messages[i].content[k].input_audio)

    def parser(self) -> MessageParser:
        return MessageParser(self.syntax, reasoning_format=self.reasoning_format, thinking_open=self.thinking_open)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the call grammar added; a request grammar cannot be combined with it."""
        if not self.grammar:
            return params
        if params.grammar:
            raise RequestError(
                "grammar / response_format / json_schema cannot be combined with tools unless tool_choice is 'none'"
            )
        return msgspec.structs.replace(
            params, grammar=self.grammar, grammar_lazy=self.grammar_lazy, grammar_triggers=self.grammar_triggers
        )


@dataclass(frozen=True)
class ChatChoice:
    index: int
    message: ParsedMessage
    finish_reason: str  # "stop", "length" or "tool_calls"


@dataclass(frozen=True)
class ChatResult:
    """What ``RuntimeCore.chat`` returns: the parsed message of each choice, and the raw run."""

    choices: tuple[ChatChoice, ...]
    completion: Completion

    @property
    def message(self) -> ParsedMessage:
        return self.choices[0].message

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason


def finish_reason(message: ParsedMessage, finish: str) -> str:
    """OpenAI's finish_reason: "tool_calls" when a finished answer called tools (llama-server)."""
    return "tool_calls" if message.tool_calls and finish == "stop" else finish


def parse_completion(turn: ChatTurn, completion: Completion) -> ChatResult:
    choices = []
    for ch in completion.choices:
        parser = turn.parser()
        parser.feed(ch.text)
        parser.finish()
        choices.append(ChatChoice(ch.index, parser.message, finish_reason(parser.message, ch.finish_reason)))
    return ChatResult(tuple(choices), completion)


__all__ = [
    "ChatChoice",
    "ChatResult",
    "ChatTurn",
    "ParsedMessage",
    "ToolCall",
    "ToolFormat",
    "finish_reason",
    "parse_completion",
]
