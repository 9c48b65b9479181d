"""Split a chat answer into reasoning, content and tool calls as it streams.

One ``MessageParser`` per choice is fed the generated text piece by piece (``feed``) and once
more at the end (``finish``); each call returns what became certain: new reasoning text, new
content text and the tool calls that completed. Text that might still turn out to be the start
of ``<think>``, ``</think>`` or a call's opener is held back until it is decided, so the
pieces never need retracting and the parse does not depend on how the text was cut: a
non-streaming answer is the same parser fed everything at once (tests check both agree).

Reasoning: a ``<think>...</think>`` block at the start of the answer goes to
``reasoning_content`` (``reasoning_format`` deepseek/auto); with a template that opens the
block itself (its generation prompt ends with ``<think>``) the answer starts inside it.
``none`` leaves everything in the content; ``deepseek-legacy`` fills ``reasoning_content`` and
keeps the tags and the thoughts in the content too (llama-server's meanings).

Tool calls: after the family's opener (``runtime.service.toolcalls.CallSyntax``) the text is
held until the call is complete (closer seen, or its JSON value balanced), then parsed. A call
that does not parse stays in the content as text, and so does an unfinished one at the end.
"""

from __future__ import annotations

import enum
import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llamactor.runtime.service.toolcalls import MISTRAL_ID_CHARS, CallSyntax, ToolFormat

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_FORMATS = ("none", "deepseek", "deepseek-legacy", "auto")
_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id(length: int = 32) -> str:
    """A random call id (llama-server's gen_tool_call_id: 32 letters and digits)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    @property
    def args(self) -> dict[str, Any]:
        value = json.loads(self.arguments)
        assert isinstance(value, dict)
        return value


@dataclass
class MessageDelta:
    """What one ``feed``/``finish`` made certain; ``calls`` pairs each call with its index."""

    reasoning: str = ""
    content: str = ""
    calls: list[tuple[int, ToolCall]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class ParsedMessage:
    """An assistant message: OpenAI's ``content``, ``reasoning_content`` and ``tool_calls``."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        content = self.content if self.content or not self.tool_calls else None  # OpenAI: null beside calls
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return out


class _State(enum.Enum):
    """Where the parser is in the answer (the answer is read once, front to back)."""

    MAYBE_THINK = "maybe_think"  # at the start: the answer may open with <think>
    THINK = "think"  # inside the reasoning block
    BODY = "body"  # content (and the place calls may start)
    CALL = "call"  # inside a call, waiting for it to be complete


class MessageParser:
    """Parse one choice's answer; see the module docstring. Not thread-safe; one per choice."""

    def __init__(
        self,
        syntax: CallSyntax | None = None,
        *,
        reasoning_format: str = "none",
        thinking_open: bool = False,
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self.syntax = syntax
        self.split = reasoning_format != "none"
        self.legacy = reasoning_format == "deepseek-legacy"
        self.new_id = new_id
        self.message = ParsedMessage()
        self._buf = ""
        self._strip_body = False  # content after a reasoning block or a call starts past whitespace
        self._skip = 0  # length of the opener before a call's JSON (0: the JSON opens the call)
        if not self.split:
            self._state = _State.BODY
        elif thinking_open:
            self._state = _State.THINK
        else:
            self._state = _State.MAYBE_THINK
        self._emit_legacy_open = self.legacy and thinking_open  # the template wrote <think>

    def feed(self, text: str) -> MessageDelta:
        self._buf += text
        delta = MessageDelta()
        self._run(delta, final=False)
        return delta

    def finish(self) -> MessageDelta:
        delta = MessageDelta()
        self._run(delta, final=True)
        if self._buf:  # an unfinished block: what it holds is reasoning, or content
            if self._state == _State.THINK:
                self._reason(delta, self._buf)
            else:
                self._content(delta, self._buf)
            self._buf = ""
        return delta

    # ---- the state machine -------------------------------------------------------------------

    def _run(self, delta: MessageDelta, final: bool) -> None:
        while self._buf:
            before = (self._state, len(self._buf))
            if self._state == _State.MAYBE_THINK:
                self._maybe_think(final)
            elif self._state == _State.THINK:
                self._think(delta, final)
            elif self._state == _State.BODY:
                self._body(delta, final)
            else:
                self._call(delta, final)
            if (self._state, len(self._buf)) == before:
                return  # waiting for more text

    def _maybe_think(self, final: bool) -> None:
        stripped = self._buf.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._buf = stripped[len(THINK_OPEN) :]
            self._state = _State.THINK
            self._emit_legacy_open = self.legacy
        elif final or not THINK_OPEN.startswith(stripped):
            self._state = _State.BODY
        # else: still a prefix of <think>: wait

    def _think(self, delta: MessageDelta, final: bool) -> None:
        end = self._buf.find(THINK_CLOSE)
        if end >= 0:
            self._reason(delta, self._buf[:end], closed=True)
            self._buf = self._buf[end + len(THINK_CLOSE) :]
            self._state = _State.BODY
            self._strip_body = not self.legacy  # legacy keeps the raw text in the content
            return
        keep = 0 if final else _partial_suffix(self._buf, THINK_CLOSE)
        ready = self._buf[: len(self._buf) - keep]
        if ready:
            self._reason(delta, ready)
            self._buf = self._buf[len(ready) :]

    def _body(self, delta: MessageDelta, final: bool) -> None:
        if self._strip_body:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return
            self._strip_body = False
        if self.syntax is None:
            self._content(delta, self._buf)
            self._buf = ""
            return
        openers = [o for o in (self.syntax.opener, self.syntax.bare_opener) if o]
        found = [(at, o) for o in openers if (at := self._buf.find(o)) >= 0]
        if found:
            start, opener = min(found)
            self._content(delta, self._buf[:start])
            self._buf = self._buf[start:]
            json_opens = opener == self.syntax.bare_opener or self.syntax.format is ToolFormat.LLAMA3
            self._skip = 0 if json_opens else len(opener)  # Llama 3's opener and a bare one start the JSON
            self._state = _State.CALL
            return
        keep = 0 if final else max(_partial_suffix(self._buf, o) for o in openers)
        ready = self._buf[: len(self._buf) - keep]
        if ready:
            self._content(delta, ready)
            self._buf = self._buf[len(ready) :]

    def _call(self, delta: MessageDelta, final: bool) -> None:
        syntax = self.syntax
        assert syntax is not None
        end = _call_end(self._buf, syntax, self._skip)
        if end is None:
            if final:
                self._content(delta, self._buf)  # cut off (max_tokens): the raw text stays
                self._buf = ""
            return
        block, self._buf = self._buf[:end], self._buf[end:]
        calls = _parse_block(block, syntax, self._skip, self.new_id)
        if calls is None:
            self._content(delta, block)
        else:
            for call in calls:
                delta.calls.append((len(self.message.tool_calls), call))
                self.message.tool_calls.append(call)
            self._strip_body = True
        self._state = _State.BODY

    # ---- output --------------------------------------------------------------------------

    def _reason(self, delta: MessageDelta, text: str, closed: bool = False) -> None:
        if self.legacy:
            legacy = (THINK_OPEN if self._emit_legacy_open else "") + text + (THINK_CLOSE if closed else "")
            self._emit_legacy_open = False
            if legacy:
                self._content(delta, legacy)
        if text:
            delta.reasoning += text
            self.message.reasoning_content += text

    def _content(self, delta: MessageDelta, text: str) -> None:
        if text:
            delta.content += text
            self.message.content += text


def _partial_suffix(text: str, word: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``word``."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if word.startswith(text[-n:]):
            return n
    return 0


def _call_end(buf: str, syntax: CallSyntax, skip: int) -> int | None:
    """Where the call that ``buf`` opens with ends (past its closer), or None while incomplete."""
    if syntax.closer:
        end = buf.find(syntax.closer, skip)
        return None if end < 0 else end + len(syntax.closer)
    start = skip
    while start < len(buf) and buf[start].isspace():
        start += 1
    if start >= len(buf):
        return None
    if buf[start] not in "{[":
        return max(start, 1)  # not a call after all: the opener is content (``_parse_block`` refuses it)
    return _json_end(buf, start)


def _json_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON object/array starting at ``text[start]``, None if unfinished."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _parse_block(block: str, syntax: CallSyntax, skip: int, new_id: Callable[[], str]) -> list[ToolCall] | None:
    """The calls one complete block holds, or None when it is not a well-formed call."""
    raw = block[skip : len(block) - len(syntax.closer)]
    try:
        value = json.loads(raw, strict=False)  # control characters in strings: lenient, re-encoded below
    except ValueError:
        return None
    items = value if isinstance(value, list) and syntax.format is ToolFormat.MISTRAL else [value]
    calls = []
    for item in items:
        call = _call_of(item, new_id)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _call_of(item: Any, new_id: Callable[[], str]) -> ToolCall | None:
    if not isinstance(item, dict):
        return None
    name = item.get("name")
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args, strict=False)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    given = item.get("id")
    call_id = given if isinstance(given, str) and given else new_id()
    return ToolCall(call_id, name, json.dumps(args, ensure_ascii=False))


def mistral_call_id() -> str:
    return new_call_id(MISTRAL_ID_CHARS)
