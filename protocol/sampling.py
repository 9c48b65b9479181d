"""Sampling parameters of one request, validated once at the HTTP/embedding boundary.

The names, defaults and order of samplers are llama-server's (``common_params_sampling`` in
the llama.cpp that llama-cpp-python 0.3.36 vendors), so that the same request gives the same
tokens on both servers. The engine turns these into a llama.cpp sampler chain
(``runtime.sampling``); this module only says what a request may ask for and its bounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_N_PROBS = 20
MAX_DRY_BREAKERS = 32
MAX_GRAMMAR_TRIGGERS = 64
MAX_GRAMMAR_TRIGGER_CHARS = 128
MAX_DRY_BREAKER_CHARS = 40  # llama.cpp truncates longer breakers; we refuse them instead
DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: llama.cpp picks a random seed

# llama-server's default sampler order (common_params_sampling::samplers).
DEFAULT_SAMPLERS = (
    "penalties",
    "dry",
    "top_n_sigma",
    "top_k",
    "typ_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
)
_CANONICAL = frozenset((*DEFAULT_SAMPLERS, "infill", "adaptive_p"))
# The aliases llama.cpp's common_sampler_types_from_names accepts, and its one-letter codes.
SAMPLER_ALIASES: dict[str, str] = {
    **{name: name for name in _CANONICAL},
    **{name.replace("_", "-"): name for name in _CANONICAL if "_" in name},
    **{name.replace("_", ""): name for name in _CANONICAL if "_" in name},
    "nucleus": "top_p",
    "temp": "temperature",
    "typ": "typ_p",
    "typical_p": "typ_p",
    "typical": "typ_p",
}
SAMPLER_CHARS: dict[str, str] = {
    "d": "dry",
    "k": "top_k",
    "y": "typ_p",
    "p": "top_p",
    "s": "top_n_sigma",
    "m": "min_p",
    "t": "temperature",
    "x": "xtc",
    "i": "infill",
    "e": "penalties",
    "a": "adaptive_p",
}
DEFAULT_DRY_BREAKERS = ("\n", ":", '"', "*")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each next token. ``temperature <= 0`` means greedy.

    ``repeat_last_n`` and ``dry_penalty_last_n`` of -1 mean "the whole slot context".
    """

    temperature: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # adaptive-p (llama.cpp's llama_sampler_init_adaptive_p), used where ``samplers`` lists
    # "adaptive_p": it picks the token (instead of dist) near ``adaptive_target``'s probability,
    # the target adapting with ``adaptive_decay``; a negative target turns it into dist's pick
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9
    min_keep: int = 0
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    seed: int = DEFAULT_SEED
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str = ""
    # Lazy grammar (for tool calls): the grammar engages only once the generated text ends with one of
    # these literal words, and is fed from that word on (llama.cpp's lazy grammar sampler);
    # until then nothing is constrained, so plain answers cost no grammar work.
    grammar_lazy: bool = False
    grammar_triggers: tuple[str, ...] = ()
    n_probs: int = 0
    # n_probs read after the sampler chain (llama-server's post_sampling_probs), and a
    # time limit on the prediction phase that stops at a newline once exceeded (0: none).
    post_sampling_probs: bool = False
    t_max_predict_ms: int = 0
    # speculative decoding: the request's speculative.n_max / n_min / p_min (llama-server's names); None: the
    # server's (--spec-draft-n-max ...). n_max 0 turns speculation off for this request. Admission
    # resolves them over the server's once (``messages.Task.speculation``, what the engine reads).
    speculative_n_max: int | None = None
    speculative_n_min: int | None = None
    speculative_p_min: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 and self.mirostat == 0

    @property
    def penalized(self) -> bool:
        """Penalties or DRY are on: their samplers must see the prompt, as in llama-server."""
        return self.penalties_on or self.dry_on

    @property
    def penalties_on(self) -> bool:
        return (
            "penalties" in self.samplers
            and self.repeat_last_n != 0
            and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)
        )

    @property
    def dry_on(self) -> bool:
        return "dry" in self.samplers and self.dry_multiplier != 0.0 and self.dry_penalty_last_n != 0


class ParamError(ValueError):
    """A request field is out of range; the message names the field and the bound."""


def sampler_names(raw: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """llama-server's ``samplers`` field: a list of names (aliases allowed) or a string of letters."""
    if isinstance(raw, str):
        unknown = [c for c in raw if c not in SAMPLER_CHARS]
        if unknown:
            raise ParamError(
                f"samplers: unknown sampler letter(s) {''.join(unknown)!r}; known: {''.join(SAMPLER_CHARS)}"
            )
        return tuple(SAMPLER_CHARS[c] for c in raw)
    out = []
    for name in raw:
        canonical = SAMPLER_ALIASES.get(str(name).lower())
        if canonical is None:
            raise ParamError(f"samplers: unknown sampler {name!r}; known: {', '.join(sorted(_CANONICAL))}")
        out.append(canonical)
    return tuple(out)


_FINITE = (
    "temperature",
    "dynatemp_range",
    "dynatemp_exponent",
    "top_p",
    "min_p",
    "typical_p",
    "top_n_sigma",
    "xtc_probability",
    "xtc_threshold",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "dry_multiplier",
    "dry_base",
    "mirostat_tau",
    "mirostat_eta",
    "adaptive_target",
    "adaptive_decay",
)
_INT32_MAX = 2**31 - 1


def check_sampling(p: SamplingParams, n_vocab: int) -> None:
    """Raise ParamError for values llama.cpp would misbehave on. Called once per request."""
    for name in _FINITE:
        value = getattr(p, name)
        if not math.isfinite(value):
            raise ParamError(f"{name} must be a finite number, got {value}")
    _range("top_p", p.top_p, 0.0, 1.0)
    _range("min_p", p.min_p, 0.0, 1.0)
    _range("xtc_probability", p.xtc_probability, 0.0, 1.0)
    _range("xtc_threshold", p.xtc_threshold, 0.0, 1.0)
    if p.repeat_penalty <= 0:
        raise ParamError(f"repeat_penalty must be greater than 0, got {p.repeat_penalty}")
    if p.adaptive_target > 1.0:
        raise ParamError(f"adaptive_target must be at most 1.0 (negative: off), got {p.adaptive_target}")
    _range("adaptive_decay", p.adaptive_decay, 0.0, 0.99)
    if p.mirostat not in (0, 1, 2):
        raise ParamError(f"mirostat must be 0, 1 or 2, got {p.mirostat}")
    for name in ("top_k", "repeat_last_n", "dry_allowed_length", "dry_penalty_last_n", "min_keep"):
        value = getattr(p, name)
        low = -1 if name in ("repeat_last_n", "dry_penalty_last_n") else 0
        if name == "top_k":
            low = -_INT32_MAX  # llama.cpp: top_k <= 0 means the whole vocabulary
        _range(name, value, low, _INT32_MAX)
    if p.seed < 0 or p.seed > DEFAULT_SEED:
        raise ParamError(f"seed must be in [0, {DEFAULT_SEED}], got {p.seed}")
    if p.t_max_predict_ms < -1:
        raise ParamError(f"t_max_predict_ms must be >= -1, got {p.t_max_predict_ms}")
    if p.n_probs < 0 or p.n_probs > MAX_N_PROBS:
        raise ParamError(f"n_probs must be in [0, {MAX_N_PROBS}], got {p.n_probs}")
    if len(p.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ParamError(f"logit_bias has {len(p.logit_bias)} entries, at most {MAX_LOGIT_BIAS_ENTRIES}")
    for token, bias in p.logit_bias:
        if not 0 <= token < n_vocab:
            raise ParamError(f"logit_bias token id {token} is outside the vocabulary [0, {n_vocab})")
        if math.isnan(bias) or bias == math.inf:
            raise ParamError(f"logit_bias for token {token} must be a number or -inf/false, got {bias}")
    banned = {token for token, bias in p.logit_bias if bias == -math.inf}
    if len(banned) >= n_vocab:
        raise ParamError("logit_bias bans every token of the vocabulary: nothing could be sampled")
    if not p.dry_sequence_breakers:
        raise ParamError("dry_sequence_breakers must be a non-empty array of strings")
    _check_words(
        "dry_sequence_breakers", "entry", "entries", p.dry_sequence_breakers, MAX_DRY_BREAKERS, MAX_DRY_BREAKER_CHARS
    )
    sampler_names(p.samplers)  # every name known
    _check_speculative(p)
    _check_triggers(p)
    if "infill" in p.samplers:
        raise ParamError("samplers: 'infill' is only meaningful for /infill, which this server does not offer yet")


def _check_speculative(p: SamplingParams) -> None:
    """llama-server's hard limits of the speculative.* fields."""
    for name, value in (("speculative.n_max", p.speculative_n_max), ("speculative.n_min", p.speculative_n_min)):
        if value is not None:
            _range(name, value, 0, _INT32_MAX)
    if p.speculative_p_min is not None:
        if not math.isfinite(p.speculative_p_min):
            raise ParamError(f"speculative.p_min must be a finite number, got {p.speculative_p_min}")
        _range("speculative.p_min", p.speculative_p_min, 0.0, 1.0)


def _check_triggers(p: SamplingParams) -> None:
    if p.grammar_lazy and not (p.grammar and p.grammar_triggers):
        raise ParamError("grammar_lazy needs a grammar and at least one grammar_triggers word")
    if p.grammar_triggers and not p.grammar_lazy:
        raise ParamError("grammar_triggers are only meaningful with grammar_lazy")
    _check_words(
        "grammar_triggers", "word", "words", p.grammar_triggers, MAX_GRAMMAR_TRIGGERS, MAX_GRAMMAR_TRIGGER_CHARS
    )


def _check_words(field: str, one: str, many: str, words: Sequence[str], max_words: int, max_chars: int) -> None:
    """At most ``max_words`` entries, each 1 to ``max_chars`` characters without NUL."""
    if len(words) > max_words:
        raise ParamError(f"{field} has {len(words)} {many}, at most {max_words}")
    for word in words:
        if not word or len(word) > max_chars or "\x00" in word:
            raise ParamError(f"each {field} {one} must be 1 to {max_chars} characters without NUL, got {word!r}")


def _range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ParamError(f"{name} must be in [{low}, {high}], got {value}")


def check_stop(stop: tuple[str, ...]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise ParamError(f"too many stop strings: {len(stop)}, at most {MAX_STOP_STRINGS}")
    for s in stop:
        if not s:
            raise ParamError("stop strings must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ParamError(f"stop string longer than {MAX_STOP_STRING_CHARS} characters")
