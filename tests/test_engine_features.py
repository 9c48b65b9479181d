"""Engine features per group: KV cache types, context shift and the host-memory prompt cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import TEST_THREADS

from llamactor.runtime import ConfigError, Runtime, RuntimeConfig
from llamactor.runtime.service.config import default_model_path

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.mark.slow
async def test_context_shift_keeps_generating_past_the_context(make_config):
    """With --context-shift a generation that reaches the slot's context drops old tokens
    and goes on (finish "length" only at max_tokens, truncated); without it, it ends at the
    context, as llama-server does. Over-long prompts are still refused."""
    async with Runtime.open(make_config(parallel=1, n_ctx=128)) as rt:
        plain = await rt.complete(PROMPT, max_tokens=400, temperature=0, ignore_eos=True)
        assert plain.finish_reason == "length" and plain.n_predicted == 128 - len(PROMPT)
    async with Runtime.open(make_config(parallel=1, n_ctx=128, context_shift=True)) as rt:
        out = await rt.complete(PROMPT, max_tokens=400, temperature=0, ignore_eos=True)
        assert out.n_predicted == 400 and out.finish_reason == "length"
        events = [e async for e in rt.stream(PROMPT, max_tokens=300, temperature=0, ignore_eos=True)]
        done = events[-1]
        assert done.truncated and done.n_predicted == 300
        short = await rt.complete(PROMPT, max_tokens=20, temperature=0, ignore_eos=True)
        assert short.choices[0].tokens == out.choices[0].tokens[:20]  # no shift: the same tokens
        with pytest.raises(Exception, match="slot context"):
            await rt.complete([5] * 200, max_tokens=4)


async def test_context_shift_is_not_used_for_n_choices(make_config):
    """n > 1 choices share their prompt's KV cells: they end at the context instead (llama-server
    refuses the shift for them too)."""
    async with Runtime.open(make_config(parallel=2, n_ctx=256, context_shift=True)) as rt:
        out = await rt.complete(PROMPT, max_tokens=400, temperature=0, ignore_eos=True, n=2)
        assert all(c.finish_reason == "length" for c in out.choices)
        assert out.n_predicted < 2 * 400


@pytest.mark.slow
@pytest.mark.parametrize(("k", "v"), [("q8_0", "q8_0"), ("q4_0", "f16"), ("f32", "f32"), ("bf16", "q5_1")])
async def test_kv_cache_types(k, v):
    """-ctk/-ctv build contexts with those KV types; generation works and stays close to
    the f16 cache (SmolLM2: quantized rows need a head size that is a multiple of 32; the tiny
    model's heads have 16)."""
    base = RuntimeConfig(model=default_model_path(), n_ctx=1024, parallel=1, threads=TEST_THREADS)
    prompt = "The capital of France is"
    async with Runtime.open(base) as rt:
        ref = await rt.complete(prompt, max_tokens=8, temperature=0, ignore_eos=True)
    async with Runtime.open(replace(base, cache_type_k=k, cache_type_v=v)) as rt:
        out = await rt.complete(prompt, max_tokens=8, temperature=0, ignore_eos=True)
    assert out.n_predicted == 8
    assert out.choices[0].tokens[:2] == ref.choices[0].tokens[:2]


def test_kv_cache_types_refused(make_config):
    with pytest.raises(ConfigError, match="--cache-type-k must be one of"):
        make_config(cache_type_k="q3_k").validated()
    with pytest.raises(ConfigError, match="needs flash attention"):
        make_config(cache_type_v="q8_0", flash_attn="off").validated()


async def _turns(rt: Runtime, evict: bool) -> tuple[tuple[int, ...], int]:
    a1 = [5, 6, 7, 8, 9, 10, 11, 12] * 8
    first = await rt.complete(a1, max_tokens=16, temperature=0, ignore_eos=True)
    if evict:  # another conversation takes the only slot
        await rt.complete([40, 41, 42, 43] * 16, max_tokens=16, temperature=0, ignore_eos=True)
    a2 = a1 + list(first.choices[0].tokens) + [20, 21, 22, 23]
    second = await rt.complete(a2, max_tokens=24, temperature=0, ignore_eos=True)
    return second.choices[0].tokens, second.n_cached


async def test_prompt_cache_restores_the_evicted_state_bit_for_bit(make_config):
    """Host-memory prompt cache (--cache-ram): a conversation whose slot was taken by another is restored from host
    memory: the same tokens as when it kept its slot, the same tokens reused (timings.cache_n),
    and counted in /metrics. Off (0), the history is prefilled again."""
    async with Runtime.open(make_config(parallel=1, n_ctx=1024)) as rt:
        kept_tokens, kept_cached = await _turns(rt, evict=False)
    async with Runtime.open(make_config(parallel=1, n_ctx=1024)) as rt:
        tokens, cached = await _turns(rt, evict=True)
        metrics = (await rt.metrics_text()).decode()
        stats = rt.engine.prompt_cache.statistics()
    assert tokens == kept_tokens and cached == kept_cached == 64 + 16 - 1
    assert stats.hits == 1 and stats.tokens_reused == cached and stats.bytes_held > 0
    assert "llamactor:prompt_cache_hits_total 1.0" in metrics
    async with Runtime.open(make_config(parallel=1, n_ctx=1024, cache_ram_mib=0)) as rt:
        _, cached = await _turns(rt, evict=True)
        assert rt.engine.prompt_cache is None and cached == 0


@pytest.mark.parametrize("idle", [True, False])
async def test_prompt_cache_keeps_a_history_that_shares_the_system_text(make_config, idle):
    """--cache-idle-slots (llama-server's default): conversation B takes A's slot and keeps more
    than half of it (their common system text), yet A's next turn finds its whole history in
    the host cache. --no-cache-idle-slots saves only below half (llama-server's f_keep < 0.5):
    A gets the system text back, nothing more."""
    system = [7, 8, 9, 10] * 24
    async with Runtime.open(make_config(parallel=1, n_ctx=1024, cache_idle_slots=idle)) as rt:
        a1 = [*system, 30, 31, 32, 33]
        first = await rt.complete(a1, max_tokens=8, temperature=0, ignore_eos=True)
        await rt.complete([*system, 50, 51, 52, 53], max_tokens=8, temperature=0, ignore_eos=True)
        a2 = a1 + list(first.choices[0].tokens) + [20, 21]
        second = await rt.complete(a2, max_tokens=8, temperature=0, ignore_eos=True)
    assert second.n_cached == (len(a1) + 8 - 1 if idle else len(system))


async def test_prompt_cache_serves_any_group(make_config):
    """Host-memory prompt cache with pipeline groups: a state saved by group 0 is restored into group 1."""
    async with Runtime.open(make_config(parallel=2, pipeline_groups=2, n_ctx=2048)) as rt:
        a1 = [5, 6, 7, 8] * 16
        first = await rt.complete(a1, max_tokens=8, temperature=0, ignore_eos=True, id_slot=0)
        await rt.complete([40, 41] * 32, max_tokens=8, temperature=0, ignore_eos=True, id_slot=0)
        a2 = a1 + list(first.choices[0].tokens) + [20, 21]
        second = await rt.complete(a2, max_tokens=8, temperature=0, ignore_eos=True, id_slot=1)
        assert second.slot == 1 and second.n_cached == 64 + 8 - 1


def test_prompt_cache_limits():
    """llama-server's rules: a contained prompt is not stored twice; the byte limit drops the
    oldest entries."""
    import numpy as np

    from llamactor.runtime.engine.promptcache import PromptCache, common_prefix

    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4])) == 2
    assert PromptCache(-1).limit_bytes == 0 and PromptCache(2).limit_bytes == 2 * 1024 * 1024


@pytest.mark.slow
async def test_context_shift_over_http_with_n_keep(make_config):
    """Context shift through a real request: n_keep and n_discard are request fields (the server's
    default from --keep); the native response says truncated; bad values are a 400."""
    import httpx
    from conftest import open_server

    async with open_server(make_config(parallel=1, n_ctx=128, context_shift=True, n_keep=4)) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.post(
                "/completion",
                json={
                    "prompt": PROMPT,
                    "n_predict": 300,
                    "temperature": 0,
                    "ignore_eos": True,
                    "n_keep": -1,
                    "n_discard": 16,
                },
            )
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 300 and r.json()["truncated"]
            r = await client.post(
                "/v1/completions", json={"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200
            r = await client.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "n_keep": -3})
            assert r.status_code == 400 and "n_keep" in r.json()["error"]["message"]
        out = await rt.complete(PROMPT, max_tokens=250, temperature=0, ignore_eos=True, n_keep=2, n_discard=8)
        assert out.truncated and out.n_predicted == 250
