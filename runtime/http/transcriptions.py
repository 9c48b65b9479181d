"""``POST /v1/audio/transcriptions``: OpenAI's transcription API over the chat path, as llama-server.

The request is a ``multipart/form-data`` form: the audio in its ``file`` part (wav, mp3 or
flac, as libmtmd's helper decodes them), the rest text fields. As llama-server's
``convert_transcriptions_to_chatcmpl`` does, it becomes one chat: a user message of
``prompt`` (default "Transcribe audio to text"; for an LFM2 chat template the system message
"Perform ASR." and no text), `` (language: <language>)`` when ``language`` is given, and the
audio right after (its media marker glued to the text), answered greedily or as the sampling
fields say. ``response_format`` must be "json" (the only one llama-server makes).

Form fields are all strings: ``stream``, ``max_tokens`` and ``temperature`` are read as
llama-server reads them; any other field of a chat request (``top_k``, ``seed``, ...) is read
as its type (llama-server refuses those as strings; here "3" is 3); fields a chat request does
not have are ignored (OpenAI's ``timestamp_granularities[]`` among them), as there.

The answer is llama-server's: ``{"type": "transcript.text.done", "text", "usage": {"type":
"tokens", "input_tokens", "output_tokens", "total_tokens", "input_tokens_details":
{"cached_tokens"}}}``; streamed, a ``transcript.text.delta`` frame per token (its raw text),
then the done frame and ``data: [DONE]``.
"""

from __future__ import annotations

import base64
from email.message import Message
from typing import Any

import msgspec

from llamactor.protocol.errors import RequestError
from llamactor.protocol.events import Done, Token
from llamactor.protocol.wire import ChatCompletionRequest
from llamactor.runtime.http.shaper import Shaper
from llamactor.runtime.service.chatturn import ChatTurn, parse_completion
from llamactor.runtime.service.results import Completion

ASR_USER_PROMPT = "Transcribe audio to text"  # llama-server's common_chat_get_asr_prompt
LFM2_ASR_SYSTEM_PROMPT = "Perform ASR."
# read by the conversion itself, not passed on as chat fields
OWN_FIELDS = frozenset({"file", "prompt", "language", "response_format", "stream", "messages"})
CHAT_FIELDS = frozenset(f.encode_name for f in msgspec.structs.fields(ChatCompletionRequest))


def parse_form(content_type: str, body: bytes) -> tuple[dict[str, str], dict[str, bytes]]:
    """The text fields and the files of a ``multipart/form-data`` body (a part with a filename
    is a file; a field given twice keeps its last value)."""
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if header.get_content_type() != "multipart/form-data" or not isinstance(boundary, str) or not boundary:
        raise RequestError(
            "No input file found for transcription: send a multipart/form-data form with the audio in its "
            f"'file' part (got Content-Type {content_type or 'none'!r})"
        )
    fields: dict[str, str] = {}
    files: dict[str, bytes] = {}
    delimiter = b"--" + boundary.encode("latin-1")
    pieces = body.split(delimiter)
    if len(pieces) < 2 or not pieces[-1].startswith(b"--"):
        raise RequestError("the multipart/form-data body is malformed: its closing boundary is missing")
    for piece in pieces[1:-1]:
        piece = piece.removeprefix(b"\r\n")
        head, sep, content = piece.partition(b"\r\n\r\n")
        if not sep:
            raise RequestError("the multipart/form-data body is malformed: a part has no blank line after its headers")
        content = content.removesuffix(b"\r\n")
        disposition = Message()
        for line in head.decode("latin-1").split("\r\n"):
            name, colon, value = line.partition(":")
            if colon and name.strip().lower() == "content-disposition":
                disposition["content-disposition"] = value.strip()
        field = disposition.get_param("name", header="content-disposition")
        if not isinstance(field, str) or not field:
            raise RequestError("the multipart/form-data body is malformed: a part has no name")
        if disposition.get_param("filename", header="content-disposition") is not None or field == "file":
            files[field] = content
        else:
            try:
                fields[field] = content.decode("utf-8")
            except UnicodeDecodeError:
                raise RequestError(f"form field {field!r} is not UTF-8 text") from None
    return fields, files


def to_chat(fields: dict[str, str], files: dict[str, bytes], template_source: str | None) -> ChatCompletionRequest:
    """The chat request a transcription form is (llama-server's ``convert_transcriptions_to_chatcmpl``)."""
    audio = files.get("file")
    if audio is None:
        raise RequestError("No input file found for transcription: the form has no 'file' part")
    if not audio:
        raise RequestError("the form's 'file' part is empty: it holds the audio (wav, mp3 or flac)")
    response_format = fields.get("response_format", "json")
    if response_format != "json":
        raise RequestError(
            f"Only 'json' response_format is supported for transcription (got response_format={response_format!r})"
        )
    source = template_source or ""
    lfm2 = "<|tool_list_start|>" in source and "<|tool_list_end|>" in source  # llama.cpp's is_lfm2_template
    prompt = fields.get("prompt", "") or ("" if lfm2 else ASR_USER_PROMPT)
    if fields.get("language"):
        prompt += f" (language: {fields['language']})"
    content: list[dict[str, Any]] = [{"type": "text", "text": prompt}] if prompt else []
    content.append({"type": "input_audio", "input_audio": {"data": base64.b64encode(audio).decode("ascii")}})
    messages: list[dict[str, Any]] = [{"role": "system", "content": LFM2_ASR_SYSTEM_PROMPT}] if lfm2 else []
    messages.append({"role": "user", "content": content})
    body: dict[str, Any] = {k: v for k, v in fields.items() if k in CHAT_FIELDS and k not in OWN_FIELDS}
    body["messages"] = messages
    body["stream"] = fields.get("stream", "false") == "true"  # llama-server: "true" only
    return msgspec.convert(body, ChatCompletionRequest, strict=False)


class TranscriptionShaper(Shaper):
    """The transcription answer of choice 0, whole or as a stream."""

    done = True

    def __init__(self, turn: ChatTurn) -> None:
        self.turn = turn

    @staticmethod
    def _done(text: str, n_prompt: int, n_cached: int, n_predicted: int) -> dict[str, Any]:
        return {
            "type": "transcript.text.done",
            "text": text,
            "usage": {
                "type": "tokens",
                "input_tokens": n_prompt,
                "output_tokens": n_predicted,
                "total_tokens": n_prompt + n_predicted,
                "input_tokens_details": {"cached_tokens": n_cached},
            },
        }

    def body(self, c: Completion) -> dict[str, Any]:
        message = parse_completion(self.turn, c).message
        return self._done(message.content or "", c.n_prompt, c.n_cached, c.n_predicted)

    def stream(self, ev: Token | Done) -> list[dict[str, Any]]:
        if ev.index != 0:
            return []
        if isinstance(ev, Token):
            return [{"type": "transcript.text.delta", "delta": ev.text}] if ev.text else []
        parser = self.turn.parser()
        parser.feed(ev.text)
        parser.finish()
        return [self._done(parser.message.content or "", ev.n_prompt, ev.n_cached, ev.n_predicted)]
