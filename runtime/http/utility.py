"""The bundled HTTP app's endpoints that do not generate (``UtilityEndpoints``); ``Api``
(``runtime.http.generation``) adds the generation endpoints over them, and ``runtime.http.app``
routes both."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llamactor.actors.policies import policy_name
from llamactor.protocol.errors import NotFound, NotSupported, RequestError, Unavailable
from llamactor.protocol.wire import (
    DetokenizeRequest,
    EmbeddingRequest,
    LoraEntry,
    RerankRequest,
    TokenizeRequest,
)
from llamactor.runtime.http import embeddings
from llamactor.runtime.http.body import decode_body, json_response, read_body, read_body_buffer
from llamactor.runtime.http.errors import error_response
from llamactor.runtime.http.generation_settings import default_generation_settings
from llamactor.runtime.http.live import LiveFeed
from llamactor.runtime.http.slots import slot_action_json, slots_json
from llamactor.runtime.service.slottransfer import MAX_IMPORT_BYTES
from llamactor.runtime.service.templatecaps import template_caps

if TYPE_CHECKING:
    from llamactor.runtime.service.core import RuntimeCore as Runtime

SLOT_FILENAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SLOT_ACTIONS = ("save", "restore", "erase", "export", "import")
DEFAULT_MEDIA_MARKER = "<__media__>"  # libmtmd's (mtmd_default_marker): /props names it without --mmproj too


class UtilityEndpoints:
    """The routes of one model that do not generate: health, the model and server facts, LoRA
    scales, tokens, slots, metrics, the live view, embeddings and rerank."""

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
            return json_response({"status": "ok"})
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
        return json_response({"models": [self._ollama_model()], "object": "list", "data": [owned]})

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
        return json_response(
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
        await read_body(request)
        return json_response({"success": True})

    async def lora_adapters(self, request: Request) -> Response:
        """GET /lora-adapters: the loaded adapters and their global scales."""
        return json_response(self.rt.lora_adapters())

    async def set_lora_adapters(self, request: Request) -> Response:
        """POST /lora-adapters: ``[{"id", "scale"}, ...]`` sets the global scales."""
        entries = await decode_body(request, list[LoraEntry])
        self.rt.set_lora_adapters(entries)
        return json_response({"success": True})

    async def tokenize(self, request: Request) -> Response:
        req = await decode_body(request, TokenizeRequest)
        tokens = await self.rt.tokenize(req.content, add_special=req.add_special, parse_special=req.parse_special)
        if req.with_pieces:
            model = self.rt.model
            assert model is not None

            def pieces() -> list[dict[str, Any]]:
                return [{"id": t, "piece": model.piece(t).decode("utf-8", "replace")} for t in tokens]

            return json_response(
                {"tokens": await anyio.to_thread.run_sync(pieces)}
            )  # as long as the text: off the loop
        return json_response({"tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        req = await decode_body(request, DetokenizeRequest)
        return json_response(
            {"content": await anyio.to_thread.run_sync(self.rt.detokenize, req.tokens)}
        )  # off the loop

    async def slots(self, request: Request) -> Response:
        """GET /slots: llama-server's 501 when started with --no-slots. ``POST /slots/{id}``
        stays, as in llama-server, where --no-slots turns off the monitoring endpoint only."""
        if not self.rt.config.endpoint_slots:
            raise NotSupported("This server does not support slots endpoint. Start it with `--slots`")
        states = await self.rt.slots()
        # ?fail_on_no_slot=1: a 503 while every slot is busy (a load balancer's readiness probe)
        if "fail_on_no_slot" in request.query_params and not any(not s.busy and s.phase != "down" for s in states):
            raise Unavailable("no slot available")
        return json_response(slots_json(states))

    async def slot_action(self, request: Request) -> Response:
        self.rt.require_ready()
        try:
            slot = int(request.path_params["id"])
        except ValueError:
            raise RequestError("slot id must be an integer") from None
        action = request.query_params.get("action", "")
        if action not in SLOT_ACTIONS:
            raise RequestError(f"action must be one of {', '.join(SLOT_ACTIONS)}, got {action!r}")
        if action in ("export", "import"):
            return await self._slot_transfer(request, slot, action)
        path = ""
        if action != "erase":
            root = self.rt.config.slot_save_path
            if root is None:
                raise RequestError("slot save/restore is disabled: start the server with --slot-save-path")
            body = await decode_body(request, dict[str, Any])
            filename = body.get("filename")
            if not isinstance(filename, str) or not SLOT_FILENAME.fullmatch(filename) or ".." in filename:
                raise RequestError(f"invalid slot file name {filename!r}: letters, digits, '.', '_' and '-' only")
            full = Path(root) / filename
            if action == "restore" and not full.is_file():
                raise NotFound(f"no saved slot file named {filename!r}")
            path = str(full)
        return json_response(slot_action_json(await self.rt.slot_action(slot, action, path), path))

    async def drain_replica(self, request: Request) -> Response:
        """POST /replicas/{id}/drain: no new requests to that replica; its streams move to
        the others with their KV (the replica ids are ``GET /props``' ``engine.replicas``)."""
        self.rt.require_ready()
        return json_response(await self.rt.drain_replica(request.path_params["id"]))

    async def scale_replicas(self, request: Request) -> Response:
        """POST /replicas/scale ``{"replicas": N}``: N replicas of a fixed-size set; a replica
        Ray Serve stops first moves its streams to the others with their KV."""
        self.rt.require_ready()
        body = await decode_body(request, dict[str, Any])
        n = body.get("replicas")
        if not isinstance(n, int) or isinstance(n, bool):
            raise RequestError(f"replicas must be an integer, got {n!r}")
        return json_response(await self.rt.scale_replicas(n))

    async def _slot_transfer(self, request: Request, slot: int, action: str) -> Response:
        """Export: the slot's KV state as bytes (``service.slottransfer``); import: such bytes
        as the body, into the slot. Off unless the server was started with --slot-transfer."""
        if not self.rt.config.slot_transfer:
            raise RequestError("slot export and import are disabled: start the server with --slot-transfer")
        if action == "export":
            data = await self.rt.export_slot(slot)
            return Response(data, media_type="application/octet-stream")
        body = await read_body_buffer(request, MAX_IMPORT_BYTES)
        return json_response(slot_action_json(await self.rt.import_slot(slot, body)))

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
        req = await decode_body(request, EmbeddingRequest)
        return json_response(await embeddings.openai_embeddings(self.rt, req, self.model_id, request))

    async def embeddings_native(self, request: Request) -> Response:
        req = await decode_body(request, EmbeddingRequest)
        return json_response(await embeddings.native_embeddings(self.rt, req, request))

    async def rerank(self, request: Request) -> Response:
        req = await decode_body(request, RerankRequest)
        return json_response(await embeddings.rerank(self.rt, req, self.model_id, request))
