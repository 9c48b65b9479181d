"""A chat's messages, tools and tool choice, typed: OpenAI's chat completions shapes.

These Structs are the one statement of a chat's shape. An HTTP body is decoded straight into
them (``protocol.wire.ChatCompletionRequest``; the Responses and Anthropic bodies are converted
into that request), and a request built in Python gets them from ``request.validated``, which
decodes OpenAI-shaped dicts into them. The chat path (``runtime.service.chatprepare``) then
checks only what a type cannot say: a tool message answers an earlier call, a call's arguments
are a JSON object, a tool's name and schema are usable, a content part is one the server takes.

A content part stays loose (``list[Any]``): which parts are taken depends on the server (a
multimodal projector or not), so they are checked, naming the part, where they are rendered.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ToolCallFunction(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; some clients an object


class ToolCallItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One of an assistant's earlier tool calls."""

    function: ToolCallFunction
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[Any] | None = None  # text, or content parts (text, image_url, input_audio)
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant's earlier tool calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning


class ToolFunction(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; checked in runtime.service.toolcalls
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True, omit_defaults=True):
    function: ToolFunction
    type: str = "function"


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, omit_defaults=True):
    function: ToolChoiceFunction
    type: str = "function"


__all__ = [
    "ChatMessage",
    "NamedToolChoice",
    "Tool",
    "ToolCallFunction",
    "ToolCallItem",
    "ToolChoiceFunction",
    "ToolFunction",
]
