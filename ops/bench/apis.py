"""The wire dialects the harness speaks: request bodies and stream-event decoding (pure).

``NativeApi`` is llama-server's ``POST /completion``: each SSE event carries the ids of the
tokens it delivers (``tokens``), and the last one has ``stop: true`` with the server's own
``tokens_predicted``. ``OpenAIApi`` is ``POST /v1/completions``: events carry text only, the
token count comes from ``usage`` (asked for with ``stream_options.include_usage``; llama-server
puts it in its last chunk anyway), and the stream ends with ``data: [DONE]``. ``ChatApi`` is
``POST /v1/chat/completions``: the prompt goes as messages, so as text, made from the token
pieces of the probed prompt ids (``Vocabulary``); events carry ``delta.content``, the token
count comes from ``usage`` (else one token per content chunk counted), ``data: [DONE]`` ends it.

Both servers under test (llamactor and llama.cpp's llama-server) accept exact token ids as the
prompt, ``ignore_eos`` and ``cache_prompt`` on both completion endpoints, so the same body
measures both; the chat endpoint takes ``ignore_eos`` and ``cache_prompt`` too.

A prompt is a ``list[int]``; a ``Dialogue`` is one that also knows its messages (a shared
system prefix, earlier turns and their answers), for the dialects that send text. An answer
is kept for a later turn when asked (``keep``): as token ids by the native dialect
(``RequestRecord.token_ids``), as text by the others (``TextRecord.text``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from llamactor.ops.bench.stats import RequestRecord

DONE_PAYLOAD = b"[DONE]"
ERROR_FIELD = b"error"
DATA_FIELD = b"data"

_decode = msgspec.json.decode


class SseDecoder:
    """Splits a byte stream into ``(field, value)`` pairs, one per SSE line that has a value.

    Fed once per received network chunk; a line cut across two chunks is kept until its end
    arrives. Only the ``data`` and ``error`` fields matter here; comments (``:``) are dropped.
    """

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> list[tuple[bytes, bytes]]:
        buf = self._tail + chunk
        lines = buf.split(b"\n")
        self._tail = lines.pop()
        out = []
        for raw in lines:
            line = raw.rstrip(b"\r")
            if not line or line.startswith(b":"):
                continue
            name, sep, value = line.partition(b":")
            if sep:
                out.append((name.strip(), value.strip()))
        return out


@dataclass(frozen=True)
class Message:
    """One chat message of a prompt: token ids (rendered as text where text is sent) or text
    as a server returned it (an earlier answer, for the text dialects)."""

    role: str  # "system", "user" or "assistant"
    ids: tuple[int, ...] = ()
    text: str | None = None  # when set, the message is this text (``ids`` is then empty)


class Dialogue(list[int]):
    """A prompt as token ids that also knows its chat messages.

    As a list it is every message's ids in order (what the token-id dialects send; an answer
    known only as text adds no ids, so ``len`` counts the ids known). The chat dialect sends the
    messages; the completions dialect sends the whole text once some message is text.
    """

    def __init__(self, messages: Sequence[Message]) -> None:
        super().__init__(t for m in messages for t in m.ids)
        self.messages = tuple(messages)

    @property
    def has_text(self) -> bool:
        return any(m.text is not None for m in self.messages)


class Vocabulary:
    """Token id -> its text piece, for the prompt ids (from ``/tokenize`` with ``with_pieces``).

    Prompt ids are drawn from these ids, so any prompt renders to text exactly as the
    concatenation of its pieces (the server re-tokenizes that text: about as many tokens).
    """

    def __init__(self, pieces: Mapping[int, str]) -> None:
        self.pieces = dict(pieces)

    def text(self, ids: Sequence[int]) -> str:
        try:
            return "".join(self.pieces[t] for t in ids)
        except KeyError as exc:
            raise ValueError(f"token id {exc.args[0]} has no known text piece") from None

    def message_text(self, m: Message) -> str:
        return m.text if m.text is not None else self.text(m.ids)


@dataclass
class TextRecord(RequestRecord):
    """A record that also keeps the answer's text, for a later turn (text dialects)."""

    text: list[str] = field(default_factory=list)


class Api(Protocol):
    """One dialect. ``apply`` is called once per SSE line with a value, in arrival order."""

    name: str
    path: str

    def new_record(self, n_prompt: int, keep: bool) -> RequestRecord:
        """An empty record for one request; ``keep``: it keeps the answer for a later turn."""
        ...

    def body(
        self,
        prompt: list[int],
        n_predict: int,
        temperature: float,
        cache_prompt: bool = False,
        return_tokens: bool = False,
    ) -> dict[str, Any]: ...

    def apply(self, rec: RequestRecord, field: bytes, value: bytes, now_s: float) -> None: ...

    def finish(self, rec: RequestRecord) -> None:
        """Called once when the HTTP stream ended; flags a stream that ended early."""
        ...


def _error_text(obj: Any) -> str:
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def _decode_or_error(rec: RequestRecord, field: bytes, value: bytes) -> Any:
    """The JSON value of a data line, or ``None`` after recording an error on ``rec``."""
    try:
        obj = _decode(value)
    except msgspec.DecodeError:
        rec.error = f"undecodable event: {value[:120]!r}"
        return None
    if field == ERROR_FIELD or (isinstance(obj, dict) and "error" in obj):
        rec.error = _error_text(obj)
        return None
    if field != DATA_FIELD or not isinstance(obj, dict):
        return None
    return obj


def _keep_timings(rec: RequestRecord, obj: dict[str, Any]) -> None:
    timings = obj.get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("prompt_ms"), (int, float)):
        rec.server_prompt_ms = float(timings["prompt_ms"])


def _keep_text(rec: RequestRecord, text: str) -> None:
    if isinstance(rec, TextRecord):
        rec.text.append(text)


class NativeApi:
    name = "native"
    path = "/completion"

    def new_record(self, n_prompt: int, keep: bool) -> RequestRecord:
        return RequestRecord(sent_s=0.0, n_prompt_sent=n_prompt, token_ids=[] if keep else None)

    def body(
        self,
        prompt: list[int],
        n_predict: int,
        temperature: float,
        cache_prompt: bool = False,
        return_tokens: bool = False,
    ) -> dict[str, Any]:
        body = {
            "prompt": prompt,
            "n_predict": n_predict,
            "stream": True,
            "ignore_eos": True,
            "temperature": temperature,
            "cache_prompt": cache_prompt,
        }
        if return_tokens:
            # llama-server's switch for ``tokens`` in a non-streamed answer; stream chunks carry
            # each token's id anyway, which is where the harness reads them (chat history)
            body["return_tokens"] = True
        return body

    def apply(self, rec: RequestRecord, field: bytes, value: bytes, now_s: float) -> None:
        obj = _decode_or_error(rec, field, value)
        if obj is None:
            return
        if obj.get("stop"):
            _keep_timings(rec, obj)
            rec.done_s = now_s
            rec.n_generated_server = obj.get("tokens_predicted")
            rec.n_prompt_server = obj.get("tokens_evaluated")
            return
        tokens = obj.get("tokens")
        n = len(tokens) if isinstance(tokens, list) else (1 if obj.get("content") else 0)
        if n:
            rec.event_times.append(now_s)
            rec.event_tokens.append(n)
            if rec.token_ids is not None and isinstance(tokens, list):
                rec.token_ids.extend(tokens)

    def finish(self, rec: RequestRecord) -> None:
        if rec.error is None and rec.done_s is None:
            rec.error = "stream ended without a final (stop: true) event"


class OpenAIApi:
    """``/v1/completions``; a ``Dialogue`` holding an answer as text is sent as text (rendered
    with ``vocabulary``), as a client that appends the answer to its prompt would."""

    name = "openai"
    path = "/v1/completions"

    def __init__(self, vocabulary: Vocabulary | None = None) -> None:
        self.vocabulary = vocabulary

    def new_record(self, n_prompt: int, keep: bool) -> RequestRecord:
        return TextRecord(sent_s=0.0, n_prompt_sent=n_prompt) if keep else RequestRecord(0.0, n_prompt)

    def prompt_fields(self, prompt: list[int]) -> dict[str, Any]:
        """The body's prompt: the token ids, or a ``Dialogue`` holding text as one text."""
        sent: list[int] | str = list(prompt)
        if isinstance(prompt, Dialogue) and prompt.has_text:
            if self.vocabulary is None:
                raise ValueError("a prompt with text needs the vocabulary of the prompt ids")
            sent = "".join(self.vocabulary.message_text(m) for m in prompt.messages)
        return {"prompt": sent}

    def body(
        self,
        prompt: list[int],
        n_predict: int,
        temperature: float,
        cache_prompt: bool = False,
        return_tokens: bool = False,
    ) -> dict[str, Any]:
        return {
            **self.prompt_fields(prompt),
            "max_tokens": n_predict,
            "stream": True,
            "ignore_eos": True,
            "temperature": temperature,
            "cache_prompt": cache_prompt,
            "stream_options": {"include_usage": True},
        }

    def piece(self, choice: dict[str, Any]) -> tuple[str, bool]:
        """The text one chunk's choice carries, and whether it counts as a generated token."""
        text = choice.get("text") or ""
        return text, bool(text) and choice.get("finish_reason") is None

    def apply(self, rec: RequestRecord, field: bytes, value: bytes, now_s: float) -> None:
        if field == DATA_FIELD and value == DONE_PAYLOAD:
            rec.done_s = now_s
            return
        obj = _decode_or_error(rec, field, value)
        if obj is None:
            return
        _keep_timings(rec, obj)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            rec.n_generated_server = usage.get("completion_tokens")
            rec.n_prompt_server = usage.get("prompt_tokens")
        for choice in obj.get("choices") or ():
            text, token = self.piece(choice)
            if text:
                _keep_text(rec, text)
            if token:
                rec.event_times.append(now_s)
                rec.event_tokens.append(1)

    def finish(self, rec: RequestRecord) -> None:
        if rec.error is None and rec.done_s is None:
            rec.error = "stream ended without data: [DONE]"


class ChatApi(OpenAIApi):
    """``/v1/chat/completions``: the prompt as messages, each rendered as text.

    A plain prompt is one user message; a ``Dialogue`` sends its own messages (a shared prefix
    as the system message, earlier turns as user and assistant messages). One token is counted
    per chunk with content (or reasoning) until ``usage`` gives the server's count.
    """

    name = "chat"
    path = "/v1/chat/completions"

    def __init__(self, vocabulary: Vocabulary) -> None:
        super().__init__(vocabulary)
        self._vocab = vocabulary  # never None here

    def messages(self, prompt: list[int]) -> list[dict[str, str]]:
        if isinstance(prompt, Dialogue):
            return [{"role": m.role, "content": self._vocab.message_text(m)} for m in prompt.messages]
        return [{"role": "user", "content": self._vocab.text(prompt)}]

    def prompt_fields(self, prompt: list[int]) -> dict[str, Any]:
        return {"messages": self.messages(prompt)}

    def piece(self, choice: dict[str, Any]) -> tuple[str, bool]:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return "", False
        content = delta.get("content") or ""
        return content, bool(content or delta.get("reasoning_content"))


APIS: dict[str, Api] = {"native": NativeApi(), "openai": OpenAIApi()}
API_NAMES = ("native", "openai", "chat")  # chat needs a Vocabulary: make_api, not APIS


def make_api(name: str, vocabulary: Vocabulary | None = None) -> Api:
    """The dialect ``name``; the text dialects render prompts with ``vocabulary``."""
    if name == "native":
        return NativeApi()
    if name == "openai":
        return OpenAIApi(vocabulary)
    if name == "chat":
        if vocabulary is None:
            raise ValueError("the chat dialect needs the text pieces of the prompt ids (/tokenize with_pieces)")
        return ChatApi(vocabulary)
    raise ValueError(f"unknown API {name!r}: expected one of {', '.join(API_NAMES)}")


__all__ = [
    "APIS",
    "API_NAMES",
    "Api",
    "ChatApi",
    "Dialogue",
    "Message",
    "NativeApi",
    "OpenAIApi",
    "SseDecoder",
    "TextRecord",
    "Vocabulary",
    "make_api",
]
