"""Embedding llamactor in your own Starlette app.

The runtime lives inside the app's lifespan and event loop; its whole HTTP API (OpenAI,
llama-server's native endpoints) is mounted under /llm, and the app's own routes call the
runtime directly:

- ``GET /hello?name=Ada``: one completion, answered as JSON;
- ``GET /story?topic=sea``: a completion streamed as plain text. A request the runtime refuses
  (a prompt too long for a slot, a bad value) is refused before the first event, so the route
  answers 400 with the reason; a client that goes away mid-stream cancels the request at once.

The engine runs in a child process (the default): if llama.cpp aborts, the app keeps serving
and the runtime's requests resume once the engine is back (``RuntimeConfig(isolate=False)``
keeps it in-process).

    python examples/embed_app.py [model.gguf]      # then: curl localhost:8000/story?topic=sea
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from llamactor.runtime import RequestError, Runtime, RuntimeConfig, Token


def create_app(config: RuntimeConfig) -> Starlette:
    runtime = Runtime(config)

    async def hello(request: Request) -> JSONResponse:
        name = request.query_params.get("name", "world")
        out = await runtime.complete(f"Say hello to {name}.", max_tokens=16, temperature=0)
        return JSONResponse({"greeting": out.text, "tokens": out.n_predicted})

    async def story(request: Request) -> Response:
        topic = request.query_params.get("topic", "the sea")
        try:  # request errors are raised here, before any byte is sent
            events = await runtime.stream(f"A short story about {topic}:", max_tokens=64)
        except RequestError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)

        async def text() -> AsyncIterator[str]:
            async with events:  # the client leaving ends this generator: the request is cancelled
                async for event in events:
                    if isinstance(event, Token):
                        yield event.text

        return StreamingResponse(text(), media_type="text/plain")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with runtime:  # loads the model and starts the engine inside the app's own loop
            yield

    app = Starlette(
        routes=[Route("/hello", hello), Route("/story", story), Mount("/llm", app=runtime.asgi_app())],
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    return app


if __name__ == "__main__":
    import anyio
    from hypercorn.asyncio import serve  # any ASGI server works; hypercorn ships with llamactor
    from hypercorn.config import Config

    cfg = RuntimeConfig(model=sys.argv[1] if len(sys.argv) > 1 else None, parallel=4)
    hc = Config()
    hc.bind = ["127.0.0.1:8000"]
    anyio.run(serve, create_app(cfg), hc)  # type: ignore[arg-type]
