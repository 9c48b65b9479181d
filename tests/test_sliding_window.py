"""Prefix reuse on a sliding-window model, through a real server (tiny gemma3-layout model).

A slot holds a 400-token prompt and its answer; the next prompt shares only its first 100
tokens. The sliding-window layers have reused the cells of those positions, so by default
the prompt is prefilled whole (llama-server's ``pos_min`` test). With ``--swa-full`` those
layers keep every position: the 100 tokens are reused and the answer is a cold run's.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import open_server
from tinyswa import write_tiny_swa_model

from llamactor.runtime import Runtime

FIRST = [(7 * i) % 400 + 10 for i in range(400)]
SHARED = 100
SECOND = FIRST[:SHARED] + [(11 * i) % 400 + 20 for i in range(300)]
N_PREDICT = 16


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_swa_model(tmp_path_factory.mktemp("swa") / "tiny-swa.gguf")


async def _complete(client: httpx.AsyncClient, prompt: list[int]) -> tuple[list[int], int, int]:
    """Greedy tokens, ``timings.cache_n`` and ``timings.prompt_n`` of one /completion."""
    body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "ignore_eos": True, "cache_prompt": True}
    r = await client.post("/completion", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["tokens"], out["timings"]["cache_n"], out["timings"]["prompt_n"]


async def _second_after_first(cfg) -> tuple[list[int], int, int]:
    async with open_server(cfg) as (rt, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
        await _complete(client, FIRST)
        return await _complete(client, SECOND)


async def test_swa_full_keeps_a_prefix_reusable_past_the_window(make_config, swa_model):
    # one slot, no host-memory cache (a state it restored would hide what the slot kept)
    base = {"model": swa_model, "parallel": 1, "n_ctx": 1024, "cache_ram_mib": 0, "n_batch": 64, "n_ubatch": 64}
    async with open_server(make_config(**base)) as (rt, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
        cold, cache_n, prompt_n = await _complete(client, SECOND)
        assert (cache_n, prompt_n) == (0, len(SECOND))
    windowed = await _second_after_first(make_config(**base))
    full = await _second_after_first(make_config(**base, swa_full=True))
    assert windowed[1:] == (0, len(SECOND)), "the window moved past the shared prefix: prefilled whole"
    assert full[1:] == (SHARED, len(SECOND) - SHARED), "every position kept: the shared prefix reused"
    assert windowed[0] == cold and full[0] == cold


def test_swa_full_is_read_from_the_command_line_and_the_environment(tiny_model):
    from serveargs import parse_serve

    assert parse_serve(["-m", str(tiny_model), "--swa-full"]).config.swa_full
    assert parse_serve(["-m", str(tiny_model)], {"LLAMA_ARG_SWA_FULL": "1"}).config.swa_full
    assert not parse_serve(["-m", str(tiny_model)]).config.swa_full


async def test_an_imported_state_goes_on_from_its_last_token_and_no_earlier(make_config, swa_model):
    """llama.cpp writes a sliding-window sequence's state as the window its last position sees:
    imported elsewhere, it serves a prompt that goes on from all its tokens (its last token
    decoded again, the answer a cold run's), not one that leaves them earlier."""
    cfg = make_config(
        model=swa_model, parallel=1, n_ctx=1024, cache_ram_mib=0, n_batch=64, n_ubatch=64, slot_transfer=True
    )
    greedy = {"temperature": 0, "ignore_eos": True}
    async with Runtime.open(cfg) as rt:
        first = await rt.complete(FIRST, max_tokens=N_PREDICT, **greedy)
        state = await rt.export_slot(0)
    async with Runtime.open(cfg) as rt:
        held = (await rt.import_slot(0, state)).n_tokens
        history = (FIRST + list(first.choices[0].tokens))[:held]
        assert held > 400
        moved = await rt.complete(history, max_tokens=N_PREDICT, **greedy)
        assert moved.n_cached == held - 1
        await rt.import_slot(0, state)
        elsewhere = await rt.complete(FIRST[: held - 40], max_tokens=N_PREDICT, **greedy)
        assert elsewhere.n_cached == 0  # the window before its end is not in the state
        await rt.slot_action(0, "erase")
        cold = await rt.complete(history, max_tokens=N_PREDICT, **greedy)
        assert cold.n_cached == 0 and moved.choices[0].tokens == cold.choices[0].tokens
