"""A slot's KV state moved between servers: POST /slots/{id}?action=export and ?action=import,
``Runtime.export_slot`` / ``import_slot``.

A state imported into another server's slot continues exactly as the source slot does (the
same greedy tokens, its prompt taken from the imported KV instead of prefilled again); an
import is a 400 naming what differs when the state came from another model, other KV cache
types or a LoRA adapter the importing server has not loaded.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import TEST_THREADS, open_server, past_first_event
from tinylora import write_tiny_lora
from tinymodel import write_tiny_model

from llamactor.protocol.errors import RequestError
from llamactor.runtime import Runtime, RuntimeConfig
from llamactor.runtime.service.config import default_model_path

PROMPT = "The quick brown fox jumps over the lazy dog. Hello world, this is a tiny model"
GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True, "cache_prompt": True}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("slot-lora")
    return write_tiny_lora(folder / "one.gguf", seed=1), write_tiny_lora(folder / "two.gguf", seed=2)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("slot-model") / "other.gguf", seed=1)


async def _complete(client: httpx.AsyncClient, prompt: Any, slot: int, n: int, lora: list[dict[str, Any]]) -> dict:
    body = {"prompt": prompt, "n_predict": n, "id_slot": slot, "lora": lora, **GREEDY}
    r = await client.post("/completion", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def test_exported_slot_continues_on_another_server_and_incompatible_imports_are_400(
    make_config, adapters, other_model
):
    one, two = adapters
    transfer = dict(parallel=2, slot_transfer=True, lora_init_without_apply=True)
    configs = {
        # the source and the target run their engines in child processes (the state crosses both
        # engine links); adapter "one" is id 0 on the source, id 1 on the target
        "source": make_config(lora=((str(one), 1.0),), isolate=True, **transfer),
        "target": make_config(lora=((str(two), 1.0), (str(one), 1.0)), isolate=True, **transfer),
        "other model": make_config(model=other_model, lora=((str(one), 1.0),), **transfer),
        "other kv type": make_config(lora=((str(one), 1.0),), cache_type_k="f32", **transfer),
        "other adapter": make_config(lora=((str(two), 1.0),), **transfer),
        "closed": make_config(parallel=2),
    }
    async with AsyncExitStack() as stack:
        urls = {name: (await stack.enter_async_context(open_server(cfg)))[1] for name, cfg in configs.items()}
        c = {
            name: await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=60))
            for name, url in urls.items()
        }

        first = await _complete(c["source"], PROMPT, 0, 8, [{"id": 0, "scale": 1.0}])
        r = await c["source"].post("/slots/0?action=export")
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
        exported = r.content

        # the source slot goes on with the conversation: its prompt and answer, then 16 more tokens
        prompt = (await c["source"].post("/tokenize", json={"content": PROMPT, "add_special": True})).json()["tokens"]
        history = [*prompt, *first["tokens"]]
        src = await _complete(c["source"], history, 0, 16, [{"id": 0, "scale": 1.0}])
        assert src["timings"]["cache_n"] > 0

        r = await c["target"].post("/slots/1?action=import", content=exported)
        assert r.status_code == 200, r.text
        assert r.json()["id_slot"] == 1 and r.json()["n_imported"] == len(history) - 1
        imp = await _complete(c["target"], history, 1, 16, [{"id": 1, "scale": 1.0}])
        assert imp["tokens"] == src["tokens"]
        assert imp["timings"]["cache_n"] == src["timings"]["cache_n"]  # not prefilled again

        for name, needle in (
            ("other model", "another model"),
            ("other kv type", "KV cache types"),
            ("other adapter", "LoRA adapter"),
            ("closed", "--slot-transfer"),
        ):
            r = await c[name].post("/slots/0?action=import", content=exported)
            assert r.status_code == 400, (name, r.text)
            assert needle in r.json()["error"]["message"], (name, r.text)
        assert (await c["closed"].post("/slots/0?action=export")).status_code == 400
        # a slot serving a request is not exported: its KV is that request's
        body = {"prompt": PROMPT, "n_predict": 4000, "id_slot": 0, "stream": True, **GREEDY}
        async with c["source"].stream("POST", "/completion", json=body) as stream:
            await past_first_event(stream)
            r = await c["source"].post("/slots/0?action=export")
            assert r.status_code == 409 and "processing" in r.json()["error"]["message"], r.text

        r = await c["target"].post("/slots/0?action=import", content=b"not a slot")
        assert r.status_code == 400 and "not an exported slot" in r.json()["error"]["message"]
        # a state cut short is refused by the KV cache, and the slot is left empty
        r = await c["target"].post("/slots/1?action=import", content=exported[:-64])
        assert r.status_code == 400 and "does not fit" in r.json()["error"]["message"], r.text
        again = await _complete(c["target"], history, 1, 4, [{"id": 1, "scale": 1.0}])
        assert again["timings"]["cache_n"] == 0


async def test_smollm2_round_trip_through_the_embedding_api():
    """The default model, in one runtime: slot 0's state imported into slot 1 continues as slot 0 does."""
    config = RuntimeConfig(model=default_model_path(), n_ctx=2048, parallel=2, threads=TEST_THREADS)
    prompt = "Write one sentence about the sea."
    async with Runtime.open(config) as rt:
        first = await rt.complete(prompt, max_tokens=8, id_slot=0, **GREEDY)
        data = await rt.export_slot(0)
        history = [*await rt.tokenize(prompt), *first.choices[0].tokens]
        src = await rt.complete(history, max_tokens=12, id_slot=0, **GREEDY)
        result = await rt.import_slot(1, data)
        assert result.n_tokens == len(history) - 1
        imp = await rt.complete(history, max_tokens=12, id_slot=1, **GREEDY)
        assert imp.choices[0].tokens == src.choices[0].tokens
        assert imp.n_cached == src.n_cached > 0
        with pytest.raises(RequestError, match="not an exported slot"):
            await rt.import_slot(1, b"garbage")


def test_the_flags_that_move_kv_reach_the_config(tiny_model):
    """--slot-transfer, --replica-pull and --prefill-replicas as the command line and the
    environment give them; a bad value is refused."""
    from serveargs import parse_serve

    cfg = parse_serve(
        [
            "-m",
            str(tiny_model),
            "--slot-transfer",
            "--replicas",
            "2",
            "--prefill-replicas",
            "1",
            "--replica-pull",
            "off",
        ]
    ).config
    assert (cfg.slot_transfer, cfg.prefill_replicas, cfg.replica_pull) == (True, 1, "off")
    env = {"LLAMACTOR_SLOT_TRANSFER": "1", "LLAMACTOR_REPLICA_PULL": "always"}
    cfg = parse_serve(["-m", str(tiny_model)], env).config
    assert (cfg.slot_transfer, cfg.prefill_replicas, cfg.replica_pull) == (True, 0, "always")
    assert parse_serve(["-m", str(tiny_model)]).config.replica_pull == "auto"
    with pytest.raises(SystemExit):  # argparse: "argument --replica-pull: must be one of auto, always, off"
        parse_serve(["-m", str(tiny_model), "--replica-pull", "sometimes"])
