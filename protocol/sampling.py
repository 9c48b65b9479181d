"""Sampling parameters of one request, validated once at the HTTP/embedding boundary.

The engine turns these into a llama.cpp sampler chain (``runtime.sampling``); this module
only says what a request may ask for and what its bounds are.
"""

from __future__ import annotations

import msgspec

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_N_PROBS = 20
DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: llama.cpp picks a random seed


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each next token. ``temperature <= 0`` means greedy."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = DEFAULT_SEED
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str = ""
    n_probs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class ParamError(ValueError):
    """A request field is out of range; the message names the field and the bound."""


def check_sampling(p: SamplingParams, n_vocab: int) -> None:
    """Raise ParamError for values llama.cpp would misbehave on. Called once per request."""
    if p.top_p < 0 or p.top_p > 1:
        raise ParamError(f"top_p must be in [0, 1], got {p.top_p}")
    if p.min_p < 0 or p.min_p > 1:
        raise ParamError(f"min_p must be in [0, 1], got {p.min_p}")
    if p.repeat_last_n < -1:
        raise ParamError(f"repeat_last_n must be >= -1, got {p.repeat_last_n}")
    if p.seed < 0 or p.seed > DEFAULT_SEED:
        raise ParamError(f"seed must be in [0, {DEFAULT_SEED}], got {p.seed}")
    if p.n_probs < 0 or p.n_probs > MAX_N_PROBS:
        raise ParamError(f"n_probs must be in [0, {MAX_N_PROBS}], got {p.n_probs}")
    if len(p.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ParamError(f"logit_bias has {len(p.logit_bias)} entries, at most {MAX_LOGIT_BIAS_ENTRIES}")
    for token, _ in p.logit_bias:
        if not 0 <= token < n_vocab:
            raise ParamError(f"logit_bias token id {token} is outside the vocabulary [0, {n_vocab})")


def check_stop(stop: tuple[str, ...]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise ParamError(f"too many stop strings: {len(stop)}, at most {MAX_STOP_STRINGS}")
    for s in stop:
        if not s:
            raise ParamError("stop strings must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ParamError(f"stop string longer than {MAX_STOP_STRING_CHARS} characters")
