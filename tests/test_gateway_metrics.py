"""/metrics speaks the Gateway API Inference Extension's model server protocol.

A gateway's endpoint picker (llm-d's inference scheduler, the GIE EPP) scrapes the queue, the
running requests, the KV cache usage, the cache sizes and the LoRA adapters in use. The tests
hold requests in their slots (their prompts in the KV) and others in the queue, scrape
/metrics over HTTP, parse it as Prometheus does and check each series against the runtime's
own state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from conftest import open_server, wait_until
from faults import Faults
from prometheus_client.parser import text_string_to_metric_families
from tinylora import write_tiny_lora

from llamactor.runtime.service.gatewaymetrics import GATEWAY_BLOCK_TOKENS, adapter_names

N_PREDICT = 1000  # past the slot's context: the held requests generate until the test ends them


class HoldGenerate(Faults):
    """Decode steps that only generate wait on ``hold`` once ``when()`` is true (read in the
    group's worker thread, between steps); any step that prefills goes on."""

    def __init__(self) -> None:
        super().__init__()
        self.when: Callable[[], bool] = lambda: True

    def before_decode(self, group: int, n_prompt: int, n_generate: int) -> None:
        if n_prompt == 0 and self.when():
            super().before_decode(group, n_prompt, n_generate)


def scrape(text: str) -> dict[str, Any]:
    """Metric families by name, as a Prometheus scraper reads them."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def only(family: Any) -> Any:
    """The family's one sample."""
    assert len(family.samples) == 1, family.samples
    return family.samples[0]


async def _hold(
    config: Any,
    running: list[dict[str, Any]],
    queued: list[dict[str, Any]],
    check: Callable[[Any, httpx.AsyncClient], Awaitable[None]],
    *,
    before: Sequence[dict[str, Any]] = (),
) -> None:
    """Serve the ``before`` requests to their end; send the ``running`` ones and wait until they
    hold their slots with their prompts in the KV and decoding waits (a request that arrives
    late finds its group still decoding: one that waited would not take it); then send the
    ``queued`` ones and wait until the queue holds them; ``await check(rt, client)``, then
    cancel what is left (the clients leave)."""
    faults = HoldGenerate()
    async with open_server(config, hooks=faults) as (rt, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
        sup = rt.engine.supervisor

        async def send(body: dict[str, Any]) -> None:
            r = await client.post("/completion", json={"n_predict": N_PREDICT, "ignore_eos": True, **body})
            assert r.status_code == 200, r.text

        for body in before:
            await send(body)
        slots = sup.groups[0].slots

        def all_prefilled() -> bool:
            busy = [s for s in slots if s.busy]
            return len(busy) == len(running) and all(len(s.cache) >= len(s.prompt) for s in busy)

        faults.when = all_prefilled
        faults.hold = threading.Event()
        async with anyio.create_task_group() as tg:
            try:
                for body in running:
                    tg.start_soon(send, body)
                await wait_until(
                    lambda: (
                        0 in faults.holding
                        and len(sup.running) == len(running)
                        and sum(s.busy for s in rt.engine.slot_states()) == len(running)
                    ),
                    timeout_s=30,
                )
                for body in queued:
                    tg.start_soon(send, body)
                await wait_until(lambda: len(sup.queue) == len(queued), timeout_s=30)
                await check(rt, client)
            finally:
                faults.hold.set()
                tg.cancel_scope.cancel()


async def test_queue_running_kv_usage_and_cache_info(make_config):
    """Two requests hold their slots, three wait for them, a third slot keeps an earlier prompt
    cached: waiting 3, running 2, KV usage the busy slots' cells over every KV cell (the idle
    slot's cached prompt is evictable, not counted), the cache sizes in 16-token blocks, and an
    empty LoRA series (no adapter loaded)."""
    config = make_config(parallel=3)
    prompt = "The quick brown fox jumps over the lazy dog. " * 4

    async def check(rt: Any, client: httpx.AsyncClient) -> None:
        started = time.time()
        text = (await client.get("/metrics")).text
        families = scrape(text)
        for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "cache_config_info"):
            assert families[f"llamactor:{name}"].type == "gauge", name
        assert only(families["llamactor:num_requests_waiting"]).value == 3
        assert only(families["llamactor:num_requests_running"]).value == 2
        assert families["llamacpp:requests_deferred"].samples[0].value == 3  # the old name stays

        slots = rt.engine.slot_states()
        busy = [s for s in slots if s.busy]
        assert [s.id for s in busy] == [1, 2]
        assert all(s.n_cached >= s.n_prompt > 0 for s in busy)  # every prompt is in the KV
        assert slots[0].n_cached > 0  # the idle slot's cached prompt
        usage = only(families["llamactor:kv_cache_usage_perc"]).value
        assert 0 < usage < 1
        assert usage == sum(s.n_cached for s in busy) / config.total_kv_cells

        info = only(families["llamactor:cache_config_info"])
        assert info.value == 1
        assert info.labels == {
            "block_size": str(GATEWAY_BLOCK_TOKENS),
            "num_gpu_blocks": str(config.total_kv_cells // GATEWAY_BLOCK_TOKENS),
        }
        lora = families["llamactor:lora_requests_info"]
        assert lora.type == "gauge"
        sample = only(lora)
        assert sample.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "0"}
        assert 0 < sample.value <= started

    running = [{"prompt": f"{i}: {prompt}", "id_slot": i} for i in (1, 2)]
    queued = [{"prompt": f"queued {i}", "id_slot": 1 + i % 2} for i in range(3)]  # pinned to busy slots: they wait
    first = {"prompt": "An earlier prompt, cached on slot 0 when it is done", "id_slot": 0, "n_predict": 2}
    await _hold(config, running, queued, check, before=[first])


@pytest.fixture(scope="module")
def two_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("gateway-lora")
    return write_tiny_lora(folder / "alpha.gguf", seed=1), write_tiny_lora(folder / "beta.gguf", seed=2)


async def test_lora_requests_info(make_config, two_adapters):
    """Adapters alpha (id 0) and beta (id 1) loaded at scale 0: a request with alpha holds the
    one slot; one with beta and one with the base model wait. The LoRA series names alpha
    running, beta waiting, two adapters at most, and its value is a recent unix time."""
    alpha, beta = two_adapters
    config = make_config(
        parallel=1,
        lora=((str(alpha), 1.0), (str(beta), 1.0)),
        lora_init_without_apply=True,
        n_batch=64,
        n_ubatch=64,
    )
    before = time.time()

    async def check(rt: Any, client: httpx.AsyncClient) -> None:
        families = scrape((await client.get("/metrics")).text)
        lora = families["llamactor:lora_requests_info"]
        assert lora.type == "gauge"
        sample = only(lora)
        assert sample.labels == {"running_lora_adapters": "alpha", "waiting_lora_adapters": "beta", "max_lora": "2"}
        assert before <= sample.value <= time.time()
        assert only(families["llamactor:num_requests_running"]).value == 1
        assert only(families["llamactor:num_requests_waiting"]).value == 2

    await _hold(
        config,
        [{"prompt": "Hello with alpha", "lora": [{"id": 0, "scale": 1.0}]}],
        [{"prompt": "Hello with beta", "lora": [{"id": 1, "scale": 0.5}]}, {"prompt": "Hello, base model"}],
        check,
    )


def test_adapter_names():
    assert adapter_names(["/a/alpha.gguf", "b/beta.gguf", "c/alpha.gguf", "x,y.gguf"]) == (
        "alpha",
        "beta",
        "alpha-2",
        "x_y",
    )
