"""Server-Sent Events framing: ``data: <json>\\n\\n`` per event, ``data: [DONE]`` at the end."""

from __future__ import annotations

from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode

DONE = b"data: [DONE]\n\n"
PING = b":\n\n"  # a comment: llama-server's keep-alive while a stream is silent (API-14)


def frame(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"

