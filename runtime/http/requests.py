"""Each HTTP API's body mapped to the one ``GenerationRequest``, in one function per API.

The wire Structs (``protocol.wire``) hold llama-server's and OpenAI's JSON shapes; here they
become the request the embedding API would build: the sampling fields by their shared names,
then what differs between APIs (the native ``n_predict`` and ``json_schema``, OpenAI's
``max_tokens``, ``logprobs`` and ``response_format``, the prompt shapes, the logit-bias forms).
Server defaults are not applied here: a field the body leaves out stays None, and admission
fills it in (the one place). Narrowings the wire types could not express raise a RequestError
naming the field.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from llama_cpp.llama_grammar import JSON_GBNF

from llamactor.protocol.errors import RequestError
from llamactor.protocol.request import SAMPLING_FIELDS, GenerationRequest, InfillChunk, InfillParts
from llamactor.protocol.wire import (
    ChatCompletionRequest,
    CompletionRequest,
    InfillRequest,
    NativeCompletionRequest,
    ResponseFormat,
)

NEG_INF_BIAS = float("-inf")
# Sampling fields each body carries under the request's own name (the rest are mapped below).
_SAMPLING_BY_NAME = tuple(
    name for name in SAMPLING_FIELDS if name not in ("seed", "logit_bias", "grammar", "n_probs", "post_sampling_probs")
)

Body = NativeCompletionRequest | CompletionRequest | ChatCompletionRequest

_TOKEN_ID = re.compile(r"\s*-?[0-9]+\s*")  # a logit_bias key that names a token by its id


def from_native(body: NativeCompletionRequest) -> GenerationRequest:
    """``POST /completion``: llama-server's native body."""
    prompt, files = prompt_media_of(body.prompt)
    return _request(
        body,
        prompt=prompt,
        multimodal_data=files,
        max_tokens=body.n_predict,
        json_schema=body.json_schema,
        n_probs=body.n_probs or None,
        logit_bias=logit_bias_of(body.logit_bias),
    )


def from_infill(body: InfillRequest) -> GenerationRequest:
    """``POST /infill``: the native body plus the FIM inputs (``prompt`` is the middle's start)."""
    for name in ("input_prefix", "input_suffix"):
        if getattr(body, name) is None:
            raise RequestError(f'"{name}" is required')
    assert body.input_prefix is not None and body.input_suffix is not None
    extra = tuple(InfillChunk(text=c.text, filename=c.filename) for c in body.input_extra)
    parts = InfillParts(input_prefix=body.input_prefix, input_suffix=body.input_suffix, input_extra=extra)
    return msgspec.structs.replace(
        from_native(msgspec.structs.replace(body, prompt="")), prompt=body.prompt, infill=parts
    )


def from_completion(body: CompletionRequest, default_max_tokens: int) -> GenerationRequest:
    """``POST /v1/completions``. ``default_max_tokens``: OpenAI's 16, or the server's -n when it
    sets one (as llama-server does)."""
    prompt, files = prompt_media_of(body.prompt)
    return _request(
        body,
        prompt=prompt,
        multimodal_data=files,
        max_tokens=default_max_tokens if body.max_tokens is None else body.max_tokens,
        n_probs=None if body.logprobs is None else max(body.logprobs, 1),
        **_openai_output(body),
    )


def from_chat(body: ChatCompletionRequest) -> GenerationRequest:
    """``POST /v1/chat/completions`` (and the Responses and Anthropic bodies converted to it)."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _request(
        body,
        messages=body.messages,  # decoded typed with the body: the chat path reads them as they are
        tools=body.tools,
        tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        reasoning_format=body.reasoning_format,
        reasoning_effort=body.reasoning_effort,
        chat_template_kwargs=body.chat_template_kwargs,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        max_tokens=max_tokens,
        n_probs=(body.top_logprobs or 1) if body.logprobs else (body.n_probs if body.n_probs > 0 else None),
        **_openai_output(body),
    )


def _request(body: Body, **fields: Any) -> GenerationRequest:
    """The fields every generation body shares (same names in every API), and ``fields``."""
    sampling = {name: getattr(body, name) for name in _SAMPLING_BY_NAME if getattr(body, name) is not None}
    if body.seed is not None:
        sampling["seed"] = body.seed
    if body.grammar:
        sampling["grammar"] = body.grammar
    if body.post_sampling_probs:
        sampling["post_sampling_probs"] = True
    lora = body.lora or None
    request = GenerationRequest(
        **sampling,
        **fields,
        stop=body.stop,
        n=body.n,
        id_slot=body.id_slot,
        cache_prompt=body.cache_prompt,
        ignore_eos=body.ignore_eos,
        n_keep=body.n_keep,
        n_discard=body.n_discard or 0,
        n_cache_reuse=body.n_cache_reuse,
        return_progress=body.return_progress and body.stream,
        timings_per_token=body.timings_per_token and body.stream,
        lora=lora,
        priority=body.priority,
        tags=body.tags or {},
    )
    return request


def _openai_output(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """OpenAI's ``logit_bias`` (a map) and ``response_format`` (a grammar or a JSON schema)."""
    out: dict[str, Any] = {"logit_bias": logit_bias_of(body.logit_bias)}
    fmt = body.response_format
    if body.grammar or fmt is None or fmt.type == "text":
        if not body.grammar and body.json_schema is not None:  # llama-server's own field
            out["json_schema"] = body.json_schema
        return out
    schema = response_schema(fmt)
    if schema is None:
        out["grammar"] = JSON_GBNF
    else:
        out["json_schema"] = schema
    return out


def response_schema(fmt: ResponseFormat) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` asks for; None for any JSON object."""
    if fmt.type == "json_object":
        return fmt.schema
    if fmt.type == "json_schema":
        wrapped = fmt.json_schema or {}
        schema = wrapped.get("schema", wrapped) if isinstance(wrapped, dict) else None
        if not schema or not isinstance(schema, dict):
            raise RequestError("response_format json_schema needs a 'json_schema.schema' object")
        return schema
    raise RequestError(f"response_format type must be text, json_object or json_schema, got {fmt.type!r}")


def prompt_media_of(raw: str | Sequence[Any] | Mapping[str, Any]) -> tuple[str | list[int | str], tuple[bytes, ...]]:
    """A prompt (``prompt_of``) and its images: llama-server's multimodal prompt is an object,
    ``{"prompt_string": "... <__media__> ...", "multimodal_data": ["<base64>", ...]}``, alone
    or as a one-element list."""
    if not isinstance(raw, str) and len(raw) == 1 and isinstance(raw, Sequence) and isinstance(raw[0], Mapping):
        raw = raw[0]
    if not isinstance(raw, Mapping):
        return prompt_of(raw), ()
    text = raw.get("prompt_string")
    if not isinstance(text, str):
        raise RequestError('prompt: an object prompt needs a "prompt_string" string')
    data = raw.get("multimodal_data", [])
    if not isinstance(data, list) or not all(isinstance(d, str) for d in data):
        raise RequestError("prompt.multimodal_data must be an array of base64 strings")
    files = []
    for i, entry in enumerate(data):
        try:
            files.append(base64.b64decode("".join(entry.split()), validate=True))
        except (binascii.Error, ValueError):
            raise RequestError(f"prompt.multimodal_data[{i}] is not valid base64") from None
    return text, tuple(files)


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


# prompts one /completion may carry: each is a task admitted at once, so the count is bounded
# like Vertex's instances (llama-server has no bound)
MAX_PROMPTS = 128


def several_prompts(raw: Any) -> list[Any] | None:
    """llama-server's several prompts in one /completion: an array of two or more prompts, none of
    its items a token id (else it is one prompt of token ids, maybe mixed with texts); None when
    ``raw`` is one prompt."""
    if isinstance(raw, list) and len(raw) > 1 and not any(map(_is_id, raw)):
        if len(raw) > MAX_PROMPTS:
            raise RequestError(f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(raw)}")
        return raw
    return None


def prompt_of(raw: str | Sequence[Any] | Mapping[str, Any]) -> str | list[int | str]:
    """A prompt is a string, a list of token ids (texts among them are tokenized in place, as
    llama-server reads ``[1, 2, "text", 3]``), or a one-element list holding either."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, Mapping):
        raise RequestError("prompt: an object prompt ({prompt_string, multimodal_data}) is read on completions only")
    if len(raw) == 1 and isinstance(raw[0], (str, list)):
        return prompt_of(raw[0])
    if not raw:
        return []  # admission says the prompt is empty
    if all(_is_id(t) or isinstance(t, str) for t in raw) and any(map(_is_id, raw)):
        return list(raw)
    raise RequestError("prompt must be a string or a list of token ids (texts may stand among the ids)")


def logit_bias_of(raw: dict[str, float] | list[Any] | None) -> tuple[tuple[int | str, float], ...] | None:
    """``{"token": bias}`` or ``[[token, bias], ...]``; a bias of false bans the token. As in
    llama-server, a token may be a text (not a number): each of its tokens gets the bias
    (admission tokenizes it)."""
    if not raw:
        return None
    out: list[tuple[int | str, float]] = []
    items = raw.items() if isinstance(raw, dict) else raw
    for item in items:
        try:
            tok, bias = item
            value = NEG_INF_BIAS if bias is False else float(bias)
            if isinstance(tok, bool) or not isinstance(tok, (int, str)):
                raise TypeError
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias entries must be [token id or text, bias], got {item!r}") from None
        # a key of ASCII digits is a token id ("¹" and "٣" are digits to str.isdigit, and texts here)
        token = tok if isinstance(tok, int) else int(tok) if _TOKEN_ID.fullmatch(tok) else tok
        out.append((token, value))
    return tuple(out)
