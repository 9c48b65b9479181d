"""Prefix reuse on a sliding-window model, through a real server (tiny gemma3-layout model).

A slot holds a 400-token prompt and its answer; the next prompt shares only its first 100
tokens. The sliding-window layers have reused the cells of those positions, so without more
the prompt is prefilled whole (llama-server's ``pos_min`` test). Context checkpoints (the
window's cells saved as the first prompt went in, one a 64-token chunk here) give the prefix
back up to the newest checkpoint before 100: 64 tokens. With ``--swa-full`` those layers keep
every position: all 100 are reused. The answer is a cold run's each time.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import open_server
from tinyswa import write_tiny_swa_model

from llamactor.protocol.messages import PREFIX_HOLDER
from llamactor.protocol.slots import SlotKV
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


async def test_checkpoints_and_swa_full_keep_a_prefix_reusable_past_the_window(make_config, swa_model):
    # one slot, no host-memory cache (a state it restored would hide what the slot kept)
    base = {"model": swa_model, "parallel": 1, "n_ctx": 1024, "cache_ram_mib": 0, "n_batch": 64, "n_ubatch": 64}
    async with open_server(make_config(**base)) as (rt, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
        cold, cache_n, prompt_n = await _complete(client, SECOND)
        assert (cache_n, prompt_n) == (0, len(SECOND))
    windowed = await _second_after_first(make_config(**base, ctx_checkpoints=0))
    checkpoint = await _second_after_first(make_config(**base))
    full = await _second_after_first(make_config(**base, swa_full=True))
    assert windowed[1:] == (0, len(SECOND)), "the window moved past the shared prefix: prefilled whole"
    assert checkpoint[1:] == (64, len(SECOND) - 64), "back to the checkpoint after the first chunk"
    assert full[1:] == (SHARED, len(SECOND) - SHARED), "every position kept: the shared prefix reused"
    assert windowed[0] == cold and checkpoint[0] == cold and full[0] == cold
    # checkpoints at chunk ends 64 tokens apart (-cms 64): a prompt sharing 150 goes back to 128
    longer = FIRST[:150] + SECOND[SHARED:]
    async with open_server(make_config(**base, checkpoint_min_step=64)) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await _complete(client, FIRST)
            assert (await _complete(client, longer))[1:] == (128, len(longer) - 128)


async def test_a_state_from_host_memory_comes_back_with_its_checkpoints(make_config, swa_model):
    """One slot and the host-memory prompt cache: another prompt takes the slot, so the first
    one's state goes to host memory, with its checkpoints (chunk ends 64 apart here). A prompt
    sharing the first 200 tokens restores that state, whose window is the one its last position
    saw, and goes back to its checkpoint at 192: a cold run's answer."""
    base = {"model": swa_model, "parallel": 1, "n_ctx": 1024, "n_batch": 64, "n_ubatch": 64}
    base |= {"cache_ram_mib": 64, "checkpoint_min_step": 64}
    other = [(17 * i) % 400 + 5 for i in range(300)]
    third = FIRST[:200] + [(13 * i) % 400 + 30 for i in range(200)]
    async with open_server(make_config(**base)) as (rt, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
        cold = await _complete(client, third)
    async with open_server(make_config(**base)) as (rt, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
        await _complete(client, FIRST)
        await _complete(client, other)  # takes the slot: the first prompt's state is saved
        tokens, cache_n, prompt_n = await _complete(client, third)
        assert rt.engine.prompt_cache.statistics().hits == 1  # restored from host memory
    assert (cache_n, prompt_n) == (192, len(third) - 192)
    assert tokens == cold[0]


def test_swa_full_and_checkpoints_are_read_from_the_command_line_and_the_environment(tiny_model):
    from serveargs import parse_serve

    assert parse_serve(["-m", str(tiny_model), "--swa-full"]).config.swa_full
    assert parse_serve(["-m", str(tiny_model)], {"LLAMA_ARG_SWA_FULL": "1"}).config.swa_full
    assert not parse_serve(["-m", str(tiny_model)]).config.swa_full
    assert parse_serve(["-m", str(tiny_model), "--ctx-checkpoints", "3"]).config.ctx_checkpoints == 3
    assert parse_serve(["-m", str(tiny_model)], {"LLAMA_ARG_CTX_CHECKPOINTS": "0"}).config.ctx_checkpoints == 0
    assert parse_serve(["-m", str(tiny_model)]).config.ctx_checkpoints == 32  # llama-server's default
    cms = parse_serve(["-m", str(tiny_model), "-cms", "100"]).config
    assert cms.checkpoint_min_step == 100 and parse_serve(["-m", str(tiny_model)]).config.checkpoint_min_step == 8192


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


async def test_a_prefix_export_carries_the_checkpoint_before_the_prompts_part(make_config, swa_model):
    """What a replica pull asks of the holder: its state for the prefix a new prompt shares with
    it. Past the window, that is its full state plus the checkpoint before the shared part; the
    importer goes back to that checkpoint and prefills from there, with a cold run's answer."""
    cfg = make_config(model=swa_model, parallel=1, n_ctx=1024, cache_ram_mib=0, n_batch=64, n_ubatch=64)
    greedy = {"temperature": 0, "ignore_eos": True}
    async with Runtime.open(cfg) as rt:
        await rt.complete(FIRST, max_tokens=N_PREDICT, **greedy)
        want = SlotKV(tokens=tuple(SECOND))
        kv = (await rt.engine.slot_action(PREFIX_HOLDER, "export", kv=want)).kv
        assert kv is not None and kv.window_at == 64 and kv.window
        none = await rt.engine.slot_action(PREFIX_HOLDER, "export", kv=SlotKV(tokens=tuple(FIRST[:20])))
        assert none.kv is not None and not none.kv.tokens  # inside the first window: no checkpoint before it
    async with Runtime.open(cfg) as rt:
        assert (await rt.engine.slot_action(0, "import", kv=kv)).n_tokens == 64
        pulled = await rt.complete(SECOND, max_tokens=N_PREDICT, id_slot=0, **greedy)
        await rt.slot_action(0, "erase")
        cold = await rt.complete(SECOND, max_tokens=N_PREDICT, **greedy)
    assert pulled.n_cached == 64 and pulled.choices[0].tokens == cold.choices[0].tokens
