"""GET /metrics as llama-server serves it: off (501) unless started with ``--metrics``, the
``Process-Start-Time-Unix`` header, and its ``llamacpp:*`` series unlabelled, each with its own
``# HELP`` and ``# TYPE`` lines, counting what the responses' ``timings`` report: prompt tokens
decoded apart from the cached ones, tokens predicted, and an embedding's prompt."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import open_server

COUNTERS = (
    "prompt_tokens_total",
    "prompt_tokens_cached_total",
    "prompt_seconds_total",
    "tokens_predicted_total",
    "tokens_predicted_seconds_total",
    "n_decode_total",
    "n_tokens_max",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_drafts_total",
)
GAUGES = (
    "prompt_tokens_seconds",
    "predicted_tokens_seconds",
    "requests_processing",
    "requests_deferred",
    "n_busy_slots_per_decode",
)


def _llamacpp(text: str) -> dict[str, tuple[str, float]]:
    """``{name: (type, value)}`` for the unlabelled ``llamacpp:*`` samples; each must have its
    ``# TYPE`` line under its own full name (what llama-server's test suite parses)."""
    types: dict[str, str] = {}
    out: dict[str, tuple[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("llamacpp:") and "{" not in line:
            name, value = line.split(" ", 1)
            assert name in types, f"{name} has no # TYPE line"
            out[name] = (types[name], float(value))
    return out


async def _scrape(client: httpx.AsyncClient) -> dict[str, tuple[str, float]]:
    r = await client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    started = int(dict(r.headers.raw)[b"Process-Start-Time-Unix"])  # llama-server's spelling
    assert time.time() - 600 < started <= time.time()
    return _llamacpp(r.text)


async def test_metrics_off_without_the_flag(make_config):
    """Without --metrics: 501 with llama-server's not_supported_error, and /props says so."""
    async with open_server(make_config(endpoint_metrics=False)) as (_, url), httpx.AsyncClient(base_url=url) as client:
        r = await client.get("/metrics")
        assert r.status_code == 501
        assert r.json()["error"]["type"] == "not_supported_error"
        assert "--metrics" in r.json()["error"]["message"]
        assert (await client.get("/props")).json()["endpoint_metrics"] is False


async def test_llama_server_series_unlabelled_and_counting_the_timings(make_config):
    """Every llama-server series, unlabelled, of its type, with a help line; after the same
    prompt twice on one slot the prompt counters equal the sums of ``timings.prompt_n`` and
    ``timings.cache_n`` (cached tokens counted apart), the predicted counter the sum of
    ``predicted_n``; nothing is processing at rest; the per-group view has the same totals."""
    prompt = "the quick brown fox jumps over the lazy dog"
    async with (
        open_server(make_config(parallel=1)) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        n_processed = n_cached = n_predicted = 0
        for n_predict in (4, 1, 16):
            r = await client.post("/completion", json={"prompt": prompt, "n_predict": n_predict, "ignore_eos": True})
            assert r.status_code == 200, r.text
            timings = r.json()["timings"]
            n_processed += timings["prompt_n"]
            n_cached += timings["cache_n"]
            n_predicted += timings["predicted_n"]
        assert n_cached > 0  # the later requests reused the first one's prompt
        metrics = await _scrape(client)
        text = (await client.get("/metrics")).text
    for name in COUNTERS:
        assert metrics[f"llamacpp:{name}"][0] == "counter", name
        assert f"# HELP llamacpp:{name} " in text
    for name in GAUGES:
        assert metrics[f"llamacpp:{name}"][0] == "gauge", name
        assert f"# HELP llamacpp:{name} " in text
    assert metrics["llamacpp:prompt_tokens_total"][1] == n_processed
    assert metrics["llamacpp:prompt_tokens_cached_total"][1] == n_cached
    assert metrics["llamacpp:tokens_predicted_total"][1] == n_predicted == 21
    assert metrics["llamacpp:n_decode_total"][1] > 0
    assert metrics["llamacpp:requests_processing"][1] == 0
    assert metrics["llamacpp:n_tokens_max"][1] >= 16
    assert f'llamactor:group_prompt_tokens_cached_total{{group="0"}} {float(n_cached)}' in text


@pytest.mark.parametrize("pipeline_groups", [2])
async def test_totals_over_groups(make_config, pipeline_groups: int):
    """With several groups the llama-server series are the sums of the per-group ones."""
    async with (
        open_server(make_config(parallel=4, pipeline_groups=pipeline_groups)) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        for prompt in ("one prompt", "another prompt", "a third", "and a fourth"):
            r = await client.post("/completion", json={"prompt": prompt, "n_predict": 5, "ignore_eos": True})
            assert r.status_code == 200, r.text
        metrics = await _scrape(client)
        text = (await client.get("/metrics")).text
    per_group = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llamactor:group_tokens_predicted_total{")
    ]
    assert len(per_group) == pipeline_groups
    assert metrics["llamacpp:tokens_predicted_total"][1] == sum(per_group) == 20


async def test_embedding_prompt_is_counted(make_config):
    """An embedding request samples nothing, but its prompt is decoded and counted."""
    async with (
        open_server(make_config(embedding=True, pooling="mean")) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        r = await client.post("/v1/embeddings", json={"input": ["hello world", "goodbye world"]})
        assert r.status_code == 200, r.text
        metrics = await _scrape(client)
    assert metrics["llamacpp:prompt_tokens_total"][1] > 0
    assert metrics["llamacpp:n_decode_total"][1] > 0
    assert metrics["llamacpp:tokens_predicted_total"][1] == 0
