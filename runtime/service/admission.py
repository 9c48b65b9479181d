"""Admission: a request's arguments become a validated, tokenized ``Task`` (or a RequestError).

Everything that can be wrong with one request is found here, before it reaches the
supervisor: sampling settings (every sampler of its chain is built once, so settings that
llama.cpp refuses fail this request alone), stop strings, the prompt and its length, the token
budget, n, id_slot and the LoRA adapters (EN-1). Nothing here touches an actor.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import msgspec
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream

from llamactor.protocol.errors import ConfigError, ExceedContextSize, NotFound, RequestError
from llamactor.protocol.events import Event
from llamactor.protocol.messages import Task
from llamactor.protocol.sampling import ParamError, SamplingParams, check_sampling, check_stop, sampler_names
from llamactor.runtime.engine.model import Model
from llamactor.runtime.engine.sampling import check_chain
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.lora import LoraAdapters

MAX_N_PREDICT = 1 << 24
EVENT_HEADROOM = 8  # result-stream buffer beyond one event per token

Tokenize = Callable[..., Awaitable[list[int]]]


class Admission:
    def __init__(self, model: Model, config: RuntimeConfig, tokenize: Tokenize,
                 adapters: LoraAdapters | None = None) -> None:
        self.model = model
        self.config = config
        self.tokenize = tokenize
        self.adapters = adapters if adapters is not None else LoraAdapters()
        self._ids = itertools.count(1)

    async def admit(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int,
        n: int,
        stop: Sequence[str] | None,
        id_slot: int,
        cache_prompt: bool | None,
        ignore_eos: bool | None,
        add_special: bool,
        params: SamplingParams | None,
        sampling: dict[str, Any],
        n_keep: int | None = None,
        n_discard: int = 0,
        return_progress: bool = False,
        lora: Sequence[Any] | None = None,
    ) -> tuple[Task, MemoryObjectReceiveStream[Event]]:
        """The task and the receive end of its result stream (the task holds the send end).

        What the caller leaves out (None, or sampling fields not given) is the server's
        default: ``RuntimeConfig.sampling``, ``stop``, ``cache_prompt``, ``ignore_eos`` (API-15),
        and for ``lora`` the global adapter scales (EN-1).
        """
        cfg = self.config
        params = params or sampling_params(sampling, cfg.sampling)
        stops = tuple(stop) if stop else cfg.stop
        cache_prompt = cfg.cache_prompt if cache_prompt is None else cache_prompt
        ignore_eos = cfg.ignore_eos if ignore_eos is None else ignore_eos
        lora_set = self.adapters.resolve(lora)
        await self.check_sampling(params, stops)
        tokens = await self.prompt_tokens(prompt, add_special)
        n_predict = self.token_budget(len(tokens), max_tokens)
        if not 1 <= n <= cfg.slots_per_group:
            raise RequestError(f"n must be between 1 and the slots of one group ({cfg.slots_per_group}), got {n}")
        if (n_keep is not None and n_keep < -1) or n_discard < 0:
            raise RequestError(f"n_keep must be >= -1 and n_discard >= 0, got n_keep={n_keep}, n_discard={n_discard}")
        if id_slot >= cfg.parallel or id_slot < -1:
            raise NotFound(f"slot {id_slot} does not exist (0..{cfg.parallel - 1})")
        # Room for every event the group may send without waiting: a token (and a Done) per
        # choice, and with return_progress at most one Progress per prompt chunk (>= 1 token).
        size = n * (max(n_predict, 0) + 2) + EVENT_HEADROOM + (len(tokens) + 1 if return_progress else 0)
        send, recv = anyio.create_memory_object_stream[Event](size)
        task = Task(
            id=next(self._ids), prompt=np.asarray(tokens, dtype=np.int32), params=params, n_predict=n_predict,
            stop=stops, n=n, id_slot=id_slot, cache_prompt=cache_prompt, ignore_eos=ignore_eos,
            n_keep=cfg.n_keep if n_keep is None else n_keep, n_discard=n_discard, return_progress=return_progress,
            lora=lora_set, sink=send,
            arrived=time.perf_counter(),
        )
        return task, recv

    async def check_defaults(self) -> None:
        """The server's defaults against the loaded model (logit-bias ids, grammar): once at startup."""
        try:
            await self.check_sampling(self.config.sampling, self.config.stop)
        except RequestError as exc:
            raise ConfigError(f"server sampling defaults: {exc}") from None

    async def check_sampling(self, params: SamplingParams, stop: tuple[str, ...]) -> None:
        try:
            check_sampling(params, self.model.n_vocab)
            check_stop(stop)
        except ParamError as exc:
            raise RequestError(str(exc)) from None
        # Grammars and DRY breakers scan the vocabulary: off the event loop.
        if params.grammar or params.dry_on:
            await anyio.to_thread.run_sync(check_chain, self.model, params, self.config.ctx_per_request)
        else:
            check_chain(self.model, params, self.config.ctx_per_request)

    async def prompt_tokens(self, prompt: str | Sequence[int], add_special: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty")
            tokens = await self.tokenize(prompt, add_special=add_special)
        else:
            tokens = list(prompt)
            self.model.check_tokens(tokens)
        if not tokens:
            raise RequestError("the prompt is empty")
        limit = self.config.ctx_per_request
        if len(tokens) >= limit:
            raise ExceedContextSize(
                f"the prompt has {len(tokens)} tokens but the slot context is {limit} tokens "
                f"(prompt + generation must fit)", n_prompt_tokens=len(tokens), n_ctx=limit,
            )
        return tokens

    def token_budget(self, n_prompt: int, max_tokens: int) -> int:
        """Tokens this request may generate: asked for, capped by the slot and the server."""
        if max_tokens < -1:
            raise RequestError(f"n_predict/max_tokens must be -1 (unlimited) or >= 0, got {max_tokens}")
        if max_tokens > MAX_N_PREDICT:
            raise RequestError(f"n_predict/max_tokens must be at most {MAX_N_PREDICT}, got {max_tokens}")
        room = self.config.ctx_per_request - n_prompt
        if self.config.context_shift:
            # The context shifts instead of filling up (EN-4): the slot does not bound the
            # generation; "unlimited" is bounded by EOS and the server's --n-predict cap only.
            room = MAX_N_PREDICT
        n_predict = room if max_tokens < 0 else min(max_tokens, room)
        if self.config.n_predict_max > 0:
            n_predict = min(n_predict, self.config.n_predict_max)
        return n_predict


def sampling_params(sampling: dict[str, Any], defaults: SamplingParams | None = None) -> SamplingParams:
    """``SamplingParams`` from keyword arguments over ``defaults`` (the server's,
    ``RuntimeConfig.sampling``); lists and dicts are accepted where tuples are held."""
    sampling = dict(sampling)
    try:
        if "samplers" in sampling:
            sampling["samplers"] = sampler_names(sampling["samplers"])
        for name in ("dry_sequence_breakers", "logit_bias"):
            if name in sampling:
                sampling[name] = _as_tuple(sampling[name])
        return msgspec.structs.replace(defaults or SamplingParams(), **sampling)
    except (ParamError, TypeError) as exc:
        raise RequestError(str(exc)) from None


def _as_tuple(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple((int(k), float(v)) for k, v in value.items())
    if isinstance(value, list):
        return tuple(_as_tuple(v) if isinstance(v, list) else v for v in value)
    return value
