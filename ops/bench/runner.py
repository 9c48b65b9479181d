"""One benchmark run of one workload against one server URL.

A workload is anything with a ``plan`` (prompts in, warm-up jobs and measured jobs out) and a
``summarize`` (the measured phase in, a result out); ``run_workload`` does the I/O around
them. Called once per run: once for a plain ``bench``, once per server, sweep point and pair
for ``--sweep`` and ``--vs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from llamactor.ops.bench.client import BenchClient
from llamactor.ops.bench.phase import Job, PhaseResult, measure, warm_up
from llamactor.ops.bench.progress import NoProgress, Progress
from llamactor.ops.bench.prompts import PromptSource
from llamactor.ops.bench.slo import DEFAULT_SLO_ITL_MS, DEFAULT_SLO_TTFT_MS

DEFAULT_TIMEOUT_S = 600.0  # a single request slower than this counts as failed


@dataclass(frozen=True)
class Common:
    """Settings every workload shares."""

    api: str = "native"  # "native" (/completion) or "openai" (/v1/completions)
    warmup: int = 1  # warm-up rounds; each sends one short request per job, all at once
    temperature: float = 0.0  # greedy: the cheapest sampler, the same work on every server
    seed: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS  # goodput: a good request's TTFT is at most this
    slo_itl_ms: float = DEFAULT_SLO_ITL_MS  # ... and its time per output token after the first
    # --api-key / LLAMA_API_KEY, sent as a Bearer token; never printed nor written to JSON
    api_key: str | None = field(default=None, repr=False, metadata={"report": False})


R_co = TypeVar("R_co", covariant=True)


class Workload(Protocol[R_co]):
    @property
    def common(self) -> Common: ...

    def plan(self, prompts: PromptSource) -> tuple[list[Job], list[Job]]:
        """(warm-up jobs, measured jobs); called once per run, before any request."""
        ...

    def summarize(self, phase: PhaseResult, warmup_failed: int) -> R_co:
        """The run's figures; called once, after the measured phase (pure)."""
        ...

    @property
    def n_requests(self) -> int:
        """Requests in the measured phase (for the progress bar)."""
        ...


async def probe_prompt_ids(url: str, api_key: str | None = None) -> list[int]:
    """The token ids prompts are drawn from (see ``BenchClient.prompt_ids``)."""
    async with BenchClient(url, "native", timeout_s=DEFAULT_TIMEOUT_S, api_key=api_key) as client:
        return await client.prompt_ids()


async def run_workload(
    url: str,
    workload: Workload[Any],
    *,
    seed: int | None = None,
    prompt_ids: list[int] | None = None,
    progress: Progress | None = None,
) -> Any:
    """Warm up, measure and summarize ``workload`` against ``url``.

    ``seed`` overrides ``workload.common.seed`` (``--vs`` and ``--sweep`` derive one per run);
    ``prompt_ids`` skips the /tokenize probe so two servers get exactly the same prompts.
    """
    common = workload.common
    async with BenchClient(url, common.api, timeout_s=common.timeout_s, api_key=common.api_key) as client:
        ids = prompt_ids if prompt_ids is not None else await client.prompt_ids()
        warm_jobs, jobs = workload.plan(PromptSource(ids, common.seed if seed is None else seed))
        warm = await warm_up(client, warm_jobs, common.temperature)
        phase = await measure(client, jobs, common.temperature, progress or NoProgress())
    return workload.summarize(phase, warmup_failed=sum(not r.ok for r in warm))


__all__ = ["DEFAULT_TIMEOUT_S", "Common", "Workload", "probe_prompt_ids", "run_workload"]
