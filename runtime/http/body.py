"""The one reader of request bodies: every route reads its body through ``read_body`` (a JSON
one through ``decode_body``); ``json_response`` answers in JSON.

A body is read as it arrives, and the read stops at ``MAX_BODY_BYTES`` (a declared
``Content-Length`` over it stops before a byte is read): whatever a route does with a body, no
client makes the server hold more than the limit of it. Past the limit, ``BodyTooLarge`` (413).
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from llamactor.protocol.errors import RequestError
from llamactor.runtime.http.errors import BodyTooLarge
from llamactor.runtime.service.config import MAX_BODY_BYTES


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    return bytes(await read_body_buffer(request, limit))


async def read_body_buffer(request: Request, limit: int) -> bytearray:
    """The body as it arrives, appended chunk by chunk (a large body is never copied whole on
    the event loop: an imported slot's state reaches its thread as this buffer)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        body += chunk
    return body


async def decode_body(request: Request, type_: type) -> Any:
    """The body as ``type_`` (msgspec's JSON decoding names the field that does not fit)."""
    body = await read_body(request)
    if not body:
        raise RequestError("the request body is empty; a JSON object is expected")
    return msgspec.json.decode(body, type=type_)


_encode = msgspec.json.Encoder().encode


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_encode(obj), status_code=status, media_type="application/json")


__all__ = ["decode_body", "json_response", "read_body"]
