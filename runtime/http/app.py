"""The bundled HTTP app: Starlette routes over one ``Runtime``.

Requests are decoded with msgspec into ``protocol.wire`` Structs, submitted to the runtime,
and answered either as one JSON body or as SSE. Errors are shaped by ``runtime.http.errors``
(``errors_for``: Anthropic's shape on its endpoints, OpenAI's elsewhere). The first event of
a request is awaited before any response starts, so a queue-full or engine error still gets
its proper status code even for streaming requests. A client that disconnects cancels its
request at once, streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from llamactor.actors.policies import policy_name
from llamactor.protocol import sse
from llamactor.protocol.errors import Closed, NotFound, NotSupported, RequestError, Unauthorized, Unavailable
from llamactor.protocol.events import Done, Progress, Token
from llamactor.protocol.wire import (
    DEFAULT_MAX_TOKENS_OPENAI_COMPLETIONS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    InfillRequest,
    LoraEntry,
    NativeCompletionRequest,
    RerankRequest,
    TokenizeRequest,
)
from llamactor.runtime.http import anthropic, embeddings, responses_api, transcriptions, vertex
from llamactor.runtime.http.agent import Agent
from llamactor.runtime.http.body import read_body
from llamactor.runtime.http.chat_api import ChatShaper, named_frame
from llamactor.runtime.http.cors import Cors
from llamactor.runtime.http.disconnect import until_disconnect
from llamactor.runtime.http.errors import (
    anthropic_error_body,
    anthropic_error_response,
    error_body,
    error_response,
)
from llamactor.runtime.http.live import LiveFeed
from llamactor.runtime.http.page import ASSET_PATH, PAGE_PATHS, PUBLIC_PAGE_PATHS, Page
from llamactor.runtime.http.requests import from_chat, from_completion, from_infill, from_native, several_prompts
from llamactor.runtime.http.responses import (
    NativeShaper,
    OpenAIShaper,
    default_generation_settings,
    generation_settings,
)
from llamactor.runtime.http.slots import slot_action_json, slots_json
from llamactor.runtime.service.config import RuntimeConfig, route_prefix
from llamactor.runtime.service.engine import served_by
from llamactor.runtime.service.handles import RequestHandle, collect
from llamactor.runtime.service.infill import check_fim
from llamactor.runtime.service.templatecaps import template_caps

if TYPE_CHECKING:
    from llamactor.runtime.service.core import RuntimeCore as Runtime

PUBLIC_PATHS = frozenset({"/health", "/v1/health", *PUBLIC_PAGE_PATHS})  # the page asks for the key itself
SLOT_FILENAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SLOT_ACTIONS = ("save", "restore", "erase")
INLINE_DETOKENIZE_TOKENS = 2048  # a longer prompt's text is rendered in a worker thread
ANTHROPIC_PATH = "/v1/messages"  # this path and the ones under it answer errors in Anthropic's shape
DEFAULT_MEDIA_MARKER = "<__media__>"  # libmtmd's (mtmd_default_marker): /props names it without --mmproj too

_encode = msgspec.json.Encoder().encode


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_encode(obj), status_code=status, media_type="application/json")


def errors_for(path: str) -> Callable[[BaseException], Response]:
    """How a request to ``path`` answers an error: Anthropic's shape on the Anthropic endpoints
    (their SDKs read no other), OpenAI's everywhere else."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return anthropic_error_response
    return error_response


class _ApiKey:
    """401 for a missing or wrong key on every path but /health and the page (constant-time
    compare). ``prefix`` is the app's --api-prefix: the public paths are under it."""

    def __init__(self, app: ASGIApp, key: str | None, more: tuple[str, ...] = (), prefix: str = "") -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in ((key,) if key else ()) + more)  # --api-key a,b / --api-key-file
        # the bare prefix too: it redirects to the page at prefix + "/"
        self.public = frozenset({prefix + path for path in PUBLIC_PATHS} | ({prefix} if prefix else set()))
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.keys or scope["type"] != "http" or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        if given.lower().startswith(b"bearer "):
            given = given[7:].strip()
        else:
            given = headers.get(b"x-api-key", b"")
        if not sum(hmac.compare_digest(given, k) for k in self.keys):  # every key compared: no early exit
            errors = errors_for(scope["path"].removeprefix(self.prefix))
            await errors(Unauthorized("invalid or missing API key"))(scope, receive, send)
            return
        await self.app(scope, receive, send)


_body = read_body  # every body through the one size-limited reader


async def _decode(request: Request, type_: type) -> Any:
    body = await _body(request)
    if not body:
        raise RequestError("the request body is empty; a JSON object is expected")
    return msgspec.json.decode(body, type=type_)


async def _unless_disconnected(request: Request, handle: RequestHandle, wait: Any) -> Any:
    """Await ``wait()`` while watching the client; if it leaves (or anything fails), the request
    is cancelled at once and its slot freed."""
    try:
        return await until_disconnect(request, wait)
    except BaseException:
        handle.close()
        raise


class Api:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.feed = LiveFeed(rt.read_live)  # one ticker shared by every /live client
        self._facts: dict[str, Any] | None = None  # the model's (GET /v1/models' meta)
        self._caps: dict[str, bool] | None = None  # the chat template's (GET /props)

    @property
    def model_id(self) -> str:
        return self.rt.config.model_name

    # ---- utility endpoints -----------------------------------------------------------

    async def health(self, request: Request) -> Response:
        state = self.rt.health()
        if state == "ok":
            return _json({"status": "ok"})
        down = self.rt.engine_status()
        message = {
            "loading": "Loading model",
            "unhealthy": f"the engine process is down: {down.last_exit}"
            if down.state == "down" and down.last_exit
            else "a group is down past its restart limit",
            "draining": "the server is shutting down: it finishes the requests it has",
            "restarting": "engine restarting: the requests in flight resume when it is back",
        }.get(state, "the server is shutting down")
        return error_response(Unavailable(message))

    async def models(self, request: Request) -> Response:
        """GET /v1/models, /models: the one model, its names and tags, as llama-server lists them."""
        self.rt.require_ready()
        cfg = self.rt.config
        owned = {
            "id": self.model_id,
            "aliases": cfg.model_aliases,
            "tags": cfg.tags,
            "object": "model",
            "created": int(self.rt.started_at),
            "owned_by": "llamactor",
            "meta": {**self._model_facts(), "n_ctx": cfg.ctx_per_request},
        }
        return _json({"models": [self._ollama_model()], "object": "list", "data": [owned]})

    def _ollama_model(self) -> dict[str, Any]:
        """llama-server's entry of ``models`` (Ollama's listing), with its values where it has them:
        the name, the capabilities, the format; the rest empty as llama-server leaves them."""
        capabilities = ["completion", "multimodal"] if self.rt.vision is not None else ["completion"]
        details = {"parent_model": "", "format": "gguf", "family": "", "families": [""]}
        return {
            "name": self.model_id,
            "model": self.model_id,
            "modified_at": "",
            "size": "",
            "digest": "",
            "type": "model",
            "description": "",
            "tags": [""],
            "capabilities": capabilities,
            "parameters": "",
            "details": {**details, "parameter_size": "", "quantization_level": ""},
        }

    def _model_facts(self) -> dict[str, Any]:
        """The model's sizes and quantisation (read once: they do not change while it is loaded)."""
        if self._facts is None:
            assert self.rt.model is not None
            self._facts = self.rt.model.facts()
        return self._facts

    async def props(self, request: Request) -> Response:
        self.rt.require_ready()
        cfg = self.rt.config
        return _json(
            {
                "model_path": str(cfg.model),
                "model_alias": self.model_id,
                "total_slots": cfg.parallel,
                "n_ctx": cfg.ctx_per_request,
                "n_ctx_total": cfg.n_ctx,
                "pipeline_groups": cfg.pipeline_groups,
                "kv_unified": cfg.kv_unified,
                "scheduler": policy_name(cfg.scheduler),
                "engine": msgspec.to_builtins(self.rt.engine_status()),  # in this process or a child process
                "chat_template": self.rt.chat_template.source if self.rt.chat_template else "",
                "chat_template_caps": await self._template_caps(),
                "model_ftype": self._model_facts()["ftype"],
                "default_generation_settings": default_generation_settings(cfg),
                **self._server_props(),
            }
        )

    async def _template_caps(self) -> dict[str, bool]:
        """What the chat template renders (probe chats: off the event loop, once)."""
        if self._caps is None and self.rt.chat_template is not None:
            self._caps = await anyio.to_thread.run_sync(template_caps, self.rt.chat_template)
        return self._caps or {}

    def _server_props(self) -> dict[str, Any]:
        """The rest of llama-server's GET /props fields (its ``get_res_props``)."""
        cfg, model, vision = self.rt.config, self.rt.model, self.rt.vision
        assert model is not None
        return {
            "modalities": {
                "vision": vision is not None and vision.vision,
                "video": False,
                "audio": vision is not None and vision.audio,
            },
            # the marker a prompt's media take (libmtmd's default without --mmproj, as llama-server's)
            "media_marker": vision.marker if vision is not None else DEFAULT_MEDIA_MARKER,
            "endpoint_slots": cfg.endpoint_slots,
            "endpoint_props": cfg.endpoint_props,
            "endpoint_metrics": cfg.endpoint_metrics,
            "ui": cfg.webui,
            "ui_settings": {},
            "bos_token": model.token_text(model.bos) if model.bos >= 0 else "",
            "eos_token": model.token_text(model.eos) if model.eos >= 0 else "",
            "build_info": "llamactor",
            "is_sleeping": self.rt.engine_status().state == "sleeping",  # --sleep-idle-seconds
            "cors_proxy_enabled": cfg.ui_mcp_proxy,  # --ui-mcp-proxy: /cors-proxy forwards
            "infill": model.fim_tokens().mid >= 0,  # llamactor's: /infill serves this model
        }

    async def set_props(self, request: Request) -> Response:
        """POST /props: llama-server's 501 unless started with --props, then a no-op success."""
        self.rt.require_ready()
        if not self.rt.config.endpoint_props:
            raise NotSupported("This server does not support changing global properties. Start it with `--props`")
        await _body(request)
        return _json({"success": True})

    async def lora_adapters(self, request: Request) -> Response:
        """GET /lora-adapters: the loaded adapters and their global scales."""
        return _json(self.rt.lora_adapters())

    async def set_lora_adapters(self, request: Request) -> Response:
        """POST /lora-adapters: ``[{"id", "scale"}, ...]`` sets the global scales."""
        entries = await _decode(request, list[LoraEntry])
        self.rt.set_lora_adapters(entries)
        return _json({"success": True})

    async def tokenize(self, request: Request) -> Response:
        req = await _decode(request, TokenizeRequest)
        tokens = await self.rt.tokenize(req.content, add_special=req.add_special, parse_special=req.parse_special)
        if req.with_pieces:
            model = self.rt.model
            assert model is not None

            def pieces() -> list[dict[str, Any]]:
                return [{"id": t, "piece": model.piece(t).decode("utf-8", "replace")} for t in tokens]

            return _json({"tokens": await anyio.to_thread.run_sync(pieces)})  # as long as the text: off the loop
        return _json({"tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        req = await _decode(request, DetokenizeRequest)
        return _json({"content": await anyio.to_thread.run_sync(self.rt.detokenize, req.tokens)})  # off the loop

    async def slots(self, request: Request) -> Response:
        """GET /slots: llama-server's 501 when started with --no-slots. ``POST /slots/{id}``
        stays, as in llama-server, where --no-slots turns off the monitoring endpoint only."""
        if not self.rt.config.endpoint_slots:
            raise NotSupported("This server does not support slots endpoint. Start it with `--slots`")
        states = await self.rt.slots()
        # ?fail_on_no_slot=1: a 503 while every slot is busy (a load balancer's readiness probe)
        if "fail_on_no_slot" in request.query_params and not any(not s.busy and s.phase != "down" for s in states):
            raise Unavailable("no slot available")
        return _json(slots_json(states))

    async def slot_action(self, request: Request) -> Response:
        self.rt.require_ready()
        try:
            slot = int(request.path_params["id"])
        except ValueError:
            raise RequestError("slot id must be an integer") from None
        action = request.query_params.get("action", "")
        if action not in SLOT_ACTIONS:
            raise RequestError(f"action must be one of {', '.join(SLOT_ACTIONS)}, got {action!r}")
        path = ""
        if action != "erase":
            root = self.rt.config.slot_save_path
            if root is None:
                raise RequestError("slot save/restore is disabled: start the server with --slot-save-path")
            body = await _decode(request, dict[str, Any])
            filename = body.get("filename")
            if not isinstance(filename, str) or not SLOT_FILENAME.fullmatch(filename) or ".." in filename:
                raise RequestError(f"invalid slot file name {filename!r}: letters, digits, '.', '_' and '-' only")
            full = Path(root) / filename
            if action == "restore" and not full.is_file():
                raise NotFound(f"no saved slot file named {filename!r}")
            path = str(full)
        return _json(slot_action_json(await self.rt.slot_action(slot, action, path), path))

    async def live(self, request: Request) -> Response:
        """The live view's SSE stream: one shared snapshot per tick, see ``http.live``."""
        return StreamingResponse(
            self.feed.frames(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def metrics(self, request: Request) -> Response:
        """GET /metrics: llama-server's 501 unless started with --metrics; the header names the
        unix time the server started, as llama-server's ``Process-Start-Time-Unix``."""
        if not self.rt.config.endpoint_metrics:
            raise NotSupported("This server does not support metrics endpoint. Start it with `--metrics`")
        self.rt.require_ready()
        response = Response(await self.rt.metrics_text(), media_type="text/plain; version=0.0.4")
        # spelled as llama-server spells it: clients that copy headers into a plain dict look it up so
        response.raw_headers.append((b"Process-Start-Time-Unix", str(int(self.rt.started_at)).encode()))
        return response

    # ---- embeddings and rerank: shapes in ``http.embeddings`` --------------------------------

    async def embeddings_oai(self, request: Request) -> Response:
        req = await _decode(request, EmbeddingRequest)
        return _json(await embeddings.openai_embeddings(self.rt, req, self.model_id, request))

    async def embeddings_native(self, request: Request) -> Response:
        req = await _decode(request, EmbeddingRequest)
        return _json(await embeddings.native_embeddings(self.rt, req, request))

    async def rerank(self, request: Request) -> Response:
        req = await _decode(request, RerankRequest)
        return _json(await embeddings.rerank(self.rt, req, self.model_id, request))

    # ---- generation --------------------------------------------------------------------

    async def _native(
        self, handle: RequestHandle, *, stream: bool, n_probs: int = 0, post: bool = False
    ) -> NativeShaper:
        """The /completion shape of ``handle``'s answer (its generation_settings list the model's
        end-of-generation tokens banned when the request ignores EOS; its ``prompt`` is the
        prompt's text as the model reads it, as llama-server's, rendered in a worker thread when long)."""
        model = self.rt.model
        assert model is not None
        settings = generation_settings(
            handle.task, stream=stream, eog=model.eog_tokens, spec_type=self.rt.config.spec_type
        )
        tokens = [int(t) for t in handle.task.prompt if t >= 0]  # images and audio have no text
        if len(tokens) > INLINE_DETOKENIZE_TOKENS:
            prompt = await anyio.to_thread.run_sync(model.detokenize, tokens)
        else:
            prompt = model.detokenize(tokens)
        return NativeShaper(
            self.model_id,
            want_probs=n_probs > 0,
            settings=settings,
            post_sampling_probs=post,
            prompt=prompt,
            n_prompt=len(handle.task.prompt),
        )

    async def completion(self, request: Request) -> Response:
        req = await _decode(request, NativeCompletionRequest)
        prompts = several_prompts(req.prompt)
        if prompts is not None:
            return await self._completions_of(request, req, prompts)
        handle = await self.rt.submit_request(from_native(req))
        shaper = await self._native(handle, stream=req.stream, n_probs=req.n_probs, post=req.post_sampling_probs)
        if req.stream:
            return await self._stream(
                request,
                handle,
                lambda ev: [shaper.chunk(ev)],
                done=False,
                ping=req.sse_ping_interval,
                progress=shaper.progress,
            )
        return _json(shaper.body(await self._collect(request, handle)))

    async def _completions_of(self, request: Request, req: NativeCompletionRequest, prompts: list[Any]) -> Response:
        """Several prompts in one /completion, as llama-server: run at once, answered as an array
        in prompt order, each answer's ``index`` its prompt's place. Answered whole: a stream is one
        prompt's (several in a streaming request are a 400)."""
        if req.stream:
            raise RequestError("prompt: several prompts are answered as a whole; send one prompt per streaming request")
        requests = [from_native(msgspec.structs.replace(req, prompt=p)) for p in prompts]  # all checked first
        async with contextlib.AsyncExitStack() as stack:
            handles = [await stack.enter_async_context(await self.rt.submit_request(r)) for r in requests]
            results = [await self._collect(request, h) for h in handles]
            answers = []
            for i, (handle, result) in enumerate(zip(handles, results)):
                shaper = await self._native(handle, stream=False, n_probs=req.n_probs, post=req.post_sampling_probs)
                body = shaper.body(result)
                for one in body if isinstance(body, list) else [body]:  # a list: n choices
                    one.index = i * req.n + one.index
                    answers.append(one)
        return _json(answers)

    async def infill(self, request: Request) -> Response:
        """POST /infill: llama-server's fill-in-the-middle prompt, answered in the /completion shape."""
        self.rt.require_ready()
        assert self.rt.model is not None
        check_fim(self.rt.model)  # 501 before the body is read, as llama-server checks first
        req = await _decode(request, InfillRequest)
        handle = await self.rt.submit_request(from_infill(req))
        shaper = await self._native(handle, stream=req.stream, n_probs=req.n_probs)
        if req.stream:
            return await self._stream(request, handle, lambda ev: [shaper.chunk(ev)], done=False)
        return _json(shaper.body(await self._collect(request, handle)))

    async def completions(self, request: Request) -> Response:
        req = await _decode(request, CompletionRequest)
        cfg = self.rt.config
        default = cfg.n_predict_max if cfg.n_predict_max > 0 else DEFAULT_MAX_TOKENS_OPENAI_COMPLETIONS
        handle = await self.rt.submit_request(from_completion(req, default))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        shaper = OpenAIShaper(
            self.model_id, chat=False, want_logprobs=req.logprobs is not None, include_usage=include_usage
        )
        if req.stream:
            return await self._stream(
                request,
                handle,
                shaper.chunks,
                done=True,
                tail=shaper.usage_chunk,
                ping=req.sse_ping_interval,
                progress=shaper.progress,
            )
        result = await self._collect(request, handle)
        return _json(await self._verbose(req.verbose, shaper.body(result), handle, result))

    async def _verbose(
        self, asked: bool | None, body: dict[str, Any], handle: RequestHandle, result: Any
    ) -> dict[str, Any]:
        """``body`` with llama-server's ``__verbose`` when the request asks (``verbose``; by default
        when the server runs with ``-v``): the native /completion answer and the prompt's text."""
        if not (self.rt.config.verbose if asked is None else asked):
            return body
        shaper = await self._native(handle, stream=False)
        native = msgspec.to_builtins(shaper.body(result))
        if handle.turn is not None:  # a chat's prompt as its template rendered it
            for one in native if isinstance(native, list) else [native]:
                one["prompt"] = handle.turn.prompt
        return {**body, "__verbose": native}

    async def chat(self, request: Request) -> Response:
        req = await _decode(request, ChatCompletionRequest)
        handle = await self.rt.submit_request(from_chat(req))
        assert handle.turn is not None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        want = req.logprobs or req.n_probs > 0
        shaper = ChatShaper(self.model_id, turn=handle.turn, want_logprobs=want, include_usage=include_usage)
        if req.stream:
            return await self._stream(
                request,
                handle,
                shaper.chunks,
                done=True,
                tail=shaper.usage_chunk,
                ping=req.sse_ping_interval,
                progress=shaper.progress,
            )
        result = await self._collect(request, handle)
        return _json(await self._verbose(req.verbose, shaper.body(result), handle, result))

    # ---- chat-shaped APIs over the chat path (Responses, Anthropic Messages) -------------

    async def responses(self, request: Request) -> Response:
        req = responses_api.to_chat(await _decode(request, dict[str, Any]))
        return await self._chat_as(request, req, responses_api.ResponsesShaper)

    async def messages(self, request: Request) -> Response:
        req = anthropic.to_chat(await _decode(request, dict[str, Any]))
        return await self._chat_as(request, req, anthropic.AnthropicShaper)

    async def transcriptions(self, request: Request) -> Response:
        """POST /v1/audio/transcriptions (``http.transcriptions``): a form with an audio file, as
        a chat; llama-server's 501 when the projector (--mmproj) takes no audio."""
        self.rt.require_ready()  # loading: 503, as every endpoint (not the 501 below)
        vision, template = self.rt.vision, self.rt.chat_template
        if vision is None or not vision.audio:
            raise NotSupported("The current model does not support audio input.")
        body = await _body(request)
        fields, files = await anyio.to_thread.run_sync(  # ~0.2 s a MiB: off the event loop
            transcriptions.parse_form, request.headers.get("content-type", ""), body
        )
        req = transcriptions.to_chat(fields, files, template.source if template is not None else None)
        handle = await self.rt.submit_request(from_chat(msgspec.structs.replace(req, n=1)))
        assert handle.turn is not None
        shaper = transcriptions.TranscriptionShaper(handle.turn)
        if req.stream:
            return await self._stream(request, handle, shaper.events, done=True, ping=req.sse_ping_interval)
        return _json(shaper.body(await self._collect(request, handle)))

    async def _chat_as(self, request: Request, req: ChatCompletionRequest, shaper_cls: Any) -> Response:
        handle = await self.rt.submit_request(from_chat(msgspec.structs.replace(req, n=1)))
        shaper = shaper_cls(self.model_id, handle.turn)
        shaper.prompt_tokens = len(handle.task.prompt)
        if req.stream:
            error_frame = _anthropic_error_frame if shaper_cls is anthropic.AnthropicShaper else None
            return await self._stream(
                request,
                handle,
                shaper.events,
                done=False,
                tail=shaper.tail,
                frame=named_frame,
                error_frame=error_frame,
                progress=getattr(shaper, "progress", None),  # Responses: response.in_progress events
            )
        return _json(shaper.body(await self._collect(request, handle)))

    async def apply_template(self, request: Request) -> Response:
        req = await _decode(request, ChatCompletionRequest)
        turn = await anyio.to_thread.run_sync(self.rt.chat_turn, from_chat(req))  # rendering: off the loop
        return _json({"prompt": turn.prompt})

    async def chat_input_tokens(self, request: Request) -> Response:
        req = await _decode(request, ChatCompletionRequest)
        return _json(responses_api.input_tokens_body(await self._count(req)))

    async def responses_input_tokens(self, request: Request) -> Response:
        req = responses_api.to_chat(await _decode(request, dict[str, Any]))
        return _json(responses_api.input_tokens_body(await self._count(req)))

    async def count_tokens(self, request: Request) -> Response:
        req = anthropic.to_chat(await _decode(request, dict[str, Any]))
        return _json(anthropic.count_tokens_body(await self._count(req)))

    async def _count(self, req: ChatCompletionRequest) -> int:
        return await self.rt.count_prompt(await anyio.to_thread.run_sync(self.rt.chat_turn, from_chat(req)))

    async def _collect(self, request: Request, handle: RequestHandle) -> Any:
        """Collect a non-streaming result; a client disconnect cancels the request."""
        return await _unless_disconnected(request, handle, lambda: collect(handle))

    async def _first(self, request: Request, handle: RequestHandle) -> Token | Done | Progress | None:
        """The first event, or an error; a client leaving while queued or prefilling cancels."""
        return await _unless_disconnected(request, handle, handle.first)

    async def _stream(
        self,
        request: Request,
        handle: RequestHandle,
        shape: Any,
        *,
        done: bool,
        tail: Any = None,
        frame: Any = sse.frame,
        ping: int | None = None,
        progress: Any = None,
        error_frame: Callable[[BaseException], bytes] | None = None,
    ) -> Response:
        """SSE of one request. ``ping`` (llama-server's ``sse_ping_interval``; None: the server's
        --sse-ping-interval): after that many seconds without an event, a comment frame ``:``
        keeps the connection open; <= 0 sends none (and costs nothing). ``error_frame`` makes
        the frame of an error after the stream started (default: OpenAI's error body)."""
        first = await self._first(request, handle)
        if first is None:
            raise Closed("the request ended before its first event (the runtime is closing)")
        interval = self.rt.config.sse_ping_interval if ping is None else ping

        async def frames() -> AsyncIterator[bytes]:
            pending: asyncio.Future[Token | Done | Progress | None] | None = None
            try:
                event: Token | Done | Progress | None = first
                iterator = handle.__aiter__()
                while event is not None:
                    # Progress events come only for return_progress; an API without a progress
                    # shape skips them.
                    chunks = shape(event) if not isinstance(event, Progress) else progress(event) if progress else []
                    for chunk in chunks:
                        yield frame(chunk)
                    if interval <= 0:
                        event = await anext(iterator, None)
                        continue
                    # The pending read is never cancelled by a ping (that would end the iterator).
                    pending = asyncio.ensure_future(anext(iterator, None))
                    while not (await asyncio.wait((pending,), timeout=interval))[0]:
                        yield sse.PING
                    event, pending = pending.result(), None
                extra = tail() if tail is not None else None
                if extra is not None:
                    yield frame(extra)
                if done:
                    yield sse.DONE
            except Exception as exc:
                yield error_frame(exc) if error_frame is not None else sse.frame(error_body(exc))
            finally:
                if pending is not None:
                    pending.cancel()
                handle.close()

        return StreamingResponse(
            frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )


def _anthropic_error_frame(exc: BaseException) -> bytes:
    """An error once an Anthropic stream has started: its ``event: error`` frame."""
    return named_frame(("error", anthropic_error_body(exc)))


# The routes of one model: (path, the ``Api`` method that serves it, its HTTP methods). The
# router mode serves the same table, each request sent to the Api of the model it names
# (``runtime.http.router``).
MODEL_ROUTES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("/health", "health", ("GET",)),
    ("/v1/health", "health", ("GET",)),
    ("/v1/models", "models", ("GET",)),
    ("/models", "models", ("GET",)),
    ("/props", "props", ("GET",)),
    ("/props", "set_props", ("POST",)),
    ("/lora-adapters", "lora_adapters", ("GET",)),
    ("/lora-adapters", "set_lora_adapters", ("POST",)),
    ("/infill", "infill", ("POST",)),
    ("/completion", "completion", ("POST",)),
    ("/completions", "completion", ("POST",)),
    ("/v1/completions", "completions", ("POST",)),
    ("/v1/chat/completions", "chat", ("POST",)),
    ("/chat/completions", "chat", ("POST",)),
    ("/v1/responses", "responses", ("POST",)),
    ("/responses", "responses", ("POST",)),
    ("/v1/messages", "messages", ("POST",)),
    ("/v1/messages/count_tokens", "count_tokens", ("POST",)),
    ("/v1/audio/transcriptions", "transcriptions", ("POST",)),
    ("/audio/transcriptions", "transcriptions", ("POST",)),
    ("/apply-template", "apply_template", ("POST",)),
    ("/v1/chat/completions/input_tokens", "chat_input_tokens", ("POST",)),
    ("/chat/completions/input_tokens", "chat_input_tokens", ("POST",)),
    ("/v1/responses/input_tokens", "responses_input_tokens", ("POST",)),
    ("/responses/input_tokens", "responses_input_tokens", ("POST",)),
    ("/tokenize", "tokenize", ("POST",)),
    ("/detokenize", "detokenize", ("POST",)),
    ("/slots", "slots", ("GET",)),
    ("/slots/{id}", "slot_action", ("POST",)),
    ("/metrics", "metrics", ("GET",)),
    ("/v1/embeddings", "embeddings_oai", ("POST",)),
    ("/embeddings", "embeddings_native", ("POST",)),
    ("/embedding", "embeddings_native", ("POST",)),
    ("/rerank", "rerank", ("POST",)),
    ("/reranking", "rerank", ("POST",)),
    ("/v1/rerank", "rerank", ("POST",)),
    ("/v1/reranking", "rerank", ("POST",)),
    ("/live", "live", ("GET",)),
)


def make_route(prefix: str, path: str, fn: Callable[[Request], Awaitable[Response]], methods: Sequence[str]) -> Route:
    """``fn`` served at ``prefix + path``: any error it raises answered in the path's shape
    (``errors_for``), and the replica that served it (a replica set's) in a response header."""
    errors = errors_for(path)

    async def endpoint(request: Request) -> Response:
        placement: list[str] = []
        token = served_by.set(placement)  # a replica set writes the replica that serves
        try:
            response = await fn(request)
        except Exception as exc:
            return errors(exc)
        finally:
            served_by.reset(token)
        if placement:
            response.headers["x-llamactor-replica"] = placement[0]
        return response

    return Route(prefix + path, endpoint, methods=list(methods))


def app_around(config: RuntimeConfig, routes: Sequence[BaseRoute], *, lifespan: Any = None) -> Starlette:
    """A Starlette app of ``routes`` with the server's middleware (CORS, the API key) and its
    404/405 answers, as ``config`` (--cors-*, --api-key, --api-prefix) asks."""
    prefix = route_prefix(config.api_prefix)

    async def not_found(request: Request, exc: Exception) -> Response:
        path = request.url.path
        return errors_for(path.removeprefix(prefix))(NotFound(f"no route for {request.method} {path}"))

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        err = RequestError(f"method {request.method} is not allowed on {request.url.path}")
        err.status = 405
        return errors_for(request.url.path.removeprefix(prefix))(err)

    app = Starlette(
        routes=routes,
        middleware=[  # CORS first: a preflight needs no key, and a 401 still carries Allow-Origin
            Middleware(
                Cors,
                origins=config.cors_origins,
                methods=config.cors_methods,
                headers=config.cors_headers,
                credentials=config.cors_credentials,
            ),
            Middleware(_ApiKey, key=config.api_key, more=config.api_keys, prefix=prefix),
        ],
        exception_handlers={404: not_found, 405: method_not_allowed},
        lifespan=lifespan,
    )
    # AIP_MODE=PREDICTION (Vertex AI): the predict route over this very app, as llama-server
    posts = [r.path.removeprefix(prefix) for r in routes if isinstance(r, Route) and "POST" in (r.methods or ())]
    health = next((r.endpoint for r in routes if isinstance(r, Route) and r.path == prefix + "/health"), None)
    app.router.routes.extend(vertex.routes(prefix, posts, lambda: app, health))
    return app


def build_app(rt: Runtime, *, lifespan: Any = None) -> Starlette:
    """The app of ``rt``; every route is under ``config.api_prefix`` (llama-server prepends its
    --api-prefix to each path, the page's included; the page asks for the rest by relative URLs)."""
    api = Api(rt)
    prefix = route_prefix(rt.config.api_prefix)
    routes: list[BaseRoute] = [
        make_route(prefix, path, getattr(api, name), methods) for path, name, methods in MODEL_ROUTES
    ]
    if rt.config.webui and rt.config.static_path:  # --path: its files instead of the page
        routes.append(Mount(prefix or "/", app=_StaticFiles(directory=rt.config.static_path, html=True)))
    elif rt.config.webui:  # --no-webui: GET / is a 404, as in llama-server
        page = Page()
        routes += [make_route(prefix, path, page.index, ["GET"]) for path in PAGE_PATHS]
        routes.append(make_route(prefix, ASSET_PATH, page.asset, ["GET"]))
    agent = Agent(rt.config, rt.health)  # /tools and /cors-proxy (403 when off)
    routes += agent.routes(prefix, make_route)
    return app_around(rt.config, routes, lifespan=agent.lifespan(lifespan))


class _StaticFiles(StaticFiles):
    """--path: llama-server's static files (its ``set_mount_point``): GET and HEAD of the files
    under the directory, ``index.html`` for a directory; the API's routes are matched first, and
    another method, or a path with no file, answers the server's 404 like any unknown route."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        if scope["method"] not in ("GET", "HEAD"):
            raise HTTPException(status_code=404)
        return await super().get_response(path, scope)
