"""The checks of a ``RuntimeConfig`` at startup: ``validated`` raises a ``ConfigError`` naming the
first bad value (the flag a user gave), and resolves the defaults that depend on other fields."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from llamactor.protocol.errors import ConfigError
from llamactor.protocol.lora import finite_scale
from llamactor.protocol.sampling import ParamError, check_sampling
from llamactor.runtime.engine.controlvector import load_control_vector
from llamactor.runtime.engine.overrides import ROPE_SCALING_TYPES
from llamactor.runtime.engine.speculative import SPEC_CACHE, SPEC_DRAFT, SPEC_NONE, SPEC_TYPES
from llamactor.runtime.service.configfields import (
    ALL_LAYERS,
    AUTO_LAYERS,
    CACHE_TYPES,
    FLASH_ATTN,
    LOG_FORMATS,
    LOG_LEVELS,
    MAX_SEQUENCES,
    REPLICA_ROUTERS,
    SPLIT_MODES,
    ConfigFields,
    default_model_path,
    name_set,
    replica_range,
    route_prefix,
)

C = TypeVar("C", bound=ConfigFields)
ANY_VOCAB = 2**31 - 1  # validated() checks sampling bounds before the model (and its vocabulary) loads


def validated(cfg: C) -> C:
    """Return a copy with defaults resolved; raise ConfigError naming every bad value."""
    n, p, c = cfg.pipeline_groups, cfg.parallel, cfg.n_ctx
    if cfg.log_level.lower() not in LOG_LEVELS:
        raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {cfg.log_level!r}")
    if cfg.log_format not in LOG_FORMATS:
        raise ConfigError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {cfg.log_format!r}")
    if cfg.log_colors not in ("on", "off", "auto"):
        raise ConfigError(f"--log-colors must be on, off or auto, got {cfg.log_colors!r}")
    if cfg.log_file is not None and not Path(cfg.log_file).expanduser().parent.is_dir():
        raise ConfigError(f"--log-file: the directory of {cfg.log_file} does not exist")
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
    if not cfg.kv_unified and c % n:
        raise ConfigError(f"--ctx-size ({c}) must be a multiple of --pipeline-groups ({n}) with split KV")
    if cfg.n_batch < 1 or cfg.n_ubatch < 1:
        raise ConfigError(f"--batch-size and --ubatch-size must be >= 1, got {cfg.n_batch}, {cfg.n_ubatch}")
    if cfg.n_batch < p // n:
        raise ConfigError(
            f"--batch-size ({cfg.n_batch}) must be at least the slots of one group ({p // n}): "
            f"every slot may need a row in one step"
        )
    if cfg.cache_reuse < 0:
        raise ConfigError(f"--cache-reuse must be >= 0 (0: off), got {cfg.cache_reuse}")
    if cfg.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {cfg.threads}")
    if cfg.queue_size < 0:
        raise ConfigError(f"queue size must be >= 0, got {cfg.queue_size}")
    targets: dict[str, float] = {
        "--prefill-budget": cfg.prefill_budget,
        "--target-itl-ms": cfg.target_itl_ms,
        "--target-ttft-ms": cfg.target_ttft_ms,
        "--shutdown-timeout": cfg.shutdown_timeout,
        "--slo-ttft-ms": cfg.slo_ttft_ms,
        "--slo-itl-ms": cfg.slo_itl_ms,
    }
    for flag, target in targets.items():
        if target < 0:
            raise ConfigError(f"{flag} must be >= 0 (0: the policy's default), got {target}")
    replicas = replica_range(cfg.replicas)
    if cfg.prefill_replicas and (replicas is None or cfg.prefill_replicas >= replicas[0]):
        raise ConfigError("--prefill-replicas N needs --replicas with more than N replicas (the others decode)")
    _check_sleep(cfg)
    if cfg.replica_router not in REPLICA_ROUTERS:
        raise ConfigError(f"--replica-router must be one of {', '.join(REPLICA_ROUTERS)}, got {cfg.replica_router!r}")
    model = Path(cfg.model) if cfg.model else default_model_path()
    if not model.is_file():
        raise ConfigError(f"model file not found: {model}")
    if cfg.mmproj is not None and not Path(cfg.mmproj).is_file():
        raise ConfigError(f"--mmproj: multimodal projector file not found: {cfg.mmproj}")
    if cfg.media_path is not None and not Path(cfg.media_path).is_dir():
        raise ConfigError(f"--media-path: not a directory: {cfg.media_path}")
    bounds = (("--image-min-tokens", cfg.image_min_tokens), ("--image-max-tokens", cfg.image_max_tokens))
    for flag, count in bounds:
        if count < -1 or count == 0:
            raise ConfigError(f"{flag} must be a positive count (-1: the projector's own), got {count}")
    if 0 < cfg.image_max_tokens < cfg.image_min_tokens:
        raise ConfigError(
            f"--image-max-tokens ({cfg.image_max_tokens}) is below --image-min-tokens ({cfg.image_min_tokens})"
        )
    if cfg.mtmd_batch_max_tokens < 1:
        raise ConfigError(f"--mtmd-batch-max-tokens must be >= 1, got {cfg.mtmd_batch_max_tokens}")
    if cfg.media_fetch_max_bytes < 1 or not cfg.media_fetch_timeout_s > 0:
        raise ConfigError(
            "media_fetch_max_bytes and media_fetch_timeout_s must be > 0, got "
            f"{cfg.media_fetch_max_bytes} and {cfg.media_fetch_timeout_s}"
        )
    from llamactor.actors.policies import resolve_policy
    from llamactor.runtime.engine.rpc import parse_endpoint

    for endpoint in cfg.rpc_servers:
        parse_endpoint(endpoint)
    if cfg.flash_attn not in FLASH_ATTN:
        raise ConfigError(f"--flash-attn must be one of {', '.join(FLASH_ATTN)}, got {cfg.flash_attn!r}")
    for flag, value in (("--cache-type-k", cfg.cache_type_k), ("--cache-type-v", cfg.cache_type_v)):
        if value not in CACHE_TYPES:
            raise ConfigError(f"{flag} must be one of {', '.join(CACHE_TYPES)}, got {value!r}")
    if cfg.cache_type_v not in ("f32", "f16", "bf16") and cfg.flash_attn == "off":
        raise ConfigError(
            f"--cache-type-v {cfg.cache_type_v} (a quantized V cache) needs flash attention; "
            f"llama.cpp refuses it with --flash-attn off"
        )
    if cfg.split_mode not in SPLIT_MODES:
        raise ConfigError(f"--split-mode must be one of {', '.join(SPLIT_MODES)}, got {cfg.split_mode!r}")
    if cfg.tensor_split:
        if any(x < 0 for x in cfg.tensor_split) or sum(cfg.tensor_split) <= 0:
            raise ConfigError(
                f"--tensor-split needs non-negative shares with a positive sum, got "
                f"{','.join(map(str, cfg.tensor_split))}"
            )
        if cfg.devices and len(cfg.tensor_split) != len(cfg.devices):
            raise ConfigError(
                f"--tensor-split has {len(cfg.tensor_split)} shares for "
                f"{len(cfg.devices)} devices ({','.join(cfg.devices)})"
            )

    resolve_policy(cfg.scheduler)  # raises ConfigError naming an unknown scheduler
    if not 0 <= cfg.slo_itl_pct < 100:
        raise ConfigError(f"--slo-itl-pct must be a percentile in (0, 100) or 0 (the mean), got {cfg.slo_itl_pct}")
    if cfg.pooling not in ("", "none", "mean", "cls", "last", "rank"):
        raise ConfigError(f"--pooling must be one of none, mean, cls, last, rank, got {cfg.pooling!r}")
    if not 1 <= cfg.embedding_parallel <= MAX_SEQUENCES:
        raise ConfigError(f"--embedding-parallel must be between 1 and {MAX_SEQUENCES}, got {cfg.embedding_parallel}")
    if cfg.embd_normalize < -1:
        raise ConfigError(f"--embd-normalize must be >= -1, got {cfg.embd_normalize}")
    try:
        check_sampling(cfg.sampling, n_vocab=ANY_VOCAB)  # the vocabulary is checked once loaded
    except ParamError as exc:
        raise ConfigError(f"server sampling defaults: {exc}") from None
    for path, scale in cfg.lora:
        if not Path(path).is_file():
            raise ConfigError(f"--lora: LoRA adapter file not found: {path}")
        if finite_scale(scale) is None:
            raise ConfigError(f"--lora-scaled: the scale of {path} must be a finite number, got {scale}")
    _check_overrides(cfg)
    spec_type = _check_speculative(cfg)
    _check_placement(cfg)
    if cfg.chat_template_file is not None and not Path(cfg.chat_template_file).is_file():
        raise ConfigError(f"--chat-template-file not found: {cfg.chat_template_file}")
    if cfg.record_trace is not None and not Path(cfg.record_trace).expanduser().parent.is_dir():
        raise ConfigError(f"--record-trace: the directory of {cfg.record_trace} does not exist")
    if cfg.slot_save_path is not None and not Path(cfg.slot_save_path).is_dir():
        raise ConfigError(f"--slot-save-path is not a directory: {cfg.slot_save_path}")
    n_gpu_layers = cfg.n_gpu_layers
    if (cfg.rpc_servers or cfg.devices) and n_gpu_layers in (0, AUTO_LAYERS):
        n_gpu_layers = ALL_LAYERS  # a split over devices means offloading the layers to them
    return replace(
        cfg,
        model=model,
        api_prefix=route_prefix(cfg.api_prefix),
        aliases=name_set(cfg.aliases),
        tags=name_set(cfg.tags),
        spec_type=spec_type,
        n_gpu_layers=n_gpu_layers,
        n_ubatch=min(cfg.n_ubatch, cfg.n_batch),
        threads_batch=cfg.threads_batch or cfg.threads,
    )


def _check_placement(cfg: ConfigFields) -> None:
    """--load-mode (or the older flags, not both), --lazy-mode, -ot's buffer type names (those
    of a ggml-rpc worker are checked once it is registered, in ``load_options``),
    --kv-unified-per-slot, --path."""
    from llamactor.runtime.engine import placement

    if cfg.load_mode not in placement.LOAD_MODES:
        raise ConfigError(f"--load-mode must be one of {', '.join(placement.LOAD_MODES)}, got {cfg.load_mode!r}")
    if cfg.load_mode != "auto" and (cfg.use_mmap is not None or cfg.use_mlock):
        raise ConfigError("--load-mode and --mmap/--no-mmap/--mlock disagree; give --load-mode alone")
    if cfg.lazy_mode not in placement.LAZY_MODES:
        raise ConfigError(f"--lazy-mode must be one of {', '.join(placement.LAZY_MODES)}, got {cfg.lazy_mode!r}")
    if cfg.tensor_overrides and not cfg.rpc_servers:
        placement.check_buffer_types(cfg.tensor_overrides)
    if cfg.ctx_checkpoints < 0:
        raise ConfigError(f"--ctx-checkpoints must be >= 0 (0: none), got {cfg.ctx_checkpoints}")
    if cfg.checkpoint_min_step < 0:
        raise ConfigError(f"--checkpoint-min-step must be >= 0, got {cfg.checkpoint_min_step}")
    if cfg.kv_unified_per_slot < 0:
        raise ConfigError(f"--kv-unified-per-slot must be >= 0 (0: unset), got {cfg.kv_unified_per_slot}")
    if cfg.static_path is not None and not Path(cfg.static_path).is_dir():
        raise ConfigError(f"--path: not a directory: {cfg.static_path}")


def _check_overrides(cfg: ConfigFields) -> None:
    """--override-kv, the RoPE/YaRN values and the control vectors (each file is read here,
    so a malformed one stops startup before anything loads)."""
    for override in cfg.kv_overrides:
        problem = override.problem()
        if problem is not None:
            raise ConfigError(f"--override-kv {override.key!r}: {problem}")
    if cfg.rope_scaling not in ("", *ROPE_SCALING_TYPES):
        raise ConfigError(f"--rope-scaling must be one of {', '.join(ROPE_SCALING_TYPES)}, got {cfg.rope_scaling!r}")
    for flag, value in (
        ("--rope-freq-base", cfg.rope_freq_base),
        ("--rope-freq-scale", cfg.rope_freq_scale),
        ("--yarn-ext-factor", cfg.yarn_ext_factor),
        ("--yarn-attn-factor", cfg.yarn_attn_factor),
        ("--yarn-beta-slow", cfg.yarn_beta_slow),
        ("--yarn-beta-fast", cfg.yarn_beta_fast),
    ):
        if not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, got {value}")
    if cfg.yarn_orig_ctx < 0:
        raise ConfigError(f"--yarn-orig-ctx must be >= 0 (0: the model's own), got {cfg.yarn_orig_ctx}")
    for path, scale in cfg.control_vectors:
        if not Path(path).is_file():
            raise ConfigError(f"--control-vector: control vector file not found: {path}")
        if not math.isfinite(scale):
            raise ConfigError(f"--control-vector-scaled: the scale of {path} must be a finite number, got {scale}")
    if cfg.control_vectors:
        load_control_vector(cfg.control_vectors)  # ConfigError naming a malformed file


def _check_sleep(cfg: ConfigFields) -> None:
    """--sleep-idle-seconds: -1 (never) or a positive number of seconds, as llama-server takes
    it; sleeping stops the engine's process, so there must be one (and not a replica set's)."""
    if cfg.sleep_idle_seconds == -1:
        return
    if cfg.sleep_idle_seconds < 1:
        raise ConfigError(f"--sleep-idle-seconds must be -1 (never) or >= 1, got {cfg.sleep_idle_seconds}")
    if not cfg.isolate:
        raise ConfigError("--sleep-idle-seconds needs the engine in its own process (--isolate)")
    if cfg.replicas:
        raise ConfigError("--sleep-idle-seconds is not supported with --replicas")


def _check_speculative(cfg: ConfigFields) -> str:
    """The speculative-decoding flags; returns the speculation type (-md alone means draft-simple,
    -lcs/-lcd alone ngram-cache)."""
    if cfg.spec_type not in SPEC_TYPES:
        raise ConfigError(f"--spec-type must be one of {', '.join(SPEC_TYPES)}, got {cfg.spec_type!r}")
    for flag, value in (
        ("--spec-ngram-simple-size-n", cfg.spec_ngram_size_n),
        ("--spec-ngram-simple-size-m", cfg.spec_ngram_size_m),
    ):
        if not 1 <= value <= 1024:  # llama-server's bounds
            raise ConfigError(f"{flag} must be between 1 and 1024, got {value}")
    for flag, value in (
        ("--spec-ngram-mod-n-min", cfg.spec_ngram_mod_n_min),
        ("--spec-ngram-mod-n-max", cfg.spec_ngram_mod_n_max),
    ):
        if not 0 <= value <= 1024:  # llama-server's bounds
            raise ConfigError(f"{flag} must be between 0 and 1024, got {value}")
    if not 1 <= cfg.spec_ngram_mod_n_match <= 1024:
        raise ConfigError(f"--spec-ngram-mod-n-match must be between 1 and 1024, got {cfg.spec_ngram_mod_n_match}")
    if cfg.spec_draft_n_max < 0 or cfg.spec_draft_n_min < 0:
        raise ConfigError(
            f"--spec-draft-n-max and --spec-draft-n-min must be >= 0, got "
            f"{cfg.spec_draft_n_max}, {cfg.spec_draft_n_min}"
        )
    if not 0.0 <= cfg.spec_draft_p_min <= 1.0:
        raise ConfigError(f"--spec-draft-p-min must be between 0 and 1, got {cfg.spec_draft_p_min}")
    spec_type = cfg.spec_type
    if cfg.spec_draft_model is not None:
        if spec_type == SPEC_NONE:
            spec_type = SPEC_DRAFT
        elif spec_type != SPEC_DRAFT:
            raise ConfigError(f"--spec-type {spec_type} does not use --model-draft: give one kind of speculation")
        if not Path(cfg.spec_draft_model).is_file():
            raise ConfigError(f"--model-draft: draft model file not found: {cfg.spec_draft_model}")
    elif spec_type == SPEC_DRAFT:
        raise ConfigError("--spec-type draft-simple needs a draft model (--model-draft FILE)")
    if cfg.lookup_cache_static or cfg.lookup_cache_dynamic:
        if spec_type == SPEC_NONE:
            spec_type = SPEC_CACHE
        elif spec_type != SPEC_CACHE:
            raise ConfigError(
                f"--spec-type {spec_type} does not use the lookup caches (-lcs, -lcd): give one kind of speculation"
            )
        if cfg.lookup_cache_static and not Path(cfg.lookup_cache_static).is_file():
            raise ConfigError(f"--lookup-cache-static: file not found: {cfg.lookup_cache_static}")
        dynamic = Path(cfg.lookup_cache_dynamic or ".")
        if cfg.lookup_cache_dynamic and (dynamic.is_dir() or not dynamic.parent.is_dir()):
            raise ConfigError(f"--lookup-cache-dynamic: cannot write a file at {cfg.lookup_cache_dynamic}")
    return spec_type
