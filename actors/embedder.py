"""EmbeddingActor: owns the embedding context and packs every queued input into shared decodes
(embeddings and rerank).

It serves embeddings and rerank scores next to the generation groups, from the same weights:
its ``llama_decode`` runs in a worker thread of its own (ctypes releases the GIL), so the groups
keep decoding while it works. Per iteration the loop (1) takes new jobs from its mailbox without
waiting; (2) packs inputs into one batch, round-robin over the jobs so a small request is not
stuck behind a large one, up to the context's token and sequence limits; (3) decodes the batch
in its thread; (4) answers each job once all of its inputs are done. Idle, it waits on the mailbox.

A job whose caller left (its result stream has no receiver: disconnect or cancellation) is
dropped before its next input is packed. At most ``max_jobs`` jobs are held; beyond that they wait
in the mailbox, and once that is full too, callers get ``Overloaded`` (503).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import structlog

from llamactor.protocol.embedding import Embedded, EmbedJob, EmbedMsg
from llamactor.protocol.errors import EngineError
from llamactor.protocol.events import Failed
from llamactor.runtime.engine.embedding import EmbeddingContext, EmbeddingOptions, normalize
from llamactor.runtime.kernel.actor import Actor, ActorStatistics

if TYPE_CHECKING:
    from llamactor.runtime.engine.model import Model

log = structlog.get_logger("llamactor.embedder")

EMBED_MAILBOX_SIZE = 64  # jobs waiting to be taken in (then try_tell raises Overloaded)
EMBED_MAX_JOBS = 64  # jobs taken in and being packed at once


@dataclass
class _Job:
    msg: EmbedJob
    results: list[Any]
    next: int = 0  # the next input to pack
    left: int = 0  # inputs not yet decoded

    @property
    def gone(self) -> bool:
        return self.msg.sink.statistics().open_receive_streams == 0


@dataclass(frozen=True)
class EmbedderStatistics(ActorStatistics):
    jobs: int = 0  # jobs taken in and not answered
    inputs_waiting: int = 0  # inputs of those jobs not yet packed
    steps: int = 0  # decodes run
    inputs_done: int = 0
    tokens_done: int = 0
    callers_gone: int = 0  # held jobs whose caller left (dropped before their next input is packed)


class EmbeddingActor(Actor[EmbedMsg]):
    name = "embedder"
    mailbox_size = EMBED_MAILBOX_SIZE

    def __init__(self, model: Model, opts: EmbeddingOptions, *, max_jobs: int = EMBED_MAX_JOBS) -> None:
        super().__init__()
        self.model = model
        self.opts = opts
        self.max_jobs = max_jobs
        self.engine: EmbeddingContext | None = None
        self._jobs: dict[int, _Job] = {}  # taken in, not answered; in arrival order
        self._steps = self._inputs_done = self._tokens_done = 0
        self._limiter = anyio.CapacityLimiter(1)

    # ---- what callers may know (valid once started) -----------------------------------

    @property
    def pooling(self) -> str:
        assert self.engine is not None
        return self.engine.pooling

    @property
    def max_input_tokens(self) -> int:
        """The longest input one decode holds (the embedding context's batch)."""
        assert self.engine is not None
        return self.engine.n_batch

    @property
    def n_embd(self) -> int:
        assert self.engine is not None
        return self.engine.n_embd

    def statistics(self) -> EmbedderStatistics:
        base = super().statistics()
        return EmbedderStatistics(
            base.name,
            base.mailbox_used,
            base.mailbox_size,
            base.finished,
            jobs=len(self._jobs),
            inputs_waiting=sum(len(j.msg.inputs) - j.next for j in self._jobs.values()),
            steps=self._steps,
            inputs_done=self._inputs_done,
            tokens_done=self._tokens_done,
            callers_gone=sum(j.gone for j in self._jobs.values()),
        )

    # ---- lifecycle -------------------------------------------------------------------

    async def setup(self) -> None:
        self.engine = await anyio.to_thread.run_sync(EmbeddingContext, self.model, self.opts)
        log.info(
            "embedder_ready",
            pooling=self.engine.pooling,
            n_batch=self.engine.n_batch,
            n_seq_max=self.engine.n_seq_max,
            n_embd=self.engine.n_embd,
        )

    async def teardown(self) -> None:
        self._fail(list(self._jobs.values()), Failed("the runtime is shutting down", "Closed"))
        while True:
            try:
                msg = self._inbox_recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            _answer(msg.sink, Failed("the runtime is shutting down", "Closed"))
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await anyio.to_thread.run_sync(engine.close, limiter=self._limiter)

    # ---- the loop --------------------------------------------------------------------

    async def loop(self) -> None:
        assert self.engine is not None
        while True:
            if not self._jobs:
                try:
                    msg = await self._inbox_recv.receive()
                except (anyio.EndOfStream, anyio.ClosedResourceError):
                    return
                self._take(msg)
            if not self._drain():
                return
            batch = self._pack()
            if not batch:
                continue
            try:
                out = await anyio.to_thread.run_sync(self._step, batch, limiter=self._limiter)
            except EngineError as exc:  # this batch's jobs fail; the context is reused for the next
                log.error("embedding_step_failed", jobs=sorted({j.msg.id for j, _ in batch}), error=str(exc))
                self._fail(list({id(j): j for j, _ in batch}.values()), Failed(str(exc), "EngineError"))
                continue
            self._steps += 1
            for (job, i), vec in zip(batch, out):
                job.results[i] = vec
                job.left -= 1
                self._inputs_done += 1
                self._tokens_done += len(job.msg.inputs[i])
                if job.left == 0:
                    self._finish(job)

    def _take(self, msg: EmbedJob) -> None:
        assert self.engine is not None
        if not msg.inputs or not all(0 < len(t) <= self.engine.n_batch for t in msg.inputs):
            # Admission (runtime.service.embeddings) refuses these first; a job that got past it
            # anyway would never be packed, so it fails here instead of spinning the loop.
            _answer(msg.sink, Failed(f"every input must hold 1 to {self.engine.n_batch} tokens", "RequestError"))
            return
        self._jobs[msg.id] = _Job(msg, [None] * len(msg.inputs), left=len(msg.inputs))

    def _drain(self) -> bool:
        """Take queued jobs without waiting, up to ``max_jobs``; False once the mailbox is closed."""
        return self.drain_queued(self._take, lambda: len(self._jobs) < self.max_jobs)

    def _pack(self) -> list[tuple[_Job, int]]:
        """Inputs for one decode, round-robin over the jobs in arrival order; drops jobs whose
        caller left. Every input fits a decode on its own (checked at admission), so the first
        one packed always fits and every call makes progress."""
        assert self.engine is not None
        for job in [j for j in self._jobs.values() if j.gone]:
            del self._jobs[job.msg.id]
            job.msg.sink.close()
        batch: list[tuple[_Job, int]] = []
        n_tokens = 0
        progress = True
        while progress:
            progress = False
            for job in self._jobs.values():
                if job.next == len(job.msg.inputs):
                    continue
                k = len(job.msg.inputs[job.next])
                if not self.engine.fits(n_tokens + k, len(batch) + 1):
                    continue
                batch.append((job, job.next))
                job.next += 1
                n_tokens += k
                progress = True
        return batch

    def _step(self, batch: Sequence[tuple[_Job, int]]) -> list[np.ndarray]:
        """In the worker thread: decode the batch, normalize pooled vectors per job."""
        assert self.engine is not None
        out = self.engine.decode([job.msg.inputs[i] for job, i in batch])
        if self.engine.pooling in ("none", "rank"):
            return out  # per-token vectors and scores are returned as llama.cpp gives them
        return [normalize(vec, job.msg.normalize) for (job, _), vec in zip(batch, out)]

    def _finish(self, job: _Job) -> None:
        assert self.engine is not None
        del self._jobs[job.msg.id]
        n_tokens = tuple(len(t) for t in job.msg.inputs)
        _answer(job.msg.sink, Embedded(tuple(job.results), n_tokens, self.engine.pooling))

    def _fail(self, jobs: list[_Job], failure: Failed) -> None:
        for job in jobs:
            self._jobs.pop(job.msg.id, None)
            _answer(job.msg.sink, failure)


def _answer(sink: Any, event: Embedded | Failed) -> None:
    """Send the one answer of a job and close its stream; a caller that left is not an error."""
    try:
        sink.send_nowait(event)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
        pass
    finally:
        sink.close()
