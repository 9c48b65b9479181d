"""RuntimeConfig: every knob of a runtime, with units in the names, validated once at startup.

Its fields are ``runtime.service.configfields`` (the table), its checks
``runtime.service.configcheck``; here are the sizes derived from them and the form in which a
config crosses to an engine process.

Context sizing of pipeline groups, with C = n_ctx, P = parallel, N = pipeline_groups:
- split KV (default): each of the N contexts gets C/N cells and P/N sequences, so every slot
  has C/P cells, exactly as with one context;
- unified KV (``kv_unified``): each context gets all C cells shared by its P/N slots, so one
  request may use up to C; the process holds N·C cells in total.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from llamactor.actors.policy import Policy
from llamactor.protocol.errors import ConfigError
from llamactor.runtime.service import configcheck
from llamactor.runtime.service.configfields import (
    ALL_LAYERS,
    AUTO_LAYERS,
    CACHE_TYPES,
    DEFAULT_MODEL_PACKAGE,
    DEFAULT_N_BATCH,
    DEFAULT_N_CTX,
    DEFAULT_N_UBATCH,
    DEFAULT_PARALLEL,
    DEFAULT_QUEUE_SIZE,
    FLASH_ATTN,
    LOG_FORMATS,
    LOG_LEVELS,
    MAX_BODY_BYTES,
    MAX_SEQUENCES,
    REPLICA_ROUTERS,
    SPLIT_MODES,
    ConfigFields,
    default_model_path,
    name_set,
    replica_range,
    route_prefix,
    size_per_slot,
    unified_without_slots,
)


@dataclass(frozen=True)
class RuntimeConfig(ConfigFields):
    """Every knob of a runtime (the fields: ``ConfigFields``); made with keywords, checked by
    ``validated`` before a runtime starts."""

    def validated(self) -> RuntimeConfig:
        """Return a copy with defaults resolved; raise ConfigError naming every bad value."""
        return configcheck.validated(self)

    # ---- the model's names ------------------------------------------------------------

    @property
    def model_name(self) -> str:
        """The model's id in every response: ``alias``; else the first of ``aliases`` in sorted
        order, as llama-server names its model after the first of its --alias set; else the
        model file's name."""
        if self.alias:
            return self.alias
        names = name_set(self.aliases)
        if names:
            return names[0]
        return Path(str(self.model)).name if self.model else "default"

    @property
    def model_aliases(self) -> tuple[str, ...]:
        """Every name given to the model (``alias`` and ``aliases``), sorted, without repeats."""
        return name_set((*self.aliases, *((self.alias,) if self.alias else ())))

    # ---- derived sizes ----------------------------------------------------------------

    @property
    def slots_per_group(self) -> int:
        return self.parallel // self.pipeline_groups

    @property
    def ctx_per_context(self) -> int:
        return self.n_ctx if self.kv_unified else self.n_ctx // self.pipeline_groups

    @property
    def ctx_per_request(self) -> int:
        """The longest prompt + generation one request may have (capped by --kv-unified-per-slot)."""
        n = self.n_ctx if self.kv_unified else self.n_ctx // self.parallel
        return min(n, self.kv_unified_per_slot) if self.kv_unified_per_slot > 0 else n

    @property
    def model_load_mode(self) -> str:
        """The load mode: --load-mode, or what the older --mmap/--no-mmap and --mlock say (as
        llama-server turned them into its load mode: --mlock with mmap on is mmap+mlock)."""
        if self.use_mmap is None and not self.use_mlock:
            return self.load_mode
        mmap = self.use_mmap is not False
        if self.use_mlock:
            return "mmap+mlock" if mmap else "mlock"
        return "mmap" if mmap else "none"

    @property
    def total_kv_cells(self) -> int:
        return self.ctx_per_context * self.pipeline_groups

    def group_slots(self, group: int) -> range:
        """Contiguous partition: group g owns slots [g·P/N, (g+1)·P/N)."""
        k = self.slots_per_group
        return range(group * k, (group + 1) * k)


# ---- the config as it crosses to an engine process ------------------------------------------


def _wire_type() -> type:
    """A Struct with ``RuntimeConfig``'s fields, where the types msgspec cannot decode are the
    forms they cross in: a path as a string, a policy class as "module:Class", a policy
    instance as ``{"class": "module:Class", "state": {...}}`` (its attributes)."""
    hints = typing.get_type_hints(RuntimeConfig)
    hints.update(model=str | None, mmproj=str | None, media_path=str | None, scheduler=str | dict[str, Any])
    fields = []
    for f in dataclasses.fields(RuntimeConfig):
        default: Any = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = msgspec.field(default_factory=f.default_factory)
        fields.append((f.name, hints[f.name], default))
    return msgspec.defstruct("WireConfig", fields, kw_only=True)


_WireConfig = _wire_type()


def _policy_path(cls: type) -> str:
    path = f"{cls.__module__}:{cls.__qualname__}"
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise ConfigError(
            f"scheduler {path} cannot reach an engine in a child process: define it at module level "
            f"in an importable module (or open the runtime with isolate=False)"
        )
    return path


def _encode_hook(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, type):
        return _policy_path(value)
    if isinstance(value, Policy):
        return {"class": _policy_path(type(value)), "state": msgspec.to_builtins(vars(value), enc_hook=_encode_hook)}
    raise TypeError(f"{type(value).__name__} cannot cross to an engine process")


def config_to_wire(config: RuntimeConfig) -> bytes:
    """``config`` as msgpack bytes for an engine process (ConfigError if a part cannot cross)."""
    try:
        return msgspec.msgpack.encode(config, enc_hook=_encode_hook)
    except TypeError as exc:
        raise ConfigError(f"the config cannot reach an engine in a child process: {exc}") from None


def config_from_wire(data: bytes) -> RuntimeConfig:
    """The config ``config_to_wire`` wrote, with a policy instance made again."""
    wire: Any = msgspec.msgpack.decode(data, type=_WireConfig)
    values = msgspec.structs.asdict(wire)
    scheduler = values["scheduler"]
    if isinstance(scheduler, dict):
        from llamactor.actors.policies import resolve_policy

        cls = resolve_policy(scheduler["class"])
        policy = cls.__new__(cls)
        vars(policy).update(scheduler["state"])
        values["scheduler"] = policy
    return RuntimeConfig(**values)


__all__ = [
    "ALL_LAYERS",
    "AUTO_LAYERS",
    "CACHE_TYPES",
    "DEFAULT_MODEL_PACKAGE",
    "DEFAULT_N_BATCH",
    "DEFAULT_N_CTX",
    "DEFAULT_N_UBATCH",
    "DEFAULT_PARALLEL",
    "DEFAULT_QUEUE_SIZE",
    "FLASH_ATTN",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MAX_BODY_BYTES",
    "MAX_SEQUENCES",
    "REPLICA_ROUTERS",
    "SPLIT_MODES",
    "RuntimeConfig",
    "config_from_wire",
    "config_to_wire",
    "default_model_path",
    "name_set",
    "replica_range",
    "route_prefix",
    "size_per_slot",
    "unified_without_slots",
]
