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

from llamactor.protocol.sampling import SamplingParams

DEFAULT_MAX_TOKENS_OPENAI_COMPLETIONS = 16


_SAMPLING_DEFAULTS = SamplingParams()


class _Generation(msgspec.Struct, kw_only=True):
    """Fields both APIs share, named as llama-server names them; defaults from SamplingParams."""

    stream: bool = False
    stop: list[str] | str | None = None
    n: int = 1
    temperature: float = _SAMPLING_DEFAULTS.temperature
    top_k: int = _SAMPLING_DEFAULTS.top_k
    top_p: float = _SAMPLING_DEFAULTS.top_p
    min_p: float = _SAMPLING_DEFAULTS.min_p
    repeat_penalty: float = _SAMPLING_DEFAULTS.repeat_penalty
    repeat_last_n: int = _SAMPLING_DEFAULTS.repeat_last_n
    presence_penalty: float = _SAMPLING_DEFAULTS.presence_penalty
    frequency_penalty: float = _SAMPLING_DEFAULTS.frequency_penalty
    dynatemp_range: float = _SAMPLING_DEFAULTS.dynatemp_range
    dynatemp_exponent: float = _SAMPLING_DEFAULTS.dynatemp_exponent
    typical_p: float = _SAMPLING_DEFAULTS.typical_p
    top_n_sigma: float = _SAMPLING_DEFAULTS.top_n_sigma
    xtc_probability: float = _SAMPLING_DEFAULTS.xtc_probability
    xtc_threshold: float = _SAMPLING_DEFAULTS.xtc_threshold
    dry_multiplier: float = _SAMPLING_DEFAULTS.dry_multiplier
    dry_base: float = _SAMPLING_DEFAULTS.dry_base
    dry_allowed_length: int = _SAMPLING_DEFAULTS.dry_allowed_length
    dry_penalty_last_n: int = _SAMPLING_DEFAULTS.dry_penalty_last_n
    dry_sequence_breakers: list[str] | None = None
    mirostat: int = _SAMPLING_DEFAULTS.mirostat
    mirostat_tau: float = _SAMPLING_DEFAULTS.mirostat_tau
    mirostat_eta: float = _SAMPLING_DEFAULTS.mirostat_eta
    min_keep: int = _SAMPLING_DEFAULTS.min_keep
    samplers: list[str] | str | None = None
    grammar: str = ""
    cache_prompt: bool = True
    id_slot: int = -1
    ignore_eos: bool = False


class NativeCompletionRequest(_Generation, kw_only=True):
    prompt: str | list[Any]
    n_predict: int = -1
    seed: int = -1
    logit_bias: dict[str, float] | list[Any] | None = None
    json_schema: dict[str, Any] | None = None
    n_probs: int = 0


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ResponseFormat(msgspec.Struct):
    type: str = "text"
    json_schema: dict[str, Any] | None = None
    schema: dict[str, Any] | None = None


class _OpenAISampling(_Generation, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
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
