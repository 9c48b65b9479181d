"""``/cors-proxy`` (``--ui-mcp-proxy``, or ``--agent``): llama-server's CORS proxy for the web
UI's MCP clients, a 403 when off.

``GET|POST /cors-proxy?url=http(s)://host[:port]/path`` sends the same method and body (at most
the server's body limit: 413 past it) to ``url`` and streams back its status, headers and body,
under the egress policy of ``runtime.service.egress`` on the first hop and on each of at most
``MAX_REDIRECTS`` redirects: by default never to loopback, private or link-local addresses
(``--ui-mcp-proxy-allow-private`` lets loopback and private ones through, for MCP servers on
this machine or its network), and only to ``--ui-mcp-proxy-allowed-hosts`` when given. A target
the policy refuses is a 403 ``proxy error: ...``. Reads time out after 600 s, as llama-server's.
Only the request headers named ``X-Llama-Server-Proxy-Header-<name>`` go along, as ``<name>``
(never Accept-Encoding, Transfer-Encoding or Content-Length). The response loses Server,
Transfer-Encoding, Content-Length, Keep-Alive and the Access-Control-* headers (this server's
CORS headers are the ones that count). A URL with no scheme, another scheme, no host or a
password is a 500 naming it; a target that cannot be reached answers 500 with the body
``proxy error: <why>``, as llama-server does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llamactor.runtime.http.body import read_body
from llamactor.runtime.http.errors import BodyTooLarge
from llamactor.runtime.service.egress import EgressPolicy, EgressRefused, tls_context

log = structlog.get_logger("llamactor.cors_proxy")

HEADER_PREFIX = "x-llama-server-proxy-header-"
STRIPPED_REQUEST = frozenset({"accept-encoding", "transfer-encoding", "content-length"})
STRIPPED_RESPONSE = frozenset({"server", "transfer-encoding", "content-length", "keep-alive"})
TIMEOUT_S = 600.0


class ProxyUrlError(Exception):
    pass


def parse_url(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path with query) of a target URL, as llama.cpp's URL parser."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ProxyUrlError("invalid URL: no scheme")
    if scheme not in ("http", "https"):
        raise ProxyUrlError(f"unsupported URL scheme: {scheme}")
    auth, at, after = rest.partition("@")
    password = ""
    if at:
        password = auth.partition(":")[2]
        rest = after
    host, slash, path = rest.partition("/")
    path = slash + path if slash else "/"
    port_text = ""
    if host.startswith("["):
        close = host.find("]")
        if close < 0:
            raise ProxyUrlError(f"invalid IPv6 URL authority: {host}")
        after_host = host[close + 1 :]
        port_text = after_host[1:] if after_host.startswith(":") else ""
        host = host[1:close]
    elif ":" in host:
        host, _, port_text = host.partition(":")
    try:
        port = int(port_text) if port_text else (443 if scheme == "https" else 80)
    except ValueError:
        raise ProxyUrlError(f"invalid port in target URL: {port_text}") from None
    if not host:
        raise ProxyUrlError("invalid target URL: missing host")
    if password:
        raise ProxyUrlError("authentication in target URL is not supported")
    return scheme, host, port, path


JSON_TYPE = "application/json; charset=utf-8"  # llama-server's type of a response that names none


def _server_error(message: str) -> Response:
    body = {"error": {"code": 500, "message": message, "type": "server_error"}}
    return Response(json.dumps(body, separators=(",", ":")), status_code=500, media_type=JSON_TYPE)


def _why(exc: httpx.HTTPError) -> str:
    """httplib's words for a failed request (what llama-server puts after "proxy error: ")."""
    if isinstance(exc, httpx.ConnectTimeout):
        return "Connection timed out"
    if isinstance(exc, httpx.ConnectError):
        return "Could not establish connection"
    if isinstance(exc, httpx.TimeoutException):
        return "Read timed out"
    if isinstance(exc, httpx.TooManyRedirects):
        return "Too many redirects"
    return "Failed to read connection"


class CorsProxy:
    def __init__(self, policy: EgressPolicy | None = None) -> None:
        self.client: httpx.AsyncClient | None = None
        self.policy = policy if policy is not None else EgressPolicy()

    async def _client(self) -> httpx.AsyncClient:
        if self.client is None:  # redirects are the policy's to follow, each hop checked
            self.client = httpx.AsyncClient(
                verify=await tls_context(),
                follow_redirects=False,
                timeout=httpx.Timeout(TIMEOUT_S),
                trust_env=False,
                headers={},
            )
        return self.client

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    async def handle(self, request: Request) -> Response:
        try:
            scheme, host, port, path = parse_url(request.query_params.get("url", ""))
        except ProxyUrlError as exc:
            return _server_error(str(exc))
        shown = f"[{host}]" if ":" in host else host
        log.info("proxying", method=request.method, url=f"{scheme}://{shown}:{port}{path}")
        headers = {}
        for key, value in request.headers.items():  # lowercased by the ASGI server
            if not key.startswith(HEADER_PREFIX) or len(key) == len(HEADER_PREFIX):
                continue
            name = key[len(HEADER_PREFIX) :]
            if name in STRIPPED_REQUEST:
                continue
            if name == "host":
                default = (scheme, port) in (("http", 80), ("https", 443))
                value = shown if default else f"{shown}:{port}"
            headers[name] = value
        headers.setdefault("accept-encoding", "identity")  # the body goes back as it comes
        try:
            body = await read_body(request)
        except BodyTooLarge as exc:
            return Response(
                json.dumps({"error": {"code": 413, "message": str(exc), "type": "invalid_request_error"}}),
                status_code=413,
                media_type=JSON_TYPE,
            )
        try:
            response = await self.policy.send(
                await self._client(), request.method, f"{scheme}://{shown}:{port}{path}", headers, body or None
            )
        except EgressRefused as exc:
            log.warning("proxy_refused", url=f"{scheme}://{shown}:{port}{path}", reason=str(exc))
            return Response(
                "proxy error: the target is not allowed (--ui-mcp-proxy-allowed-hosts, --ui-mcp-proxy-allow-private)",
                status_code=403,
                media_type=JSON_TYPE,
            )
        except httpx.HTTPError as exc:
            log.warning("proxy_failed", error=str(exc) or type(exc).__name__)
            return Response(f"proxy error: {_why(exc)}", status_code=500, media_type=JSON_TYPE)
        out_headers = {
            k: v
            for k, v in response.headers.items()
            if k not in STRIPPED_RESPONSE and not k.startswith("access-control-")
        }
        out_headers.setdefault("content-type", JSON_TYPE)  # as given: no charset added
        if response.status_code in (204, 304) or request.method == "HEAD":
            await response.aclose()
            return Response(status_code=response.status_code, headers=out_headers)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:
                log.warning("proxy_failed", error=str(exc) or type(exc).__name__)
            finally:
                await response.aclose()

        return StreamingResponse(chunks(), status_code=response.status_code, headers=out_headers)
