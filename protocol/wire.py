"""HTTP bodies: llama-server's native API and the OpenAI API (API-2 … API-5).

Requests are decoded straight into these Structs (``msgspec.json.decode(body, type=...)``),
so a wrong type is a 400 whose message names the field. Request bodies accept unknown fields
(clients send extras, as llama-server tolerates); the small utility endpoints are strict.
msgspec allows one array-like type per union, so fields that are "a string or a list of
anything" are typed loosely here and narrowed in ``runtime.requests``.
"""

from __future__ import annotations

from typing import Any

import msgspec

DEFAULT_MAX_TOKENS_OPENAI_COMPLETIONS = 16


class NativeCompletionRequest(msgspec.Struct, kw_only=True):
    prompt: str | list[Any]
    n_predict: int = -1
    stream: bool = False
    stop: list[str] | str | None = None
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1
    logit_bias: dict[str, float] | list[Any] | None = None
    grammar: str = ""
    json_schema: dict[str, Any] | None = None
    cache_prompt: bool = True
    id_slot: int = -1
    n_probs: int = 0
    ignore_eos: bool = False
    n: int = 1


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ResponseFormat(msgspec.Struct):
    type: str = "text"
    json_schema: dict[str, Any] | None = None
    schema: dict[str, Any] | None = None


class _OpenAISampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 0.8
    top_p: float = 0.95
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[str] | str | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # llama.cpp extensions accepted by llama-server's OpenAI endpoints too
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    ignore_eos: bool = False
    cache_prompt: bool = True
    id_slot: int = -1
    grammar: str = ""
    response_format: ResponseFormat | None = None


class CompletionRequest(_OpenAISampling, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Any] | None = None
    name: str | None = None


class ChatCompletionRequest(_OpenAISampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[int]


# ---- responses -------------------------------------------------------------------------


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class Timings(msgspec.Struct):
    prompt_n: int
    prompt_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float
    cache_n: int = 0


class NativeChunk(msgspec.Struct, omit_defaults=True):
    content: str
    stop: bool
    index: int = 0
    id_slot: int = -1
    tokens: list[int] = msgspec.field(default_factory=list)
    completion_probabilities: list[dict[str, Any]] | None = None


class NativeResult(msgspec.Struct):
    content: str
    stop: bool
    index: int
    id_slot: int
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    tokens_cached: int
    stop_type: str  # "eos" | "word" | "limit"
    stopping_word: str
    truncated: bool
    timings: Timings
    tokens: list[int] = msgspec.field(default_factory=list)
    completion_probabilities: list[dict[str, Any]] | None = None
