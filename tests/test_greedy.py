"""Greedy output is a function of the prompt only: not of --parallel, batching or the server."""

from __future__ import annotations

import anyio
import httpx
import llama_cpp
import numpy as np
from conftest import open_server

from llamactor.runtime import Runtime
from llamactor.runtime.engine.model import Model

PROMPTS = [
    "The quick brown fox",
    "Hello world",
    "héllo 世界 🙂",
    "What is the time?",
    "a b c d e f",
    "Once upon a time there was",
    "1 2 3 4 5",
    "def main():",
]
N_PREDICT = 24


def reference_greedy(model: Model, prompt: str, n_predict: int, n_ctx: int) -> list[int]:
    """A plain greedy decode with llama_cpp's low-level API: one context, one sequence."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_seq_max = n_ctx, 512, 1
    params.n_threads = params.n_threads_batch = 1
    ctx = llama_cpp.llama_init_from_model(model.ptr, params)
    try:
        tokens = model.tokenize(prompt)
        out: list[int] = []
        feed = tokens
        for _ in range(n_predict):
            arr = (llama_cpp.llama_token * len(feed))(*feed)
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(feed))) == 0
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(model.n_vocab,))
            token = int(logits.argmax())
            out.append(token)
            feed = [token]
        return out
    finally:
        llama_cpp.llama_free(ctx)


async def _run_concurrently(rt: Runtime, prompts: list[str]) -> list[tuple[int, ...]]:
    results: list[tuple[int, ...]] = [()] * len(prompts)

    async def one(i: int) -> None:
        out = await rt.complete(prompts[i], max_tokens=N_PREDICT, temperature=0, ignore_eos=True)
        results[i] = out.choices[0].tokens

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


async def test_greedy_identical_parallel_1_and_8_and_reference(make_config, tiny_model):
    """--parallel 1 == --parallel 8 (8 concurrent prompts) == direct llama_cpp."""
    async with Runtime.open(make_config(parallel=1, n_ctx=512)) as rt:
        serial = await _run_concurrently(rt, PROMPTS)
    async with Runtime.open(make_config(parallel=8, n_ctx=8 * 512)) as rt:
        parallel = await _run_concurrently(rt, PROMPTS)
        model = rt.model
        reference = [tuple(reference_greedy(model, p, N_PREDICT, 512)) for p in PROMPTS]
    assert serial == parallel
    assert parallel == reference
    assert len(set(parallel)) == len(PROMPTS)  # the prompts really differ


async def test_greedy_identical_through_http(make_config):
    """The HTTP server returns the same greedy tokens as the embedding API."""
    async with open_server(make_config(parallel=4)) as (rt, url):
        direct = await rt.complete(PROMPTS[0], max_tokens=N_PREDICT, temperature=0, ignore_eos=True)
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post(
                "/completion",
                json={
                    "prompt": PROMPTS[0],
                    "n_predict": N_PREDICT,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
    assert r.status_code == 200
    assert tuple(r.json()["tokens"]) == direct.choices[0].tokens
    assert r.json()["content"] == direct.text
