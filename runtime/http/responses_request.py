"""OpenAI Responses API requests (``POST /v1/responses`` and ``/v1/responses/input_tokens``)
as the chat completions request each stands for: ``to_chat``.

A Responses request is converted into a chat completions request as llama-server's
``server_chat_convert_responses_to_chatcmpl`` does: ``instructions`` become a system message,
``input`` (a string, or message / function_call / function_call_output / reasoning items)
becomes the messages (``input_image`` parts become ``image_url`` parts), function ``tools``
stay (other tool types are skipped, as there),
``max_output_tokens`` is ``max_tokens`` and ``reasoning.effort`` is ``reasoning_effort``;
``previous_response_id`` is refused (nothing is stored). Beyond llama-server,
``text.format`` (json_schema / json_object) becomes ``response_format`` and a named
``tool_choice`` forces that function. The answer is ``responses_shaper``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from llamactor.protocol.errors import RequestError
from llamactor.protocol.wire import ChatCompletionRequest

ROLES_IN = ("user", "system", "developer")
# Responses fields with no chat meaning (dropped rather than passed on as chat fields).
DROPPED = frozenset(
    {
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "reasoning",
        "text",
        "previous_response_id",
        "store",
        "include",
        "truncation",
        "metadata",
        "background",
        "prompt",
        "prompt_cache_key",
        "safety_identifier",
        "service_tier",
        "conversation",
        "max_tool_calls",
        "stream_options",
    }
)


def to_chat(body: Any) -> ChatCompletionRequest:
    """The chat completions request a Responses body stands for. Raises RequestError naming the field."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    if "input" not in body:
        raise RequestError("input is required")
    if body.get("previous_response_id"):
        raise RequestError(
            "previous_response_id is not supported: this server stores no responses; "
            "send the whole conversation in input"
        )
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in DROPPED}
    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise RequestError("instructions must be a string")
        messages.append({"role": "system", "content": body["instructions"]})
    raw = body["input"]
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list):
        for i, item in enumerate(raw):
            _item(item, f"input[{i}]", messages)
    else:
        raise RequestError("input must be a string or an array of items")
    chat["messages"] = messages
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    fmt = body.get("text", {}).get("format") if isinstance(body.get("text"), Mapping) else None
    if isinstance(fmt, Mapping) and fmt.get("type") in ("json_schema", "json_object"):
        chat["response_format"] = (
            {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
            if fmt["type"] == "json_schema"
            else {"type": "json_object"}
        )
    return msgspec.convert(chat, ChatCompletionRequest)


def _text_parts(content: Any, where: str, allowed: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or an array of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in allowed or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}]: only {' and '.join(allowed)} parts are supported, got {kind!r}")
        parts.append(part["text"])
    return "".join(parts)


def _input_content(
    content: Any, where: str, allowed: tuple[str, ...] = ("input_text", "text")
) -> str | list[dict[str, Any]]:
    """A user, system or developer message's content (or a function call's output): its text,
    or, with ``input_image`` parts, chat content parts: text parts and ``image_url`` parts, as
    llama-server converts them (the image's ``detail`` is not used)."""
    if not isinstance(content, list):
        return _text_parts(content, where, allowed)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": _input_image_url(part, f"{where}[{j}]")}})
        elif kind in allowed and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise RequestError(
                f"{where}[{j}]: only {', '.join(allowed)} and input_image parts are supported, got {kind!r}"
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _input_image_url(part: Mapping[str, Any], where: str) -> str:
    url = part.get("image_url")
    if isinstance(url, Mapping):  # the chat shape, {"url": ...}, taken too
        url = url.get("url")
    if isinstance(url, str) and url:
        return url
    if part.get("file_id") is not None:
        raise RequestError(
            f"{where}.file_id: this server stores no files; send image_url (a data:, http(s):// or file:// URL)"
        )
    raise RequestError(f"{where}.image_url is required (a data:, http(s):// or file:// URL)")


def _item(item: Any, where: str, messages: list[dict[str, Any]]) -> None:
    """Append one input item to ``messages`` (assistant pieces merge into one message)."""
    if not isinstance(item, Mapping):
        raise RequestError(f"{where} must be an object")
    kind, role = item.get("type"), item.get("role")
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if role in ROLES_IN and kind in (None, "message"):
        messages.append({"role": role, "content": _input_content(item.get("content"), f"{where}.content")})
    elif role == "assistant" and kind in (None, "message"):
        text = _text_parts(item.get("content"), f"{where}.content", ("output_text", "input_text", "text"))
        if last is not None and not last.get("tool_calls"):
            last["content"] += text
        else:
            messages.append({"role": "assistant", "content": text})
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise RequestError(f"{where}.{key} must be a string")
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        if last is not None:
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise RequestError(f"{where}.call_id must be a string")
        output = _input_content(item.get("output"), f"{where}.output", ("input_text", "output_text", "text"))
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    elif kind == "reasoning":
        text = _reasoning_text(item.get("content"), f"{where}.content")
        if last is not None:
            last["reasoning_content"] = text
        else:
            messages.append({"role": "assistant", "content": "", "reasoning_content": text})
    else:
        raise RequestError(
            f"{where}: cannot tell what this item is (type {kind!r}, role {role!r}); "
            f"messages, function_call, function_call_output and reasoning items are supported"
        )


def _reasoning_text(content: Any, where: str) -> str:
    """A reasoning item's text: its parts' ``text`` (reasoning_text parts, as this server sends
    them; parts without text, such as encrypted ones, add nothing)."""
    if content is None:
        return ""
    if not isinstance(content, list):
        raise RequestError(f"{where} must be an array of content parts")
    parts = []
    for j, part in enumerate(content):
        text = part.get("text", "") if isinstance(part, Mapping) else None
        if not isinstance(text, str):
            raise RequestError(f"{where}[{j}] must be an object whose text is a string")
        parts.append(text)
    return "".join(parts)


def _tools(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise RequestError("tools must be an array of objects")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, Mapping):
            raise RequestError(f"tools[{i}] must be an object")
        if tool.get("type") != "function":
            continue  # built-in tools (web_search, ...) have no chat equivalent: skipped, as llama-server does
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any) -> Any:
    if isinstance(raw, Mapping) and raw.get("type") == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    return raw
