"""``ReplicaSet``: N llamactor engines on Ray Serve behind one ``EngineClient``.

    Runtime (admission, HTTP app) ──► ReplicaSet (this process: the ingress)
        journal of every request in flight (the engine process's, ``runtime.service.journal``)
        deployment handle ──► router (``replicarouters.CacheRouter``: each replica's real cache)
            ──► replica 0: ReplicaServer, its own engine (groups, policy, prompt cache)
            ──► replica 1: …

The ingress is the process that serves HTTP (or embeds the runtime): it keeps admission and
the journal, so when a replica dies mid-stream (killed, OOM, its node gone) or falls silent,
each of its requests goes on on another replica by exact replay of the tokens already
delivered, and the client sees neither a gap nor a duplicate. Ray Serve starts a new replica
in its place. A request whose replicas died ``resume_max`` times while serving it fails alone.

Ray is started, the replicas deployed and both stopped by ``runtime.service.raycluster``; the
requests' placement, events and resumes are ``runtime.service.replicarequests``; the calls to
the replicas (slots, metrics, the live view) ``runtime.service.replicacalls``. This module opens
the set and follows its replicas as Ray Serve starts and replaces them.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import msgspec
import structlog

from llamactor.protocol import enginelink as link
from llamactor.protocol.embedding import EmbedderInfo
from llamactor.protocol.errors import ConfigError, RequestError
from llamactor.runtime.service.config import RuntimeConfig, config_to_wire, replica_range
from llamactor.runtime.service.raycluster import (
    deploy_failure,
    first_line,
    init_ray,
    make_deployment,
    replica_config,
    require_ray,
    scale_to,
    stop_app,
)
from llamactor.runtime.service.remote import RemoteEmbedder
from llamactor.runtime.service.replicamoves import ReplicaMoves
from llamactor.runtime.service.routing import Route

log = structlog.get_logger("llamactor.replicas")

READY_TIMEOUT_S = 600.0
MAX_REPLICAS = 256  # the most ``scale`` asks for
_apps = itertools.count()


class ReplicaSet(ReplicaMoves):
    """N llamactor engines on Ray Serve behind one ``EngineClient``; made by ``open``."""

    @classmethod
    @asynccontextmanager
    async def open(cls, config: RuntimeConfig) -> AsyncIterator[ReplicaSet]:
        ray = require_ray()
        from ray import serve

        from llamactor.runtime.service import replica as rep
        from llamactor.runtime.service import replicarouters

        lo, hi = replica_range(config.replicas) or (1, 1)
        started_ray = False
        if not ray.is_initialized():
            await anyio.to_thread.run_sync(init_ray, ray, config, hi)
            started_ray = True
        app = f"llamactor-{os.getpid()}-{next(_apps)}"
        try:
            deployment = make_deployment(serve, rep, replicarouters, config, lo, hi)
            # no Ray Serve HTTP proxy (the ingress serves HTTP); a Serve already running is kept
            await anyio.to_thread.run_sync(lambda: serve.start(proxy_location="Disabled"))
            try:
                handle = await anyio.to_thread.run_sync(
                    lambda: serve.run(
                        deployment.bind(config_to_wire(replica_config(config))),
                        name=app,
                        route_prefix=None,
                        external_scaler_enabled=lo == hi,  # a fixed count: ``scale`` changes it
                    )
                )
            except Exception as exc:
                why = await anyio.to_thread.run_sync(deploy_failure, serve, app)
                raise ConfigError(f"the replicas did not start: {why or first_line(exc)}") from None
            self = cls(config, handle, app)
            await self._meet(lo)
            log.info("replicas_ready", replicas=len(self._pids), router=config.replica_router, app=app)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._follow)
                try:
                    yield self
                finally:
                    tg.cancel_scope.cancel()
                    self.fail_journal("the runtime is shutting down", "Closed")
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stop_app, serve, ray, app, started_ray)

    async def _meet(self, n: int) -> None:
        """Wait until the router sees ``n`` replicas; learn each one's pid (and the embedder)."""
        first = await self.handle.hello.remote(Route(0))  # the handle's router starts with the first call
        with anyio.fail_after(READY_TIMEOUT_S):
            while len(self._replica_ids()) < n:
                await anyio.sleep(0.1)
        self._pids[first["replica"]] = first["pid"]
        for rid in self._replica_ids():
            if rid not in self._pids:
                hello = await self.handle.hello.remote(Route(0, replica=rid))
                self._pids[hello["replica"]] = hello["pid"]
        if first["embedder"]:
            info = msgspec.msgpack.decode(first["embedder"], type=EmbedderInfo)
            self.embedder = RemoteEmbedder(partial(self.call, answer_type=link.EmbedDone), info)

    async def _follow(self) -> None:
        """Learn each new replica's pid; follow its routing stats (a ``watch`` call per replica,
        answered when they change) into the cache router."""
        following: set[str] = set()
        listening: set[str] = set()

        async def listen(rid: str) -> None:
            try:
                await self._listen(rid)
            finally:
                listening.discard(rid)

        async def follow(rid: str) -> None:
            seen = -1.0
            try:
                # cancelled when the replica leaves (``_see_off``): a ``watch`` would hold it up
                with self._streams.setdefault(f"watch:{rid}", anyio.CancelScope()):
                    if rid not in self._pids:  # a replica Ray started since: learn its pid
                        hello = await self.handle.hello.remote(Route(0, replica=rid))
                        self._pids[hello["replica"]] = hello["pid"]
                    while self.config.replica_router == "cache":
                        stats = await self.handle.watch.remote(seen, Route(0, replica=rid))
                        router = self._router()
                        if router is not None and stats:
                            router.reported[rid] = stats
                        seen = stats.get("at", seen)
            except Exception as exc:  # the replica is gone (Ray starts another: followed anew)
                log.info("replica_unfollowed", replica=rid, reason=first_line(exc))
            finally:
                self._streams.pop(f"watch:{rid}", None)
                following.discard(rid)

        async with anyio.create_task_group() as tg:
            while True:
                router = self._router()
                leaving = set(getattr(router, "leaving", ()))
                for rid in leaving - self._seen_off:
                    self._seen_off.add(rid)
                    tg.start_soon(self._see_off, rid)
                for rid in self._replica_ids():
                    if rid in leaving:
                        continue
                    self._seen_off.discard(rid)  # (back in Ray's set after it left: served again)
                    if rid not in listening:
                        listening.add(rid)
                        tg.start_soon(listen, rid)
                    if rid not in following:
                        following.add(rid)
                        tg.start_soon(follow, rid)
                await anyio.sleep(0.5)

    async def scale(self, n: int) -> dict[str, Any]:
        """Ask Ray Serve for ``n`` replicas (a set started with a fixed ``--replicas``; with a
        range Ray Serve's autoscaler decides). A replica Ray stops first sees its streams moved
        to the others with their KV (``_see_off``); one it starts joins the router when ready."""
        lo, hi = replica_range(self.config.replicas) or (1, 1)
        if lo != hi:
            raise RequestError(f"--replicas {self.config.replicas} autoscales: Ray Serve sets the count")
        least = self.config.prefill_replicas + 1  # a decode replica beside the prefill ones
        if not least <= n <= MAX_REPLICAS:
            raise RequestError(f"replicas must be {least}..{MAX_REPLICAS}, got {n}")
        was = len(self._replica_ids()) - len(getattr(self._router(), "leaving", ()))
        ray = require_ray()
        await anyio.to_thread.run_sync(scale_to, ray, self.app, n)
        log.info("replicas_scaled", replicas=n, was=was)
        return {"replicas": n, "was": was}

    async def _see_off(self, rid: str) -> None:
        """Ray Serve is stopping replica ``rid`` (scale-down, a redeploy, its node drained): its
        streams move to the other replicas with their KV (``drain``), then its events stream is
        closed, so that it stops now (it waits for its ongoing calls, that one included, up to
        its graceful shutdown timeout), and the router forgets it."""
        try:
            report = await self.drain(rid)
            self.stopped_drains.append(report)
        except Exception as exc:  # the streams left on it are replayed when its events stream ends
            log.warning("leaving_replica_not_drained", replica=rid, error=first_line(exc))
        finally:
            for key in (rid, f"watch:{rid}"):  # its events stream and its routing stats
                scope = self._streams.get(key)
                if scope is not None:
                    scope.cancel()
            router = self._router()
            if router is not None:
                router.forget(rid)
