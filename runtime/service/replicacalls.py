"""``ReplicaCalls``: the replica set's calls to one replica or to each, and what it reports from them.

The link's calls (slots, slot actions, metrics, the live view; embeddings by ``call``) go to a
replica named in the ``Route``, or to each replica the router sees, in id order: the set's slots
are numbered on replica by replica, its metrics get a ``replica`` label, its live view names each
group's replica. A replica lost during such a call is left out of the answer, not an error.
Requests (``runtime.service.replicarequests``) and the set's start (``runtime.service.replicas``)
build on this.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import msgspec
import structlog

from llamactor.protocol import enginelink as link
from llamactor.protocol.errors import LlamactorError, error_from
from llamactor.protocol.live import LiveSnapshot, merge_replicas
from llamactor.protocol.slots import SlotActionResult, SlotKV, SlotState
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.engine import EngineStatus, ReplicaStatus
from llamactor.runtime.service.raycluster import replica_lost
from llamactor.runtime.service.remote import JournaledEngine, metrics_text
from llamactor.runtime.service.routing import Route

log = structlog.get_logger("llamactor.replicas")

CALL_TIMEOUT_S = 60.0

_answers: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(link.Answer)
_encoder = msgspec.msgpack.Encoder()


@dataclass
class Counters:
    deaths: int = 0  # replicas lost while serving requests
    resumed: int = 0  # requests submitted again on another replica


class ReplicaCalls(JournaledEngine):
    """The Ray Serve deployment's handle, the replicas its router sees, and the calls to them."""

    def __init__(self, config: RuntimeConfig, handle: Any, app: str) -> None:
        super().__init__(config)
        self.handle = handle
        self.app = app
        self.counters = Counters()
        self._pids: dict[str, int] = {}
        self._live: LiveSnapshot | None = None
        self._call_ids = itertools.count(1)

    def _router(self) -> Any:
        from llamactor.runtime.service import replicarouters

        return replicarouters.ROUTERS.get(self.app)

    def _replica_ids(self) -> list[str]:
        router = self._router()
        return sorted(r.replica_id.unique_id for r in router.replicas()) if router is not None else []

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
                if not replica_lost(exc):
                    raise
        return out

    async def slots(self) -> list[SlotState]:
        """Every slot of every replica, numbered on (replica by replica, in id order)."""
        out: list[SlotState] = []
        for _, answer in await self._each(link.GetSlots, link.Slots):
            base = len(out)
            out += [msgspec.structs.replace(s, id=base + s.id) for s in answer.slots]
        return out

    async def slot_action(self, slot: int, action: str, path: str = "", kv: SlotKV | None = None) -> SlotActionResult:
        local = slot
        for rid in self._replica_ids():
            n = len((await self.call(link.GetSlots, link.Slots, rid)).slots)
            if local < n:
                answer = await self.call(
                    partial(slot_action_call, slot=local, action=action, path=path, kv=kv), link.SlotDone, rid
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


def slot_action_call(cid: int, *, slot: int, action: str, path: str, kv: SlotKV | None) -> link.SlotAction:
    return link.SlotAction(cid, slot, action, path, kv)
