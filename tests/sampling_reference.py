"""llama-server's sampler chain, computed at test time through the same libllama.

The parity test asks whether llamactor samples as llama-server does: which samplers, in which
order, with which parameters and seed, shown which history. Recorded llama-server answers
cannot tell that apart from kernel rounding: the tiny model's logits are nearly flat, so the
last bit that differs between two builds of ggml's CPU kernels (AVX2, AVX-512, AMX repacking)
moves a seeded sample. So the reference is made here, on this machine, with this build: the
prompt decoded by libllama as llamactor decodes it (one batch, then one token per step, one
sequence, the same context parameters), and each token drawn by the chain exactly as
llama-server's ``common_sampler_init`` builds it (llama.cpp's common/sampling.cpp and
common/common.h of the version llama-cpp-python 0.3.36 vendors): the logit biases (the
end-of-generation tokens banned for ``ignore_eos``), then every sampler of the ``samplers`` list
whether or not it changes anything (a no-op top-k still sorts the candidates, which decides
which token a seeded draw lands on), then ``dist``; or temperature then mirostat. The prompt is
shown to the chain first, as llama-server's ``init_sampler`` does.

Both sides then compute the same logits bit for bit, and any difference is the chain's.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Any

import llama_cpp

# common/common.h: common_params_sampling's defaults, named as llama-server's request fields
DEFAULTS: dict[str, Any] = {
    "seed": llama_cpp.LLAMA_DEFAULT_SEED,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "typical_p": 1.0,
    "temperature": 0.8,
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "repeat_last_n": 64,
    "repeat_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": -1,
    "dry_sequence_breakers": ["\n", ":", '"', "*"],
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
    "top_n_sigma": -1.0,
    "min_keep": 0,
    "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
}
# the request's sampler names as llama-server reads them (common_sampler_types_from_names)
ALIASES = {
    "typical_p": "typ_p",
    "typical": "typ_p",
    "top-k": "top_k",
    "top-p": "top_p",
    "min-p": "min_p",
    "temp": "temperature",
}


def _chain(model: Any, vocab: Any, p: dict[str, Any], n_ctx: int, ignore_eos: bool) -> Any:
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)
    biases = [(t, -math.inf) for t in range(n_vocab) if ignore_eos and llama_cpp.llama_vocab_is_eog(vocab, t)]
    n_suppress = ctypes.c_int(0)
    suppress = llama_cpp.llama_vocab_get_suppress_tokens(vocab, ctypes.byref(n_suppress))
    biases += [(suppress[i], -math.inf) for i in range(n_suppress.value)]
    if biases:
        arr = (llama_cpp.llama_logit_bias * len(biases))()
        for i, (tok, bias) in enumerate(biases):
            arr[i].token, arr[i].bias = tok, bias
        add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(biases), arr))
    seed = p["seed"]
    last_n = lambda n: n_ctx if n == -1 else n  # llama-server: -1 is the slot's context
    if p["mirostat"]:
        add(llama_cpp.llama_sampler_init_temp(p["temperature"]))
        if p["mirostat"] == 1:
            add(llama_cpp.llama_sampler_init_mirostat(n_vocab, seed, p["mirostat_tau"], p["mirostat_eta"], 100))
        else:
            add(llama_cpp.llama_sampler_init_mirostat_v2(seed, p["mirostat_tau"], p["mirostat_eta"]))
        return chain
    keep = p["min_keep"]
    for name in (ALIASES.get(n, n) for n in p["samplers"]):
        if name == "penalties":
            add(
                llama_cpp.llama_sampler_init_penalties(
                    n_vocab,
                    last_n(p["repeat_last_n"]),
                    p["repeat_penalty"],
                    p["frequency_penalty"],
                    p["presence_penalty"],
                )
            )
        elif name == "dry":
            breakers = [b.encode() for b in p["dry_sequence_breakers"]]
            c_breakers = (ctypes.c_char_p * len(breakers))(*breakers)
            add(
                llama_cpp.llama_sampler_init_dry(
                    vocab,
                    p["dry_multiplier"],
                    p["dry_base"],
                    p["dry_allowed_length"],
                    last_n(p["dry_penalty_last_n"]),
                    c_breakers,
                    len(breakers),
                )
            )
        elif name == "top_n_sigma":
            add(llama_cpp.llama_sampler_init_top_n_sigma(p["top_n_sigma"]))
        elif name == "top_k":
            add(llama_cpp.llama_sampler_init_top_k(p["top_k"]))
        elif name == "typ_p":
            add(llama_cpp.llama_sampler_init_typical(p["typical_p"], keep))
        elif name == "top_p":
            add(llama_cpp.llama_sampler_init_top_p(p["top_p"], keep))
        elif name == "min_p":
            add(llama_cpp.llama_sampler_init_min_p(p["min_p"], keep))
        elif name == "xtc":
            add(llama_cpp.llama_sampler_init_xtc(p["xtc_probability"], p["xtc_threshold"], keep, seed))
        elif name == "temperature":
            add(llama_cpp.llama_sampler_init_temp_ext(p["temperature"], p["dynatemp_range"], p["dynatemp_exponent"]))
        else:
            raise ValueError(f"the reference has no sampler {name!r}")
    add(llama_cpp.llama_sampler_init_dist(seed))
    return chain


def llama_server_tokens(
    model_path: Path,
    request: dict[str, Any],
    *,
    n_ctx: int,
    n_batch: int,
    n_ubatch: int,
    flash_attn: int = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    threads: int = 1,
) -> list[int]:
    """The token ids llama-server's chain draws for a /completion ``request`` (a text prompt,
    ``n_predict``, sampling fields, ``ignore_eos``), on a context made as llamactor makes one
    slot's (``n_ctx`` cells, one sequence, ``threads`` threads)."""
    p = {**DEFAULTS, **{k: v for k, v in request.items() if k in DEFAULTS}}
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
    assert model, f"could not load {model_path}"
    vocab = llama_cpp.llama_model_get_vocab(model)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = n_ctx, n_batch, n_ubatch, 1
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.flash_attn_type = flash_attn
    cparams.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    assert ctx, "could not make a context"
    chain = None
    try:
        text = request["prompt"].encode()
        buf = (llama_cpp.llama_token * (len(text) + 8))()
        n = llama_cpp.llama_tokenize(vocab, text, len(text), buf, len(buf), True, True)
        assert n > 0
        prompt = list(buf[:n])
        chain = _chain(model, vocab, p, n_ctx, bool(request.get("ignore_eos")))
        for tok in prompt:  # llama-server's init_sampler: the chain sees the prompt
            llama_cpp.llama_sampler_accept(chain, tok)
        out: list[int] = []
        batch = (llama_cpp.llama_token * n)(*prompt)
        assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(batch, n)) == 0
        for _ in range(request["n_predict"]):
            tok = llama_cpp.llama_sampler_sample(chain, ctx, -1)  # applies the chain, then accepts the token
            out.append(tok)
            one = (llama_cpp.llama_token * 1)(tok)
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(one, 1)) == 0
        return out
    finally:
        if chain is not None:
            llama_cpp.llama_sampler_free(chain)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
