"""Embedding llamactor in your own Starlette app.

The runtime lives inside the app's lifespan and event loop; its OpenAI-compatible API is
mounted under /llm, and the app's own route calls the runtime directly. The engine runs in a
child process (the default): if llama.cpp aborts, the app keeps serving and the runtime's
requests resume once the engine is back (``RuntimeConfig(isolate=False)`` keeps it in-process).

    python examples/embed_app.py [model.gguf]      # then: curl localhost:8000/hello?name=Ada
"""

from __future__ import annotations

import sys
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from llamactor.runtime import Runtime, RuntimeConfig


def create_app(config: RuntimeConfig) -> Starlette:
    runtime = Runtime(config)

    async def hello(request: Request) -> JSONResponse:
        name = request.query_params.get("name", "world")
        out = await runtime.complete(f"Say hello to {name}.", max_tokens=16, temperature=0)
        return JSONResponse({"greeting": out.text, "tokens": out.n_predicted})

    @asynccontextmanager
    async def lifespan(app: Starlette):
        async with runtime:  # loads the model and starts the actors inside the app's own loop
            yield

    return Starlette(
        routes=[Route("/hello", hello), Mount("/llm", app=runtime.asgi_app())],
        lifespan=lifespan,
    )


if __name__ == "__main__":
    import anyio
    from hypercorn.asyncio import serve  # any ASGI server works; hypercorn ships with llamactor
    from hypercorn.config import Config

    cfg = RuntimeConfig(model=sys.argv[1] if len(sys.argv) > 1 else None, parallel=4)
    hc = Config()
    hc.bind = ["127.0.0.1:8000"]
    anyio.run(serve, create_app(cfg), hc)
