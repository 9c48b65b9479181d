"""Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A Messages request is converted into a chat completions request the way llama-server's
``server_chat_convert_anthropic_to_oai`` does (system prompt, text/thinking/tool_use/
tool_result content blocks, tools with ``input_schema``, ``tool_choice``, ``stop_sequences``),
then runs as any chat request. Differences, on purpose: ``tool_choice: {"type": "tool"}``
forces that tool (llama-server only asks for some call), a ``tool_result`` must answer an
earlier ``tool_use`` and unsupported blocks (documents, images in a ``tool_result``) are a 400
naming the block (an ``image`` block of a message is an ``image_url`` part, as llama-server
converts it: a 400 too without ``--mmproj``),
``thinking: {"type": "disabled"}`` turns the template's thinking off, and a stop sequence
ends with ``stop_reason: "stop_sequence"`` as Anthropic's API does.

``AnthropicShaper`` writes the answer as a message of content blocks (thinking, text,
tool_use), or as Anthropic's stream: ``message_start``, then per block ``content_block_start``
/ ``content_block_delta`` (text_delta, thinking_delta + signature_delta, input_json_delta) /
``content_block_stop``, then ``message_delta`` (stop_reason, usage) and ``message_stop``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from llamactor.protocol.errors import RequestError
from llamactor.protocol.events import Done, Token
from llamactor.protocol.wire import ChatCompletionRequest
from llamactor.runtime.http.chat_api import ChoiceParsers
from llamactor.runtime.http.errors import anthropic_error_body
from llamactor.runtime.http.shaper import NamedEvents, named_frame
from llamactor.runtime.service.chatparse import MessageDelta, ParsedMessage
from llamactor.runtime.service.chatturn import ChatTurn, parse_completion
from llamactor.runtime.service.results import Completion

DEFAULT_MAX_TOKENS = 4096  # llama-server's value when a request leaves max_tokens out
PASSED_THROUGH = ("model", "temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
TOOL_CHOICE_TYPES = {"auto": "auto", "any": "required", "none": "none"}


# ---- request -------------------------------------------------------------------------------


def to_chat(body: Any) -> ChatCompletionRequest:
    """The chat completions request a Messages body stands for. Raises RequestError naming the field."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _system_text(system)})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty array")
    seen_calls: set[str] = set()
    for i, m in enumerate(raw):
        messages.extend(_message(m, f"messages[{i}]", seen_calls))
    chat: dict[str, Any] = {k: body[k] for k in PASSED_THROUGH if k in body}
    chat["messages"] = messages
    chat["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"], parallel = _tool_choice(body["tool_choice"])
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") == "disabled":
        kwargs = chat.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise RequestError("chat_template_kwargs must be an object")
        chat["chat_template_kwargs"] = {**kwargs, "enable_thinking": False}
    return msgspec.convert(chat, ChatCompletionRequest)


def _system_text(system: Any) -> str:
    return _text_blocks(system, "system", " must be a text block")


def _text_blocks(content: Any, where: str, not_text: str) -> str:
    """A string, or the text of an array of text blocks (RequestError ``{where}[k]{not_text}`` otherwise)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, block in enumerate(content):
            if not isinstance(block, Mapping) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise RequestError(f"{where}[{k}]{not_text}")
            parts.append(block["text"])
        return "".join(parts)
    raise RequestError(f"{where} must be a string or an array of text blocks")


def _message(m: Any, where: str, seen_calls: set[str]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: the message itself, then one per tool_result."""
    if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant"):
        raise RequestError(f"{where}.role must be 'user' or 'assistant'")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or an array of content blocks")
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # text and image parts in order (the content when it has images)
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{at}.source")}})
        elif kind == "thinking" and role == "assistant":
            if not isinstance(block.get("thinking", ""), str):
                raise RequestError(f"{at}.thinking must be a string")
            reasoning.append(block.get("thinking", ""))
        elif kind == "redacted_thinking" and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str):
                raise RequestError(f"{at}: a tool_use block needs a string id and name")
            if not isinstance(args, Mapping):
                raise RequestError(f"{at}.input must be an object")
            seen_calls.add(call_id)
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
        elif kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in seen_calls:
                raise RequestError(f"{at}.tool_use_id: no earlier tool_use block has id {call_id!r}")
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _result_text(block.get("content"), f"{at}.content"),
                }
            )
        else:
            raise RequestError(
                f"{at}: unsupported content block {kind!r} for role {role!r} "
                f"(text, image, thinking, tool_use and tool_result are)"
            )
    out: list[dict[str, Any]] = []
    has_image = len(parts) > len(texts)
    if texts or calls or reasoning or has_image:
        msg: dict[str, Any] = {"role": role, "content": parts if has_image else "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        out.append(msg)
    return results + out if role == "user" else out  # results answer the previous turn's calls


def _image_url(source: Any, where: str) -> str:
    """An image block's ``source`` as an ``image_url`` part's URL (a base64 data URL, or the
    ``url`` source's URL, fetched at admission as an ``image_url`` part's is)."""
    if not isinstance(source, Mapping) or source.get("type") not in ("base64", "url"):
        raise RequestError(
            f'{where} must be {{"type": "base64", "media_type": ..., "data": ...}} or {{"type": "url", "url": ...}}'
        )
    if source["type"] == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise RequestError(f"{where}.url must be a string")
        return url
    media_type, data = source.get("media_type", "image/jpeg"), source.get("data")
    if not isinstance(media_type, str) or not isinstance(data, str):
        raise RequestError(f"{where}: media_type and data must be strings")
    return f"data:{media_type};base64,{data}"


def _result_text(content: Any, where: str) -> str:
    return "" if content is None else _text_blocks(content, where, ": only text blocks are supported in a tool_result")


def _tools(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise RequestError("tools must be an array")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            raise RequestError(f"tools[{i}].name is required")
        if tool.get("type") not in (None, "custom"):
            raise RequestError(
                f"tools[{i}].type: only client tools with an input_schema are supported, got {tool.get('type')!r}"
            )
        fn: dict[str, Any] = {"name": tool["name"], "description": tool.get("description") or ""}
        if tool.get("input_schema") is not None:
            fn["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any) -> tuple[Any, bool | None]:
    if not isinstance(raw, Mapping) or raw.get("type") not in (*TOOL_CHOICE_TYPES, "tool"):
        raise RequestError('tool_choice must be {"type": "auto" | "any" | "tool" | "none"}')
    parallel = None if raw.get("disable_parallel_tool_use") is None else not raw["disable_parallel_tool_use"]
    if raw["type"] == "tool":
        if not isinstance(raw.get("name"), str):
            raise RequestError("tool_choice.name is required with type 'tool'")
        return {"type": "function", "function": {"name": raw["name"]}}, parallel
    return TOOL_CHOICE_TYPES[raw["type"]], parallel


# ---- response --------------------------------------------------------------------------------


def _stop_reason(message: ParsedMessage, finish: str, stopping_word: str) -> str:
    if finish == "length":
        return "max_tokens"
    if message.tool_calls:
        return "tool_use"
    return "stop_sequence" if stopping_word else "end_turn"


def _blocks(message: ParsedMessage) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.reasoning_content:
        blocks.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.args})
    return blocks


class AnthropicShaper(NamedEvents):
    """One Messages answer (choice 0), as a body or as Anthropic's stream events."""

    def __init__(self, model: str, turn: ChatTurn) -> None:
        self.model = model
        self.turn = turn
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.prompt_tokens = 0  # set once the prompt is tokenized (message_start reports it)
        self.cached_tokens = 0  # of those, reused from the cache (known at the first token)
        self.parsers = ChoiceParsers(turn)
        self._started = False
        self._finished = False
        self._block = -1  # index of the open block, -1 when none
        self._kind = ""  # "thinking" or "text" while a block is open
        self._n_blocks = 0

    def _usage(self, n_prompt: int, n_cached: int, n_predicted: int) -> dict[str, int]:
        return {"input_tokens": n_prompt - n_cached, "cache_read_input_tokens": n_cached, "output_tokens": n_predicted}

    def body(self, c: Completion) -> dict[str, Any]:
        choice = parse_completion(self.turn, c).choices[0]
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": _blocks(choice.message),
            "stop_reason": _stop_reason(choice.message, c.finish_reason, c.stopping_word),
            "stop_sequence": c.stopping_word or None,
            "usage": self._usage(c.n_prompt, c.n_cached, c.n_predicted),
        }

    # ---- stream ------------------------------------------------------------------------------

    def error_frame(self, exc: BaseException) -> bytes:
        """An error once the stream has started: Anthropic's ``event: error`` frame."""
        return named_frame(("error", anthropic_error_body(exc)))

    def stream(self, ev: Token | Done) -> list[tuple[str, Any]]:
        if ev.index != 0:
            return []
        if not self._started:
            self.cached_tokens = ev.n_cached if isinstance(ev, Done) else max(ev.n_cached, 0)
        out = self._start()
        delta = self.parsers.feed(ev)
        out += self._delta(delta)
        if isinstance(ev, Done):
            out += self._close()
            message = self.parsers.message(0)
            out.append(
                (
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {
                            "stop_reason": _stop_reason(message, ev.finish_reason, ev.stopping_word),
                            "stop_sequence": ev.stopping_word or None,
                        },
                        "usage": {"output_tokens": ev.n_predicted},
                    },
                )
            )
            out.append(("message_stop", {"type": "message_stop"}))
            self._finished = True
        return out

    def tail(self) -> list[tuple[str, Any]] | None:
        """Closing events of a stream that ended without any (nothing to generate)."""
        if self._finished:
            return None
        return [
            *self._start(),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                    "usage": {"output_tokens": 0},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]

    def _start(self) -> list[tuple[str, Any]]:
        if self._started:
            return []
        self._started = True
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self._usage(self.prompt_tokens, self.cached_tokens, 0),
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def _delta(self, delta: MessageDelta) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if delta.reasoning:
            out += self._open("thinking", {"type": "thinking", "thinking": ""})
            out.append(self._block_delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._block_delta({"type": "text_delta", "text": delta.content}))
        for _, call in delta.calls:
            out += self._open("tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            out.append(self._block_delta({"type": "input_json_delta", "partial_json": call.arguments}))
            out += self._close()
        return out

    def _open(self, kind: str, block: dict[str, Any]) -> list[tuple[str, Any]]:
        if self._block >= 0 and self._kind == kind and kind != "tool_use":
            return []
        out = self._close()
        self._block, self._kind = self._n_blocks, kind
        self._n_blocks += 1
        out.append(
            ("content_block_start", {"type": "content_block_start", "index": self._block, "content_block": block})
        )
        return out

    def _block_delta(self, delta: dict[str, Any]) -> tuple[str, Any]:
        return ("content_block_delta", {"type": "content_block_delta", "index": self._block, "delta": delta})

    def _close(self) -> list[tuple[str, Any]]:
        if self._block < 0:
            return []
        out = []
        if self._kind == "thinking":  # Anthropic's API signs a thinking block before closing it
            out.append(self._block_delta({"type": "signature_delta", "signature": ""}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": self._block}))
        self._block, self._kind = -1, ""
        return out


def count_tokens_body(n_tokens: int) -> dict[str, int]:
    return {"input_tokens": n_tokens}
