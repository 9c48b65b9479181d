"""The bundled HTTP app's generation endpoints: ``Api``, the routes of one model (the rest
are ``UtilityEndpoints``, its base).

Requests are decoded with msgspec into ``protocol.wire`` Structs, submitted to the runtime,
and answered either as one JSON body or as SSE. The first event of a request is awaited
before any response starts, so a queue-full or engine error still gets its proper status code
even for streaming requests. A client that disconnects cancels its request at once, streaming
or not.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llamactor.protocol import sse
from llamactor.protocol.errors import Closed, NotSupported, RequestError
from llamactor.protocol.events import Done, Progress, Token
from llamactor.protocol.wire import (
    DEFAULT_MAX_TOKENS_OPENAI_COMPLETIONS,
    ChatCompletionRequest,
    CompletionRequest,
    InfillRequest,
    NativeCompletionRequest,
)
from llamactor.runtime.http import anthropic, responses_request, responses_shaper, transcriptions
from llamactor.runtime.http.body import decode_body, json_response, read_body
from llamactor.runtime.http.chat_api import ChatShaper
from llamactor.runtime.http.disconnect import until_disconnect
from llamactor.runtime.http.generation_settings import generation_settings
from llamactor.runtime.http.native_shaper import NativeShaper
from llamactor.runtime.http.openai_shaper import OpenAIShaper
from llamactor.runtime.http.requests import from_chat, from_completion, from_infill, from_native, several_prompts
from llamactor.runtime.http.shaper import Shaper
from llamactor.runtime.http.utility import UtilityEndpoints
from llamactor.runtime.service.handles import RequestHandle, collect
from llamactor.runtime.service.infill import check_fim

INLINE_DETOKENIZE_TOKENS = 2048  # a longer prompt's text is rendered in a worker thread


async def _unless_disconnected(request: Request, handle: RequestHandle, wait: Any) -> Any:
    """Await ``wait()`` while watching the client; if it leaves (or anything fails), the request
    is cancelled at once and its slot freed."""
    try:
        return await until_disconnect(request, wait)
    except BaseException:
        handle.close()
        raise


class Api(UtilityEndpoints):
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
        req = await decode_body(request, NativeCompletionRequest)
        prompts = several_prompts(req.prompt)
        if prompts is not None:
            return await self._completions_of(request, req, prompts)
        handle = await self.rt.submit_request(from_native(req))
        shaper = await self._native(handle, stream=req.stream, n_probs=req.n_probs, post=req.post_sampling_probs)
        if req.stream:
            return await self._stream(request, handle, shaper, ping=req.sse_ping_interval)
        return json_response(shaper.body(await self._collect(request, handle)))

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
        return json_response(answers)

    async def infill(self, request: Request) -> Response:
        """POST /infill: llama-server's fill-in-the-middle prompt, answered in the /completion shape."""
        self.rt.require_ready()
        assert self.rt.model is not None
        check_fim(self.rt.model)  # 501 before the body is read, as llama-server checks first
        req = await decode_body(request, InfillRequest)
        handle = await self.rt.submit_request(from_infill(req))
        shaper = await self._native(handle, stream=req.stream, n_probs=req.n_probs)
        if req.stream:
            return await self._stream(request, handle, shaper)
        return json_response(shaper.body(await self._collect(request, handle)))

    async def completions(self, request: Request) -> Response:
        req = await decode_body(request, CompletionRequest)
        cfg = self.rt.config
        default = cfg.n_predict_max if cfg.n_predict_max > 0 else DEFAULT_MAX_TOKENS_OPENAI_COMPLETIONS
        handle = await self.rt.submit_request(from_completion(req, default))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        shaper = OpenAIShaper(
            self.model_id, chat=False, want_logprobs=req.logprobs is not None, include_usage=include_usage
        )
        if req.stream:
            return await self._stream(request, handle, shaper, ping=req.sse_ping_interval)
        result = await self._collect(request, handle)
        return json_response(await self._verbose(req.verbose, shaper.body(result), handle, result))

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
        req = await decode_body(request, ChatCompletionRequest)
        handle = await self.rt.submit_request(from_chat(req))
        assert handle.turn is not None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        want = req.logprobs or req.n_probs > 0
        shaper = ChatShaper(self.model_id, turn=handle.turn, want_logprobs=want, include_usage=include_usage)
        if req.stream:
            return await self._stream(request, handle, shaper, ping=req.sse_ping_interval)
        result = await self._collect(request, handle)
        return json_response(await self._verbose(req.verbose, shaper.body(result), handle, result))

    # ---- chat-shaped APIs over the chat path (Responses, Anthropic Messages) -------------

    async def responses(self, request: Request) -> Response:
        req = responses_request.to_chat(await decode_body(request, dict[str, Any]))
        return await self._chat_as(request, req, responses_shaper.ResponsesShaper)

    async def messages(self, request: Request) -> Response:
        req = anthropic.to_chat(await decode_body(request, dict[str, Any]))
        return await self._chat_as(request, req, anthropic.AnthropicShaper)

    async def transcriptions(self, request: Request) -> Response:
        """POST /v1/audio/transcriptions (``http.transcriptions``): a form with an audio file, as
        a chat; llama-server's 501 when the projector (--mmproj) takes no audio."""
        self.rt.require_ready()  # loading: 503, as every endpoint (not the 501 below)
        vision, template = self.rt.vision, self.rt.chat_template
        if vision is None or not vision.audio:
            raise NotSupported("The current model does not support audio input.")
        body = await read_body(request)
        fields, files = await anyio.to_thread.run_sync(  # ~0.2 s a MiB: off the event loop
            transcriptions.parse_form, request.headers.get("content-type", ""), body
        )
        req = transcriptions.to_chat(fields, files, template.source if template is not None else None)
        handle = await self.rt.submit_request(from_chat(msgspec.structs.replace(req, n=1)))
        assert handle.turn is not None
        shaper = transcriptions.TranscriptionShaper(handle.turn)
        if req.stream:
            return await self._stream(request, handle, shaper, ping=req.sse_ping_interval)
        return json_response(shaper.body(await self._collect(request, handle)))

    async def _chat_as(self, request: Request, req: ChatCompletionRequest, shaper_cls: Any) -> Response:
        handle = await self.rt.submit_request(from_chat(msgspec.structs.replace(req, n=1)))
        shaper = shaper_cls(self.model_id, handle.turn)
        shaper.prompt_tokens = len(handle.task.prompt)
        if req.stream:
            return await self._stream(request, handle, shaper)
        return json_response(shaper.body(await self._collect(request, handle)))

    async def apply_template(self, request: Request) -> Response:
        req = await decode_body(request, ChatCompletionRequest)
        turn = await anyio.to_thread.run_sync(self.rt.chat_turn, from_chat(req))  # rendering: off the loop
        return json_response({"prompt": turn.prompt})

    async def chat_input_tokens(self, request: Request) -> Response:
        req = await decode_body(request, ChatCompletionRequest)
        return json_response(responses_shaper.input_tokens_body(await self._count(req)))

    async def responses_input_tokens(self, request: Request) -> Response:
        req = responses_request.to_chat(await decode_body(request, dict[str, Any]))
        return json_response(responses_shaper.input_tokens_body(await self._count(req)))

    async def count_tokens(self, request: Request) -> Response:
        req = anthropic.to_chat(await decode_body(request, dict[str, Any]))
        return json_response(anthropic.count_tokens_body(await self._count(req)))

    async def _count(self, req: ChatCompletionRequest) -> int:
        return await self.rt.count_prompt(await anyio.to_thread.run_sync(self.rt.chat_turn, from_chat(req)))

    async def _collect(self, request: Request, handle: RequestHandle) -> Any:
        """Collect a non-streaming result; a client disconnect cancels the request."""
        return await _unless_disconnected(request, handle, lambda: collect(handle))

    async def _first(self, request: Request, handle: RequestHandle) -> Token | Done | Progress | None:
        """The first event, or an error; a client leaving while queued or prefilling cancels."""
        return await _unless_disconnected(request, handle, handle.first)

    async def _stream(
        self, request: Request, handle: RequestHandle, shaper: Shaper, ping: int | None = None
    ) -> Response:
        """SSE of one request in ``shaper``'s shape (``runtime.http.shaper``). ``ping``
        (llama-server's ``sse_ping_interval``; None: the server's --sse-ping-interval): after that
        many seconds without an event, a comment frame ``:`` keeps the connection open; <= 0
        sends none (and costs nothing)."""
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
                    # Progress events come only for return_progress
                    items = shaper.progress(event) if isinstance(event, Progress) else shaper.stream(event)
                    for item in items:
                        yield shaper.frame(item)
                    if interval <= 0:
                        event = await anext(iterator, None)
                        continue
                    # The pending read is never cancelled by a ping (that would end the iterator).
                    pending = asyncio.ensure_future(anext(iterator, None))
                    while not (await asyncio.wait((pending,), timeout=interval))[0]:
                        yield sse.PING
                    event, pending = pending.result(), None
                extra = shaper.tail()
                if extra is not None:
                    yield shaper.frame(extra)
                if shaper.done:
                    yield sse.DONE
            except Exception as exc:
                yield shaper.error_frame(exc)
            finally:
                if pending is not None:
                    pending.cancel()
                handle.close()

        return StreamingResponse(
            frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
