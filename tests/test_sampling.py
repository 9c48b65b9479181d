"""Every sampling field of llama-server, through real requests (HTTP and embedding API).

A field nobody sends once is how a plain ``repeat_penalty`` came to crash a group: each field
here goes through ``/completion``, the OpenAI endpoints (the ``openai`` client where OpenAI has
the field) and ``Runtime.complete``; where the field's effect is deterministic on the tiny
model, the test checks the effect, so a sampler that is silently dropped fails it.
"""

from __future__ import annotations

import math
import os

import httpx
import openai
import pytest
from conftest import open_server

from llamactor.protocol.errors import RequestError
from llamactor.runtime import Runtime

PROMPT = "hello world"
N = 16

# One request per llama-server sampling field (non-default value). Greedy unless the field
# only matters when sampling, then seeded so the answer is reproducible.
FIELDS: dict[str, dict] = {
    "repeat_penalty": {"repeat_penalty": 1.5, "temperature": 0},
    "repeat_last_n": {"repeat_penalty": 1.3, "repeat_last_n": -1, "temperature": 0},
    "frequency_penalty": {"frequency_penalty": 1.5, "temperature": 0},
    "presence_penalty": {"presence_penalty": 1.5, "temperature": 0},
    "dry": {
        "dry_multiplier": 2.0,
        "dry_base": 1.75,
        "dry_allowed_length": 1,
        "dry_penalty_last_n": -1,
        "dry_sequence_breakers": ["\n", "."],
        "temperature": 0,
    },
    "xtc": {"xtc_probability": 1.0, "xtc_threshold": 0.0, "temperature": 0, "seed": 3},
    "mirostat_1": {"mirostat": 1, "mirostat_tau": 3.0, "mirostat_eta": 0.2, "temperature": 0.9, "seed": 5},
    "mirostat_2": {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2, "temperature": 0.9, "seed": 5},
    "typical_p": {"typical_p": 0.5, "temperature": 1.0, "seed": 7},
    "top_n_sigma": {"top_n_sigma": 0.5, "temperature": 1.0, "seed": 7},
    "dynatemp": {"dynatemp_range": 0.5, "dynatemp_exponent": 2.0, "temperature": 1.0, "seed": 7},
    "min_keep": {"min_keep": 5, "top_p": 0.1, "temperature": 1.0, "seed": 7},
    "samplers_list": {"samplers": ["top-k", "temp"], "top_k": 3, "temperature": 1.0, "seed": 9},
    "samplers_letters": {"samplers": "kt", "top_k": 3, "temperature": 1.0, "seed": 9},
    "top_k_top_p_min_p": {"top_k": 5, "top_p": 0.9, "min_p": 0.1, "temperature": 1.0, "seed": 11},
    "logit_bias": {"logit_bias": [[308, False]], "temperature": 0},
    "grammar": {"grammar": 'root ::= [a-z ]+ "."', "temperature": 0},
    "seed": {"seed": 1234, "temperature": 1.0},
    "n_probs": {"n_probs": 3, "temperature": 0},
}


async def _greedy(rt: Runtime) -> tuple[int, ...]:
    return (await rt.complete(PROMPT, max_tokens=N, temperature=0, ignore_eos=True)).choices[0].tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIELDS))
async def test_every_sampling_field_through_http_and_embedding_api(make_config, name):
    """Each field gives 200 over HTTP and a result from Runtime.complete, both
    the same tokens (same seed), and the group never restarts."""
    fields = FIELDS[name]
    async with open_server(make_config(parallel=2)) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.post("/completion", json={"prompt": PROMPT, "n_predict": N, "ignore_eos": True, **fields})
        assert r.status_code == 200, r.text
        http_tokens = tuple(r.json()["tokens"])
        kwargs = dict(fields)
        if "logit_bias" in kwargs:
            kwargs["logit_bias"] = [(t, -math.inf) for t, _ in kwargs["logit_bias"]]
        out = await rt.complete(PROMPT, max_tokens=N, ignore_eos=True, **kwargs)
        assert out.choices[0].tokens == http_tokens
        assert len(http_tokens) == N
        assert rt.engine.supervisor.restarts == [0]


async def test_penalties_and_bias_change_greedy_output(make_config):
    """The samplers really run: on the tiny model, greedy output repeats token 387; every
    penalty breaks the repetition, DRY too, and a banned token never appears."""
    async with Runtime.open(make_config(parallel=2)) as rt:
        plain = await _greedy(rt)
        assert plain.count(387) >= 3
        for name in ("repeat_penalty", "frequency_penalty", "presence_penalty", "dry"):
            kwargs = {k: v for k, v in FIELDS[name].items() if k != "temperature"}
            out = await rt.complete(PROMPT, max_tokens=N, temperature=0, ignore_eos=True, **kwargs)
            assert out.choices[0].tokens != plain, name
        banned = await rt.complete(PROMPT, max_tokens=N, temperature=0, ignore_eos=True, logit_bias={308: -math.inf})
        assert 308 not in banned.choices[0].tokens


async def test_penalties_see_the_prompt(make_config):
    """As in llama-server, the penalty sampler is shown the prompt: continue the greedy text
    right where it repeats token 387; unpenalized the next token is 387 again, with a strong
    penalty it is not, although no token has been generated yet."""
    async with Runtime.open(make_config(parallel=1)) as rt:
        plain = await _greedy(rt)
        cut = plain.index(387) + 1
        prompt = (await rt.tokenize(PROMPT)) + list(plain[:cut])
        unpenalized = (await rt.complete(prompt, max_tokens=1, temperature=0)).choices[0].tokens[0]
        penalized = (await rt.complete(prompt, max_tokens=1, temperature=0, repeat_penalty=100.0)).choices[0].tokens[0]
        assert unpenalized == 387 and penalized != 387


async def test_seeds_reproduce_and_differ(make_config):
    async with Runtime.open(make_config(parallel=2)) as rt:
        a = await rt.complete(
            PROMPT, max_tokens=N, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=1, ignore_eos=True
        )
        b = await rt.complete(
            PROMPT, max_tokens=N, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=1, ignore_eos=True
        )
        c = await rt.complete(
            PROMPT, max_tokens=N, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=2, ignore_eos=True
        )
        assert a.choices[0].tokens == b.choices[0].tokens != c.choices[0].tokens


async def test_openai_client_penalties(make_config):
    """Frequency/presence penalties through the openai client (chat and completions)."""
    async with open_server(make_config(parallel=2)) as (rt, url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        chat = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            temperature=0,
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        done = await client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=8,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            temperature=0,
            extra_body={"repeat_penalty": 1.1, "dry_multiplier": 0.8, "xtc_probability": 0.5, "mirostat": 2},
        )
        assert done.usage.completion_tokens >= 1
        await client.close()
        assert rt.engine.supervisor.restarts == [0] and rt.health() == "ok"


BAD = [
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_penalty": -1.0}, "repeat_penalty"),
    ({"mirostat": 3}, "mirostat"),
    ({"xtc_probability": 1.5}, "xtc_probability"),
    ({"samplers": ["top_k", "nonsense"]}, "samplers"),
    ({"samplers": "kz"}, "samplers"),
    ({"dry_sequence_breakers": []}, "dry_sequence_breakers"),
    ({"dry_sequence_breakers": ["x" * 41]}, "dry_sequence_breakers"),
    ({"dry_allowed_length": -2}, "dry_allowed_length"),
    ({"min_keep": -1}, "min_keep"),
    ({"repeat_last_n": -2}, "repeat_last_n"),
    ({"logit_bias": [[i, False] for i in range(460)]}, "logit_bias"),
    ({"grammar": "root ::= nothing-defined"}, "grammar"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("fields", "named"), BAD)
async def test_bad_sampling_values_are_400_naming_the_field(make_config, fields, named):
    async with open_server(make_config(parallel=1)) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.post("/completion", json={"prompt": PROMPT, "n_predict": 4, **fields})
            assert r.status_code == 400, r.text
            assert named in r.json()["error"]["message"]
            assert r.json()["error"]["type"] == "invalid_request_error"
            ok = await client.post("/completion", json={"prompt": PROMPT, "n_predict": 4})
            assert ok.status_code == 200
        kwargs = dict(fields)
        if "logit_bias" in kwargs:
            kwargs["logit_bias"] = [(t, -math.inf) for t, _ in kwargs["logit_bias"]]
        with pytest.raises(RequestError):
            await rt.complete(PROMPT, max_tokens=4, **kwargs)
        assert rt.engine.supervisor.restarts == [0]


async def test_grammar_with_ignore_eos_keeps_serving(make_config):
    """A grammar that completes with ignore_eos once aborted the process: the grammar allows only
    end-of-generation tokens then, and ignore_eos had banned them too (found by the fuzzer). Now
    the text is the grammar's and the generation goes on to n_predict."""
    async with Runtime.open(make_config()) as rt:
        for seed in range(3):
            c = await rt.complete(PROMPT, max_tokens=8, grammar='root ::= "yes" | "no"', ignore_eos=True, seed=seed)
            assert c.choices[0].text in ("yes", "no") and c.n_predicted == 8


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
async def test_a_grammar_with_every_allowed_token_banned_fails_alone(make_config, temperature):
    """A grammar whose every allowed token logit_bias bans leaves the chain nothing to draw: it
    used to hand the grammar a forbidden token, which throws through C and aborts the engine
    (a request aborting the engine before its first token then came back after each restart).
    Now the request fails alone, with a 400 naming the cause, and the engine never dies."""
    async with Runtime.open(make_config(), isolate=True) as rt:
        words = ("yes", "no")
        banned = [
            t
            for t in range(rt.model.n_vocab)
            if (piece := rt.model.piece(t).decode("utf-8", "replace")) and any(w.startswith(piece) for w in words)
        ]
        with pytest.raises(RequestError, match="the grammar allows no token here"):
            await rt.complete(
                PROMPT,
                max_tokens=4,
                grammar='root ::= "yes" | "no"',
                temperature=temperature,
                logit_bias=[(t, float("-inf")) for t in banned],
            )
        c = await rt.complete(PROMPT, max_tokens=4, grammar='root ::= "yes" | "no"', temperature=temperature)
        assert c.choices[0].text in ("yes", "no")
        assert rt.engine.counters.restarts == 0


def test_greedy_argmax_is_the_chains_token(tiny_model):
    """The greedy fast path (numpy's arg-max of the biased logits, ``sampling.argmax_biases``)
    picks the token llama.cpp's chain picks: ties (the first maximum), positive, negative and
    -inf biases, a token biased twice, the end-of-generation ban of ``ignore_eos``; and any
    stateful sampler (penalties, DRY, XTC, a grammar) or a temperature keeps the chain."""
    import ctypes

    import llama_cpp
    import numpy as np

    from llamactor.protocol.sampling import SamplingParams
    from llamactor.runtime.engine.model import Model
    from llamactor.runtime.engine.sampling import argmax_biases, biased_argmax, build_chain

    model = Model(tiny_model)
    n = model.n_vocab
    rng = np.random.default_rng(0)
    cases = [
        (SamplingParams(temperature=0), False),
        (SamplingParams(temperature=0), True),
        (SamplingParams(temperature=0, logit_bias=((3, 5.0), (7, float("-inf")), (3, 2.5), (11, -1.0))), False),
        (SamplingParams(temperature=0, logit_bias=((0, 1.0),)), True),
        (SamplingParams(temperature=0, logit_bias=((5, -0.25), (9, float("-inf")))), False),  # lowering only
    ]
    for params, ignore_eos in cases:
        biases = argmax_biases(model, params, ignore_eos=ignore_eos)
        assert biases is not None
        chain = build_chain(model, params, n_ctx=64, ignore_eos=ignore_eos)
        try:
            for trial in range(200):
                logits = rng.standard_normal(n).astype(np.float32)
                if trial % 3 == 0:  # ties: the first of the maxima wins in both
                    top = rng.choice(n, 4, replace=False)
                    logits[top] = logits.max() + 1.0
                if trial % 5 == 0:  # a biased token near the top
                    logits[3] = logits.max() - 3.0
                if trial % 7 == 0:  # a lowered token on top: the next one wins, or it ties
                    logits[5] = logits.max() + (0.25 if trial % 2 else 0.1)
                if trial % 4 == 1:
                    logits[9] = logits.max() + 1.0
                data = (llama_cpp.llama_token_data * n)()
                for j in range(n):
                    data[j].id, data[j].logit, data[j].p = j, float(logits[j]), 0.0
                arr = llama_cpp.llama_token_data_array(data, n, -1, False)
                llama_cpp.llama_sampler_apply(chain, ctypes.byref(arr))
                assert biased_argmax(logits, biases) == data[arr.selected].id, (params, ignore_eos, trial)
        finally:
            llama_cpp.llama_sampler_free(chain)
    for stateful in (
        {"repeat_penalty": 1.3},
        {"frequency_penalty": 0.5},
        {"dry_multiplier": 1.0},
        {"xtc_probability": 0.5},
        {"grammar": 'root ::= "a"'},
        {"temperature": 0.7},
    ):
        assert argmax_biases(model, SamplingParams(**{"temperature": 0, **stateful})) is None, stateful


def test_history_lengths_past_the_context_cost_no_memory(tiny_model):
    """repeat_last_n / dry_penalty_last_n beyond the slot context mean the whole context (as -1
    does): llama.cpp sizes their ring buffers by the number given, and one request with
    2**31 - 1 (a valid int32) took 8 GB for each, in the engine and again in the API process that
    checks the chain (found by the fuzz run: the machine ran out of memory)."""
    import llama_cpp

    from llamactor.protocol.sampling import SamplingParams
    from llamactor.runtime.engine.model import Model
    from llamactor.runtime.engine.sampling import build_chain

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    model = Model(tiny_model)
    for field in ("repeat_last_n", "dry_penalty_last_n"):
        params = SamplingParams(repeat_penalty=1.5, dry_multiplier=1.0, **{field: 2**27})  # 512 MB unclamped
        before = rss_mb()
        chain = build_chain(model, params, n_ctx=512)
        grown = rss_mb() - before
        llama_cpp.llama_sampler_free(chain)
        assert grown < 64, (field, grown)


@pytest.mark.slow
async def test_history_lengths_past_the_context_are_the_whole_context(make_config):
    """The same through a request: a length past the slot context answers as -1 does (the whole
    slot context). 10**6, not 2**31 - 1: were the cap lost, this test must not take 24 GB."""
    body = dict(max_tokens=24, temperature=0, repeat_penalty=1.3, dry_multiplier=0.8, ignore_eos=True)
    async with Runtime.open(make_config(), isolate=True) as rt:
        whole = await rt.complete(PROMPT, repeat_last_n=-1, dry_penalty_last_n=-1, **body)
        huge = await rt.complete(PROMPT, repeat_last_n=10**6, dry_penalty_last_n=10**6, **body)
    assert huge.choices[0].tokens == whole.choices[0].tokens
