"""Bad input through the embedding API's typed entry points and the HTTP APIs, field by field.

Every field of ``GenerationRequest`` given a wrong type is a ``RequestError`` (HTTP: a 400)
whose message names the field, and nothing else is lost. Then a property-based fuzz of
``rt.complete`` / ``rt.stream`` / ``rt.chat`` with keyword arguments drawn from every field's
valid, edge and wrong values: each call either completes or raises ``RequestError`` (never
another exception), and the runtime keeps serving.
"""

from __future__ import annotations

import os
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamactor.protocol.request import GenerationRequest
from llamactor.runtime import RequestError, Runtime

WRONG_TYPE: dict[str, Any] = {
    "prompt": 3.5,
    "messages": "hi",
    "infill": "x",
    "add_special": "yes",
    "multimodal_data": 5,
    "tools": "f",
    "tool_choice": 5,
    "parallel_tool_calls": "no",
    "reasoning_format": 1,
    "reasoning_effort": 2,
    "chat_template_kwargs": [1],
    "max_tokens": "many",
    "n": "two",
    "stop": 7,
    "ignore_eos": "sure",
    "t_max_predict_ms": "soon",
    "temperature": "hot",
    "dynatemp_range": "x",
    "dynatemp_exponent": "x",
    "top_k": "x",
    "top_p": "x",
    "min_p": "x",
    "typical_p": "x",
    "top_n_sigma": "x",
    "xtc_probability": "x",
    "xtc_threshold": "x",
    "repeat_penalty": "x",
    "repeat_last_n": "x",
    "presence_penalty": "x",
    "frequency_penalty": "x",
    "dry_multiplier": "x",
    "dry_base": "x",
    "dry_allowed_length": "x",
    "dry_penalty_last_n": "x",
    "dry_sequence_breakers": 5,
    "mirostat": "x",
    "mirostat_tau": "x",
    "mirostat_eta": "x",
    "min_keep": "x",
    "samplers": 5,
    "seed": "x",
    "logit_bias": "x",
    "grammar": 5,
    "json_schema": "x",
    "n_probs": "x",
    "post_sampling_probs": "x",
    "speculative_n_max": "x",
    "speculative_n_min": "x",
    "speculative_p_min": "x",
    "cache_prompt": "x",
    "id_slot": "x",
    "n_keep": "x",
    "n_discard": "x",
    "n_cache_reuse": "x",
    "lora": "x",
    "return_progress": "x",
    "timings_per_token": "x",
    "add_generation_prompt": "x",
    "continue_final_message": "x",
    "adaptive_target": "x",
    "adaptive_decay": "x",
    "priority": "x",
    "tags": "x",
}
# Values of the right type the server refuses, each with what the message must name.
WRONG_VALUE: dict[str, Any] = {
    "max_tokens": -7,
    "n": 0,
    "top_p": 1.5,
    "min_p": -1.0,
    "xtc_probability": 2.0,
    "repeat_penalty": 0.0,
    "mirostat": 3,
    "n_probs": 99,
    "seed": 2**40,
    "logit_bias": {10**6: 1.0},
    "grammar": "root ::= [",
    "samplers": ["nope"],
    "dry_sequence_breakers": [],
    "id_slot": 99,
    "n_keep": -3,
    "n_discard": -1,
    "n_cache_reuse": -1,
    "stop": ["a"] * 40,
    "speculative_p_min": 3.0,
    "top_k": 2**40,
    "t_max_predict_ms": -5,
}
NAMES = {"logit_bias": "logit_bias", "grammar": "grammar", "stop": "stop", "seed": "seed", "max_tokens": "max_tokens"}


def test_every_field_has_a_wrong_type_case():
    assert set(WRONG_TYPE) == set(GenerationRequest.__struct_fields__)


async def test_a_wrong_type_names_the_field_through_the_embedding_api(make_config):
    async with Runtime.open(make_config()) as rt:
        for field, value in WRONG_TYPE.items():
            with pytest.raises(RequestError) as err:
                await rt.complete("Hi", **{field: value})
            assert field in str(err.value), (field, str(err.value))
        for field, value in WRONG_VALUE.items():
            with pytest.raises(RequestError) as err:
                await rt.complete("Hi", **{field: value})
            assert NAMES.get(field, field).split("_")[0] in str(err.value), (field, str(err.value))
        assert rt.in_flight() == 0 and rt.health() == "ok"
        assert (await rt.complete("Hi", max_tokens=2)).n_predicted == 2


@pytest.mark.parametrize(
    ("path", "base"),
    [
        ("/completion", {"prompt": "Hi", "n_predict": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ],
)
async def test_a_wrong_type_names_the_field_through_http(make_config, path, base):
    json_names = {"max_tokens": "n_predict" if path == "/completion" else "max_tokens"}
    skip = {
        "prompt",
        "messages",
        "infill",
        "add_special",
        "multimodal_data",
        "max_tokens",
        "n_probs",
        "json_schema",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "reasoning_format",
        "reasoning_effort",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "logit_bias",
        "stop",
        "speculative_n_max",
        "speculative_n_min",
        "speculative_p_min",
        "samplers",
    }
    async with Runtime.open(make_config()) as rt:
        transport = httpx.ASGITransport(app=rt.asgi_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for field, value in WRONG_TYPE.items():
                if field in skip:
                    continue  # shapes of their own per API (fuzzed in test_fuzz_requests.py)
                name = json_names.get(field, field)
                r = await client.post(path, json={**base, name: value})
                assert r.status_code == 400, (field, r.text)
                assert name in r.json()["error"]["message"], (field, r.text)
            r = await client.post(path, json=base)
            assert r.status_code == 200


# ---- property-based: any keyword arguments, any values ------------------------------------

EXAMPLES = int(os.environ.get("LLAMACTOR_FUZZ_EXAMPLES", "150"))
junk = st.one_of(
    st.none(),
    st.text(max_size=4),
    st.integers(-5, 5),
    st.floats(allow_nan=False),
    st.booleans(),
    st.lists(st.integers(0, 50), max_size=3),
    st.dictionaries(st.text(max_size=2), st.text(max_size=2)),
)
GOOD: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(-1, 6),
    "n": st.integers(1, 2),
    "temperature": st.floats(0, 2),
    "top_k": st.integers(-1, 50),
    "top_p": st.floats(0, 1),
    "min_p": st.floats(0, 1),
    "repeat_penalty": st.floats(0.5, 2),
    "repeat_last_n": st.integers(-1, 64),
    "seed": st.integers(-1, 2**32 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "logit_bias": st.one_of(
        st.dictionaries(st.integers(0, 200), st.floats(-5, 5), max_size=3),
        st.dictionaries(st.text(max_size=3), st.floats(-5, 5), max_size=2),  # texts, tokenized
    ),
    "n_probs": st.integers(0, 5),
    "ignore_eos": st.booleans(),
    "priority": st.integers(-3, 3),
    "tags": st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
    "dry_multiplier": st.floats(0, 1),
    "mirostat": st.integers(0, 2),
    "return_progress": st.booleans(),
    "timings_per_token": st.booleans(),
    "cache_prompt": st.booleans(),
    "id_slot": st.integers(-1, 3),
    "samplers": st.just("kt"),
}
FIELDS = sorted(GOOD)
kwargs_strategy = st.dictionaries(st.sampled_from(FIELDS), st.just(None), max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({k: st.one_of(GOOD[k], GOOD[k], GOOD[k], junk) for k in keys})
)


@pytest.mark.slow
def test_fuzz_the_typed_entry_points(make_config):
    """Each call completes or raises RequestError; afterwards the runtime serves a plain request."""
    seen = {"calls": 0, "refused": 0}

    async def main() -> None:
        async with Runtime.open(make_config()) as rt:

            @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
            @given(kwargs=kwargs_strategy, entry=st.sampled_from(["complete", "stream", "chat"]))
            def one(kwargs: dict[str, Any], entry: str) -> None:
                async def call() -> None:
                    seen["calls"] += 1
                    try:
                        with anyio.fail_after(30):
                            if entry == "complete":
                                await rt.complete("Hi there", **kwargs)
                            elif entry == "stream":
                                async for _ in rt.stream("Hi there", **kwargs):
                                    pass
                            else:
                                await rt.chat([{"role": "user", "content": "Hi"}], **kwargs)
                    except RequestError:
                        seen["refused"] += 1

                anyio.from_thread.run(call)

            await anyio.to_thread.run_sync(one)
            assert rt.health() == "ok" and rt.in_flight() == 0
            assert (await rt.complete("Hi", max_tokens=2)).n_predicted == 2
            assert rt.engine.supervisor.snapshot().restarts == (0,)

    anyio.run(main)
    assert seen["calls"] >= EXAMPLES
    print(f"fuzzed {seen['calls']} calls, {seen['refused']} refused")
