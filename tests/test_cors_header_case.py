"""CORS header names go out as llama-server spells them (``Access-Control-Allow-Origin``), on a
preflight and on an ordinary response: clients that copy the headers into a plain dict (llama.cpp's
own server tests do) look them up by that exact spelling."""

from __future__ import annotations

import httpx
from conftest import open_server

ORIGIN = "http://localhost:5173"


def _names(response: httpx.Response) -> set[str]:
    return {name.decode("latin-1") for name, _ in response.headers.raw}


async def test_cors_header_names_keep_llama_server_casing(make_config) -> None:
    async with open_server(make_config(parallel=1)) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            preflight = await client.options(
                "/completion", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
            )
            assert preflight.status_code == 200
            assert {
                "Access-Control-Allow-Origin",
                "Access-Control-Allow-Credentials",
                "Access-Control-Allow-Methods",
                "Access-Control-Allow-Headers",
            } <= _names(preflight)
            assert dict(preflight.headers.raw)[b"Access-Control-Allow-Origin"] == ORIGIN.encode()
            health = await client.get("/health", headers={"Origin": ORIGIN})
            assert health.status_code == 200
            assert "Access-Control-Allow-Origin" in _names(health)
            assert dict(health.headers.raw)[b"Access-Control-Allow-Origin"] == ORIGIN.encode()


async def test_localhost_origins_reflect_with_llama_server_casing(make_config) -> None:
    async with open_server(make_config(parallel=1, cors_origins="localhost")) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            local = await client.options("/completion", headers={"Origin": "http://[::1]:3000"})
            assert dict(local.headers.raw)[b"Access-Control-Allow-Origin"] == b"http://[::1]:3000"
            far = await client.options("/completion", headers={"Origin": "http://evil.com"})
            assert "access-control-allow-origin" not in {name.lower() for name in _names(far)}
