"""The request settings as llama-server writes them: a native response's
``generation_settings``, ``/props``' ``default_generation_settings`` and ``/slots``' params,
every key of llama-server's ``task_params::to_json``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from llamactor.protocol.messages import Task
from llamactor.protocol.sampling import SamplingParams
from llamactor.runtime.service.config import RuntimeConfig


def sampling_settings(
    p: SamplingParams,
    *,
    n_predict: int,
    ignore_eos: bool,
    stream: bool | None,
    lora: Sequence[tuple[int, float]] = (),
    reasoning_format: str = "none",
    spec_type: str = "none",
) -> dict[str, Any]:
    """llama-server's ``task_params::to_json(only_metrics=true)``, every key. Its chat-parser
    keys are those of a request whose output is not parsed as a chat ("Content-only")."""
    return {
        "seed": p.seed,
        "temperature": p.temperature,
        "dynatemp_range": p.dynatemp_range,
        "dynatemp_exponent": p.dynatemp_exponent,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "top_n_sigma": p.top_n_sigma,
        "xtc_probability": p.xtc_probability,
        "xtc_threshold": p.xtc_threshold,
        "typical_p": p.typical_p,
        "repeat_last_n": p.repeat_last_n,
        "repeat_penalty": p.repeat_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "dry_multiplier": p.dry_multiplier,
        "dry_base": p.dry_base,
        "dry_allowed_length": p.dry_allowed_length,
        "dry_penalty_last_n": p.dry_penalty_last_n,
        "mirostat": p.mirostat,
        "mirostat_tau": p.mirostat_tau,
        "mirostat_eta": p.mirostat_eta,
        "adaptive_target": p.adaptive_target,
        "adaptive_decay": p.adaptive_decay,
        "max_tokens": n_predict,
        "n_predict": n_predict,
        "n_keep": 0,
        "ignore_eos": ignore_eos,
        "stream": stream,
        "n_probs": p.n_probs,
        "min_keep": p.min_keep,
        "n_discard": 0,
        "chat_format": "Content-only",
        "reasoning_format": reasoning_format,
        "reasoning_in_content": False,
        "generation_prompt": "",
        "samplers": list(p.samplers),
        "speculative.types": spec_type,
        "timings_per_token": False,
        "post_sampling_probs": False,
        "backend_sampling": False,  # llama.cpp's sampling on the GPU backend: not built here
        "lora": [{"id": i, "scale": scale} for i, scale in lora],  # the LoRA adapters it runs with
    }


GRAMMAR_TRIGGER_WORD = 1  # llama.cpp's COMMON_GRAMMAR_TRIGGER_TYPE_WORD


def generation_settings(
    task: Task, *, stream: bool, eog: Sequence[int] = (), spec_type: str = "none"
) -> dict[str, Any]:
    """A native response's ``generation_settings``: the request's effective settings, every key
    of llama-server's ``task_params::to_json``. Its ``logit_bias`` as llama-server writes it
    (``{"bias", "token"}``, null for -inf), with the end-of-generation tokens ``eog`` banned
    when the request ignores EOS, as llama-server adds them. A native completion parses no chat
    output: its chat and reasoning settings are llama-server's for one ("Content-only", "none")."""
    p = task.params
    out = sampling_settings(
        p, n_predict=task.n_predict, ignore_eos=task.ignore_eos, stream=stream, lora=task.lora, spec_type=spec_type
    )
    bias = [*p.logit_bias, *((t, -math.inf) for t in eog if task.ignore_eos)]
    out.update(
        dry_sequence_breakers=list(p.dry_sequence_breakers),
        stop=list(task.stop),
        n_keep=task.n_keep,
        n_discard=task.n_discard,
        logit_bias=[{"bias": b if math.isfinite(b) else None, "token": t} for t, b in bias],
        grammar=p.grammar,
        grammar_lazy=p.grammar_lazy,
        grammar_triggers=[{"type": GRAMMAR_TRIGGER_WORD, "value": w} for w in p.grammar_triggers],
        preserved_tokens=[],
        timings_per_token=task.timings_per_token,
        post_sampling_probs=task.post_sampling_probs,
    )
    return out


def default_generation_settings(cfg: RuntimeConfig) -> dict[str, Any]:
    """``/props``' ``default_generation_settings``: the server's defaults, set by its flags."""
    params = sampling_settings(
        cfg.sampling,
        n_predict=cfg.n_predict_max,
        ignore_eos=cfg.ignore_eos,
        stream=False,
        reasoning_format=cfg.reasoning_format,
        spec_type=cfg.spec_type,
    )
    return {"params": params, "n_ctx": cfg.ctx_per_request}
