"""What a chat template can render, as llama-server reports it in ``GET /props``.

llama.cpp's Jinja engine runs the template on probe chats and watches which values it reads
(``common/jinja/caps.cpp``). jinja2 has no such watch, so each probe here carries a marker that
the template either writes into the prompt or not: a system message's text, a tool's name, a
second tool call's name, a reasoning text, a text part inside typed content. A template that
reads a value without writing it (rare) counts as not supporting it. ``reasoning_effort`` is
supported when the template names that variable.

A built-in llama.cpp template (``--chat-template NAME`` without Jinja) has no tools, typed
content or reasoning: it gets string content and a system role only.
"""

from __future__ import annotations

import json
from typing import Any

import jinja2.meta

from llamactor.protocol.errors import RequestError
from llamactor.runtime.service.chat import ChatTemplate

_MARK = "LlamactorProbe"  # a word no template writes of its own
_TOOL = {
    "type": "function",
    "function": {
        "name": f"{_MARK}Tool",
        "description": "Tool description",
        "parameters": {
            "type": "object",
            "properties": {"arg": {"type": "string", "description": "Arg description"}},
            "required": ["arg"],
        },
    },
}


def _call(n: int, arguments: Any) -> dict[str, Any]:
    return {"id": f"call0000{n}", "type": "function", "function": {"name": f"{_MARK}Call{n}", "arguments": arguments}}


def _tool_chat(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "User message"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        {"role": "user", "content": "User message"},
    ]


def _render(template: ChatTemplate, messages: list[dict[str, Any]], **extra: Any) -> str | None:
    """The probe's prompt, or None when the template refuses it (raise_exception, an error)."""
    try:
        return template.render(messages, add_generation_prompt=True, **extra)
    except (RequestError, jinja2.TemplateError, TypeError, KeyError, ValueError, AttributeError, IndexError):
        return None


def template_caps(template: ChatTemplate) -> dict[str, bool]:
    """llama-server's ``chat_template_caps`` of ``template``, by rendering probe chats."""
    if template.builtin:
        return {
            "supports_object_arguments": False,
            "supports_parallel_tool_calls": False,
            "supports_preserve_reasoning": False,
            "supports_reasoning_effort": False,
            "supports_string_content": True,
            "supports_system_role": True,
            "supports_tool_calls": False,
            "supports_tools": False,
            "supports_typed_content": False,
        }
    text = _render(template, [{"role": "user", "content": f"{_MARK}Text"}])
    typed = _render(template, [{"role": "user", "content": [{"type": "text", "text": f"{_MARK}Part"}]}])
    system = _render(template, [{"role": "system", "content": f"{_MARK}System"}, {"role": "user", "content": "Hi"}])
    objects = _render(template, _tool_chat([_call(1, {"arg": f"{_MARK}Arg"})]), tools=[_TOOL])
    strings = _render(template, _tool_chat([_call(1, json.dumps({"arg": f"{_MARK}Arg"}))]), tools=[_TOOL])
    tool_chat = objects if objects is not None and f"{_MARK}Call1" in objects else strings
    # read as an object: the argument written, and not as Python's repr of a dict ('...')
    object_args = objects is not None and f"{_MARK}Arg" in objects and f"'{_MARK}Arg'" not in objects
    args: Any = {"arg": "value"} if object_args else json.dumps({"arg": "value"})
    parallel = _render(template, _tool_chat([_call(1, args), _call(2, args)]), tools=[_TOOL])
    reasoning = _render(
        template,
        [
            {"role": "user", "content": "User message"},
            {"role": "assistant", "content": "Assistant message", "reasoning_content": f"{_MARK}Thought"},
            {"role": "user", "content": "User message"},
            {"role": "assistant", "content": "Assistant message", "reasoning_content": "Reasoning content"},
            {"role": "user", "content": "User message"},
        ],
        enable_thinking=True,
        preserve_thinking=True,
        clear_thinking=False,
        truncate_history_thinking=False,
        drop_thinking=False,
    )
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    names = jinja2.meta.find_undeclared_variables(env.parse(template.source))  # it compiled at startup
    return {
        "supports_object_arguments": object_args,
        "supports_parallel_tool_calls": parallel is not None and f"{_MARK}Call2" in parallel,
        "supports_preserve_reasoning": reasoning is not None and f"{_MARK}Thought" in reasoning,
        "supports_reasoning_effort": "reasoning_effort" in names,
        "supports_string_content": text is not None and f"{_MARK}Text" in text,
        "supports_system_role": system is not None and f"{_MARK}System" in system,
        "supports_tool_calls": tool_chat is not None and f"{_MARK}Call1" in tool_chat,
        "supports_tools": tool_chat is not None and f"{_MARK}Tool" in tool_chat,
        # the part's text written, not Python's repr of the list of parts
        "supports_typed_content": typed is not None and f"{_MARK}Part" in typed and f"'{_MARK}Part'" not in typed,
    }
