"""One chat request made ready to run: messages checked, prompt rendered, call grammar chosen.

``prepare_chat`` is the one path from OpenAI-shaped messages and options to a ``ChatTurn``,
used by ``RuntimeCore.chat`` and by every chat-shaped HTTP endpoint (chat completions,
Responses, Anthropic Messages, /apply-template, the token counters), so they render and parse
alike. It is called once per request, on the event loop: it renders a
Jinja template and builds a grammar string, both cheap next to a decode step.

The turn carries the sampling additions (a call grammar, lazy or not, and its trigger words)
and makes the ``MessageParser`` of each choice.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from llamactor.protocol.errors import RequestError
from llamactor.protocol.sampling import SamplingParams
from llamactor.runtime.service.chat import ChatTemplate
from llamactor.runtime.service.chatparse import (
    REASONING_FORMATS,
    THINK_CLOSE,
    THINK_OPEN,
    MessageParser,
    ParsedMessage,
    ToolCall,
)
from llamactor.runtime.service.mediafetch import ImageURL, named_by_url
from llamactor.runtime.service.results import Completion
from llamactor.runtime.service.toolcalls import (
    SYNTAX,
    CallSyntax,
    ToolChoice,
    ToolFormat,
    ToolSpec,
    call_grammar,
    detect_format,
    generic_tool_prompt,
    parse_tool_choice,
    parse_tools,
    render_call,
    render_tool_result,
    trigger_words,
)

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# Variables the server sets itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})
ROLES_AS_SYSTEM = frozenset({"developer"})  # llama.cpp maps OpenAI's developer role to system
# Whitespace a model may write right after </think> before a forced call (trigger words).
_AFTER_THINK = ("", "\n", "\n\n", " ")


MEDIA_PARTS = {"image_url": "image", "input_audio": "audio"}  # content part type -> medium
AUDIO_FILES = "wav, mp3 or flac"


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


def prepare_chat(
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Any] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
    reasoning_format: str = "auto",
    reasoning_effort: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool | None = None,
    prefill_assistant: bool = True,
    media_marker: str | None = None,
    media_kinds: Sequence[str] = ("image", "audio"),
) -> ChatTurn:
    """Check everything, render the prompt, choose the grammar. Raises RequestError naming the field.

    ``media_marker``: with a multimodal projector (--mmproj), each ``image_url`` and
    ``input_audio`` part becomes this marker in the prompt and its file one of the turn's
    ``media``; None refuses them. ``media_kinds``: what the projector takes ("image",
    "audio"); a part of another kind is refused, naming it."""
    if reasoning_format not in REASONING_FORMATS:
        raise RequestError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got {reasoning_format!r}")
    continued = _continued(messages, continue_final_message, prefill_assistant, add_generation_prompt)
    if continued is not None:  # rendered up to the assistant's opening, its text after it
        messages, add_generation_prompt = messages[:-1], True
    specs = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, specs)
    parallel = bool(parallel_tool_calls)
    fmt = detect_format(template.source)
    syntax = SYNTAX[fmt]
    extra = template_vars(reasoning_effort, chat_template_kwargs)
    media: list[bytes | ImageURL] = []
    where: list[str] = []
    rows = template_messages(
        messages, syntax, media_marker=media_marker, media=media, media_kinds=media_kinds, media_where=where
    )
    if specs and syntax.native:
        extra["tools"] = [t.to_openai() for t in specs]  # as llama-server, even with tool_choice "none"
    elif specs and choice.mode != "none":
        rows = _with_system(rows, generic_tool_prompt(specs, choice, parallel))
    prompt = template.render(rows, add_generation_prompt=add_generation_prompt, **extra) + (continued or "")
    thinking_open = reasoning_format != "none" and prompt.rstrip().endswith(THINK_OPEN)
    if reasoning_format == "auto" and not thinking_open and not _knows_thinking(template.source):
        # As llama-server, which takes the reasoning markers from the template: a template that
        # never writes <think> leaves the answer whole. Waiting to see whether a first "<" opens a
        # block would also hold the first token back one decode step (gemma3 starts most
        # answers with "<").
        reasoning_format = "none"
    turn = ChatTurn(
        prompt,
        specs,
        choice,
        reasoning_format=reasoning_format,
        thinking_open=thinking_open,
        media=tuple(media),
        media_where=tuple(where),
    )
    if not specs or choice.mode == "none":
        return turn
    grammar = call_grammar(syntax, specs, choice, parallel)
    triggers: tuple[str, ...] = ()
    lazy = not choice.forced
    if lazy:
        triggers = trigger_words(syntax)
    elif thinking_open:
        # A forced call still lets the model think first: the grammar engages at </think>.
        lazy = True
        triggers = tuple(THINK_CLOSE + ws for ws in _AFTER_THINK)
        grammar = grammar.replace("root ::=", "calls ::=", 1) + f'\nroot ::= "{THINK_CLOSE}" [ \\n]{{0,3}} calls'
    return replace(turn, syntax=syntax, grammar=grammar, grammar_lazy=lazy, grammar_triggers=triggers)


def _knows_thinking(source: str) -> bool:
    """Whether a template writes or strips think blocks (DeepSeek R1's and Qwen3's drop the
    thoughts of earlier answers with ``split('</think>')``)."""
    return THINK_OPEN in source or THINK_CLOSE in source


def _continued(
    messages: Sequence[Mapping[str, Any]],
    continue_final_message: bool | None,
    prefill_assistant: bool,
    add_generation_prompt: bool,
) -> str | None:
    """The text of the final assistant message to continue, None when the chat is answered. As
    llama-server: a chat that ends with the assistant's message continues it (its prefill) unless
    the request says ``continue_final_message: false`` or the server ``--no-prefill-assistant``
    (one ending with the assistant's tool calls is answered: llama-server refuses it); asking for
    both a generation prompt and a continuation is an error."""
    last = messages[-1] if messages and isinstance(messages[-1], Mapping) else {}
    prefill = last.get("role") == "assistant" and not last.get("tool_calls")  # a call is answered, not continued
    if continue_final_message is None and prefill_assistant and prefill:
        before = messages[-2] if len(messages) >= 2 and isinstance(messages[-2], Mapping) else {}
        if before.get("role") == "assistant":
            raise RequestError("messages: cannot have 2 or more assistant messages at the end of the list")
        continue_final_message, add_generation_prompt = True, False
    if not continue_final_message:
        return None
    if add_generation_prompt:
        raise RequestError("cannot set both add_generation_prompt and continue_final_message to true")
    if last.get("role") != "assistant":
        raise RequestError("continue_final_message: the last message must be the assistant's")
    if last.get("tool_calls"):
        raise RequestError("continue_final_message: cannot continue an assistant message that contains tool calls")
    content = last.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "\n\n".join(str(p.get("text", "")) for p in content)  # as llama.cpp renders text parts
    raise RequestError("continue_final_message: the assistant message to continue must be text")


def template_vars(reasoning_effort: str | None, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The extra template variables: ``chat_template_kwargs``, ``enable_thinking`` (default on,
    as in llama-server) and ``reasoning_effort`` ("none" turns thinking off)."""
    out: dict[str, Any] = {"enable_thinking": True}
    if kwargs is not None:
        if not isinstance(kwargs, Mapping):
            raise RequestError("chat_template_kwargs must be an object")
        for key, value in kwargs.items():
            if not isinstance(key, str) or not key.isidentifier():
                raise RequestError(f"chat_template_kwargs: {key!r} is not a template variable name")
            if key in RESERVED_TEMPLATE_VARS:
                raise RequestError(f"chat_template_kwargs.{key}: set by the server, cannot be passed")
            out[key] = value
        if not isinstance(out["enable_thinking"], bool):
            raise RequestError("chat_template_kwargs.enable_thinking must be a boolean")
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise RequestError(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {reasoning_effort!r}"
            )
        if reasoning_effort == "none":
            out["enable_thinking"] = False
            out.pop("reasoning_effort", None)
        else:
            out["reasoning_effort"] = reasoning_effort
    return out


# ---- messages ------------------------------------------------------------------------------


def template_messages(
    messages: Sequence[Mapping[str, Any]],
    syntax: CallSyntax,
    *,
    media_marker: str | None = None,
    media: list[bytes | ImageURL] | None = None,
    media_kinds: Sequence[str] = ("image", "audio"),
    media_where: list[str] | None = None,
) -> list[dict[str, Any]]:
    """OpenAI-shaped messages as the template sees them.

    Checked here: content is text (or, with ``media_marker``, text, ``image_url`` and
    ``input_audio`` parts of the ``media_kinds`` the projector takes: each becomes the marker
    and its file is appended to ``media``, the part's field to ``media_where``), an assistant's
    ``tool_calls`` are well-formed with JSON-object
    arguments, and every ``role: "tool"`` message answers an earlier call by ``tool_call_id``.
    Templates of a tool family get ``tool_calls`` (arguments as objects, as llama.cpp passes
    them) and ``tool`` messages; other templates get the calls written into the assistant's
    text and the results as user messages, so any template can render a tool conversation.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise RequestError("messages must be an array")
    if not messages:
        raise RequestError("messages must not be empty")
    rows: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise RequestError(f"{where} must be an object")
        role = m.get("role")
        if not isinstance(role, str):
            raise RequestError(f"{where}.role must be a string")
        role = "system" if role in ROLES_AS_SYSTEM else role
        row: dict[str, Any] = {
            "role": role,
            "content": _text(m.get("content"), f"{where}.content", media_marker, media, media_kinds, media_where),
        }
        if isinstance(m.get("name"), str):
            row["name"] = m["name"]
        if isinstance(m.get("reasoning_content"), str):
            row["reasoning_content"] = m["reasoning_content"]
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant":
                raise RequestError(f"{where}.tool_calls: only assistant messages carry tool calls")
            parsed = _calls(calls, f"{where}.tool_calls")
            for call_id, name, _ in parsed:
                if call_id:
                    call_names[call_id] = name
            if syntax.native:
                row["tool_calls"] = [
                    {"id": cid, "type": "function", "function": {"name": name, "arguments": json.loads(args)}}
                    for cid, name, args in parsed
                ]
            else:
                written = "\n".join(render_call(syntax, name, args) for _, name, args in parsed)
                row["content"] = (row["content"] + "\n" if row["content"] else "") + written
        if role == "tool":
            answered = m.get("tool_call_id")
            if not isinstance(answered, str) or not answered:
                raise RequestError(f"{where}.tool_call_id is required for a tool message")
            if answered not in call_names:
                raise RequestError(f"{where}.tool_call_id: no earlier assistant tool call has id {answered!r}")
            if syntax.native:
                row["tool_call_id"] = answered
                row.setdefault("name", call_names[answered])
            else:
                result = render_tool_result(row["content"])
                if rows and rows[-1].get("_results"):  # consecutive results: one user turn
                    rows[-1]["content"] += "\n" + result
                    continue
                row = {"role": "user", "content": result, "_results": True}
        rows.append(row)
    for row in rows:
        row.pop("_results", None)
    return rows


def _text(
    content: Any,
    where: str,
    media_marker: str | None = None,
    media: list[bytes | ImageURL] | None = None,
    media_kinds: Sequence[str] = ("image", "audio"),
    media_where: list[str] | None = None,
) -> str:
    """A message's content as text. Text parts are joined; with an ``image_url`` or
    ``input_audio`` part, as llama-server joins them: text parts on lines of their own, the
    media marker glued to what is next to it."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[tuple[bool, str]] = []  # (is a media marker, text)
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append((False, part["text"]))
            elif kind in MEDIA_PARTS:
                medium = MEDIA_PARTS[kind]
                if media_marker is None or media is None:
                    raise RequestError(
                        f"{where}[{k}]: {medium} input is not supported by this server: it was started "
                        "without --mmproj (a multimodal projector)"
                    )
                if medium not in media_kinds:
                    has = "vision" if medium == "image" else "audio"
                    takes = " and ".join("images" if m == "image" else m for m in media_kinds)
                    raise RequestError(
                        f"{where}[{k}]: {medium} input is not supported: the multimodal projector (--mmproj) has "
                        f"no {has} encoder, it takes {takes} only"
                    )
                if kind == "image_url":
                    media.append(image_bytes(part.get("image_url"), f"{where}[{k}].image_url"))
                else:
                    media.append(audio_bytes(part.get("input_audio"), f"{where}[{k}].input_audio"))
                if media_where is not None:
                    media_where.append(f"{where}[{k}].{kind}")
                parts.append((True, media_marker))
            else:
                allowed = (
                    "text, image_url and input_audio parts are" if media_marker is not None else "only text parts are"
                )
                raise RequestError(f"{where}[{k}]: {kind!r} parts are not supported ({allowed})")
        if not any(is_media for is_media, _ in parts):
            return "".join(text for _, text in parts)
        out, after_media = "", False
        for is_media, text in parts:
            if not is_media and out and not after_media:
                out += "\n"
            out += text
            after_media = is_media
        return out
    raise RequestError(f"{where} must be a string, an array of content parts or null")


def image_bytes(image_url: Any, where: str) -> bytes | ImageURL:
    """The file of an ``image_url`` part: a ``data:image/...;base64,`` URL or bare base64;
    an http(s):// or file:// URL is left to fetch at admission (other schemes are refused)."""
    url = image_url.get("url") if isinstance(image_url, Mapping) else image_url
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where}.url is required (a data:image/...;base64, http(s):// or file:// URL)")
    data = url
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
            raise RequestError(f"{where}.url: expected a data:image/<type>;base64, URL, got {head[:40]!r}")
    elif named_by_url(url):
        return ImageURL(url, where)
    elif url.split(":", 1)[0].lower() in ("ftp", "ftps", "sftp"):
        raise RequestError(f"{where}.url: only data:, http(s):// and file:// URLs are read, not {url[:40]!r}")
    return _base64_file(data, f"{where}.url", "image")


def audio_bytes(input_audio: Any, where: str) -> bytes | ImageURL:
    """The file of an ``input_audio`` part: its ``data`` (or ``url``, as llama-server reads
    it), base64 or a ``data:audio/...;base64,`` URL; an http(s):// or file:// URL is left to
    fetch at admission. ``format`` ("wav", "mp3") is not checked: the file's bytes say what it
    is (llama-server does not read it either)."""
    if not isinstance(input_audio, Mapping):
        raise RequestError(f'{where} must be an object: {{"data": <base64 audio>, "format": "wav"|"mp3"}}')
    data = input_audio.get("data", input_audio.get("url"))
    if not isinstance(data, str) or not data:
        raise RequestError(f"{where}.data is required: the audio file ({AUDIO_FILES}) in base64")
    if data.startswith("data:"):
        head, sep, data = data.partition(",")
        if not sep or not head.startswith("data:audio/") or not head.endswith(";base64"):
            raise RequestError(f"{where}.data: expected base64 or a data:audio/<type>;base64, URL, got {head[:40]!r}")
    elif named_by_url(data):
        return ImageURL(data, where)
    return _base64_file(data, f"{where}.data", "audio")


def _base64_file(data: str, where: str, kind: str) -> bytes:
    """A media file given in base64 (whitespace allowed); RequestError naming ``where`` if it is
    not base64 or is empty."""
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: not valid base64") from None
    if not raw:
        raise RequestError(f"{where}: the {kind} is empty")
    return raw


def _calls(raw: Any, where: str) -> list[tuple[str, str, str]]:
    """(id, name, arguments as JSON text) of each call of an assistant message."""
    if not isinstance(raw, list):
        raise RequestError(f"{where} must be an array")
    out = []
    for j, call in enumerate(raw):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{at}.function.name is required")
        if call.get("type", "function") not in ("function", None):
            raise RequestError(f"{at}.type: only 'function' calls are supported")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise RequestError(f"{at}.function.arguments is not valid JSON") from None
        if not isinstance(args, dict):
            raise RequestError(f"{at}.function.arguments must be a JSON object")
        call_id = call.get("id") or ""
        if not isinstance(call_id, str):
            raise RequestError(f"{at}.id must be a string")
        out.append((call_id, fn["name"], json.dumps(args, ensure_ascii=False)))
    return out


def _with_system(rows: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if rows and rows[0]["role"] == "system":
        first = dict(rows[0])
        first["content"] = (first["content"] + "\n\n" if first["content"] else "") + text
        return [first, *rows[1:]]
    return [{"role": "system", "content": text}, *rows]


__all__ = [
    "ChatChoice",
    "ChatResult",
    "ChatTurn",
    "ParsedMessage",
    "ToolCall",
    "ToolFormat",
    "finish_reason",
    "parse_completion",
    "prepare_chat",
    "template_messages",
    "template_vars",
]
