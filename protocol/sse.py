"""Server-Sent Events framing: ``data: <json>\\n\\n`` per event, ``data: [DONE]`` at the end.

The JSON is UTF-8 as llama-server sends it, except for three characters that many line
readers take for line ends although SSE does not: U+0085, U+2028 and U+2029 (Python's
``str.splitlines``, hence httpx's ``iter_lines``, splits on them). A model that generates one
would cut a ``data:`` line in two for those clients, so they go out as JSON escapes, which
every JSON parser reads back to the same string.
"""

from __future__ import annotations

from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode

DONE = b"data: [DONE]\n\n"
PING = b":\n\n"  # a comment: llama-server's keep-alive while a stream is silent

# UTF-8 of the three, and their JSON escapes. In UTF-8 these byte pairs/triples only ever
# encode these characters, and JSON text outside strings is ASCII: the replace is exact.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def encode(obj: Any) -> bytes:
    """One event's JSON, safe on a single line for any line reader."""
    data = _encode(obj)
    if b"\xc2\x85" in data or b"\xe2\x80" in data:
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    return data


def frame(obj: Any) -> bytes:
    return b"data: " + encode(obj) + b"\n\n"


def named_frame(name: str, obj: Any) -> bytes:
    """``event: <name>`` + ``data: <json>`` (Responses and Anthropic streams)."""
    return b"event: " + name.encode() + b"\ndata: " + encode(obj) + b"\n\n"
