"""Typed chat messages (``protocol.chat``) made into the rows a chat template renders:
``template_messages``.

Content parts become text (image and audio parts a media marker, their files decoded by
``chatmedia``); an assistant's tool calls and the tool results that answer them become what the
template's tool family expects, or plain text for templates without one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from llamactor.protocol.chat import ChatMessage, ToolCallItem
from llamactor.protocol.errors import RequestError
from llamactor.runtime.service.chatmedia import audio_bytes, image_bytes
from llamactor.runtime.service.mediafetch import ImageURL
from llamactor.runtime.service.toolcalls import CallSyntax, render_call, render_tool_result

ROLES_AS_SYSTEM = frozenset({"developer"})  # llama.cpp maps OpenAI's developer role to system
MEDIA_PARTS = {"image_url": "image", "input_audio": "audio"}  # content part type -> medium


def template_messages(
    messages: Sequence[ChatMessage],
    syntax: CallSyntax,
    *,
    media_marker: str | None = None,
    media: list[bytes | ImageURL] | None = None,
    media_kinds: Sequence[str] = ("image", "audio"),
    media_where: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Typed chat messages (their shape was checked where they were decoded) as the template
    sees them.

    Checked here, what a type cannot say: content parts are text (or, with ``media_marker``,
    text, ``image_url`` and ``input_audio`` parts of the ``media_kinds`` the projector takes:
    each becomes the marker and its file is appended to ``media``, the part's field to
    ``media_where``), only an assistant carries ``tool_calls``, each a function call with
    JSON-object arguments, and every ``role: "tool"`` message answers an earlier call by
    ``tool_call_id``. Templates of a tool family get ``tool_calls`` (arguments as objects, as
    llama.cpp passes them) and ``tool`` messages; other templates get the calls written into
    the assistant's text and the results as user messages, so any template can render a tool
    conversation.
    """
    if not messages:
        raise RequestError("messages must not be empty")
    rows: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = "system" if m.role in ROLES_AS_SYSTEM else m.role
        row: dict[str, Any] = {
            "role": role,
            "content": _text(m.content, f"{where}.content", media_marker, media, media_kinds, media_where),
        }
        if m.name is not None:
            row["name"] = m.name
        if m.reasoning_content is not None:
            row["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            if role != "assistant":
                raise RequestError(f"{where}.tool_calls: only assistant messages carry tool calls")
            parsed = _calls(m.tool_calls, f"{where}.tool_calls")
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
            answered = m.tool_call_id
            if not answered:
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
    content: str | list[Any] | None,
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
            allowed = "text, image_url and input_audio parts are" if media_marker is not None else "only text parts are"
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


def _calls(calls: Sequence[ToolCallItem], where: str) -> list[tuple[str, str, str]]:
    """(id, name, arguments as JSON text) of each call of an assistant message."""
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if call.type != "function":
            raise RequestError(f"{at}.type: only 'function' calls are supported")
        args = call.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise RequestError(f"{at}.function.arguments is not valid JSON") from None
        if not isinstance(args, dict):
            raise RequestError(f"{at}.function.arguments must be a JSON object")
        out.append((call.id or "", call.function.name, json.dumps(args, ensure_ascii=False)))
    return out


__all__ = ["template_messages"]
