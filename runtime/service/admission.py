"""Admission: a ``GenerationRequest`` becomes a validated, tokenized ``Task`` (or a RequestError).

The one place where a request meets the server: every field's type is checked
(``request.validated``), the server's defaults are resolved once (sampling flags, ``-r``,
``--keep``, ``--no-cache-prompt``, ``--ignore-eos``, ``-n``, the global LoRA scales, the chat
template's settings, the draft limits of speculative decoding), a chat is rendered with its
call grammar, a fill-in-the-middle request gets its FIM prompt, the prompt is tokenized and
checked against the slot context, and every sampler of the request's chain is built once (so
settings llama.cpp refuses fail this request alone). Nothing here touches an actor.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream
from llama_cpp.llama_grammar import json_schema_to_gbnf

from llamactor.protocol.errors import ConfigError, ExceedContextSize, NotFound, RequestError
from llamactor.protocol.events import Event
from llamactor.protocol.media import MediaChunk
from llamactor.protocol.messages import Task
from llamactor.protocol.request import SAMPLING_FIELDS, GenerationRequest, bias_pairs, stop_strings, validated
from llamactor.protocol.sampling import (
    DEFAULT_SEED,
    ParamError,
    SamplingParams,
    check_sampling,
    check_stop,
    sampler_names,
)
from llamactor.runtime.engine.model import Model
from llamactor.runtime.engine.sampling import check_chain
from llamactor.runtime.service.chat import ChatTemplate
from llamactor.runtime.service.chatprepare import prepare_chat
from llamactor.runtime.service.chatturn import ChatTurn
from llamactor.runtime.service.config import RuntimeConfig
from llamactor.runtime.service.egress import EgressPolicy, host_names
from llamactor.runtime.service.infill import infill_tokens
from llamactor.runtime.service.lora import LoraAdapters
from llamactor.runtime.service.mediafetch import ImageURL, MediaFetcher
from llamactor.runtime.service.mediaproc import MediaTokenizer
from llamactor.runtime.service.schemalimits import check_limits
from llamactor.runtime.service.speculation import resolve_speculation, server_speculation

MAX_N_PREDICT = 1 << 24  # a larger max_tokens means as many as the context holds (llama-server takes any)
INLINE_CHAT_BYTES = 16 * 1024  # a chat's messages (as JSON) rendered on the event loop up to this size
EVENT_HEADROOM = 8  # result-stream buffer beyond one event per token
TOKENIZE_IN_THREAD_CHARS = 4096  # longer prompts are tokenized off the event loop

Tokenize = Callable[..., Awaitable[list[int]]]


@dataclass(frozen=True)
class Admitted:
    """An admitted request: its task (holding the send end of its stream), the receive end,
    and for a chat the rendered turn (how its answer is parsed)."""

    task: Task
    events: MemoryObjectReceiveStream[Event]
    turn: ChatTurn | None = None


class Admission:
    def __init__(
        self,
        model: Model,
        config: RuntimeConfig,
        template: ChatTemplate,
        adapters: LoraAdapters | None = None,
        vision: MediaTokenizer | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.template = template
        self.adapters = adapters if adapters is not None else LoraAdapters()
        self.vision = vision  # --mmproj: prompts with images are tokenized with it
        self.speculation = server_speculation(config)  # the server's draft limits (None: no speculation)
        media_path = Path(config.media_path) if config.media_path is not None else None
        policy = EgressPolicy(host_names(config.allowed_media_domains), config.allow_private_media_urls)
        self.fetcher = MediaFetcher(media_path, config.media_fetch_max_bytes, config.media_fetch_timeout_s, policy)
        self._ids = itertools.count(1)

    async def admit(self, request: GenerationRequest) -> Admitted:
        """Check and resolve ``request``; raises RequestError (or NotFound, ExceedContextSize)
        naming the field. The task's stream has room for every event the engine may send."""
        req = validated(request)
        cfg = self.config
        turn = None
        if req.messages is not None:  # rendering grows with the chat (and its tools' schemas)
            turn = await anyio.to_thread.run_sync(self.chat_turn, req) if _heavy_chat(req) else self.chat_turn(req)
        params = await self.sampling(req, turn)
        stops = stop_strings(req.stop)
        stops = stops if any(stops) else cfg.stop  # none, or only empty ones: the server's (-r)
        try:
            check_stop(stops)
        except ParamError as exc:
            raise RequestError(str(exc)) from None
        if not 1 <= req.n <= cfg.slots_per_group:
            raise RequestError(f"n must be between 1 and the slots of one group ({cfg.slots_per_group}), got {req.n}")
        if (req.n_keep is not None and req.n_keep < -1) or req.n_discard < 0:
            raise RequestError(
                f"n_keep must be >= -1 and n_discard >= 0, got n_keep={req.n_keep}, n_discard={req.n_discard}"
            )
        if req.n_cache_reuse is not None and req.n_cache_reuse < 0:
            raise RequestError(f"n_cache_reuse must be >= 0, got {req.n_cache_reuse}")
        if req.id_slot >= cfg.parallel or req.id_slot < -1:
            raise NotFound(f"id_slot: slot {req.id_slot} does not exist (0..{cfg.parallel - 1})")
        lora = self.adapters.resolve(req.lora)
        tokens, media = await self.prompt_media(req, turn)
        n_predict = self.token_budget(len(tokens), -1 if req.max_tokens is None else req.max_tokens)
        # Room for every event the group may send without waiting: a token (and a Done) per
        # choice, and with return_progress at most one Progress per prompt chunk (>= 1 token).
        size = req.n * (max(n_predict, 0) + 2) + EVENT_HEADROOM + (len(tokens) + 1 if req.return_progress else 0)
        send, recv = anyio.create_memory_object_stream[Event](size)
        task = Task(
            id=next(self._ids),
            params=params,
            n_predict=n_predict,
            n=req.n,
            id_slot=req.id_slot,
            stop=stops,
            cache_prompt=cfg.cache_prompt if req.cache_prompt is None else req.cache_prompt,
            ignore_eos=cfg.ignore_eos if req.ignore_eos is None else req.ignore_eos,
            n_keep=cfg.n_keep if req.n_keep is None else req.n_keep,
            n_discard=req.n_discard,
            n_cache_reuse=cfg.cache_reuse if req.n_cache_reuse is None else req.n_cache_reuse,
            lora=lora,
            return_progress=req.return_progress,
            timings_per_token=req.timings_per_token,
            post_sampling_probs=bool(req.post_sampling_probs),
            priority=req.priority,
            tags=req.tags,
            speculation=resolve_speculation(params, self.speculation),
            prompt=np.asarray(tokens, dtype=np.int32),
            media=media,
            sink=send,
            arrived=time.perf_counter(),
        )
        return Admitted(task, recv, turn)

    def chat_turn(self, req: GenerationRequest, *, add_generation_prompt: bool = True) -> ChatTurn:
        """Render a chat request and choose its call grammar (tool calls, reasoning)."""
        if req.prompt or req.infill is not None:
            raise RequestError("messages: a request has messages or a prompt (or infill parts), not both")
        assert req.messages is not None
        cfg = self.config
        kwargs = req.chat_template_kwargs
        server = cfg.chat_template_kwargs
        if cfg.reasoning != "auto":  # --reasoning on|off, as llama-server: a default enable_thinking
            server = {"enable_thinking": cfg.reasoning == "on", **server}
        elif cfg.reasoning_budget == 0:  # --reasoning-budget 0, as llama-server: no thinking
            server = {"enable_thinking": False, **server}
        if server:  # the server's (--reasoning, --chat-template-kwargs) under the request's
            kwargs = {**server, **(kwargs or {})}
        return prepare_chat(
            self.template,
            req.messages,
            tools=req.tools,
            tool_choice=req.tool_choice,
            parallel_tool_calls=req.parallel_tool_calls,
            reasoning_format=cfg.reasoning_format if req.reasoning_format is None else req.reasoning_format,
            reasoning_effort=req.reasoning_effort,
            chat_template_kwargs=kwargs,
            add_generation_prompt=add_generation_prompt and req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            prefill_assistant=cfg.prefill_assistant,
            media_marker=self.vision.marker if self.vision is not None else None,
            media_kinds=self.vision.modalities if self.vision is not None else (),
        )

    async def sampling(self, req: GenerationRequest, turn: ChatTurn | None = None) -> SamplingParams:
        """The request's sampling over the server's defaults, checked against the model."""
        if req.logit_bias:
            req = msgspec.structs.replace(req, logit_bias=await self._bias_tokens(req.logit_bias))
        if req.json_schema is not None:  # a schema's grammar grows with it: off the event loop
            params = await anyio.to_thread.run_sync(resolve_sampling, req, self.config.sampling)
        else:
            params = resolve_sampling(req, self.config.sampling)
        if turn is not None:
            params = turn.sampling(params)  # adds the tool-call grammar
        try:
            check_sampling(params, self.model.n_vocab)
        except ParamError as exc:
            raise RequestError(str(exc)) from None
        # Grammars and DRY breakers scan the vocabulary: off the event loop.
        if params.grammar or params.dry_on:
            await anyio.to_thread.run_sync(check_chain, self.model, params, self.config.ctx_per_request)
        else:
            check_chain(self.model, params, self.config.ctx_per_request)
        return params

    async def check_defaults(self) -> None:
        """The server's defaults against the loaded model (logit-bias ids, grammar): once at startup."""
        try:
            await self.sampling(GenerationRequest(prompt="-"))
            check_stop(self.config.stop)
        except (RequestError, ParamError) as exc:
            raise ConfigError(f"server sampling defaults: {exc}") from None

    async def prompt_media(
        self, req: GenerationRequest, turn: ChatTurn | None
    ) -> tuple[list[int], tuple[MediaChunk, ...]]:
        """The prompt's tokens and its images (``prompt_tokens``; with images, a stand-in token
        at each position an image takes, ``protocol.media``)."""
        if turn is not None and req.multimodal_data:
            raise RequestError(
                "multimodal_data goes with a text prompt: a chat's media are its image_url and input_audio parts"
            )
        refs = turn.media if turn is not None else tuple(req.multimodal_data)
        if not refs:
            return await self.prompt_tokens(req, turn), ()
        if self.vision is None:
            raise RequestError(
                "multimodal_data: image and audio input is not supported by this server: it was started "
                "without --mmproj (a multimodal projector)"
            )
        prompt = turn.prompt if turn is not None else req.prompt
        if req.infill is not None or not isinstance(prompt, str):
            raise RequestError("multimodal_data: media files go with a text prompt holding their media markers")
        vision = self.vision
        files = await self.fetcher.fetch_images(refs)
        names = media_names(refs, turn.media_where if turn is not None else ())
        tokens, media = await vision.tokenize(
            prompt, files, add_special=req.add_special, n_ubatch=self.config.n_ubatch, names=names
        )
        self.check_length(tokens)
        return tokens, media

    async def prompt_tokens(self, req: GenerationRequest, turn: ChatTurn | None) -> list[int]:
        """The prompt's tokens: a chat's rendered text, a FIM prompt, a text or token ids."""
        model, cfg = self.model, self.config
        if req.infill is not None:
            parts = req.infill
            if not isinstance(req.prompt, str):
                raise RequestError("prompt: with infill parts, the prompt (the middle's start) must be a string")
            tokens = infill_tokens(
                model,
                parts.input_prefix,
                parts.input_suffix,
                parts.input_extra,
                req.prompt,
                n_batch=cfg.n_batch,
                n_predict=cfg.n_predict_max,
                n_ctx=cfg.ctx_per_request,
            )
        else:
            prompt = turn.prompt if turn is not None else req.prompt
            if isinstance(prompt, str):
                if not prompt:
                    raise RequestError("prompt: the prompt is empty")
                tokens = await self.tokenize(prompt, add_special=req.add_special)
            else:
                tokens = []
                for i, piece in enumerate(prompt):  # as llama-server: a text is tokenized in place,
                    if isinstance(piece, str):  # with the special tokens only when it comes first
                        tokens += await self.tokenize(piece, add_special=req.add_special and i == 0)
                    else:
                        tokens.append(piece)
                try:
                    model.check_tokens(tokens)
                except RequestError as exc:
                    raise RequestError(f"prompt: {exc}") from None
        self.check_length(tokens)
        return tokens

    def check_length(self, tokens: list[int]) -> None:
        if not tokens:
            raise RequestError("prompt: the prompt is empty")
        cfg = self.config
        limit = cfg.ctx_per_request
        if len(tokens) >= limit:  # llama-server's rule and words (clients parse the two counts)
            share = f"--ctx-size {cfg.n_ctx} over {cfg.parallel} slots" if limit < cfg.n_ctx else "--ctx-size"
            raise ExceedContextSize(
                f"request ({len(tokens)} tokens) exceeds the available context size ({limit} tokens), try increasing "
                f"it (the slot context: {share}): a prompt must leave room in the slot context for a token, and a "
                "generation stops where it ends (finish_reason length)",
                n_prompt_tokens=len(tokens),
                n_ctx=limit,
            )

    async def _bias_tokens(
        self, bias: Mapping[int | str, float] | Sequence[tuple[int | str, float]]
    ) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` with each text given in place of a token id replaced by its tokens (no
        special tokens added or parsed), each with the text's bias, as llama-server reads it."""
        out: list[tuple[int, float]] = []
        for token, value in _bias_items(bias):
            if isinstance(token, str):
                out.extend((t, value) for t in await self.tokenize(token, add_special=False, parse_special=False))
            else:
                out.append((token, value))
        return tuple(out)

    async def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        model = self.model
        if len(text) > TOKENIZE_IN_THREAD_CHARS:
            return await anyio.to_thread.run_sync(
                lambda: model.tokenize(text, add_special=add_special, parse_special=parse_special)
            )
        return model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_budget(self, n_prompt: int, max_tokens: int) -> int:
        """Tokens this request may generate: asked for, capped by the slot and the server."""
        if max_tokens < -1:
            raise RequestError(f"max_tokens (n_predict) must be -1 (unlimited) or >= 0, got {max_tokens}")
        # llama-server takes any count and stops where the context does; here no request runs past
        # MAX_N_PREDICT (it bounds the result stream as well)
        max_tokens = min(max_tokens, MAX_N_PREDICT)
        room = self.config.ctx_per_request - n_prompt
        if self.config.context_shift:
            # The context shifts instead of filling up: the slot does not bound the generation;
            # "unlimited" is bounded by EOS and the server's --n-predict cap only.
            room = MAX_N_PREDICT
        n_predict = room if max_tokens < 0 else min(max_tokens, room)
        if self.config.n_predict_max > 0:
            n_predict = min(n_predict, self.config.n_predict_max)
        return n_predict


def _bias_items(bias: Mapping[int | str, float] | Sequence[tuple[int | str, float]]) -> list[tuple[int | str, float]]:
    return list(bias.items() if isinstance(bias, Mapping) else bias)


def resolve_sampling(req: GenerationRequest, defaults: SamplingParams) -> SamplingParams:
    """The request's sampling fields over the server's ``defaults``; a field left as None keeps
    the default. llama-server's readings: a negative seed is a random one, a ``dry_base`` below
    1 keeps the default, ``json_schema`` becomes a grammar unless a grammar is given."""
    given: dict[str, Any] = {name: v for name in SAMPLING_FIELDS if (v := getattr(req, name)) is not None}
    try:
        if "samplers" in given:
            given["samplers"] = sampler_names(given["samplers"])
    except ParamError as exc:
        raise RequestError(str(exc)) from None
    if "dry_sequence_breakers" in given:
        given["dry_sequence_breakers"] = tuple(given["dry_sequence_breakers"])
    if "dry_base" in given and given["dry_base"] < 1.0:
        del given["dry_base"]
    if "seed" in given and given["seed"] < 0:
        given["seed"] = DEFAULT_SEED
    if "logit_bias" in given:
        given["logit_bias"] = bias_pairs(given["logit_bias"])
    if not given.get("grammar") and req.json_schema is not None:
        given["grammar"] = schema_grammar(req.json_schema)
    return msgspec.structs.replace(defaults, **given)


def _heavy_chat(req: GenerationRequest) -> bool:
    """Whether rendering ``req``'s chat may take long enough to belong off the event loop: it
    has tools (their schemas become grammars) or its messages are over ``INLINE_CHAT_BYTES``.
    A small chat renders in tens of microseconds, less than a worker thread's round trip."""
    return bool(req.tools) or len(msgspec.json.encode(req.messages)) > INLINE_CHAT_BYTES


def schema_grammar(schema: Mapping[str, Any]) -> str:
    """The GBNF grammar of a JSON schema (RequestError naming ``json_schema`` if unsupported)."""
    check_limits(schema, "json_schema")
    try:
        return str(json_schema_to_gbnf(json.dumps(schema)))
    except Exception as exc:
        raise RequestError(f"json_schema: unsupported JSON schema: {exc}") from None


def media_names(refs: tuple[bytes | ImageURL, ...], where: Sequence[str] = ()) -> tuple[str, ...]:
    """How an error names each file: the field and URL it was fetched by, else the chat part it
    came in (``where``, a turn's ``media_where``), else nothing."""
    return tuple(
        f"{ref.where}.url: {ref.url}" if isinstance(ref, ImageURL) else where[i] if i < len(where) else ""
        for i, ref in enumerate(refs)
    )
