"""The file of a chat message's ``image_url`` or ``input_audio`` part: base64 or a data URL
decoded here; an http(s):// or file:// URL left, as an ``ImageURL``, to fetch at admission
(``mediafetch``).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from llamactor.protocol.errors import RequestError
from llamactor.runtime.service.mediafetch import ImageURL, named_by_url

AUDIO_FILES = "wav, mp3 or flac"


def image_bytes(image_url: Any, where: str) -> bytes | ImageURL:
    """The file of an ``image_url`` part: a ``data:image/...;base64,`` URL or bare base64;
    an http(s):// or file:// URL is left to fetch at admission (other schemes are refused)."""
    url = image_url.get("url") if isinstance(image_url, Mapping) else image_url
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where}.url is required (a data:image/...;base64, http(s):// or file:// URL)")
    data = url
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
            raise RequestError(f"{where}.url: expected a data:image/<type>;base64, URL, got {head[:40]!r}")
    elif named_by_url(url):
        return ImageURL(url, where)
    elif url.split(":", 1)[0].lower() in ("ftp", "ftps", "sftp"):
        raise RequestError(f"{where}.url: only data:, http(s):// and file:// URLs are read, not {url[:40]!r}")
    return _base64_file(data, f"{where}.url", "image")


def audio_bytes(input_audio: Any, where: str) -> bytes | ImageURL:
    """The file of an ``input_audio`` part: its ``data`` (or ``url``, as llama-server reads
    it), base64 or a ``data:audio/...;base64,`` URL; an http(s):// or file:// URL is left to
    fetch at admission. ``format`` ("wav", "mp3") is not checked: the file's bytes say what it
    is (llama-server does not read it either)."""
    if not isinstance(input_audio, Mapping):
        raise RequestError(f'{where} must be an object: {{"data": <base64 audio>, "format": "wav"|"mp3"}}')
    data = input_audio.get("data", input_audio.get("url"))
    if not isinstance(data, str) or not data:
        raise RequestError(f"{where}.data is required: the audio file ({AUDIO_FILES}) in base64")
    if data.startswith("data:"):
        head, sep, data = data.partition(",")
        if not sep or not head.startswith("data:audio/") or not head.endswith(";base64"):
            raise RequestError(f"{where}.data: expected base64 or a data:audio/<type>;base64, URL, got {head[:40]!r}")
    elif named_by_url(data):
        return ImageURL(data, where)
    return _base64_file(data, f"{where}.data", "audio")


def _base64_file(data: str, where: str, kind: str) -> bytes:
    """A media file given in base64 (whitespace allowed); RequestError naming ``where`` if it is
    not base64 or is empty."""
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: not valid base64") from None
    if not raw:
        raise RequestError(f"{where}: the {kind} is empty")
    return raw
