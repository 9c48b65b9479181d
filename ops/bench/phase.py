"""Running a planned load against one server: warm-up, barrier release, measured phase.

Every workload (closed loop, mixed, cohort) is a list of jobs (``Job``): a job waits for the
barrier, then for its start offset, then sends its requests one after another (closed loop:
the next request leaves when the previous one has ended). All jobs are created and parked on
the barrier before the clock starts, and all prompts are drawn before that too, so the
measured phase contains nothing but requests.

A job may also take requests from a ``Feed`` once its fixed ones are sent: requests that can
only be built during the phase (chat: a turn's prompt holds the server's earlier replies).

The server's ``llamacpp:tokens_predicted_total`` is read after the warm-up and after the
measured phase; the delta must equal the tokens the client counted, unless another client
used the server meanwhile. ``llamacpp:prompt_tokens_total`` is read with it: the prompt
tokens the server actually evaluated (cached ones not counted).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from llamactor.ops.bench.client import BenchClient
from llamactor.ops.bench.progress import NoProgress, Progress
from llamactor.ops.bench.stats import CrossCheck, RequestRecord

WARMUP_NTG = 8  # tokens generated per warm-up request: enough to run decode steps


@dataclass(frozen=True)
class Request:
    prompt: list[int] = field(repr=False)
    n_predict: int
    cache_prompt: bool = False  # let the server reuse a cached prefix (shared-prefix, chat)
    keep_ids: bool = False  # record the generated token ids (chat: the next turn's history)
    tag: Any = field(default=None, compare=False)  # the workload's own label (chat: conversation, turn)


OnRecord = Callable[[Request, RequestRecord], None]  # called as each measured request ends


class Feed(Protocol):
    """Requests built during the measured phase, shared by the jobs that hold it."""

    async def take(self) -> Request | None:
        """The next request to send, waiting until it can be built; ``None``: no more."""
        ...

    def done(self, request: Request, record: RequestRecord) -> None:
        """Called once per request taken, when it has ended (completed or failed)."""
        ...


@dataclass(frozen=True)
class Job:
    """A sequence of requests that starts ``offset_s`` after the barrier opens."""

    kind: str  # "user", "stream", "arrival", "cohort": how the workload reads its records
    requests: tuple[Request, ...]
    offset_s: float = 0.0
    feed: Feed | None = field(default=None, repr=False, compare=False)  # then requests taken from it


@dataclass
class PhaseResult:
    """Records of the measured phase, per job in plan order. Times are ``perf_counter``
    seconds; ``t0_s`` is the instant the barrier opened, ``end_s`` when the last request ended."""

    jobs: list[Job]
    records: list[list[RequestRecord]]
    t0_s: float
    end_s: float
    client_cpu_s: float
    cross_check: CrossCheck
    server_prompt_tokens: int | None = None  # delta of llamacpp:prompt_tokens_total; None: not exposed
    stopped: bool = False  # ended by ``stop`` before every job was done: requests in flight were cut

    @property
    def wall_s(self) -> float:
        return self.end_s - self.t0_s

    def of_kind(self, kind: str) -> list[RequestRecord]:
        return [r for job, recs in zip(self.jobs, self.records) if job.kind == kind for r in recs]

    def all_records(self) -> list[RequestRecord]:
        return [r for recs in self.records for r in recs]


async def _send(
    client: BenchClient,
    req: Request,
    temperature: float,
    out: list[RequestRecord],
    progress: Progress,
    on_record: OnRecord | None = None,
) -> RequestRecord:
    rec = await client.complete(
        req.prompt, req.n_predict, temperature, cache_prompt=req.cache_prompt, keep_ids=req.keep_ids
    )
    out.append(rec)
    progress.advance(rec.ok)
    if on_record is not None:
        on_record(req, rec)
    return rec


async def _run_job(
    client: BenchClient,
    job: Job,
    temperature: float,
    out: list[RequestRecord],
    progress: Progress,
    on_record: OnRecord | None = None,
) -> None:
    for req in job.requests:
        await _send(client, req, temperature, out, progress, on_record)
    if job.feed is not None:
        while (taken := await job.feed.take()) is not None:
            job.feed.done(taken, await _send(client, taken, temperature, out, progress, on_record))


async def warm_up(client: BenchClient, warmup_jobs: list[Job], temperature: float) -> list[RequestRecord]:
    """Run every warm-up job at once, without offsets; called once before the barrier."""
    out: list[RequestRecord] = []
    async with anyio.create_task_group() as tg:
        for job in warmup_jobs:
            tg.start_soon(_run_job, client, job, temperature, out, NoProgress())
    return out


async def measure(
    client: BenchClient,
    jobs: list[Job],
    temperature: float,
    progress: Progress | None = None,
    *,
    on_record: OnRecord | None = None,
    stop: anyio.Event | None = None,
) -> PhaseResult:
    """Park every job on a barrier, open it, and wait until every job has ended.

    ``on_record`` sees each measured request as it ends; setting ``stop`` ends the phase early
    (the requests in flight are cancelled, their connections closed, and they leave no record):
    for a caller that already knows the outcome, such as a capacity search's failed point.
    """
    if not jobs:
        raise ValueError("a measured phase needs at least one job")
    progress = progress or NoProgress()
    records: list[list[RequestRecord]] = [[] for _ in jobs]
    parked = finished = 0
    all_parked = anyio.Event()
    all_done = anyio.Event()
    release = anyio.Event()
    t0 = 0.0

    async def job_task(i: int) -> None:
        nonlocal parked, finished
        parked += 1
        if parked == len(jobs):
            all_parked.set()
        await release.wait()
        delay = t0 + jobs[i].offset_s - time.perf_counter()
        if delay > 0:
            await anyio.sleep(delay)
        await _run_job(client, jobs[i], temperature, records[i], progress, on_record)
        finished += 1
        if finished == len(jobs):
            all_done.set()

    async def stop_task() -> None:
        assert stop is not None
        await stop.wait()
        stopped.set()
        tg.cancel_scope.cancel()

    stopped = anyio.Event()

    before, prompt_before = await client.counters()
    async with anyio.create_task_group() as tg:
        for i in range(len(jobs)):
            tg.start_soon(job_task, i)
        await all_parked.wait()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        release.set()
        if stop is not None:
            tg.start_soon(stop_task)
            await all_done.wait()
            tg.cancel_scope.cancel()  # every job ended: the stop watcher is no longer needed
    end = max((r.ended_s for recs in records for r in recs if r.ended_s is not None), default=t0)
    cpu = time.process_time() - cpu0
    after, prompt_after = await client.counters()
    progress.close()
    counted = sum(r.n_generated for recs in records for r in recs)
    prompt = None if prompt_before is None or prompt_after is None else int(round(prompt_after - prompt_before))
    cross_check = CrossCheck.of(counted, before, after)
    return PhaseResult(jobs, records, t0, end, cpu, cross_check, prompt, stopped=stopped.is_set())


__all__ = ["WARMUP_NTG", "Feed", "Job", "OnRecord", "PhaseResult", "Request", "measure", "warm_up"]
