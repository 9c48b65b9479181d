"""GPU builds (``make install BACKEND=cuda``, or vulkan, rocm, metal) as a user runs them.

Each test says why it skips: the normal build has no GPU module, and most machines no GPU.
- A build with a GPU module on a machine without that GPU (or its driver) serves on the CPU,
  and ``-ngl 99`` is then logged as not applied.
- With a GPU: the device is listed with its memory in ``/props``, ``-ngl 99`` serves, and the
  greedy answer of the layers on the GPU is the CPU's (the tiny model's logits are far apart:
  kernels' rounding cannot change the arg-max of its first tokens).

The measured GPU table (llama-server beside llamactor at 8 and 32 users, -ngl 0 against 99) is
``ops/gpu_check.sh``'s, for a machine with an NVIDIA GPU.
"""

from __future__ import annotations

import httpx
import pytest
from conftest import open_server

from llamactor.runtime.engine import backends
from llamactor.runtime.engine.backends import GPU_MODULES


def _gpu_modules() -> list[str]:
    return [name for name in GPU_MODULES if (backends.library_dir() / name).exists()]


needs_gpu_build = pytest.mark.skipif(
    not _gpu_modules(), reason="this build has no GPU backend (make install BACKEND=cuda builds one)"
)


@needs_gpu_build
async def test_a_gpu_build_without_its_gpu_serves_on_the_cpu(make_config):
    if backends.gpus():
        pytest.skip("this machine has a GPU: the test is for one without")
    async with (
        open_server(make_config(parallel=1, n_gpu_layers=99)) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        r = await client.post("/completion", json={"prompt": "hello", "n_predict": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
        devices = (await client.get("/props")).json()["engine"]["build"]["devices"]
    assert devices and not [d for d in devices if d["type"] in ("gpu", "igpu")]


@needs_gpu_build
async def test_layers_on_the_gpu_answer_as_on_the_cpu(make_config):
    gpus = backends.gpus()
    if not gpus:
        pytest.skip(f"no GPU on this machine for {', '.join(_gpu_modules())}")
    body = {"prompt": "the cat sat on", "n_predict": 8, "temperature": 0, "return_tokens": True}
    answers = []
    for layers in (0, 99):
        async with (
            open_server(make_config(parallel=1, n_gpu_layers=layers)) as (_, url),
            httpx.AsyncClient(base_url=url, timeout=60) as client,
        ):
            answers.append((await client.post("/completion", json=body)).json()["tokens"])
            devices = (await client.get("/props")).json()["engine"]["build"]["devices"]
    assert answers[0] == answers[1]
    assert any(d["type"] == "gpu" and d["memory_total"] > 0 for d in devices)
