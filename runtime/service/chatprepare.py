"""``prepare_chat``: a chat request made into a ``ChatTurn``: messages checked, prompt rendered,
call grammar chosen.

``prepare_chat`` is the one path from OpenAI-shaped messages and options to a ``ChatTurn``,
used by ``RuntimeCore.chat`` and by every chat-shaped HTTP endpoint (chat completions,
Responses, Anthropic Messages, /apply-template, the token counters), so they render and parse
alike. It is called once per request, on the event loop: it renders a
Jinja template and builds a grammar string, both cheap next to a decode step. The messages as
the template sees them are ``chatmessages``'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from llamactor.protocol.chat import ChatMessage, NamedToolChoice, Tool
from llamactor.protocol.errors import RequestError
from llamactor.runtime.service.chat import ChatTemplate
from llamactor.runtime.service.chatmessages import template_messages
from llamactor.runtime.service.chatparse import REASONING_FORMATS, THINK_CLOSE, THINK_OPEN
from llamactor.runtime.service.chatturn import ChatTurn
from llamactor.runtime.service.mediafetch import ImageURL
from llamactor.runtime.service.toolcalls import (
    SYNTAX,
    call_grammar,
    detect_format,
    generic_tool_prompt,
    parse_tool_choice,
    parse_tools,
    trigger_words,
)

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# Variables the server sets itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})
# Whitespace a model may write right after </think> before a forced call (trigger words).
_AFTER_THINK = ("", "\n", "\n\n", " ")


def prepare_chat(
    template: ChatTemplate,
    messages: Sequence[ChatMessage],
    *,
    tools: Sequence[Tool] | None = None,
    tool_choice: str | NamedToolChoice | None = None,
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
    """Check what the types of the messages and tools cannot say (they were decoded typed,
    ``protocol.chat``), render the prompt, choose the grammar. Raises RequestError naming the field.

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
    messages: Sequence[ChatMessage],
    continue_final_message: bool | None,
    prefill_assistant: bool,
    add_generation_prompt: bool,
) -> str | None:
    """The text of the final assistant message to continue, None when the chat is answered. As
    llama-server: a chat that ends with the assistant's message continues it (its prefill) unless
    the request says ``continue_final_message: false`` or the server ``--no-prefill-assistant``
    (one ending with the assistant's tool calls is answered: llama-server refuses it); asking for
    both a generation prompt and a continuation is an error."""
    last = messages[-1] if messages else None
    role = last.role if last is not None else None
    calls = last.tool_calls if last is not None else None
    prefill = role == "assistant" and not calls  # a call is answered, not continued
    if continue_final_message is None and prefill_assistant and prefill:
        if len(messages) >= 2 and messages[-2].role == "assistant":
            raise RequestError("messages: cannot have 2 or more assistant messages at the end of the list")
        continue_final_message, add_generation_prompt = True, False
    if not continue_final_message:
        return None
    if add_generation_prompt:
        raise RequestError("cannot set both add_generation_prompt and continue_final_message to true")
    if last is None or role != "assistant":
        raise RequestError("continue_final_message: the last message must be the assistant's")
    if calls:
        raise RequestError("continue_final_message: cannot continue an assistant message that contains tool calls")
    content = last.content
    if content is None or isinstance(content, str):
        return content or ""
    if all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
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


def _with_system(rows: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if rows and rows[0]["role"] == "system":
        first = dict(rows[0])
        first["content"] = (first["content"] + "\n\n" if first["content"] else "") + text
        return [first, *rows[1:]]
    return [{"role": "system", "content": text}, *rows]


__all__ = ["prepare_chat", "template_vars"]
