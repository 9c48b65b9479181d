"""OpenAI Responses API answers: ``ResponsesShaper`` (the request is ``responses_request``'s).

``ResponsesShaper`` writes the answer as a ``response`` object whose ``output`` holds a
reasoning item, a message item and one function_call item per call; or as the Responses
stream: ``response.created``, ``response.in_progress``, then for each item
``response.output_item.added``, its deltas (``response.output_text.delta`` after
``response.content_part.added``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``) and its ``.done`` events, and
``response.completed`` with the whole response. Every event carries ``sequence_number`` and
the ``output_index``/``content_index`` the openai client's stream accumulator needs.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from llamactor.protocol.events import Done, Progress, Token
from llamactor.runtime.http.chat_api import ChoiceParsers
from llamactor.runtime.http.shaper import NamedEvents
from llamactor.runtime.http.timings import done_timings, progress_json, progress_timings, token_timings
from llamactor.runtime.service.chatparse import MessageDelta, ParsedMessage, ToolCall
from llamactor.runtime.service.chatturn import ChatTurn, parse_completion
from llamactor.runtime.service.results import Completion


def _uid(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": content,
        "encrypted_content": "",
        "status": status,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "id": "fc_" + call.id,
        "type": "function_call",
        "status": status,
        "call_id": "call_" + call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
    }


class ResponsesShaper(NamedEvents):
    """One Responses answer (choice 0), as a response object or as the Responses stream."""

    def __init__(self, model: str, turn: ChatTurn) -> None:
        self.model = model
        self.turn = turn
        self.id = _uid("resp_")
        self.created_at = int(time.time())
        self.parsers = ChoiceParsers(turn)
        self.prompt_tokens = 0
        self._seq = 0
        self._started = False
        self._finished = False
        self._output: list[dict[str, Any]] = []  # completed items, in output order
        self._open: dict[str, Any] | None = None  # the item being streamed (reasoning or message)
        self._open_text = ""

    def _response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, incomplete: bool = False
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": [],
            "metadata": {},
            **({"completed_at": int(time.time())} if status != "in_progress" else {}),
        }

    @staticmethod
    def _usage(n_prompt: int, n_cached: int, n_predicted: int) -> dict[str, Any]:
        return {
            "input_tokens": n_prompt,
            "output_tokens": n_predicted,
            "total_tokens": n_prompt + n_predicted,
            "input_tokens_details": {"cached_tokens": n_cached},
            "output_tokens_details": {"reasoning_tokens": 0},
        }

    def body(self, c: Completion) -> dict[str, Any]:
        message = parse_completion(self.turn, c).message
        output = self._items(message)
        return self._response(
            "incomplete" if c.finish_reason == "length" else "completed",
            output,
            self._usage(c.n_prompt, c.n_cached, c.n_predicted),
            c.finish_reason == "length",
        )

    def _items(self, message: ParsedMessage) -> list[dict[str, Any]]:
        output = []
        if message.reasoning_content:
            output.append(_reasoning_item(_uid("rs_"), message.reasoning_content, "completed"))
        if message.content:
            output.append(_message_item(_uid("msg_"), message.content, "completed"))
        output.extend(_call_item(call, "completed") for call in message.tool_calls)
        return output

    # ---- stream ------------------------------------------------------------------------------

    def _event(self, name: str, **data: Any) -> tuple[str, Any]:
        self._seq += 1
        return name, {"type": name, "sequence_number": self._seq - 1, **data}

    def progress(self, ev: Progress) -> list[tuple[str, Any]]:
        """A return_progress event, as llama-server's: ``response.in_progress`` with
        ``prompt_progress`` (and ``timings`` with timings_per_token)."""
        out = self._start()
        timings = progress_timings(ev)
        out.append(
            self._event(
                "response.in_progress",
                response=self._response("in_progress", [], None),
                prompt_progress=progress_json(ev),
                **({} if timings is None else {"timings": timings}),
            )
        )
        return out

    def stream(self, ev: Token | Done) -> list[tuple[str, Any]]:
        if ev.index != 0:
            return []
        out = self._start()
        out += self._delta(self.parsers.feed(ev))
        if isinstance(ev, Token):
            timings = token_timings(ev)
            if out and timings is not None:  # as llama-server: on the token's last event
                out[-1][1]["timings"] = timings
        if isinstance(ev, Done):
            out += self._close()
            incomplete = ev.finish_reason == "length"
            response = self._response(
                "incomplete" if incomplete else "completed",
                self._output,
                self._usage(ev.n_prompt, ev.n_cached, ev.n_predicted),
                incomplete,
            )
            # Always "response.completed", as llama-server sends (the openai client's stream helper
            # waits for it); a cut-off answer says so in the response's status and incomplete_details.
            timings = done_timings(ev)
            out.append(self._event("response.completed", response=response, timings=timings))
            self._finished = True
        return out

    def tail(self) -> list[tuple[str, Any]] | None:
        if self._finished:
            return None
        return [
            *self._start(),
            self._event(
                "response.completed", response=self._response("completed", [], self._usage(self.prompt_tokens, 0, 0))
            ),
        ]

    def _start(self) -> list[tuple[str, Any]]:
        if self._started:
            return []
        self._started = True
        response = self._response("in_progress", [], None)
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def _delta(self, delta: MessageDelta) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if delta.reasoning:
            out += self._open_item("reasoning")
            self._open_text += delta.reasoning
            out.append(
                self._event(
                    "response.reasoning_text.delta",
                    item_id=self._open_id,
                    output_index=self._index,
                    content_index=0,
                    delta=delta.reasoning,
                )
            )
        if delta.content:
            out += self._open_item("message")
            self._open_text += delta.content
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self._open_id,
                    output_index=self._index,
                    content_index=0,
                    delta=delta.content,
                    logprobs=[],
                )
            )
        for _, call in delta.calls:
            out += self._close()
            index, item_id = len(self._output), "fc_" + call.id
            added = _call_item(call, "in_progress")
            out.append(self._event("response.output_item.added", output_index=index, item=added))
            out.append(
                self._event(
                    "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=call.arguments
                )
            )
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=index,
                    arguments=call.arguments,
                )
            )
            done = _call_item(call, "completed")
            out.append(self._event("response.output_item.done", output_index=index, item=done))
            self._output.append(done)
        return out

    @property
    def _index(self) -> int:
        return len(self._output)  # the open item is the next one of the output

    @property
    def _open_id(self) -> str:
        assert self._open is not None
        return str(self._open["id"])

    def _open_item(self, kind: str) -> list[tuple[str, Any]]:
        if self._open is not None and self._open["type"] == kind:
            return []
        out = self._close()
        if kind == "reasoning":
            self._open = _reasoning_item(_uid("rs_"), "", "in_progress")
            out.append(self._event("response.output_item.added", output_index=self._index, item=self._open))
        else:
            self._open = _message_item(_uid("msg_"), "", "in_progress")
            out.append(self._event("response.output_item.added", output_index=self._index, item=self._open))
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=self._open_id,
                    output_index=self._index,
                    content_index=0,
                    part=_text_part(""),
                )
            )
        self._open_text = ""
        return out

    def _close(self) -> list[tuple[str, Any]]:
        if self._open is None:
            return []
        out = []
        item_id, index, text = self._open_id, self._index, self._open_text
        if self._open["type"] == "reasoning":
            out.append(
                self._event(
                    "response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0, text=text
                )
            )
            done = _reasoning_item(item_id, text, "completed")
        else:
            out.append(
                self._event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            out.append(
                self._event(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=_text_part(text),
                )
            )
            done = _message_item(item_id, text, "completed")
        out.append(self._event("response.output_item.done", output_index=index, item=done))
        self._output.append(done)
        self._open, self._open_text = None, ""
        return out


def input_tokens_body(n_tokens: int) -> dict[str, Any]:
    """llama-server's answer to the input_tokens endpoints of the OpenAI APIs."""
    return {"object": "response.input_tokens", "input_tokens": n_tokens}
