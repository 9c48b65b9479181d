"""The engine layer's options from a ``RuntimeConfig``: where the weights go (``load_options``,
``draft_load_options``), the RoPE/YaRN settings, the control vector, the projector, the
speculation settings and the options every scheduling policy gets.

``InProcessEngine.open`` builds its model, contexts and actors from these; the command line
calls ``load_options`` before it listens, so that a bad ggml-rpc worker or device name is an
error at once.
"""

from __future__ import annotations

import os
from contextlib import AsyncExitStack
from typing import Any

import anyio
import llama_cpp
import structlog

from llamactor.runtime.engine.controlvector import ControlVector, control_vector_for
from llamactor.runtime.engine.draftmodel import check_compatible
from llamactor.runtime.engine.model import GRAPH_REUSE_ENV, LoadOptions, Model, graph_reuse_user_setting
from llamactor.runtime.engine.overrides import ROPE_SCALING_TYPES, RopeOptions
from llamactor.runtime.engine.speculative import SPEC_CACHE, SPEC_DRAFT, SPEC_MOD, SPEC_NGRAM, SpecOptions
from llamactor.runtime.engine.vision import Vision
from llamactor.runtime.service.config import RuntimeConfig

log = structlog.get_logger("llamactor.engine")


def policy_options(cfg: RuntimeConfig) -> dict[str, Any]:
    """The options every policy gets: the built-in targets, then ``scheduler_options``."""
    return {
        "prefill_budget": cfg.prefill_budget,
        "target_itl_ms": cfg.target_itl_ms,
        "target_ttft_ms": cfg.target_ttft_ms,
        "cohort_max_generate_ms": cfg.cohort_max_generate_ms,
        "slo_ttft_ms": cfg.slo_ttft_ms,
        "slo_itl_ms": cfg.slo_itl_ms,
        "slo_itl_pct": cfg.slo_itl_pct,
        **cfg.scheduler_options,
    }


async def speculation_options(cfg: RuntimeConfig, model: Model, stack: AsyncExitStack) -> SpecOptions | None:
    """The groups' draft source; a draft model is loaded once here (each group makes its own
    draft context over it) and refused unless its vocabulary is the target's (ConfigError: exit
    2 from the command line). The draft limits go with each task (``service.speculation``)."""
    if cfg.spec_type == SPEC_NGRAM:
        return SpecOptions(SPEC_NGRAM, size_n=cfg.spec_ngram_size_n)
    if cfg.spec_type == SPEC_MOD:
        return SpecOptions(SPEC_MOD, size_n=cfg.spec_ngram_mod_n_match)
    if cfg.spec_type == SPEC_CACHE:
        from llamactor.runtime.engine import ngramcache

        static = (
            await anyio.to_thread.run_sync(ngramcache.load, cfg.lookup_cache_static) if cfg.lookup_cache_static else {}
        )
        dynamic = await anyio.to_thread.run_sync(ngramcache.DynamicCache, cfg.lookup_cache_dynamic)
        log.info("lookup_caches", static_ngrams=len(static), dynamic_ngrams=len(dynamic.cache))
        return SpecOptions(SPEC_CACHE, static_cache=static, dynamic_cache=dynamic)
    if cfg.spec_type != SPEC_DRAFT:
        return None
    assert cfg.spec_draft_model is not None
    draft = await anyio.to_thread.run_sync(Model, cfg.spec_draft_model, draft_load_options(cfg))
    stack.callback(draft.close)
    await anyio.to_thread.run_sync(check_compatible, model, draft, cfg.spec_draft_model)
    return SpecOptions(SPEC_DRAFT, draft_model=draft)


def load_options(cfg: RuntimeConfig) -> LoadOptions:
    """Weights placement from the config: local, or split over ggml-rpc workers."""
    devices = None
    if cfg.rpc_servers or cfg.devices:
        from llamactor.runtime.engine import rpc

        added = rpc.add_servers(list(cfg.rpc_servers))
        names = list(cfg.devices) or [*added, "CPU"]  # default: workers first, the local CPU last
        devices = rpc.device_array(names)
        log.info("layer_split", devices=names, tensor_split=list(cfg.tensor_split), split_mode=cfg.split_mode)
    concurrent = concurrent_rpc_contexts(cfg)
    if concurrent:
        user = graph_reuse_user_setting()
        if user:
            log.warning(
                "graph_reuse",
                enabled=True,
                why=f"{GRAPH_REUSE_ENV}={os.environ[GRAPH_REUSE_ENV]!r} is set: contexts decoding at once "
                "on a ggml-rpc device may repeat a token",
            )
        else:
            log.info("graph_reuse", enabled=False, why="contexts decoding at once on a ggml-rpc device")
    if cfg.tensor_overrides:
        from llamactor.runtime.engine import placement

        placement.check_buffer_types(cfg.tensor_overrides)  # a ggml-rpc worker's are known by now
    return LoadOptions(
        n_gpu_layers=cfg.n_gpu_layers,
        main_gpu=cfg.main_gpu,
        use_extra_bufts=cfg.repack,
        no_host=cfg.no_host,
        load_mode=cfg.model_load_mode,
        lazy_mode=cfg.lazy_mode,
        tensor_overrides=cfg.tensor_overrides,
        special=cfg.special,
        split_mode=SPLIT_MODE_CODES[cfg.split_mode],
        tensor_split=cfg.tensor_split,
        devices=devices,
        graph_reuse=not concurrent,
        kv_overrides=cfg.kv_overrides,
    )


def rope_options(cfg: RuntimeConfig) -> RopeOptions:
    """The RoPE/YaRN settings of every context (--rope-*, --yarn-*; the model's own by default)."""
    return RopeOptions(
        scaling_type=ROPE_SCALING_TYPES.get(cfg.rope_scaling, llama_cpp.LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED),
        freq_base=cfg.rope_freq_base,
        freq_scale=cfg.rope_freq_scale,
        yarn_orig_ctx=cfg.yarn_orig_ctx,
        yarn_ext_factor=cfg.yarn_ext_factor,
        yarn_attn_factor=cfg.yarn_attn_factor,
        yarn_beta_slow=cfg.yarn_beta_slow,
        yarn_beta_fast=cfg.yarn_beta_fast,
    )


def control_vector(cfg: RuntimeConfig, model: Model) -> ControlVector | None:
    """--control-vector: the files' directions summed for ``model`` (ConfigError: exit 2), or None."""
    if not cfg.control_vectors:
        return None
    cvec = control_vector_for(
        cfg.control_vectors,
        cfg.control_vector_layers,
        llama_cpp.llama_model_n_embd(model.ptr),
        llama_cpp.llama_model_n_layer(model.ptr),
    )
    log.info(
        "control_vector",
        files=[path for path, _ in cfg.control_vectors],
        layers=[cvec.layer_start, cvec.layer_end],
    )
    return cvec


def load_vision(cfg: RuntimeConfig, model: Model) -> Vision | None:
    """--mmproj: the projector next to ``model`` (ConfigError, exit 2, when it does not fit it)."""
    if cfg.mmproj is None:
        return None
    vision = Vision(
        cfg.mmproj,
        model,
        use_gpu=cfg.mmproj_offload,
        n_threads=cfg.threads_batch or cfg.threads,
        image_min_tokens=cfg.image_min_tokens,
        image_max_tokens=cfg.image_max_tokens,
        batch_max_tokens=cfg.mtmd_batch_max_tokens,
    )
    log.info("mmproj", path=str(cfg.mmproj), vision=vision.vision, audio=vision.audio, marker=vision.marker)
    return vision


def concurrent_rpc_contexts(cfg: RuntimeConfig) -> bool:
    """Whether contexts over the model may decode at once on a ggml-rpc device (pipeline groups,
    or the embedding context beside a group): then they need graph reuse off (open_context)."""
    return bool(cfg.rpc_servers) and (cfg.pipeline_groups > 1 or cfg.embedding)


def draft_load_options(cfg: RuntimeConfig) -> LoadOptions:
    """The draft model's placement: -ngld (default: as -ngl) on -devd's devices (default: local)."""
    devices = None
    if cfg.spec_draft_devices:
        from llamactor.runtime.engine import rpc

        devices = rpc.device_array(list(cfg.spec_draft_devices))
    n_gpu_layers = cfg.n_gpu_layers if cfg.spec_draft_n_gpu_layers is None else cfg.spec_draft_n_gpu_layers
    # the groups' draft contexts decode at once too (open_context)
    graph_reuse = not (devices is not None and cfg.rpc_servers and cfg.pipeline_groups > 1)
    return LoadOptions(
        n_gpu_layers=n_gpu_layers,
        load_mode=cfg.model_load_mode,  # as llama-server loads its draft: the same load and lazy modes
        lazy_mode=cfg.lazy_mode,
        devices=devices,
        graph_reuse=graph_reuse,
        kv_overrides=cfg.kv_overrides,  # as llama-server loads its draft: with the same overrides
    )


FLASH_ATTN_CODES = {
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
}

SPLIT_MODE_CODES = {
    "none": llama_cpp.LLAMA_SPLIT_MODE_NONE,
    "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
    "row": llama_cpp.LLAMA_SPLIT_MODE_ROW,
}
