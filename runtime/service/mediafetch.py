"""Images named by URL: fetched over HTTP(S), or read from the ``--media-path`` directory.

An ``image_url`` part (an Anthropic ``url`` image source, a Responses ``input_image``) may
name its image instead of carrying it, as llama-server's ``handle_media`` takes them:

- ``http://`` and ``https://``: fetched by the server under the egress policy
  (``runtime.service.egress``: by default never from loopback, private or link-local
  addresses, checked on the address it connects to, on every redirect; ``--allowed-media-domains``
  narrows the hosts, ``--allow-private-media-urls`` lets private addresses through), at most
  ``max_bytes`` (llama-server: 10 MiB) within ``timeout_s`` (llama-server: 10 s), at most
  ``egress.MAX_REDIRECTS`` redirects. A host the policy refuses, anything but a 2xx answer, a body
  over the limit, an answer not whole in time: a 400 naming the URL, with one text for all of
  them (the reason goes to the log): a client cannot tell a refused address from a closed
  port, a filtered one or a server that answered 404, so it cannot scan with it.
- ``file://<path>``: the file at ``<path>`` under ``--media-path`` (a leading ``/`` is
  relative to it too, as there). Without ``--media-path`` refused, as there. A path with
  ``..``, or one that leads out of the directory through a symlink (llama-server does not
  look at symlinks), is a 400; so is a file over ``max_bytes`` (llama-server reads any size).

Rendering a chat (``chatprepare``) runs on the event loop and does no I/O: it leaves an
``ImageURL`` where such an image goes, and admission fetches them all with ``fetch_images``,
before tokenizing, in the API process (the engine gets the bytes, as for a data URL). A
request naming more than ``MAX_MEDIA_URLS`` files by URL is a 400 before anything is fetched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import structlog

from llamactor.protocol.errors import RequestError
from llamactor.runtime.service.egress import EgressPolicy, EgressRefused, tls_context

log = structlog.get_logger("llamactor.media")

MEDIA_FETCH_MAX_BYTES = 10 * 1024 * 1024  # llama-server's limit on a downloaded image
MEDIA_FETCH_TIMEOUT_S = 10.0  # llama-server's (its read timeout; here the whole fetch)
# files one request may name by URL (http(s) or file://): each is fetched in turn, up to
# MEDIA_FETCH_TIMEOUT_S each, so this bounds how long one request keeps the server fetching
MAX_MEDIA_URLS = 16
HTTP_SCHEMES = ("http://", "https://")
FILE_SCHEME = "file://"


@dataclass(frozen=True)
class ImageURL:
    """An image a request names by URL; fetched at admission. ``where``: the request field."""

    url: str
    where: str

    @property
    def is_file(self) -> bool:
        return self.url[: len(FILE_SCHEME)].lower() == FILE_SCHEME


def named_by_url(url: str) -> bool:
    """An http(s):// or file:// URL (fetched), not the image's data."""
    head = url[:8].lower()
    return head.startswith(HTTP_SCHEMES) or head.startswith(FILE_SCHEME)


@dataclass(frozen=True)
class MediaFetcher:
    """How images named by URL are fetched: the server's ``--media-path``, the limits and the
    egress policy (``--allowed-media-domains``, ``--allow-private-media-urls``)."""

    media_path: Path | None = None
    max_bytes: int = MEDIA_FETCH_MAX_BYTES
    timeout_s: float = MEDIA_FETCH_TIMEOUT_S
    policy: EgressPolicy = EgressPolicy()

    async def fetch_images(self, media: Sequence[bytes | ImageURL]) -> tuple[bytes, ...]:
        """Every image's file, in order: bytes as given, URLs fetched (one at a time, as
        llama-server). Called once per request that names an image by URL."""
        named = [m for m in media if isinstance(m, ImageURL)]
        if not named:
            return tuple(m for m in media if isinstance(m, bytes))
        if len(named) > MAX_MEDIA_URLS:
            raise RequestError(
                f"{named[MAX_MEDIA_URLS].where}.url: a request names at most {MAX_MEDIA_URLS} media files by URL "
                f"(this one names {len(named)}); send the others inline as data URLs"
            )
        out: list[bytes] = []
        client: httpx.AsyncClient | None = None
        try:
            for m in media:
                if isinstance(m, bytes):
                    out.append(m)
                elif m.is_file:
                    out.append(await self._read_file(m))
                else:
                    if client is None:
                        # no proxy from the environment: llama-server's client uses none either
                        client = httpx.AsyncClient(
                            verify=await tls_context(), trust_env=False, follow_redirects=False, timeout=self.timeout_s
                        )
                    out.append(await self._download(client, m))
        finally:
            if client is not None:
                await client.aclose()
        return tuple(out)

    async def _download(self, client: httpx.AsyncClient, ref: ImageURL) -> bytes:
        # one text for every failure, whatever it was (the reason goes to the log only)
        failed = RequestError(
            f"{ref.where}.url: image URL {ref.url} could not be downloaded: its host is not allowed, or it did not "
            f"answer with a file of at most {_size(self.max_bytes)} within {self.timeout_s:g} s"
        )
        body = bytearray()
        try:
            with anyio.fail_after(self.timeout_s):
                response = await self.policy.send(client, "GET", ref.url)
                try:
                    if not 200 <= response.status_code < 300:
                        raise EgressRefused(f"answered HTTP {response.status_code}")
                    length = response.headers.get("content-length", "")
                    if length.isdigit() and int(length) > self.max_bytes:
                        raise EgressRefused(f"is {_size(int(length))}, over the {_size(self.max_bytes)} limit")
                    async for piece in response.aiter_bytes():
                        body += piece
                        if len(body) > self.max_bytes:
                            raise EgressRefused(f"sends more than the {_size(self.max_bytes)} limit")
                finally:
                    await response.aclose()
            if not body:
                raise EgressRefused("answered with no content")
        except TimeoutError:
            log.info("media_fetch_failed", url=ref.url, reason=f"not downloaded within {self.timeout_s:g} s")
            raise failed from None
        except EgressRefused as exc:
            log.info("media_fetch_failed", url=ref.url, reason=str(exc))
            raise failed from None
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
            log.info("media_fetch_failed", url=ref.url, reason=str(exc) or type(exc).__name__)
            raise failed from None
        return bytes(body)

    async def _read_file(self, ref: ImageURL) -> bytes:
        rel = ref.url[len(FILE_SCHEME) :]
        at = f"{ref.where}.url: {ref.url}"
        if self.media_path is None:
            raise RequestError(f"{at}: file:// URLs are not allowed unless --media-path is specified")
        if not rel.strip("/") or ".." in rel or "\x00" in rel:
            raise RequestError(f"{at}: file path is not allowed: {rel!r} (a path inside --media-path, without '..')")
        return await anyio.to_thread.run_sync(self._read_inside, rel, at)

    def _read_inside(self, rel: str, at: str) -> bytes:
        assert self.media_path is not None
        try:
            base = self.media_path.resolve(strict=True)
            target = (base / rel.lstrip("/")).resolve()
        except (OSError, RuntimeError) as exc:  # a symlink loop
            raise RequestError(f"{at}: file path is not allowed: {rel!r} ({exc})") from None
        if not target.is_relative_to(base):
            raise RequestError(f"{at}: file path is not allowed: {rel!r} leads out of --media-path")
        try:
            with open(target, "rb") as f:
                data = f.read(self.max_bytes + 1)
        except OSError:
            raise RequestError(f"{at}: file does not exist or cannot be opened: {rel!r}") from None
        if len(data) > self.max_bytes:
            raise RequestError(f"{at}: the file is over the {_size(self.max_bytes)} limit")
        if not data:
            raise RequestError(f"{at}: the file is empty")
        return data


def _size(n: int) -> str:
    return f"{n / (1024 * 1024):g} MiB" if n >= 1024 * 1024 else f"{n} bytes"


__all__ = [
    "MAX_MEDIA_URLS",
    "MEDIA_FETCH_MAX_BYTES",
    "MEDIA_FETCH_TIMEOUT_S",
    "ImageURL",
    "MediaFetcher",
    "named_by_url",
]
