"""Build a llama.cpp sampler chain from ``SamplingParams`` (AC-5).

One chain per slot per request, made in the group's thread when the slot is assigned and
freed when the slot is released. The order follows llama-server's defaults: logit bias,
grammar, penalties, top-k, top-p, min-p, temperature, then the final pick (greedy or dist).
"""

from __future__ import annotations

import ctypes

import llama_cpp

from protocol.sampling import SamplingParams
from runtime.errors import RequestError
from runtime.model import Model


def build_chain(model: Model, p: SamplingParams, seed_offset: int = 0) -> ctypes.c_void_p:
    """Return a new sampler chain; the caller owns it (``llama_sampler_free``).

    ``seed_offset`` gives each of the n choices of one request its own random stream.
    """
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)  # noqa: E731
    if p.logit_bias:
        arr = (llama_cpp.llama_logit_bias * len(p.logit_bias))()
        for i, (tok, bias) in enumerate(p.logit_bias):
            arr[i].token = tok
            arr[i].bias = bias
        add(llama_cpp.llama_sampler_init_logit_bias(model.n_vocab, len(p.logit_bias), arr))
    if p.grammar:
        g = llama_cpp.llama_sampler_init_grammar(model.vocab, p.grammar.encode(), b"root")
        if not g:
            llama_cpp.llama_sampler_free(chain)
            raise RequestError("invalid grammar: llama.cpp could not parse it")
        add(g)
    if p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        add(
            llama_cpp.llama_sampler_init_penalties(
                p.repeat_last_n if p.repeat_last_n >= 0 else 4096,
                p.repeat_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            )
        )
    if p.greedy:
        add(llama_cpp.llama_sampler_init_greedy())
        return chain
    if p.top_k > 0:
        add(llama_cpp.llama_sampler_init_top_k(p.top_k))
    if p.top_p < 1.0:
        add(llama_cpp.llama_sampler_init_top_p(p.top_p, 1))
    if p.min_p > 0.0:
        add(llama_cpp.llama_sampler_init_min_p(p.min_p, 1))
    add(llama_cpp.llama_sampler_init_temp(p.temperature))
    seed = p.seed if p.seed == llama_cpp.LLAMA_DEFAULT_SEED else (p.seed + seed_offset) & 0xFFFFFFFF
    add(llama_cpp.llama_sampler_init_dist(seed))
    return chain


def check_grammar(model: Model, grammar: str) -> None:
    """Raise RequestError if llama.cpp cannot parse ``grammar`` (done once, at submit)."""
    g = llama_cpp.llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
    if not g:
        raise RequestError("invalid grammar: llama.cpp could not parse it")
    llama_cpp.llama_sampler_free(g)
