"""Turn decoded HTTP bodies (``protocol.wire``) into ``Runtime.submit`` arguments.

Every narrowing the wire types could not express (prompt shapes, logit-bias forms, chat
content parts, response_format) happens here, with a RequestError naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

import msgspec

from llamactor.protocol.sampling import DEFAULT_SEED, ParamError, SamplingParams, sampler_names
from llamactor.protocol.wire import (
    DEFAULT_MAX_TOKENS_OPENAI_COMPLETIONS, ChatCompletionRequest, CompletionRequest,
    NativeCompletionRequest, ResponseFormat,
)
from llamactor.protocol.errors import RequestError
from llamactor.runtime.service.chatturn import ChatTurn
from llamactor.runtime.service.config import RuntimeConfig

if TYPE_CHECKING:
    from llamactor.runtime.service.core import RuntimeCore

NEG_INF_BIAS = float("-inf")
# Request fields named as SamplingParams names them; a field the request leaves out (None)
# takes the server's default, ``RuntimeConfig.sampling`` (API-15).
_SAME_NAME = (
    "temperature", "dynatemp_range", "dynatemp_exponent", "top_k", "top_p", "min_p", "typical_p", "top_n_sigma",
    "xtc_probability", "xtc_threshold", "repeat_penalty", "repeat_last_n", "presence_penalty",
    "frequency_penalty", "dry_multiplier", "dry_allowed_length", "dry_penalty_last_n", "mirostat",
    "mirostat_tau", "mirostat_eta", "min_keep", "speculative_n_max", "speculative_n_min", "speculative_p_min",
)


@dataclass
class Submission:
    prompt: str | list[int]
    max_tokens: int
    params: SamplingParams
    stop: tuple[str, ...] = ()
    n: int = 1
    id_slot: int = -1
    cache_prompt: bool = True
    ignore_eos: bool = False
    n_keep: int | None = None  # context shift (EN-4); None: the server's --keep
    n_discard: int = 0
    return_progress: bool = False
    lora: list[Any] | None = None  # EN-1: [LoraEntry]; None: the global scales
    extra: dict[str, Any] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        return dict(
            max_tokens=self.max_tokens, params=self.params, stop=self.stop, n=self.n,
            id_slot=self.id_slot, cache_prompt=self.cache_prompt, ignore_eos=self.ignore_eos,
            n_keep=self.n_keep, n_discard=self.n_discard, return_progress=self.return_progress, lora=self.lora,
        )


def prompt_of(raw: str | list[Any]) -> str | list[int]:
    """A prompt is a string, a list of token ids, or a one-element list holding either."""
    if isinstance(raw, str):
        return raw
    if len(raw) == 1 and isinstance(raw[0], (str, list)):
        return prompt_of(raw[0])
    if all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return list(raw)
    raise RequestError("prompt must be a string or a list of token ids (one prompt per request)")


def stop_of(raw: list[str] | str | None, defaults: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The request's stop strings; none (or only empty ones) means the server's (-r), as in llama-server."""
    stops = () if raw is None else (raw,) if isinstance(raw, str) else tuple(raw)
    return stops if any(stops) else defaults


def logit_bias_of(raw: dict[str, float] | list[Any] | None) -> tuple[tuple[int, float], ...]:
    if not raw:
        return ()
    out: list[tuple[int, float]] = []
    items = raw.items() if isinstance(raw, dict) else raw
    for item in items:
        try:
            tok, bias = item
            token = int(tok)
            value = NEG_INF_BIAS if bias is False else float(bias)
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias entries must be [token_id, bias], got {item!r}") from None
        out.append((token, value))
    return tuple(out)


def seed_of(raw: int) -> int:
    """A seed of -1 (any negative) asks for a random one, even on a server started with --seed."""
    return DEFAULT_SEED if raw < 0 else raw


def grammar_of(grammar: str, schema: dict[str, Any] | None, fmt: ResponseFormat | None) -> str:
    """An explicit grammar wins; else a JSON schema (native ``json_schema`` or response_format)."""
    if grammar:
        return grammar
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            schema = schema or fmt.schema
            if schema is None:
                return JSON_GBNF
        elif fmt.type == "json_schema":
            wrapped = fmt.json_schema or {}
            schema = wrapped.get("schema", wrapped) if isinstance(wrapped, dict) else None
            if not schema or not isinstance(schema, dict):
                raise RequestError("response_format json_schema needs a 'json_schema.schema' object")
        else:
            raise RequestError(f"response_format type must be text, json_object or json_schema, got {fmt.type!r}")
    if schema is None:
        return ""
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # noqa: BLE001 - the converter raises many kinds on bad schemas
        raise RequestError(f"unsupported JSON schema: {exc}") from None


def sampling_of(req: NativeCompletionRequest | CompletionRequest | ChatCompletionRequest, defaults: SamplingParams, *,
                grammar: str, n_probs: int) -> SamplingParams:
    """The sampling fields every generation body shares (same names in both APIs), over the
    server's defaults: a field the request leaves out keeps the default."""
    given: dict[str, Any] = {name: getattr(req, name) for name in _SAME_NAME if getattr(req, name) is not None}
    try:
        if req.samplers is not None:
            given["samplers"] = sampler_names(req.samplers)
    except ParamError as exc:
        raise RequestError(str(exc)) from None
    if req.dry_sequence_breakers is not None:
        given["dry_sequence_breakers"] = tuple(req.dry_sequence_breakers)
    if req.dry_base is not None and req.dry_base >= 1.0:  # llama-server: a dry_base below 1 keeps the default
        given["dry_base"] = req.dry_base
    if req.seed is not None:
        given["seed"] = seed_of(req.seed)
    if req.logit_bias:
        given["logit_bias"] = logit_bias_of(req.logit_bias)
    if grammar:
        given["grammar"] = grammar
    if req.t_max_predict_ms is not None:
        given["t_max_predict_ms"] = req.t_max_predict_ms
    if req.post_sampling_probs:
        given["post_sampling_probs"] = True
    return msgspec.structs.replace(defaults, n_probs=n_probs, **given)


def _submission(req: NativeCompletionRequest | CompletionRequest | ChatCompletionRequest, cfg: RuntimeConfig,
                prompt: str | list[int], max_tokens: int, params: SamplingParams) -> Submission:
    return Submission(
        prompt, max_tokens, params, stop_of(req.stop, cfg.stop), req.n, req.id_slot,
        cfg.cache_prompt if req.cache_prompt is None else req.cache_prompt,
        cfg.ignore_eos if req.ignore_eos is None else req.ignore_eos,
        req.n_keep, req.n_discard or 0, req.return_progress and bool(req.stream), req.lora,
    )


def from_native(req: NativeCompletionRequest, cfg: RuntimeConfig) -> Submission:
    params = sampling_of(req, cfg.sampling, grammar=grammar_of(req.grammar, req.json_schema, None), n_probs=req.n_probs)
    return _submission(req, cfg, prompt_of(req.prompt), -1 if req.n_predict is None else req.n_predict, params)


def _openai_params(req: CompletionRequest | ChatCompletionRequest, cfg: RuntimeConfig, n_probs: int) -> SamplingParams:
    return sampling_of(req, cfg.sampling, grammar=grammar_of(req.grammar, None, req.response_format), n_probs=n_probs)


def from_completion(req: CompletionRequest, cfg: RuntimeConfig) -> Submission:
    """OpenAI's default of 16 tokens, unless the server sets one with -n (as llama-server does)."""
    default = cfg.n_predict_max if cfg.n_predict_max > 0 else DEFAULT_MAX_TOKENS_OPENAI_COMPLETIONS
    max_tokens = default if req.max_tokens is None else req.max_tokens
    n_probs = 0 if req.logprobs is None else max(req.logprobs, 1)
    return _submission(req, cfg, prompt_of(req.prompt), max_tokens, _openai_params(req, cfg, n_probs))


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as OpenAI-shaped dicts (fields left out dropped), for ``prepare_chat``."""
    return [msgspec.to_builtins(m) for m in req.messages]


def chat_turn(rt: RuntimeCore, req: ChatCompletionRequest, *, add_generation_prompt: bool = True) -> ChatTurn:
    """Render the request and choose its call grammar (API-8, API-9), in the service layer."""
    return rt.prepare_chat(
        chat_messages(req), tools=None if req.tools is None else msgspec.to_builtins(req.tools),
        tool_choice=msgspec.to_builtins(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        reasoning_format=req.reasoning_format, reasoning_effort=req.reasoning_effort,
        chat_template_kwargs=req.chat_template_kwargs, add_generation_prompt=add_generation_prompt,
    )


def from_chat(req: ChatCompletionRequest, turn: ChatTurn, cfg: RuntimeConfig) -> Submission:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    n_probs = (req.top_logprobs or 1) if req.logprobs else 0
    params = turn.sampling(_openai_params(req, cfg, n_probs))  # adds the tool-call grammar
    return _submission(req, cfg, turn.prompt, -1 if max_tokens is None else max_tokens, params)
