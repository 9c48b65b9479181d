"""Build a llama.cpp sampler chain from ``SamplingParams``, as llama-server does.

One chain per slot per request. The chain is llama-server's ``common_sampler_init``: logit
bias, then the samplers in the request's order (default: penalties, dry, top_n_sigma, top_k,
typ_p, top_p, min_p, xtc, temperature), then ``dist`` (``adaptive_p`` instead where the samplers
list it); or temperature then mirostat (v1/v2).
Like llama-server, the penalty and DRY samplers are shown the prompt before the first token.

Differences, on purpose: the grammar sampler sits first in the chain (llama-server keeps it
aside and resamples only when its first pick breaks the grammar; both give valid output), and
a greedy request (temperature <= 0) ends in ``greedy`` after only the samplers that can change
the arg-max (bias, penalties, DRY, XTC): top-k/p, min-p, typical, top-n-sigma and a zero
temperature all keep the arg-max, so the token is the same and the step is cheaper.

A lazy grammar (``grammar_lazy``, for tool calls) is llama.cpp's ``llama_sampler_init_grammar_lazy_patterns``
(argtypes: vocab, grammar, root, char** patterns, n, llama_token* tokens, n): unconstrained
until the text ends with a trigger word, then the grammar; see ``_grammar`` for the pattern.

Every binding used here was checked against llama-cpp-python 0.3.36's ctypes signatures; a
test builds every sampler through a real request (tests/test_sampling.py).
"""

from __future__ import annotations

import ctypes
import re
import weakref
from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np

from llamactor.protocol.errors import RequestError
from llamactor.protocol.sampling import SamplingParams
from llamactor.runtime.engine.model import Model

MIROSTAT_M = 100  # llama-server's fixed m for mirostat v1


def build_chain(
    model: Model,
    p: SamplingParams,
    *,
    n_ctx: int,
    seed_offset: int = 0,
    prompt: Sequence[int] | np.ndarray = (),
    ignore_eos: bool = False,
) -> ctypes.c_void_p:
    """Return a new sampler chain; the caller owns it (``llama_sampler_free``).

    ``seed_offset`` gives each of the n choices of one request its own random stream;
    ``n_ctx`` is the slot's context (what -1 means for ``repeat_last_n``/``dry_penalty_last_n``);
    ``prompt`` is shown to the penalty and DRY samplers (llama-server's ``init_sampler``).
    ``ignore_eos`` bans every end-of-generation token with a -inf logit bias, as llama-server
    does (its ``logit_bias_eog``): without it a sampled EOS would be skipped rather than
    never drawn, and the random draw over the remaining tokens would differ from llama-server's.
    Raises RequestError when llama.cpp refuses the grammar; the chain is freed then.
    """
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    try:
        _fill(chain, model, p, n_ctx, seed_offset, prompt, ignore_eos)
    except BaseException:
        llama_cpp.llama_sampler_free(chain)
        raise
    return chain


def _fill(
    chain: ctypes.c_void_p,
    model: Model,
    p: SamplingParams,
    n_ctx: int,
    seed_offset: int,
    prompt: Sequence[int] | np.ndarray,
    ignore_eos: bool = False,
) -> None:
    def add(sampler: ctypes.c_void_p, *, history: int = 0) -> None:
        if not sampler:
            raise RequestError("llama.cpp could not build a sampler for these settings")
        # The sampler keeps only its last ``history`` tokens: showing it the prompt's tail
        # leaves it in the state llama-server's whole-prompt replay does.
        for tok in prompt[len(prompt) - min(history, len(prompt)) :] if history else ():
            llama_cpp.llama_sampler_accept(sampler, int(tok))
        llama_cpp.llama_sampler_chain_add(chain, sampler)

    seed = p.seed if p.seed == llama_cpp.LLAMA_DEFAULT_SEED else (p.seed + seed_offset) & 0xFFFFFFFF
    if p.grammar:
        g = _grammar(model, p)
        if not g:
            raise RequestError("invalid grammar: llama.cpp could not parse it")
        add(g)
    # Under a grammar the end-of-generation tokens are not banned: once the grammar is complete
    # they are the only tokens it allows, and with them banned too nothing is left to draw
    # (llama.cpp's grammar then throws through C: the process aborts). ``ignore_eos`` still goes
    # on past them (the step does not stop on EOG), it just cannot forbid them here.
    biases = p.logit_bias + (_eog_bias(model) if ignore_eos and not p.grammar else ())
    if biases:
        arr = (llama_cpp.llama_logit_bias * len(biases))()
        for i, (tok, bias) in enumerate(biases):
            arr[i].token = tok  # type: ignore[assignment]  # ctypes converts the int
            arr[i].bias = bias
        add(llama_cpp.llama_sampler_init_logit_bias(model.n_vocab, len(biases), arr))
    if p.mirostat:
        add(llama_cpp.llama_sampler_init_temp(p.temperature))
        if p.mirostat == 1:
            add(llama_cpp.llama_sampler_init_mirostat(model.n_vocab, seed, p.mirostat_tau, p.mirostat_eta, MIROSTAT_M))
        else:
            add(llama_cpp.llama_sampler_init_mirostat_v2(seed, p.mirostat_tau, p.mirostat_eta))
        return
    # -1 means the whole slot context; more than it is the whole slot context too (llama.cpp
    # allocates a ring buffer of that many tokens: 2**31 - 1 in one request took 8 GB, twice).
    last_n = lambda n: n_ctx if n < 0 else min(n, n_ctx)
    for name in p.samplers:
        if p.greedy and name not in _ARGMAX_CHANGING:
            continue
        if name == "penalties":
            if p.penalties_on:
                add(
                    llama_cpp.llama_sampler_init_penalties(
                        model.n_vocab,
                        last_n(p.repeat_last_n),
                        p.repeat_penalty,
                        p.frequency_penalty,
                        p.presence_penalty,
                    ),
                    history=last_n(p.repeat_last_n),
                )
        elif name == "dry":
            if p.dry_on:
                breakers = [b.encode() for b in p.dry_sequence_breakers]
                c_breakers = (ctypes.c_char_p * len(breakers))(*breakers)
                add(
                    llama_cpp.llama_sampler_init_dry(
                        model.vocab,
                        p.dry_multiplier,
                        p.dry_base,
                        p.dry_allowed_length,
                        last_n(p.dry_penalty_last_n),
                        c_breakers,
                        len(breakers),
                    ),
                    history=last_n(p.dry_penalty_last_n),
                )
        elif name == "top_n_sigma":
            if p.top_n_sigma >= 0:
                add(llama_cpp.llama_sampler_init_top_n_sigma(p.top_n_sigma))
        elif name == "top_k":
            if p.top_k > 0:
                add(llama_cpp.llama_sampler_init_top_k(p.top_k))
        elif name == "typ_p":
            if p.typical_p < 1.0:
                add(llama_cpp.llama_sampler_init_typical(p.typical_p, p.min_keep))
        elif name == "top_p":
            if p.top_p < 1.0:
                add(llama_cpp.llama_sampler_init_top_p(p.top_p, p.min_keep))
        elif name == "min_p":
            if p.min_p > 0.0:
                add(llama_cpp.llama_sampler_init_min_p(p.min_p, p.min_keep))
        elif name == "xtc":
            if p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5:
                add(llama_cpp.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, p.min_keep, seed))
        elif name == "temperature":
            add(llama_cpp.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range, p.dynatemp_exponent))
    if p.greedy:
        add(llama_cpp.llama_sampler_init_greedy())
    elif "adaptive_p" in p.samplers:  # llama-server: adaptive-p picks the token instead of dist
        add(llama_cpp.llama_sampler_init_adaptive_p(p.adaptive_target, p.adaptive_decay, seed))
    else:
        add(llama_cpp.llama_sampler_init_dist(seed))


def argmax_biases(
    model: Model,
    p: SamplingParams,
    *,
    ignore_eos: bool = False,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The chain's logit biases as (token ids, values) when ``build_chain`` gives ``p`` only
    biases and ``greedy``, else None.

    Such a token is numpy's arg-max of the biased logits: both take the first maximum, and the
    float32 sums are the same. llama.cpp's ``llama_sampler_sample`` first copies the whole
    vocabulary into a candidate array (3 MB for gemma3's 262k tokens: ~0.25 ms of a ~50 ms step
    per token here); ``np.argmax`` reads the logits where they are (~0.015 ms). The biases and
    greedy keep no state, so skipping the chain's ``accept`` loses nothing.
    """
    xtc = "xtc" in p.samplers and p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5
    if not p.greedy or p.grammar or p.penalties_on or p.dry_on or xtc:
        return None
    biases = p.logit_bias + (_eog_bias(model) if ignore_eos else ())
    return (
        np.fromiter((t for t, _ in biases), dtype=np.intp, count=len(biases)),
        np.fromiter((b for _, b in biases), dtype=np.float32, count=len(biases)),
    )


def biased_argmax(logits: np.ndarray, biases: tuple[np.ndarray, np.ndarray]) -> int:
    """The greedy token of ``logits`` under ``biases`` (from ``argmax_biases``)."""
    ids, values = biases
    if not len(ids):
        return int(np.argmax(logits))
    if values.max() < 0:  # biases that only lower (ignore_eos's ban): unless they hit the
        best = int(np.argmax(logits))  # maximum, it stays the first maximum
        if not (ids == best).any():
            return best
    logits = logits.copy()
    np.add.at(logits, ids, values)  # a token listed twice gets both, as in llama.cpp
    return int(np.argmax(logits))


_EOG_BIAS: weakref.WeakKeyDictionary[Model, tuple[tuple[int, float], ...]] = weakref.WeakKeyDictionary()


def _eog_bias(model: Model) -> tuple[tuple[int, float], ...]:
    """(token, -inf) for every end-of-generation token of ``model``, computed once per model."""
    bias = _EOG_BIAS.get(model)
    if bias is None:
        bias = _EOG_BIAS[model] = tuple((t, float("-inf")) for t in range(model.n_vocab) if model.is_eog(t))
    return bias


def _grammar(model: Model, p: SamplingParams) -> ctypes.c_void_p:
    if not p.grammar_lazy:
        return llama_cpp.llama_sampler_init_grammar(model.vocab, p.grammar.encode(), b"root")
    # One pattern for all trigger words, anchored at the end of the text so far: llama.cpp
    # searches its whole awaiting buffer with every regex after each token, so one regex keeps
    # that cost down, and the anchor makes it fire only on a token boundary right after the
    # word; the grammar is then fed exactly the word (never a token's tail past it, which it
    # could reject: llama.cpp throws then, and an exception cannot cross ctypes).
    pattern = _trie_regex(p.grammar_triggers) + "$"
    patterns = (ctypes.c_char_p * 1)(pattern.encode())
    return llama_cpp.llama_sampler_init_grammar_lazy_patterns(
        model.vocab,
        p.grammar.encode(),
        b"root",
        patterns,
        1,
        None,
        0,
    )


def _trie_regex(words: Sequence[str]) -> str:
    """One regex matching exactly ``words``, shaped as their prefix tree, so that at most
    positions the first character already fails (a flat alternation tries every word there)."""
    root: dict[str, Any] = {}
    for word in words:
        node = root
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        alts = [_regex_escape(ch) + emit(child) for ch, child in node.items() if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return emit(root)


def _regex_escape(word: str) -> str:
    """llama.cpp's regex_escape (common.cpp): a literal word as an ECMAScript regex."""
    return _REGEX_SPECIAL.sub(r"\\\g<0>", word)


_REGEX_SPECIAL = re.compile(r"[.^$|()*+?\[\]{}\\]")


# Samplers that can change which token has the highest logit; the others keep the arg-max.
_ARGMAX_CHANGING = frozenset({"penalties", "dry", "xtc"})


def check_chain(model: Model, p: SamplingParams, n_ctx: int) -> None:
    """Build and free one chain: at admission, so that a bad request fails alone (a 400),
    never inside a group. Raises RequestError."""
    llama_cpp.llama_sampler_free(build_chain(model, p, n_ctx=n_ctx))
