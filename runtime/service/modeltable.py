"""The router mode's model table: what ``ModelSet`` knows of each model and decides from.

A ``ModelSpec`` is a model as configured, ``ModelStatus`` its lifecycle, a ``ModelEntry`` its
mutable state and a ``ModelView`` a frozen reading of that. ``ModelTable`` holds the entries by
name and alias with the queue of models that requests wait for, and says whether a model may
take a slot; ``evictions`` picks the idle models that give theirs up to the queue. Nothing here
waits or opens a runtime: the set (``runtime.service.modelset``) does, from what the table says.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
from prometheus_client.metrics_core import Metric

from llamactor.protocol.errors import ConfigError, LlamactorError
from llamactor.runtime.service import modelmetrics
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.core import RuntimeCore

DEFAULT_MODELS_MAX = 4  # llama-server's --models-max default
DEFAULT_STOP_TIMEOUT_S = 10.0  # llama-server's stop-timeout default


class ModelStatus(enum.Enum):
    """A model's lifecycle, with llama-server's names (``GET /models``' ``status.value``)."""

    UNLOADED = "unloaded"  # not running: never loaded, unloaded, or its last load failed (``failure``)
    LOADING = "loading"  # its runtime is opening: vocabulary, chat template, engine process
    LOADED = "loaded"  # serving
    SLEEPING = "sleeping"  # loaded, its engine process stopped after --sleep-idle-seconds without a request


@dataclass(frozen=True)
class ModelSpec:
    """One model the server may load: what the models folder and the preset file say of it."""

    name: str
    config: RuntimeConfig  # its runtime's: the model file, the preset's flags under the command line's
    source: str = "preset"  # "models_dir" | "preset", as llama-server reports it
    aliases: tuple[str, ...] = ()  # further names that route to it
    tags: tuple[str, ...] = ()  # listed, used for nothing
    args: tuple[str, ...] = ()  # the command line its flags amount to (GET /models' status.args)
    preset: str = ""  # its flags as an INI section (GET /models' status.preset)
    load_on_startup: bool = False
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S  # an unload waits this long for its requests


@dataclass(frozen=True)
class ModelView:
    """A model as it is now: what ``GET /models`` lists and what ``evictions`` decides from."""

    spec: ModelSpec
    status: ModelStatus
    in_use: int = 0  # leases held: requests using it now
    last_used: float = 0.0  # time.monotonic() of the last lease taken or released
    stopping: bool = False  # asked to unload, not gone yet (it takes no new request)
    failure: str = ""  # why its last load failed ("" when it did not)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def running(self) -> bool:
        """Holding (or taking) one of the ``models_max`` slots."""
        return self.status is not ModelStatus.UNLOADED


def evictions(models: Sequence[ModelView], wanted: Sequence[str], models_max: int) -> list[str]:
    """The idle models to unload so that the models waiting to load get slots: while the waiting
    models outnumber the slots free or being freed, the least recently used model that serves no
    request, is not stopping already and is not waited for itself (llama-server's
    ``server_lru_sched::tick``). Empty when nothing waits or there is no limit (``models_max`` <= 0)."""
    if models_max <= 0 or not wanted:
        return []
    by_name = {m.name: m for m in models}
    running = [m for m in models if m.running]
    free = models_max - len(running) + sum(m.stopping for m in running)
    needed = sum(1 for name in wanted if not by_name[name].running or by_name[name].stopping)
    waited = set(wanted)
    idle = sorted(
        (
            m
            for m in running
            if m.status in (ModelStatus.LOADED, ModelStatus.SLEEPING)
            and not m.in_use
            and not m.stopping
            and m.name not in waited
        ),
        key=lambda m: m.last_used,
    )
    out: list[str] = []
    for m in idle:
        if free >= needed:
            break
        out.append(m.name)
        free += 1
    return out


@dataclass(eq=False)
class ModelEntry:
    """A model's mutable state; only the set touches it, on the event loop."""

    spec: ModelSpec
    status: ModelStatus = ModelStatus.UNLOADED  # UNLOADED, LOADING or LOADED (SLEEPING is read off the engine)
    runtime: RuntimeCore | None = None  # while LOADED
    in_use: int = 0
    last_used: float = 0.0
    failure: str = ""
    stop: anyio.Event | None = None  # while running: set to unload it
    stop_reason: str = ""
    scope: anyio.CancelScope | None = None  # its host task's: cancelled to stop a load
    loads: int = 0
    load_failures: int = 0
    unloads: int = 0

    @property
    def stopping(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def view(self) -> ModelView:
        status = self.status
        if self.runtime is not None and self.runtime.engine_status().state == "sleeping":
            status = ModelStatus.SLEEPING
        return ModelView(
            spec=self.spec,
            status=status,
            in_use=self.in_use,
            last_used=self.last_used,
            stopping=self.stopping,
            failure=self.failure,
        )


class ModelTable:
    """The set's models by name and alias, and the queue of those that requests wait for; only
    the set touches it, on the event loop."""

    def __init__(self, specs: Sequence[ModelSpec]) -> None:
        self.models: dict[str, ModelEntry] = {}
        self.names: dict[str, ModelEntry] = {}  # every name and alias
        for spec in specs:
            model = ModelEntry(spec)
            for name in (spec.name, *spec.aliases):
                if name in self.names:
                    raise ConfigError(f"model name {name!r} is given twice (a model's name or alias)")
                self.names[name] = model
            self.models[spec.name] = model
        self.wanted: dict[str, int] = {}  # the queue: model -> requests waiting for it to load, in arrival order

    def find(self, name: str, missing: LlamactorError) -> ModelEntry:
        model = self.names.get(name)
        if model is None:
            raise missing
        return model

    def views(self) -> list[ModelView]:
        """Every model as it is now, sorted by name."""
        return [self.models[name].view() for name in sorted(self.models)]

    def running(self) -> bool:
        return any(m.status is not ModelStatus.UNLOADED for m in self.models.values())

    def in_flight(self) -> int:
        """Requests using a model now."""
        return sum(m.in_use for m in self.models.values())

    def may_start(self, model: ModelEntry, models_max: int) -> bool:
        """Whether ``model`` may take a slot now: it is not running, one of ``models_max`` is free
        (no limit when <= 0), and no model queued before it waits for one (the queue is served in
        arrival order)."""
        if model.status is not ModelStatus.UNLOADED:
            return False
        if models_max > 0 and sum(m.status is not ModelStatus.UNLOADED for m in self.models.values()) >= (models_max):
            return False
        for name in self.wanted:
            waiting = self.models[name]
            if waiting.status is ModelStatus.UNLOADED or waiting.stopping:
                return waiting is model
        return True

    def join(self, model: ModelEntry) -> None:
        self.wanted[model.spec.name] = self.wanted.get(model.spec.name, 0) + 1

    def leave(self, model: ModelEntry) -> None:
        name = model.spec.name
        left = self.wanted.get(name, 0) - 1
        if left > 0:
            self.wanted[name] = left
        else:
            self.wanted.pop(name, None)

    def evictions(self, models_max: int) -> list[str]:
        """The idle models to unload now for the queue (``evictions`` of this table's snapshot)."""
        return evictions([m.view() for m in self.models.values()], list(self.wanted), models_max)

    def series(self) -> list[Metric]:
        """The set's own series per model: loaded, sleeping, loads, failed loads, unloads."""
        views = {m.spec.name: (m, m.view()) for m in self.models.values()}
        return [
            modelmetrics.gauge(
                "llamactor:model_loaded",
                "1 while the model is loaded (sleeping or not)",
                {name: float(v.status in (ModelStatus.LOADED, ModelStatus.SLEEPING)) for name, (_, v) in views.items()},
            ),
            modelmetrics.gauge(
                "llamactor:model_sleeping",
                "1 while the model's engine sleeps (--sleep-idle-seconds)",
                {name: float(v.status is ModelStatus.SLEEPING) for name, (_, v) in views.items()},
            ),
            modelmetrics.counter(
                "llamactor:model_loads", "Loads of the model", {n: float(m.loads) for n, (m, _) in views.items()}
            ),
            modelmetrics.counter(
                "llamactor:model_load_failures",
                "Loads of the model that failed",
                {n: float(m.load_failures) for n, (m, _) in views.items()},
            ),
            modelmetrics.counter(
                "llamactor:model_unloads",
                "Unloads of the model (asked, for another model, sleeping excluded)",
                {n: float(m.unloads) for n, (m, _) in views.items()},
            ),
        ]
