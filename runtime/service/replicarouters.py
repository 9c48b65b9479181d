"""The routers of a replica set, in the ingress (Ray Serve builds one per deployment handle).

``CacheRouter`` routes by the replicas' real caches (``runtime.service.routing``);
``Pow2Router`` and ``PrefixTreeRouter`` are Ray Serve's own two, for comparison. All three send
a call that names a replica (``Route.replica``) to that replica only. Imported only where Ray is
installed, as ``runtime.service.replica``.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import structlog
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve.request_router import RequestRouter

from llamactor.runtime.service.routing import Pull, ReplicaLoad, Route, choose, pull_plan

log = structlog.get_logger("llamactor.replica")

ROUTERS: dict[str, RequestRouter] = {}  # by application name: the ingress finds its router here


def _route_of(pending: PendingRequest | None) -> Route | None:
    if pending is None:
        return None
    for arg in (*pending.args, *pending.kwargs.values()):
        if isinstance(arg, Route):
            return arg
    return None


class _Targeted:
    """A call that names a replica goes to it (slots, metrics, live view of one replica); a
    request that names none never goes to a drained replica while another is left.

    A replica Ray Serve stops (scale-down, a redeploy, its node drained) leaves the set Ray
    routes to at once, but stays up while requests are ongoing on it, up to the deployment's
    graceful shutdown timeout. It stays here as ``leaving`` (drained: no new request) so that
    calls naming it still reach it: the ingress moves its streams off with their KV, then
    ``forget``s it.
    """

    draining: set[str]  # replica ids drained (``ReplicaRequests.drain``): no new requests
    leaving: dict[str, RunningReplica]  # replicas Ray Serve is stopping, until the ingress forgets them

    def _register(self) -> None:
        # Ray sends the class by value: this function's globals are a copy, the module is not
        from llamactor.runtime.service import replicarouters

        self.draining = set()
        self.leaving = {}
        replicarouters.ROUTERS[self.app_name] = self  # type: ignore[attr-defined,assignment]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray's new set of running replicas; one that left it while serving stays, as leaving."""
        now = {r.replica_id.unique_id for r in replicas}
        for r in self.replicas():
            rid = r.replica_id.unique_id
            if rid not in now and rid not in self.leaving:
                self.leaving[rid] = r
                self.draining.add(rid)
                log.info("replica_leaving", replica=rid)
        for rid in now & self.leaving.keys():  # back in the set
            del self.leaving[rid]
            self.draining.discard(rid)
        kept = [r for rid, r in self.leaving.items() if rid not in now]
        super().update_replicas([*replicas, *kept])  # type: ignore[misc]

    def forget(self, replica: str) -> None:
        """The ingress is done with a leaving replica (its streams moved, its events stream
        closed): it is dropped from the set, on the router's own loop (``leaving`` is the
        router's: ``update_replicas`` reads it there)."""
        self._event_loop.call_soon_threadsafe(self._forget, replica)  # type: ignore[attr-defined]

    def _forget(self, replica: str) -> None:
        r = self.leaving.get(replica)
        if r is not None:
            self.on_replica_actor_died(r.replica_id)  # (which drops it from ``leaving`` too)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        self.leaving.pop(replica_id.unique_id, None)
        super().on_replica_actor_died(replica_id)  # type: ignore[misc]

    def live(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        """The candidates not drained (all of them when every one is)."""
        return [r for r in candidates if r.replica_id.unique_id not in self.draining] or candidates

    def replicas(self) -> list[RunningReplica]:
        return list(self.curr_replicas.values())  # type: ignore[attr-defined]

    def target(self, candidates: list[RunningReplica], route: Route | None) -> list[list[RunningReplica]] | None:
        if route is None or not route.replica:
            return None
        named = [r for r in candidates if r.replica_id.unique_id == route.replica]
        if not named and route.task_id:  # a request pinned to a replica that went away: routed as any
            return None
        return [named]


class CacheRouter(_Targeted, RequestRouter):
    """Routes by the replicas' reported caches, load and what it sent since (``routing.choose``)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.loads: dict[str, ReplicaLoad] = {}
        self.rng = random.Random(kwargs.get("seed"))
        self.where: dict[str, str] = {}  # Ray's request id -> the replica it went to, until it ends
        self.requests: dict[int, str] = {}  # submission id (``Route.task_id``) -> Ray's request id
        self.lock = threading.Lock()  # the ingress says when a request ended, from its own loop
        self.guessed: dict[str, tuple[str, float]] = {}  # Ray's request id -> (replica chosen first, when)
        self.reported: dict[str, dict[str, Any]] = {}  # replica id -> its latest stats (the ingress writes)
        self._register()

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        rid = replica.replica_id.unique_id
        load = self.loads.get(rid)
        if load is None:
            load = self.loads[rid] = ReplicaLoad()
        stats = self.reported.get(rid)
        if stats and stats.get("at", 0.0) > load.at:
            load.report(stats, time.time())
        return load

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        route = _route_of(pending_request)
        targeted = self.target(candidate_replicas, route)
        if targeted is not None:
            return targeted
        by_id = {r.replica_id.unique_id: r for r in self.live(candidate_replicas)}
        loads = {rid: self._load(r) for rid, r in by_id.items()}
        now = time.time()
        ranks = choose(route or Route(0), loads, now, self.rng)
        if ranks and route is not None and pending_request is not None:
            # counted where it most likely goes from now on: requests routed before this one is
            # sent (a burst sharing a prefix) follow it there. Once: Ray asks again for a
            # request whose first choice did not answer its queue-length probe in time
            request_id = pending_request.metadata.internal_request_id
            if request_id not in self.guessed:
                first = ranks[0][0]
                loads[first].sent(route.blocks, now)
                with self.lock:
                    loads[first].in_flight += 1
                self.guessed[request_id] = (first, now)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def plan_pull(self, route: Route, min_blocks: int) -> Pull | None:
        """Where ``route``'s request would go now, and the prefix it could pull there from
        another replica (``routing.pull_plan``); None when there is none worth it."""
        by_id = {r.replica_id.unique_id: r for r in self.live(self.replicas())}
        loads = {rid: self._load(r) for rid, r in by_id.items()}
        now = time.time()
        ranks = choose(route, loads, now, self.rng)
        return pull_plan(route, loads, ranks[0][0], now, min_blocks) if ranks else None

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        route = _route_of(pending_request)
        if route is None or (route.replica and not route.task_id):  # a call (slots, metrics), not a request
            return
        request_id = pending_request.metadata.internal_request_id
        guess, at = self.guessed.pop(request_id, ("", 0.0))
        rid = replica_id.unique_id
        with self.lock:
            self.where[request_id] = rid
            self.requests[route.task_id] = request_id
            if guess == rid:
                return
            if guess in self.loads:
                self.loads[guess].unsent(at)
                self.loads[guess].ended()
            load = self.loads.setdefault(rid, ReplicaLoad())
            load.sent(route.blocks, time.time())
            load.in_flight += 1

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        with self.lock:
            rid = self.where.pop(internal_request_id, None)
            if rid is not None and rid in self.loads:
                self.loads[rid].ended()

    def finished(self, sid: int) -> None:
        """Submission ``sid`` ended (the ingress says so as its last events arrive: Ray hears of
        it only with the answer to its call, which may come after the client sent its next turn)."""
        with self.lock:
            request_id = self.requests.pop(sid, None)
        if request_id is not None:
            self.on_request_completed(None, request_id)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self.loads.pop(replica_id.unique_id, None)
        self.reported.pop(replica_id.unique_id, None)


class Pow2Router(_Targeted, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default: the less loaded of two random replicas."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._register()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        targeted = self.target(candidate_replicas, _route_of(pending_request))
        if targeted is not None:
            return targeted
        return await super().choose_replicas(self.live(candidate_replicas), pending_request)


class PrefixTreeRouter(_Targeted, PrefixCacheAffinityRouter):
    """Ray Serve LLM's: a character prefix tree of the prompts it routed (``Route.prompt``)."""

    def initialize_state(self, **kwargs: Any) -> None:  # type: ignore[override]
        super().initialize_state(**kwargs)
        self._register()

    async def choose_replicas(  # type: ignore[override]  # Ray's own returns one rank, flat
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        route = _route_of(pending_request)
        targeted = self.target(candidate_replicas, route)
        if targeted is not None:
            return targeted
        candidate_replicas = self.live(candidate_replicas)
        if route is None or not route.prompt:  # Ray's router divides by the prompt's length
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)  # type: ignore[arg-type]
        return await super().choose_replicas(candidate_replicas, pending_request)  # type: ignore[return-value]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        route = _route_of(pending_request)
        if route is not None and not route.replica:
            super().on_request_routed(pending_request, replica_id, result)


ROUTER_CLASSES: dict[str, type[RequestRouter]] = {
    "cache": CacheRouter,
    "pow2": Pow2Router,
    "prefix-tree": PrefixTreeRouter,
}
