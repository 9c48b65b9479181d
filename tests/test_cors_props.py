"""CORS and /props as llama-server: its default CORS headers on every
response, OPTIONS preflight on every path without an API key, the --cors-* flags, POST /props
(501 unless --props) and the GET /props fields llama-server sends.
"""

from __future__ import annotations

import httpx
from conftest import open_server
from serveargs import parse_serve as _parse

ORIGIN = "http://example.com"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


async def test_cors_defaults_and_preflight_without_key(make_config) -> None:
    """llama-server's defaults (origins *, credentials on: the Origin is echoed; methods
    "GET, POST, DELETE, OPTIONS"; headers *). OPTIONS on any path is a 200 with an empty body
    even with --api-key; other responses, a 401 included, carry Allow-Origin."""
    async with open_server(make_config(parallel=1, api_key="sekret")) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            for path in ("/v1/chat/completions", "/completion", "/infill", "/props", "/no/such/route"):
                r = await client.options(path, headers=PREFLIGHT)
                assert r.status_code == 200, (path, r.text)
                assert r.content == b""
                assert r.headers["access-control-allow-origin"] == ORIGIN
                assert r.headers["access-control-allow-credentials"] == "true"
                assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
                assert r.headers["access-control-allow-headers"] == "*"
            denied = await client.get("/props", headers={"Origin": ORIGIN})
            assert denied.status_code == 401
            assert denied.headers["access-control-allow-origin"] == ORIGIN
            ok = await client.post(
                "/completion",
                json={"prompt": "Hi", "n_predict": 2},
                headers={"Origin": ORIGIN, "Authorization": "Bearer sekret"},
            )
            assert ok.status_code == 200
            assert ok.headers["access-control-allow-origin"] == ORIGIN
            assert ok.headers.get("access-control-allow-credentials") is None  # preflight only, as llama-server


async def test_cors_flags(make_config) -> None:
    """--cors-origins/--cors-methods/--cors-headers/--no-cors-credentials (and their
    LLAMA_ARG_* variables) set what the responses say; "localhost" reflects only local origins."""
    opts = _parse(
        ["--cors-origins", "https://a.example", "--cors-methods", "GET, POST", "--no-cors-credentials"],
        {"LLAMA_ARG_CORS_HEADERS": "content-type"},
    )
    cfg = opts.config
    assert (cfg.cors_origins, cfg.cors_methods, cfg.cors_headers, cfg.cors_credentials) == (
        "https://a.example",
        "GET, POST",
        "content-type",
        False,
    )
    async with (
        open_server(
            make_config(
                parallel=1,
                cors_origins=cfg.cors_origins,
                cors_methods=cfg.cors_methods,
                cors_headers=cfg.cors_headers,
                cors_credentials=False,
            )
        ) as (_rt, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        r = await client.options("/v1/models", headers=PREFLIGHT)
        assert r.headers["access-control-allow-origin"] == "https://a.example"
        assert r.headers["access-control-allow-credentials"] == "false"
        assert r.headers["access-control-allow-methods"] == "GET, POST"
        assert r.headers["access-control-allow-headers"] == "content-type"
        assert (await client.get("/health")).headers["access-control-allow-origin"] == "https://a.example"
    assert _parse(["--cors-origins", "localhost"]).config.cors_origins == "localhost"
    async with open_server(make_config(parallel=1, cors_origins="localhost")) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            local = await client.get("/health", headers={"Origin": "http://localhost:5173"})
            assert local.headers["access-control-allow-origin"] == "http://localhost:5173"
            far = await client.get("/health", headers={"Origin": ORIGIN})
            assert "access-control-allow-origin" not in far.headers


async def test_post_props(make_config) -> None:
    """POST /props is llama-server's 501 not_supported_error unless --props, then
    {"success": true}; GET /props reports endpoint_props."""
    async with open_server(make_config(parallel=1)) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            r = await client.post("/props", json={"n_ctx": 1})
            assert r.status_code == 501
            err = r.json()["error"]
            assert err["type"] == "not_supported_error"
            assert err["message"] == (
                "This server does not support changing global properties. Start it with `--props`"
            )
            assert (await client.get("/props")).json()["endpoint_props"] is False
    assert _parse(["--props"]).config.endpoint_props is True
    assert _parse([], {"LLAMA_ARG_ENDPOINT_PROPS": "1"}).config.endpoint_props is True
    async with open_server(make_config(parallel=1, endpoint_props=True)) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            before = (await client.get("/props")).json()
            r = await client.post("/props", json={})
            assert r.status_code == 200 and r.json() == {"success": True}
            after = (await client.get("/props")).json()
            assert after == before and after["endpoint_props"] is True


async def test_get_props_has_llama_server_fields(make_config) -> None:
    """GET /props carries llama-server's get_res_props fields (ours kept too)."""
    async with open_server(make_config(parallel=2, webui=False)) as (_rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            props = (await client.get("/props")).json()
    for key in (
        "default_generation_settings",
        "total_slots",
        "model_alias",
        "model_path",
        "modalities",
        "endpoint_slots",
        "endpoint_props",
        "endpoint_metrics",
        "ui",
        "ui_settings",
        "chat_template",
        "bos_token",
        "eos_token",
        "build_info",
        "is_sleeping",
        "cors_proxy_enabled",
    ):
        assert key in props, key
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert (props["bos_token"], props["eos_token"]) == ("<|bos|>", "<|eos|>")
    assert props["total_slots"] == 2 and props["ui"] is False and props["is_sleeping"] is False
    assert "pipeline_groups" in props and "n_ctx" in props  # llamactor's own stay
