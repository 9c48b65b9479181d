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

Ray is started here (a local instance, dashboard off, listening on 127.0.0.1 only:
``start_local_ray``) unless ``ray_address`` names a cluster to join; what this module started,
it stops. Ray Serve's HTTP proxy is not used: the stream a
client reads must come from the process that holds its journal.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import msgspec
import numpy as np
import structlog
from anyio.abc import TaskGroup

from llamactor.protocol import enginelink as link
from llamactor.protocol.embedding import EmbedderInfo
from llamactor.protocol.errors import ConfigError, LlamactorError, Unavailable, error_from
from llamactor.protocol.events import Event, Failed
from llamactor.protocol.live import LiveSnapshot, merge_replicas
from llamactor.protocol.messages import Task
from llamactor.protocol.slots import SlotActionResult, SlotState
from llamactor.runtime.service.config import RuntimeConfig, config_to_wire, replica_range
from llamactor.runtime.service.engine import EngineStatus, ReplicaStatus, served_by
from llamactor.runtime.service.journal import Entry
from llamactor.runtime.service.remote import JournaledEngine, RemoteEmbedder, metrics_text
from llamactor.runtime.service.routing import Placed, Route, Served, block_hashes

log = structlog.get_logger("llamactor.replicas")

EXTRA = "pip install 'llamactor[cluster]'"
SILENCE_S = 10.0  # a replica sends a frame every second; this long without one: it is gone
READY_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 60.0
_apps = itertools.count()
# A local Ray instance started here runs quieter than Ray's defaults (measured idle, one replica:
# 11.6 CPU ticks a second in Ray's processes, 7.0 with these): its controller reconciles once a
# second instead of ten times, metrics are exported every second, Ray's own metrics collection is
# off (its dashboard is off anyway). And its workers run at the ingress's priority: Ray starts them
# at nice 15, and a replica's engine is the work itself (behind nice 15, any other process on the
# machine, the ingress included, takes its cores first). Each is an environment variable: one set
# already wins.
QUIET_RAY = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_enable_metrics_collection": "0",
}

_frames = msgspec.msgpack.Decoder(Placed | link.Events)
_served = msgspec.msgpack.Decoder(Served)
_answers: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(link.Answer)
_encoder = msgspec.msgpack.Encoder()


def require_ray() -> Any:
    try:
        import ray
        from ray import serve  # noqa: F401
    except ImportError:
        raise ConfigError(f"--replicas runs replicas on Ray Serve, which is not installed: {EXTRA}") from None
    return ray


def _replica_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the replica (not the request) is gone."""
    from ray import exceptions as rx

    return isinstance(exc, (rx.RayActorError, rx.ActorUnavailableError, rx.ObjectLostError, TimeoutError))


@dataclass
class _Sub:
    """One submission of a request to a replica (a resumed request is submitted anew)."""

    sid: int
    entry: Entry
    replica: str = ""  # known from its first event (or the replica's answer)
    epoch: int = -1  # of the replica's events stream that carries its events
    lost: str = ""  # why its replica was given up on
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ended: anyio.Event = field(default_factory=anyio.Event)  # its last events were delivered


@dataclass
class Counters:
    deaths: int = 0  # replicas lost while serving requests
    resumed: int = 0  # requests submitted again on another replica


class ReplicaSet(JournaledEngine):
    def __init__(self, config: RuntimeConfig, handle: Any, app: str) -> None:
        super().__init__(config)
        self.handle = handle
        self.stream = handle.options(stream=True)
        self.app = app
        self.counters = Counters()
        self._tg: TaskGroup | None = None
        self._subs: dict[int, _Sub] = {}  # submission id -> the request submitted under it
        self._sid_of: dict[int, int] = {}  # task id -> its current submission id
        self._sids = itertools.count(1)
        self._epochs: dict[str, int] = {}  # replica -> the epoch of its events stream listened to
        self._placements: dict[int, list[str]] = {}
        self._pids: dict[str, int] = {}
        self._live: LiveSnapshot | None = None
        self._call_ids = itertools.count(1)

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
            await anyio.to_thread.run_sync(_init_ray, ray, config, hi)
            started_ray = True
        app = f"llamactor-{os.getpid()}-{next(_apps)}"
        try:
            deployment = _deployment(serve, rep, replicarouters, config, lo, hi)
            # no Ray Serve HTTP proxy (the ingress serves HTTP); a Serve already running is kept
            await anyio.to_thread.run_sync(lambda: serve.start(proxy_location="Disabled"))
            try:
                handle = await anyio.to_thread.run_sync(
                    lambda: serve.run(
                        deployment.bind(config_to_wire(_replica_config(config))), name=app, route_prefix=None
                    )
                )
            except Exception as exc:
                why = await anyio.to_thread.run_sync(_deploy_failure, serve, app)
                raise ConfigError(f"the replicas did not start: {why or _first_line(exc)}") from None
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
                await anyio.to_thread.run_sync(_stop, serve, ray, app, started_ray)

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
                log.info("replica_unfollowed", replica=rid, reason=_first_line(exc))
            finally:
                following.discard(rid)

        async with anyio.create_task_group() as tg:
            while True:
                for rid in self._replica_ids():
                    if rid not in listening:
                        listening.add(rid)
                        tg.start_soon(listen, rid)
                    if rid not in following:
                        following.add(rid)
                        tg.start_soon(follow, rid)
                await anyio.sleep(0.5)

    def _router(self) -> Any:
        from llamactor.runtime.service import replicarouters

        return replicarouters.ROUTERS.get(self.app)

    def _replica_ids(self) -> list[str]:
        router = self._router()
        return sorted(r.replica_id.unique_id for r in router.replicas()) if router is not None else []

    # ---- EngineClient -------------------------------------------------------------------

    def submit(self, task: Task) -> None:
        if self._tg is None:
            raise Unavailable("the replica set is not open")
        entry = self.journal.add(task)
        placement = served_by.get()
        if placement is not None:
            self._placements[task.id] = placement
        self._tg.start_soon(self._place, entry)

    def cancel(self, task_id: int) -> None:
        entry = self.journal.pop(task_id)
        self._placements.pop(task_id, None)
        sub = self._subs.pop(self._sid_of.pop(task_id, 0), None)
        if sub is not None:
            sub.scope.cancel()  # leaving the replica's ``run`` call cancels the request there
        if entry is not None:
            entry.task.sink.close()

    async def _place(self, entry: Entry) -> None:
        """Serve ``entry`` on the replica the router picks (again, after a replica's death)."""
        task = entry.task
        while task.id in self.journal:
            what = self.journal.next_send(entry, "the replicas serving it")
            if isinstance(what, Failed):
                self.end(task.id, what)
                return
            sid = next(self._sids)
            sub = self._subs[sid] = _Sub(sid, entry)
            self._sid_of[task.id] = sid
            resumed = self.journal.submitted(entry, what)  # before its first event can arrive
            self.counters.resumed += resumed
            prompt = np.concatenate([task.prompt, *(np.asarray(d, dtype=np.int32) for d in entry.delivered[:1])])
            route = Route(sid, tuple(block_hashes(prompt)), _text(prompt, self.config.replica_router), "", task.lora)
            wire = _encoder.encode(msgspec.structs.replace(what, id=sid))
            lost = ""
            with sub.scope:
                try:
                    served = _served.decode(await _answer(self.handle.run.remote(wire, route)))
                    if not sub.replica:  # it ended before its events came (they are on their way)
                        self._placed(sub, served.replica, served.epoch)
                    gone = self._epochs.get(served.replica, 0) > served.epoch and not sub.ended.is_set()
                    if not served.delivered or gone:
                        lost = "the replica's events stream ended"
                    else:
                        await sub.ended.wait()  # its last events are on their way (the events stream)
                        lost = sub.lost
                except Exception as exc:
                    if not _replica_lost(exc):
                        self.end(
                            task.id, Failed.of(exc) if isinstance(exc, LlamactorError) else Failed(_first_line(exc))
                        )
                        return
                    lost = _first_line(exc)
            self._finished(sid)  # (its Ray call ended too: the router's own count agrees)
            if sub.scope.cancel_called:
                lost = sub.lost  # the replica's events stream was lost (else: the client left)
            if not lost:
                return
            self._subs.pop(sid, None)
            if task.id in self.journal:
                log.warning("replica_lost", task=task.id, error=lost, delivered=sum(map(len, entry.delivered)))
                self.journal.lost_one(entry, time.perf_counter())

    async def _listen(self, rid: str) -> None:
        """Follow one replica's events stream; when it ends or falls silent, the requests it
        carried are resumed on other replicas."""
        gen = self.stream.events.remote(Route(0, replica=rid))
        iterator = gen.__aiter__()
        epoch = -1
        why = "the replica's events stream ended"
        try:
            while True:
                with anyio.fail_after(SILENCE_S):
                    data = await iterator.__anext__()
                frame = _frames.decode(data)
                if isinstance(frame, Placed):
                    epoch = frame.epoch
                    self._epochs[rid] = epoch
                    self._pids[rid] = frame.pid
                    continue
                self._deliver(rid, frame)
        except StopAsyncIteration:
            pass
        except TimeoutError:
            why = f"no word from the replica for {SILENCE_S:g} s"
        except Exception as exc:
            if not _replica_lost(exc):
                raise
            why = _first_line(exc)
        finally:
            gen.cancel()
        self._epochs[rid] = max(self._epochs.get(rid, 0), epoch + 1)
        lost = [s for s in self._subs.values() if s.replica == rid and s.epoch <= epoch]
        if lost:
            self.counters.deaths += 1
        for sub in lost:
            sub.lost = why
            sub.scope.cancel()

    def _finished(self, sid: int) -> None:
        """The router counts submission ``sid`` as ended (its slot is free for the next turn)."""
        finished = getattr(self._router(), "finished", None)
        if finished is not None:
            finished(sid)

    def _placed(self, sub: _Sub, replica: str, epoch: int) -> None:
        """Where ``sub`` is served, known (the response header names it)."""
        sub.replica, sub.epoch = replica, epoch
        placement = self._placements.pop(sub.entry.task.id, None)
        if placement is not None:
            placement.append(replica)

    def _deliver(self, rid: str, msg: link.Events) -> None:
        """One replica step's events, of every request it serves for this ingress."""
        events: list[tuple[int, Event]] = []
        for sid, event in msg.events:
            sub = self._subs.get(sid)
            if sub is None:
                continue  # cancelled, or resumed elsewhere since
            if not sub.replica:  # its first event
                self._placed(sub, rid, self._epochs.get(rid, 0))
            events.append((sub.entry.task.id, event))
        ended: list[int] = []
        for sid in msg.ended:
            sub = self._subs.pop(sid, None)
            if sub is not None:
                self._finished(sid)
                sub.ended.set()
                ended.append(sub.entry.task.id)
                self._sid_of.pop(sub.entry.task.id, None)
        self.pass_on(link.Events(tuple(events)), ended)

    def end(self, task_id: int, failed: Failed) -> None:
        self._placements.pop(task_id, None)
        self._subs.pop(self._sid_of.pop(task_id, 0), None)
        super().end(task_id, failed)

    # ---- calls (to one replica, or to each) --------------------------------------------------

    async def call(self, make: Any, answer_type: type[Any], replica: str = "") -> Any:
        msg = make(next(self._call_ids))
        with anyio.fail_after(CALL_TIMEOUT_S):
            data = await self.handle.call.remote(_encoder.encode(msg), Route(0, replica=replica))
        answer = _answers.decode(data)
        if isinstance(answer, link.CallFailed):
            raise error_from(answer.error.error, answer.error.message)
        assert isinstance(answer, answer_type)
        return answer

    async def _each(self, make: Any, answer_type: type[Any]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for rid in self._replica_ids():
            try:
                out.append((rid, await self.call(make, answer_type, rid)))
            except (LlamactorError, TimeoutError) as exc:
                log.warning("replica_call_failed", replica=rid, error=str(exc))
            except Exception as exc:
                if not _replica_lost(exc):
                    raise
        return out

    async def slots(self) -> list[SlotState]:
        """Every slot of every replica, numbered on (replica by replica, in id order)."""
        out: list[SlotState] = []
        for _, answer in await self._each(link.GetSlots, link.Slots):
            base = len(out)
            out += [msgspec.structs.replace(s, id=base + s.id) for s in answer.slots]
        return out

    async def slot_action(self, slot: int, action: str, path: str = "") -> SlotActionResult:
        local = slot
        for rid in self._replica_ids():
            n = len((await self.call(link.GetSlots, link.Slots, rid)).slots)
            if local < n:
                answer = await self.call(
                    partial(_slot_action, slot=local, action=action, path=path), link.SlotDone, rid
                )
                return msgspec.structs.replace(answer.result, slot=slot)  # numbered as ``slots`` numbers it
            local -= n
        from llamactor.protocol.errors import NotFound

        raise NotFound(f"slot {slot} does not exist")

    async def metrics_text(self) -> bytes:
        """Each replica's metrics with a ``replica`` label, then the set's own."""
        texts = [(rid, a.text) for rid, a in await self._each(link.GetMetrics, link.MetricsText)]
        return relabel(texts) + self.own_metrics()

    def own_metrics(self) -> bytes:
        c = self.counters
        return metrics_text(
            [
                (
                    "llamactor:replicas_up",
                    "gauge",
                    "Replicas the router can send requests to",
                    len(self._replica_ids()),
                ),
                ("llamactor:replica_deaths_total", "counter", "Replicas lost while serving requests", c.deaths),
                ("llamactor:requests_resumed_total", "counter", "Requests resumed on another replica", c.resumed),
                ("llamactor:requests_journaled", "gauge", "Requests in flight, kept by the ingress", len(self.journal)),
            ]
        )

    def live_snapshot(self) -> LiveSnapshot | None:
        return self._live

    async def read_live(self) -> LiveSnapshot | None:
        """Every replica's live view as one: its groups, each naming its replica."""
        snapshots = [(rid, answer.snapshot) for rid, answer in await self._each(link.GetLive, link.Live)]
        self._live = merge_replicas(snapshots) if snapshots else None
        return self._live

    def health(self) -> str:
        return "ok" if self._replica_ids() else "restarting"

    def status(self) -> EngineStatus:
        ids = self._replica_ids()
        return EngineStatus(
            isolated=True,
            state="up" if ids else "restarting",
            pid=None,
            restarts=self.counters.deaths,
            requests_resumed=self.counters.resumed,
            requests_in_flight=len(self.journal),
            replicas=tuple(
                ReplicaStatus(id=rid, pid=self._pids[rid], engine_pid=self._pids[rid], state="up")
                for rid in ids
                if rid in self._pids  # one Ray just started is listed once it answered
            ),
        )

    async def restart(self) -> None:
        """Ray Serve restarts replicas by itself: nothing to do."""


def relabel(texts: list[tuple[str, bytes]]) -> bytes:
    """Prometheus texts of several replicas as one: each sample gets a ``replica`` label, each
    family's HELP and TYPE appear once."""
    seen: set[str] = set()
    out: list[str] = []
    for rid, text in texts:
        for line in text.decode().splitlines():
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(" ", 3)
                key = " ".join(parts[:3])
                if key not in seen:
                    seen.add(key)
                    out.append(line)
                continue
            name, _, rest = line.partition(" ")
            label = f'replica="{rid}"'
            if name.endswith("}"):
                name = f"{name[:-1]},{label}}}"
            else:
                name = f"{name}{{{label}}}"
            out.append(f"{name} {rest}")
    return ("\n".join(out) + "\n").encode() if out else b""


def _slot_action(cid: int, *, slot: int, action: str, path: str) -> link.SlotAction:
    return link.SlotAction(cid, slot, action, path)


def _text(prompt: np.ndarray, router: str) -> str:
    """The prompt as text for Ray's prefix-tree router (which matches characters); '' otherwise."""
    return " ".join(map(str, prompt.tolist())) if router == "prefix-tree" else ""


async def _answer(response: Any) -> Any:
    """A Ray Serve call's answer; leaving early cancels the call there (Ray would let it run)."""
    try:
        return await response
    except anyio.get_cancelled_exc_class():
        response.cancel()
        raise


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else text


def _replica_config(config: RuntimeConfig) -> RuntimeConfig:
    from dataclasses import replace

    return replace(config, isolate=False, replicas="", ray_address="")


def _init_ray(ray: Any, config: RuntimeConfig, most: int) -> None:
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if config.ray_address:
        host, sep, port = config.ray_address.rpartition(":")
        if sep and config.ray_address != "auto":  # Ray itself waits minutes for an address nobody answers
            try:
                socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=5).close()
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"cannot reach the Ray cluster at --ray-address {config.ray_address}: {exc}"
                ) from None
        try:  # a cluster started with `ray start` or ray.init() wants the token Ray saved; a driver
            # that joins sends it only when told to (it was refused, and retried for a minute)
            from ray._private.authentication import authentication_token_setup as auth

            auth.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        except (ImportError, AttributeError):  # another Ray: its own rules
            pass
        try:
            ray.init(address=config.ray_address, **kwargs)
        except Exception as exc:
            raise ConfigError(
                f"cannot join the Ray cluster at --ray-address {config.ray_address}: {_first_line(exc)}"
            ) from None
        return
    cpus = max(os.cpu_count() or 1, int(most * config.replica_cpus + 0.999))
    start_local_ray(ray, num_cpus=cpus, **kwargs)


def start_local_ray(ray: Any, **kwargs: Any) -> None:
    """``ray.init`` of a local instance every process of which listens on 127.0.0.1 only.

    Ray has no bind address of its own: each of its servers (GCS, raylet, object manager,
    workers' gRPC, the dashboard and runtime-env agents, the metrics exporters) binds
    loopback when the node's address is 127.0.0.1 and every interface otherwise, and
    ``ray.init`` replaces a loopback node address by the machine's network address unless
    it is told that no cluster is wanted (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read
    where ``ray._private.ray_constants`` sets ``ENABLE_RAY_CLUSTER``, once when Ray is
    imported: so it is set on the module too). An unauthenticated Ray accepts jobs, which
    is code execution for whoever reaches its ports; this instance is reached from this
    machine only. A cluster to join is given with ``--ray-address`` (its operator's binding)."""
    for name, value in QUIET_RAY.items():  # read by the processes Ray starts now
        os.environ.setdefault(name, value)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError):  # another Ray: the environment variable alone
        pass
    ray.init(_node_ip_address="127.0.0.1", **kwargs)


def _deployment(serve: Any, rep: Any, routers: Any, config: RuntimeConfig, lo: int, hi: int) -> Any:
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    scaling: dict[str, Any] = {"num_replicas": lo}
    if hi > lo:
        scaling = {
            "autoscaling_config": AutoscalingConfig(
                min_replicas=lo, max_replicas=hi, target_ongoing_requests=max(1, config.parallel)
            )
        }
    return serve.deployment(
        rep.ReplicaServer,
        name="llamactor",
        max_ongoing_requests=max(1, config.parallel) + config.queue_size + 16,
        ray_actor_options={"num_cpus": config.replica_cpus},
        request_router_config=RequestRouterConfig(
            request_router_class=routers.ROUTER_CLASSES[config.replica_router],
        ),
        max_constructor_retry_count=1,  # a replica that cannot start its engine fails the start, with its error
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
        **scaling,
    )


def _deploy_failure(serve: Any, app: str) -> str:
    """The replicas' own error when they did not start (Ray Serve keeps it in the app's status)."""
    try:
        status = serve.status().applications[app]
    except Exception:
        return ""
    for deployment in status.deployments.values():
        if deployment.message:
            return _first_line(Exception(deployment.message))
    return ""


def _stop(serve: Any, ray: Any, app: str, started_ray: bool) -> None:
    try:
        serve.delete(app)
    except Exception as exc:  # Ray going away already
        log.warning("replicas_stop", error=_first_line(exc))
    if started_ray:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
