"""Turn decoded HTTP bodies (``protocol.wire``) into ``Runtime.submit`` arguments.

Every narrowing the wire types could not express (prompt shapes, logit-bias forms, chat
content parts, response_format) happens here, with a RequestError naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from llamactor.protocol.sampling import (
    DEFAULT_DRY_BREAKERS, DEFAULT_SAMPLERS, DEFAULT_SEED, ParamError, SamplingParams, sampler_names,
)
from llamactor.protocol.wire import (
    DEFAULT_MAX_TOKENS_OPENAI_COMPLETIONS, ChatCompletionRequest, CompletionRequest,
    NativeCompletionRequest, ResponseFormat,
)
from llamactor.protocol.errors import RequestError

NEG_INF_BIAS = float("-inf")
_DEFAULTS = SamplingParams()


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
    extra: dict[str, Any] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        return dict(
            max_tokens=self.max_tokens, params=self.params, stop=self.stop, n=self.n,
            id_slot=self.id_slot, cache_prompt=self.cache_prompt, ignore_eos=self.ignore_eos,
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


def stop_of(raw: list[str] | str | None) -> tuple[str, ...]:
    if raw is None:
        return ()
    return (raw,) if isinstance(raw, str) else tuple(raw)


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


def seed_of(raw: int | None) -> int:
    return DEFAULT_SEED if raw is None or raw < 0 else raw


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
            if not schema:
                raise RequestError("response_format json_schema needs a 'json_schema.schema' object")
        else:
            raise RequestError(f"response_format type must be text, json_object or json_schema, got {fmt.type!r}")
    if schema is None:
        return ""
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # noqa: BLE001 - the converter raises many kinds on bad schemas
        raise RequestError(f"unsupported JSON schema: {exc}") from None


def sampling_of(req: NativeCompletionRequest | CompletionRequest | ChatCompletionRequest, *,
                grammar: str, n_probs: int) -> SamplingParams:
    """The sampling fields every generation body shares (same names in both APIs)."""
    try:
        samplers = DEFAULT_SAMPLERS if req.samplers is None else sampler_names(req.samplers)
    except ParamError as exc:
        raise RequestError(str(exc)) from None
    breakers = DEFAULT_DRY_BREAKERS if req.dry_sequence_breakers is None else tuple(req.dry_sequence_breakers)
    return SamplingParams(
        temperature=req.temperature, dynatemp_range=req.dynatemp_range, dynatemp_exponent=req.dynatemp_exponent,
        top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, typical_p=req.typical_p, top_n_sigma=req.top_n_sigma,
        xtc_probability=req.xtc_probability, xtc_threshold=req.xtc_threshold,
        repeat_penalty=req.repeat_penalty, repeat_last_n=req.repeat_last_n,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        # llama-server: a dry_base below 1 is replaced by the default
        dry_multiplier=req.dry_multiplier, dry_base=req.dry_base if req.dry_base >= 1.0 else _DEFAULTS.dry_base,
        dry_allowed_length=req.dry_allowed_length, dry_penalty_last_n=req.dry_penalty_last_n,
        dry_sequence_breakers=breakers,
        mirostat=req.mirostat, mirostat_tau=req.mirostat_tau, mirostat_eta=req.mirostat_eta,
        min_keep=req.min_keep, samplers=samplers,
        seed=seed_of(req.seed), logit_bias=logit_bias_of(req.logit_bias), grammar=grammar, n_probs=n_probs,
    )


def from_native(req: NativeCompletionRequest) -> Submission:
    params = sampling_of(req, grammar=grammar_of(req.grammar, req.json_schema, None), n_probs=req.n_probs)
    return Submission(
        prompt_of(req.prompt), req.n_predict, params, stop_of(req.stop), req.n, req.id_slot,
        req.cache_prompt, req.ignore_eos,
    )


def _openai_params(req: CompletionRequest | ChatCompletionRequest, n_probs: int) -> SamplingParams:
    return sampling_of(req, grammar=grammar_of(req.grammar, None, req.response_format), n_probs=n_probs)


def from_completion(req: CompletionRequest) -> Submission:
    max_tokens = DEFAULT_MAX_TOKENS_OPENAI_COMPLETIONS if req.max_tokens is None else req.max_tokens
    return Submission(
        prompt_of(req.prompt), max_tokens, _openai_params(req, 0 if req.logprobs is None else max(req.logprobs, 1)), stop_of(req.stop), req.n,
        req.id_slot, req.cache_prompt, req.ignore_eos,
    )


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    if not req.messages:
        raise RequestError("messages must not be empty")
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise RequestError(f"messages[{i}].content: only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        out.append({"role": m.role, "content": content or ""})
    return out


def from_chat(req: ChatCompletionRequest, prompt: str) -> Submission:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    n_probs = (req.top_logprobs or 1) if req.logprobs else 0
    return Submission(
        prompt, -1 if max_tokens is None else max_tokens, _openai_params(req, n_probs), stop_of(req.stop), req.n,
        req.id_slot, req.cache_prompt, req.ignore_eos,
    )
