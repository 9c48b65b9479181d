"""Images named by URL: http(s) fetched by the server, file:// read from --media-path.

A loopback HTTP server started here (never the internet) serves the images of
``record_vision_golden``: an image fetched from 127.0.0.1 gives the same greedy answer as the
same image sent as a data URI, on chat completions, Anthropic Messages (a ``url`` source) and
the Responses API (``input_image``); so does the file under ``--media-path``. A URL that does
not answer in time, one too large, one answering 404, one that is not an image, a file:// path
out of the directory (``..``, a symlink): each a 400 naming it, and the server goes on.
"""

from __future__ import annotations

import http.server
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinyvision
from conftest import TEST_THREADS, free_port, open_server
from record_vision_golden import IMAGE, OTHER_IMAGE, data_url
from serveargs import parse_serve

from llamactor.protocol.errors import ConfigError, RequestError
from llamactor.runtime import RuntimeConfig
from llamactor.runtime.service.mediafetch import ImageURL, MediaFetcher

MAX_BYTES = 20_000  # the test server's limit: IMAGE fits, BIG does not
TIMEOUT_S = 0.5
BIG = b"\x89PNG" + bytes(MAX_BYTES)
SLOW_S = 5.0  # /slow.png answers after this long (or when the test ends)


class _Images(http.server.BaseHTTPRequestHandler):
    release: threading.Event

    def do_GET(self) -> None:
        path = self.path
        if path == "/cat.png":
            self._send(200, IMAGE, "image/png")
        elif path == "/other.png":
            self._send(200, OTHER_IMAGE, "image/png")
        elif path in ("/moved.png", "/elsewhere.png"):  # elsewhere: the same server under another name
            self.send_response(302)
            port = self.server.server_address[1]
            self.send_header("Location", "/cat.png" if path == "/moved.png" else f"http://localhost:{port}/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/slow.png":
            self.release.wait(SLOW_S)
            self._send(200, IMAGE, "image/png")
        elif path == "/big.png":
            self._send(200, BIG, "image/png")
        elif path == "/big-unsized.png":  # no Content-Length: the body ends when the connection does
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(BIG)
        elif path == "/page.html":
            self._send(200, b"<html><body>not a picture</body></html>", "text/html")
        else:
            self._send(404, b"not found", "text/plain")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Quiet(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # /slow.png writes to a client that gave up waiting: expected


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """A loopback HTTP server of test images (a thread per request)."""
    release = threading.Event()
    handler = type("Images", (_Images,), {"release": release})
    server = _Quiet(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def vision_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tinyvision.write_tiny_vision(tmp_path_factory.mktemp("vision"))


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    """--media-path: cat.png and sub/other.png inside; secret.png beside it, a symlink to it inside."""
    media = tmp_path / "media"
    (media / "sub").mkdir(parents=True)
    (media / "cat.png").write_bytes(IMAGE)
    (media / "sub" / "other.png").write_bytes(OTHER_IMAGE)
    (tmp_path / "secret.png").write_bytes(IMAGE)
    os.symlink(tmp_path / "secret.png", media / "out.png")
    os.symlink(media / "cat.png", media / "sub" / "in.png")  # a symlink that stays inside
    return media


def _config(vision_files: tuple[Path, Path], media_dir: Path, **policy: Any) -> RuntimeConfig:
    """The test's images are on loopback: the media egress policy is opened to 127.0.0.1 alone
    (``--allowed-media-domains 127.0.0.1 --allow-private-media-urls``) unless ``policy`` says."""
    model, mmproj = vision_files
    policy = {"allowed_media_domains": ("127.0.0.1",), "allow_private_media_urls": True, **policy}
    return RuntimeConfig(
        **policy,
        model=model,
        mmproj=mmproj,
        n_ctx=2048,
        parallel=1,
        threads=TEST_THREADS,
        isolate=False,
        media_path=media_dir,
        media_fetch_max_bytes=MAX_BYTES,
        media_fetch_timeout_s=TIMEOUT_S,
    )


def _chat_body(url: str) -> dict[str, Any]:
    content = [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "Be brief."},
    ]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}


async def test_an_image_by_url_answers_as_the_same_image_inline(
    vision_files: tuple[Path, Path], media_dir: Path, image_host: str
):
    """http://127.0.0.1 (directly and through a redirect) and file:// under --media-path: the
    same greedy answer and prompt token count as the data URI, on chat completions, the token
    counter, Anthropic Messages (url source) and the Responses API (input_image)."""
    async with (
        open_server(_config(vision_files, media_dir)) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):

        async def chat(image_url: str) -> tuple[Any, int]:
            r = await client.post("/v1/chat/completions", json=_chat_body(image_url))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"], r.json()["usage"]["prompt_tokens"]

        inline = await chat(data_url(IMAGE))
        for by_url in (f"{image_host}/cat.png", f"{image_host}/moved.png", "file://cat.png", "file:///sub/in.png"):
            assert await chat(by_url) == inline, by_url
        assert await chat(data_url(OTHER_IMAGE)) == await chat("file://sub/other.png")
        counted = await client.post("/v1/chat/completions/input_tokens", json=_chat_body(f"{image_host}/cat.png"))
        assert counted.json()["input_tokens"] == inline[1]

        async def anthropic(source: dict[str, Any]) -> Any:
            block = {"type": "image", "source": source}
            message = {"role": "user", "content": [{"type": "text", "text": "Describe:"}, block]}
            body = {"model": "m", "max_tokens": 8, "temperature": 0, "messages": [message]}
            r = await client.post("/v1/messages", json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]  # input_tokens: those not read from the cache
            return r.json()["content"], usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)

        b64 = data_url(IMAGE).partition(",")[2]
        assert await anthropic({"type": "url", "url": f"{image_host}/cat.png"}) == await anthropic(
            {"type": "base64", "media_type": "image/png", "data": b64}
        )

        async def responses(image_url: str) -> Any:
            parts = [
                {"type": "input_text", "text": "What is in this image?"},
                {"type": "input_image", "image_url": image_url, "detail": "auto"},
                {"type": "input_text", "text": "Be brief."},
            ]
            body = {"input": [{"role": "user", "content": parts}], "max_output_tokens": 8, "temperature": 0}
            r = await client.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            return out["output"][-1]["content"][0]["text"], out["usage"]["input_tokens"]

        # the Responses API renders the same messages as chat completions: the same answer
        assert await responses(data_url(IMAGE)) == (inline[0]["content"], inline[1])
        assert await responses(f"{image_host}/cat.png") == (inline[0]["content"], inline[1])


async def test_a_bad_image_url_is_a_400_naming_it_and_the_server_goes_on(
    vision_files: tuple[Path, Path], media_dir: Path, image_host: str
):
    closed = f"http://127.0.0.1:{free_port()}/cat.png"  # nothing listens there
    # every failed download says the same (the reason is logged): a client cannot tell a refused
    # address from a closed port or a 404, so it cannot map the network with it
    failed = "could not be downloaded: its host is not allowed, or it did not answer with a file of at most 20000"
    cases = {
        f"{image_host}/slow.png": failed,
        f"{image_host}/big.png": failed,
        f"{image_host}/big-unsized.png": failed,
        f"{image_host}/missing.png": failed,
        f"{image_host}/elsewhere.png": failed,  # a redirect to a host not allowed
        "http://169.254.169.254/latest/meta-data/": failed,  # link-local stays refused
        f"{image_host}/page.html": "is not an image libmtmd can read",
        closed: failed,
        "file://../secret.png": "file path is not allowed",
        "file://sub/../../secret.png": "file path is not allowed",
        "file://out.png": "leads out of --media-path",
        "file://nope.png": "file does not exist or cannot be opened",
        "file://sub": "file does not exist or cannot be opened",
        "ftp://127.0.0.1/cat.png": "only data:, http(s):// and file:// URLs are read",
    }
    async with (
        open_server(_config(vision_files, media_dir)) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        for image_url, says in cases.items():
            r = await client.post("/v1/chat/completions", json=_chat_body(image_url))
            assert r.status_code == 400, (image_url, r.text)
            message = r.json()["error"]["message"]
            assert says in message and image_url in message and "messages[0].content[1]" in message, message
        parts = [{"type": "input_image", "image_url": f"{image_host}/missing.png"}, {"type": "input_text", "text": "?"}]
        r = await client.post("/v1/responses", json={"input": [{"role": "user", "content": parts}]})
        assert r.status_code == 400 and failed in r.json()["error"]["message"], r.text
        r = await client.post("/v1/responses", json={"input": [{"role": "user", "content": [{"type": "input_image"}]}]})
        assert r.status_code == 400 and "input[0].content[0].image_url is required" in r.text, r.text
        block = {"type": "image", "source": {"type": "url", "url": f"{image_host}/page.html"}}
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [block]}]}
        r = await client.post("/v1/messages", json=body)
        assert r.status_code == 400 and "page.html" in r.json()["error"]["message"], r.text
        ok = await client.post("/v1/chat/completions", json=_chat_body(f"{image_host}/cat.png"))
        assert ok.status_code == 200, ok.text
        props = (await client.get("/props")).json()
        assert props["modalities"] == {"vision": True, "video": False, "audio": False}


async def test_media_urls_under_the_default_egress_policy(
    vision_files: tuple[Path, Path], media_dir: Path, image_host: str
):
    """No --allowed-media-domains, no --allow-private-media-urls: loopback, link-local (cloud
    metadata), private networks and their IPv6 spellings are refused before any connection,
    each within a second, with the one text; and 200 URLs in one request are refused before
    any is fetched."""
    cases = [
        f"{image_host}/cat.png",  # served: refused for its address
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/cat.png",
        "http://[::ffff:127.0.0.1]/cat.png",
        "http://localhost/cat.png",
        "http://0.0.0.0/cat.png",
    ]
    config = _config(vision_files, media_dir, allowed_media_domains=(), allow_private_media_urls=False)
    async with open_server(config) as (_, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
        for image_url in cases:
            started = time.monotonic()
            r = await client.post("/v1/chat/completions", json=_chat_body(image_url))
            assert r.status_code == 400 and "its host is not allowed" in r.json()["error"]["message"], r.text
            assert time.monotonic() - started < 1.0, image_url
        many = [{"type": "image_url", "image_url": {"url": f"{image_host}/cat.png?{i}"}} for i in range(200)]
        body = {"messages": [{"role": "user", "content": many}], "max_tokens": 1}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "names at most 16 media files by URL" in r.json()["error"]["message"], r.text
        ok = await client.post("/v1/chat/completions", json=_chat_body(data_url(IMAGE)))
        assert ok.status_code == 200, ok.text


# ---- the rules, without a model ------------------------------------------------------------------


async def test_file_urls_need_media_path(media_dir: Path):
    """Without --media-path a file:// URL is refused (llama-server's words); with it, a path is
    relative to the directory (a leading / too), and never leaves it."""
    with pytest.raises(RequestError, match="file:// URLs are not allowed unless --media-path is specified"):
        await MediaFetcher().fetch_images([ImageURL("file://cat.png", "x")])
    fetcher = MediaFetcher(media_dir)
    assert await fetcher.fetch_images([b"raw", ImageURL("file:///cat.png", "x")]) == (b"raw", IMAGE)
    for bad in ("file://", "file:///", "file://a/..b.png", "file://out.png"):
        with pytest.raises(RequestError, match="file path is not allowed|leads out"):
            await fetcher.fetch_images([ImageURL(bad, "x")])
    small = MediaFetcher(media_dir, max_bytes=100)
    with pytest.raises(RequestError, match="over the 100 bytes limit"):
        await small.fetch_images([ImageURL("file://cat.png", "x")])


def test_media_path_flag(vision_files: tuple[Path, Path], media_dir: Path):
    """--media-path sets the directory; one that is not a directory stops startup (exit 2)."""
    assert parse_serve(["--media-path", str(media_dir)]).config.media_path == str(media_dir)
    with pytest.raises(ConfigError, match="--media-path: not a directory"):
        RuntimeConfig(model=vision_files[0], media_path=media_dir / "cat.png").validated()
