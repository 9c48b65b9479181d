"""``GenerationRequest``: the one description of a generation request, from the edge to the engine.

Every way in builds this Struct and nothing else: each HTTP API maps its body to it in one
function (``runtime.http.requests``), and the embedding API's ``complete``/``stream``/
``submit``/``chat`` take its fields as typed keyword arguments. Admission
(``runtime.service.admission``) then resolves the server's defaults once, turns the prompt,
messages or fill-in-the-middle parts into tokens, and hands the engine a task that carries this
same request (stripped of its prompt forms) beside the values it resolved.

A field left as None takes the server's default (the sampling flags such as ``--temp``,
``-r``, ``--keep``, ``--no-cache-prompt``, ``--ignore-eos``; the global LoRA scales). Sampling
fields carry llama-server's names and meanings (``SamplingParams`` documents them).

``validated`` checks the types of a request built in Python (a Struct's constructor does not),
so ``temperature="hot"`` is a ``RequestError`` naming ``temperature``; values are checked at
admission, against the loaded model. A chat's messages and tools may be given as OpenAI-shaped
dicts: ``validated`` decodes them into the ``protocol.chat`` Structs, as an HTTP body is
decoded, so the chat path reads one typed shape whichever way the request came in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from llamactor.protocol.chat import ChatMessage, NamedToolChoice, Tool
from llamactor.protocol.errors import RequestError
from llamactor.protocol.lora import LoraScale
from llamactor.protocol.sampling import SamplingParams


class InfillChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One file of ``input_extra``: repository-level context placed before the prefix."""

    text: str
    filename: str = "tmp"


class InfillParts(msgspec.Struct, frozen=True, kw_only=True):
    """A fill-in-the-middle request: the text (or tokens, or a mix) around the gap, and other
    files as context. ``GenerationRequest.prompt`` is then the start of the middle."""

    input_prefix: str | Sequence[Any]
    input_suffix: str | Sequence[Any]
    input_extra: Sequence[InfillChunk] = ()


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """What one generation request asks for. Exactly one of ``prompt``, ``messages`` and
    ``infill`` says what to continue (``prompt`` may go with ``infill``, as the middle's start)."""

    # ---- what to continue -------------------------------------------------------------
    prompt: str | Sequence[int | str] = ""  # text, or token ids (texts among them are tokenized in place)
    messages: Sequence[ChatMessage] | None = None  # a chat, OpenAI-shaped, rendered by the chat template
    infill: InfillParts | None = None  # fill in the middle (the model's FIM tokens)
    add_special: bool = True  # a text prompt gets the model's BOS token (and the like)
    # --mmproj: the image files (png, jpeg, ...) of a text ``prompt``, in order, one per media
    # marker in it (``<__media__>``), as llama-server's ``multimodal_data``. A chat's images
    # come as its messages' ``image_url`` parts instead.
    multimodal_data: Sequence[bytes] = ()

    # ---- chat (with ``messages``) -----------------------------------------------------
    tools: Sequence[Tool] | None = None  # OpenAI-shaped function tools
    tool_choice: str | NamedToolChoice | None = None  # "auto" | "none" | "required" | {"function": {"name"}}
    parallel_tool_calls: bool | None = None
    reasoning_format: str | None = None  # None: the server's --reasoning-format
    reasoning_effort: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None  # over the server's --chat-template-kwargs
    add_generation_prompt: bool = True  # false: the template's assistant opening is left out
    # the last message (the assistant's) is continued, not answered; None: when it is the
    # assistant's, as llama-server's prefill (unless --no-prefill-assistant)
    continue_final_message: bool | None = None

    # ---- how much, how many, when to stop -------------------------------------------
    max_tokens: int | None = None  # None or -1: until EOS or the slot context (capped by the server's -n)
    n: int = 1  # choices, sharing one prompt prefill
    stop: str | Sequence[str] | None = None  # a string is one stop string; None: the server's -r
    ignore_eos: bool | None = None
    t_max_predict_ms: int | None = None  # stop at a newline once generating took longer than this

    # ---- sampling (None: the server's default) ----------------------------------------
    temperature: float | None = None  # <= 0: greedy
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    top_n_sigma: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None  # -1: the whole slot context
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None  # below 1: the default (as llama-server)
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: Sequence[str] | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    adaptive_target: float | None = None  # adaptive-p (samplers "adaptive_p"): tokens near this probability
    adaptive_decay: float | None = None  # adaptive-p: the target's decay over time, 0 to 0.99
    min_keep: int | None = None
    samplers: str | Sequence[str] | None = None  # names (aliases allowed) or a string of letters
    seed: int | None = None  # negative: a random seed
    # -inf bans a token; a text in place of a token id biases each of its tokens (llama-server's)
    logit_bias: Mapping[int | str, float] | Sequence[tuple[int | str, float]] | None = None
    grammar: str | None = None  # GBNF
    json_schema: Mapping[str, Any] | None = None  # output constrained to this JSON schema
    n_probs: int | None = None  # top tokens with probabilities per generated token
    post_sampling_probs: bool | None = None  # probabilities after the sampler chain
    speculative_n_max: int | None = None  # draft tokens; 0 turns speculation off for this request
    speculative_n_min: int | None = None
    speculative_p_min: float | None = None

    # ---- cache, slot, context ---------------------------------------------------------
    cache_prompt: bool | None = None  # reuse a slot's cached prefix; None: the server's
    id_slot: int = -1  # pin a slot (-1: any)
    n_keep: int | None = None  # context shift: prompt tokens kept (-1: all); None: the server's --keep
    n_discard: int = 0  # context shift: tokens dropped per shift (0: half of what is not kept)
    # past the common prefix, chunks of at least this many tokens of the slot's cache are reused
    # by shifting their KV (0: off); None: the server's --cache-reuse
    n_cache_reuse: int | None = None
    lora: Sequence[LoraScale] | None = None  # adapters and scales; None or empty: the global scales
    return_progress: bool = False  # Progress events while the prompt is processed
    timings_per_token: bool = False  # every Token event carries the request's timings so far

    # ---- scheduling -------------------------------------------------------------------
    priority: int = 0  # lower first, under the priority policy (vLLM's field)
    tags: Mapping[str, str] = {}  # free-form labels a scheduling policy may read


# The request fields that are ``SamplingParams`` fields of the same name and meaning; the rest
# of ``SamplingParams`` (the lazy grammar of a tool call) is set by admission, never asked for.
SAMPLING_FIELDS: tuple[str, ...] = tuple(
    name for name in SamplingParams.__struct_fields__ if name in GenerationRequest.__struct_fields__
)
SERVER_SET_SAMPLING = frozenset(SamplingParams.__struct_fields__) - frozenset(SAMPLING_FIELDS)
assert {"grammar_lazy", "grammar_triggers"} == SERVER_SET_SAMPLING, SERVER_SET_SAMPLING


def _builtin(value: Any) -> Any:
    """``msgspec.to_builtins``' hook: numpy arrays (a prompt of token ids) as lists."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"a {type(value).__name__} is not a JSON-like value")


def validated(request: GenerationRequest) -> GenerationRequest:
    """The request with every field's type checked (and sequences made lists); raises
    ``RequestError`` naming the first wrong field. Values are checked at admission."""
    if not isinstance(request, GenerationRequest):
        raise RequestError(f"expected a GenerationRequest, got {type(request).__name__}")
    try:
        return msgspec.convert(msgspec.to_builtins(request, enc_hook=_builtin), GenerationRequest)
    except (msgspec.ValidationError, TypeError) as exc:
        raise RequestError(field_error(str(exc))) from None


def field_error(message: str, field: str = "") -> str:
    """msgspec's "Expected `float | null`, got `str` - at `$.temperature`" as "temperature:
    expected `float | null`, got `str`". ``field``: the field whose value was decoded alone
    (msgspec's ``$``), so "... - at `$[0].function.name`" of ``tools`` is "tools[0].function.name"."""
    text, sep, where = message.rpartition(" - at `")
    if not sep:
        return f"{field}: {message[:1].lower()}{message[1:]}" if field else message
    path = where.rstrip("`").removeprefix("$")
    path = field + path if field else path.removeprefix(".")
    return f"{path or 'request'}: {text[:1].lower()}{text[1:]}"


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """A request's stop strings: a string is one stop string, a list its entries."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def bias_pairs(
    bias: Mapping[int | str, float] | Sequence[tuple[int | str, float]] | None,
) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``(token, bias)`` pairs, in the order given (texts tokenized already)."""
    if not bias:
        return ()
    items = bias.items() if isinstance(bias, Mapping) else bias
    return tuple((int(token), float(value)) for token, value in items)
