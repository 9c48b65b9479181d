"""``continuous`` schedules as llama-server does: the same slots, the same prompt chunks per
step, the same order of first tokens.

tests/golden/llama_server_schedule.json holds llama-server's schedule of fixed bursts of
prompts on the tiny model (ops/golden/record_schedule.py records it with llama-server built from the
same llama.cpp: each burst is one multi-prompt request, so it arrives whole before a step).
Here the same prompts reach llamactor's ``continuous`` together (submitted with no await
between them, so the supervisor places them all before the group plans), and each request's
prompt progress step by step and the order of first tokens must be llama-server's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import TEST_THREADS

from llamactor.ops.golden.record_schedule import prompt_tokens
from llamactor.runtime import GenerationRequest, Progress, RequestHandle, Runtime, RuntimeConfig

GOLDEN = json.loads((Path(__file__).parent / "golden" / "llama_server_schedule.json").read_text())
SCENARIOS: list[dict[str, Any]] = GOLDEN["scenarios"]


async def schedule(model: Path, scenario: dict[str, Any]) -> dict[str, Any]:
    """Run the burst on llamactor: every request admitted first, then all submitted at once
    (no await between them: the supervisor places them all before the group plans a step)."""
    slots, lengths = scenario["slots"], scenario["lengths"]
    config = RuntimeConfig(
        model=model,
        n_ctx=GOLDEN["n_ctx"],
        parallel=slots,
        n_batch=GOLDEN["n_batch"],
        n_ubatch=GOLDEN["n_batch"],
        threads=TEST_THREADS,
        scheduler="continuous",
        isolate=False,
    )
    progress: list[list[int]] = [[] for _ in lengths]
    first: list[int] = []
    async with Runtime.open(config) as rt:
        assert rt.admission is not None
        handles = []
        for i, n in enumerate(lengths):
            request = GenerationRequest(
                prompt=prompt_tokens(scenario["name"], i, n),
                max_tokens=GOLDEN["n_predict"],
                temperature=0,
                ignore_eos=True,
                return_progress=True,
            )
            admitted = await rt.admission.admit(request)
            handles.append(RequestHandle(admitted.task, admitted.events, rt.engine.cancel))
        for handle in handles:
            rt.engine.submit(handle.task)

        async def read(i: int) -> None:
            async for ev in handles[i]:
                if isinstance(ev, Progress):
                    progress[i].append(ev.processed)
                    if ev.processed == ev.total:
                        first.append(i)  # its first token comes in this step

        async with anyio.create_task_group() as tg:
            for i in range(len(lengths)):
                tg.start_soon(read, i)
    return {"progress": progress, "first_token_order": first}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
async def test_continuous_schedules_a_burst_as_llama_server(tiny_model: Path, scenario: dict[str, Any]) -> None:
    ours = await schedule(tiny_model, scenario)
    assert ours["progress"] == scenario["progress"], "prompt chunks per step differ from llama-server's"
    assert ours["first_token_order"] == scenario["first_token_order"]
