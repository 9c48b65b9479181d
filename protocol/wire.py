"""HTTP bodies: llama-server's native API and the OpenAI API.

Requests are decoded straight into these Structs (``msgspec.json.decode(body, type=...)``),
so a wrong type is a 400 whose message names the field. Request bodies accept unknown fields
(clients send extras, as llama-server tolerates); the small utility endpoints are strict.
msgspec allows one array-like type per union, so fields that are "a string or a list of
anything" are typed loosely here and narrowed in ``runtime.requests``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from llamactor.protocol.chat import ChatMessage, NamedToolChoice, Tool
from llamactor.protocol.lora import LoraScale
from llamactor.protocol.request import InfillChunk

DEFAULT_MAX_TOKENS_OPENAI_COMPLETIONS = 16


LoraEntry = LoraScale  # a request's ``lora`` item, and ``POST /lora-adapters``'s


class _Generation(msgspec.Struct, kw_only=True):
    """Fields both APIs share, named as llama-server names them.

    A field left out (or sent as null, as llama-server reads null) is None: the server's
    default fills it in (``RuntimeConfig.sampling`` and friends, set by llama-server's flags
    such as ``--temp``), in ``Runtime.submit``.
    """

    stream: bool = False
    stop: list[str] | str | None = None
    n: int = 1
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    typical_p: float | None = None
    top_n_sigma: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    adaptive_target: float | None = None  # adaptive-p (samplers "adaptive_p"): negative off
    adaptive_decay: float | None = None
    min_keep: int | None = None
    samplers: list[str] | str | None = None
    grammar: str = ""
    cache_prompt: bool | None = None
    id_slot: int = -1
    ignore_eos: bool | None = None
    n_keep: int | None = None  # context shift: prompt tokens kept; -1 all; None: the server's --keep
    n_discard: int | None = None  # tokens dropped per shift; 0/None: half of what is not kept
    n_cache_reuse: int | None = None  # min chunk reused from the slot's cache by KV shifting; None: --cache-reuse
    # streaming knobs, as llama-server has them
    sse_ping_interval: int | None = (
        None  # seconds of silence before an SSE ": ping"; <= 0 none; None: --sse-ping-interval
    )
    return_progress: bool = False  # stream prompt-processing progress chunks (``prompt_progress``)
    timings_per_token: bool = False  # each streamed chunk carries ``timings`` so far
    # OpenAI answers (not streamed) carry ``__verbose``: the native answer and the prompt text;
    # None: when the server runs with -v
    verbose: bool | None = None
    t_max_predict_ms: int | None = None  # stop at a newline once the prediction phase took longer
    post_sampling_probs: bool = False  # n_probs after the sampler chain, as "prob"/"top_probs"
    lora: list[LoraScale] | None = None  # LoRA adapters and scales; None (or []): the global scales
    # speculative decoding of this request, llama-server's dotted names; None: the server's
    speculative_n_max: int | None = msgspec.field(default=None, name="speculative.n_max")  # 0: off
    speculative_n_min: int | None = msgspec.field(default=None, name="speculative.n_min")
    speculative_p_min: float | None = msgspec.field(default=None, name="speculative.p_min")
    # scheduling: vLLM's request priority (lower first, under the priority policy) and free-form
    # labels a scheduling policy may read
    priority: int = 0
    tags: dict[str, str] | None = None


class NativeCompletionRequest(_Generation, kw_only=True):
    # a string, token ids, or llama-server's {"prompt_string": ..., "multimodal_data": [base64, ...]}
    prompt: str | list[Any] | dict[str, Any]
    n_predict: int | None = None
    seed: int | None = None
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
    json_schema: dict[str, Any] | None = None  # llama-server's: as response_format's schema


class CompletionRequest(_OpenAISampling, kw_only=True):
    prompt: str | list[Any] | dict[str, Any]  # as the native one's
    logprobs: int | None = None
    echo: bool = False


class ChatCompletionRequest(_OpenAISampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    n_probs: int = 0  # llama-server's: logprobs with this many alternatives, as logprobs + top_logprobs
    # tool calls and reasoning: typed in protocol.chat, what a type cannot say is checked in
    # runtime.service.chatprepare
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_format: str | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # false: the template's assistant opening is left out
    continue_final_message: bool | None = None  # continue the last (assistant) message


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[int]


# ---- responses -------------------------------------------------------------------------


class ErrorBody(msgspec.Struct, omit_defaults=True):
    message: str
    type: str
    code: int
    # exceed_context_size_error only, as llama-server sends them
    n_prompt_tokens: int | None = None
    n_ctx: int | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class Timings(msgspec.Struct, omit_defaults=True):
    """llama-server's ``timings``: prompt figures count the tokens evaluated (not the cached
    ones); per-token and per-second generation figures count decode steps (the first token
    comes from the prompt's logits)."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: int | None = None  # speculative decoding: only when drafts were verified, as llama-server
    draft_n_accepted: int | None = None


class NativeChunk(msgspec.Struct, omit_defaults=True):
    content: str
    stop: bool
    index: int  # written on every chunk, as llama-server's (0 too)
    id_slot: int = -1
    tokens: list[int] = msgspec.field(default_factory=list)
    tokens_predicted: int = 0  # the choice's tokens so far
    tokens_evaluated: int = 0  # the prompt's tokens
    completion_probabilities: list[dict[str, Any]] | None = None
    timings: Timings | None = None  # timings_per_token: the request's timings so far


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
    truncated: bool  # the context was shifted; a prompt longer than the slot is refused, never cut
    timings: Timings
    generation_settings: dict[str, Any] = msgspec.field(default_factory=dict)
    prompt: str = ""  # the prompt's text as the model read it
    has_new_line: bool = False  # the generated text has a newline
    tokens: list[int] = msgspec.field(default_factory=list)
    # n_probs: left out when not asked, as llama-server leaves it
    completion_probabilities: list[dict[str, Any]] | msgspec.UnsetType = msgspec.UNSET


# ---- embeddings and rerank ---------------------------------------------------------------
# ``input``/``content`` stay loose (a string, token ids, or a list of either) and are narrowed
# in ``runtime.service.embeddings``, which names the bad item.


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """``/v1/embeddings`` (``input``) and the native ``/embedding(s)`` (``content`` or ``input``)."""

    input: str | list[Any] | None = None
    content: str | list[Any] | None = None
    model: str | None = None
    encoding_format: str = "float"  # float | base64 (OpenAI API only)
    embd_normalize: int | None = None  # llama.cpp's: -1 none, 0 max-abs, 1 taxicab, 2 euclidean, >2 p-norm
    dimensions: int | None = None  # OpenAI's; only the model's own width is accepted
    user: str | None = None


class RerankRequest(msgspec.Struct, kw_only=True):
    """``/rerank`` and aliases: Jina/Cohere shape (``documents``) or TEI shape (``texts``)."""

    query: Any = None
    documents: list[Any] | None = None
    texts: list[Any] | None = None
    top_n: int | None = None
    return_text: bool = False  # TEI: add "text" to each result
    return_documents: bool = False  # Jina/Cohere: add "document": {"text"} to each result
    model: str | None = None


class EmbeddingData(msgspec.Struct, omit_defaults=True):
    embedding: list[float] | str  # floats, or base64 of little-endian float32
    index: int
    object: str  # "embedding" (always sent: omit_defaults would drop a default)
    encoding_format: str | None = None  # "base64" on base64 items, as llama-server marks them


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


class NativeEmbedding(msgspec.Struct):
    """One input of the native ``/embedding(s)``: a list holding the pooled vector, or one
    vector per token with pooling none."""

    index: int
    embedding: list[list[float]]


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(msgspec.Struct):
    model: str
    usage: EmbeddingUsage
    results: list[RerankResult]
    object: str = "list"


class TeiRerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    score: float
    text: str | None = None


# ---- /infill ---------------------------------------------------------------------------------


class InfillRequest(NativeCompletionRequest, kw_only=True):
    """llama-server's /infill body: the native completion fields plus the FIM inputs."""

    prompt: str = ""  # text after FIM_MID (the start of the middle), a string only here
    input_prefix: str | list[Any] | None = None  # required: None is answered as llama-server does
    input_suffix: str | list[Any] | None = None
    input_extra: list[InfillChunk] = []
