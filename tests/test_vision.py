"""Image input (``--mmproj``) on a real server, against llama-server's recorded answers.

A ``llamactor serve`` process (its engine in a child process, one thread) serves the tiny model
and projector of ``tinyvision.py``. Greedy answers to a chat with an image, a native
/completion with two images and an Anthropic message with an image must equal llama-server's
for the same files and requests: ``tests/golden/llama_server_vision.json``, recorded by
``tests/record_vision_golden.py`` from ``/tmp/llama-server-build/bin/llama-server`` (llama.cpp
as llama-cpp-python 0.3.36 vendors it, with libmtmd): the prompt's token count on any machine,
the generated tokens on a build of the CPU class they were recorded on (they hang on the
kernels' rounding of the tiny model's flat logits). The same image sent again
is served from the cached prefix; a different image at the same place is not. Bad input is a
400 naming it and the server goes on (an image whose header declares too many pixels is
refused before it is decoded); images are decoded in a process of the server's own, whose
death fails the request it was decoding alone; a projector made for another model stops
startup with exit code 2.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinyvision
from conftest import TEST_THREADS, free_port, wait_healthy
from record_vision_golden import IMAGE, OTHER_IMAGE, REQUESTS, answer, data_url
from tinymodel import assert_llama_servers

from llamactor.protocol.errors import ConfigError, RequestError
from llamactor.protocol.media import MediaChunk
from llamactor.runtime import Runtime, RuntimeConfig
from llamactor.runtime.engine.imagesize import check_pixels, image_size
from llamactor.runtime.engine.promptcache import common_prefix, media_floor

LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]
GOLDEN = json.loads((Path(__file__).parent / "golden" / "llama_server_vision.json").read_text())
STARTUP_TIMEOUT_S = 60
N_IMAGE = tinyvision.N_IMAGE_TOKENS
SERVER_PID: list[int] = []  # the module's server process


@pytest.fixture(scope="module")
def vision_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tinyvision.write_tiny_vision(tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="module")
def server(vision_files: tuple[Path, Path]) -> Iterator[str]:
    model, mmproj = vision_files
    port = free_port()
    argv = [*LLAMACTOR, "serve", "-m", str(model), "--mmproj", str(mmproj), "-t", str(TEST_THREADS)]
    argv += ["-np", "2", "-c", "4096", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    SERVER_PID[:] = [proc.pid]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url + "/health", STARTUP_TIMEOUT_S)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _chat(url: str, content: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **fields}
    return _post(url, "/v1/chat/completions", body)


def _image_part(image: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


# ---- what llama-server answers ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(REQUESTS))
def test_greedy_answers_are_llama_servers(server: str, name: str):
    """Chat (image_url part), /completion (prompt_string + multimodal_data) and Anthropic
    (image block): the same text and prompt token count as llama-server (and the same token
    ids on /completion)."""
    path, body = REQUESTS[name]
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    assert_llama_servers(GOLDEN, name, answer(name, r.json()), "tests/record_vision_golden.py")


def test_props_say_vision(server: str):
    props = httpx.get(server + "/props").json()
    assert props["modalities"] == {"vision": True, "video": False, "audio": False}
    assert props["media_marker"] == "<__media__>"


def test_token_counts_count_the_image_positions(server: str):
    """The token counters render and tokenize as a request does: an image counts its positions."""
    _, body = REQUESTS["anthropic"]
    counted = _post(server, "/v1/messages/count_tokens", {"model": "m", "messages": body["messages"]})
    assert counted.status_code == 200, counted.text
    usage = _post(server, "/v1/messages", body).json()["usage"]
    assert counted.json()["input_tokens"] == usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    _, chat = REQUESTS["chat"]
    n = _post(server, "/v1/chat/completions/input_tokens", {"messages": chat["messages"]}).json()
    assert n["input_tokens"] == _post(server, "/v1/chat/completions", chat).json()["usage"]["prompt_tokens"]


# ---- the prompt cache --------------------------------------------------------------------------


def test_the_same_image_again_reuses_the_cached_prefix(server: str):
    """Sent again, the prompt with its image is served from the slot's KV (only the last token
    is decoded again); a different image at the same place is decoded, and what comes after
    it too, never taken for the cached one."""
    image = tinyvision.png_bytes(48, 32, seed=11)
    other = tinyvision.png_bytes(48, 32, seed=12)
    content = [{"type": "text", "text": "Cache me:"}, _image_part(image), {"type": "text", "text": "ok?"}]
    first = _chat(server, content)
    assert first.status_code == 200, first.text
    n_prompt = first.json()["usage"]["prompt_tokens"]
    again = _chat(server, content).json()
    assert again["usage"]["prompt_tokens"] == n_prompt
    assert again["timings"]["prompt_n"] == 1  # everything but the last token came from the cache
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1
    assert again["choices"][0]["message"] == first.json()["choices"][0]["message"]
    swapped = _chat(server, [content[0], _image_part(other), content[2]]).json()
    assert swapped["usage"]["prompt_tokens"] == n_prompt
    assert swapped["timings"]["prompt_n"] >= N_IMAGE + 1  # from the image on: decoded
    # the native API: the same file twice in one prompt and again later, both reused
    prompt = {
        "prompt_string": "A <__media__> B <__media__> C",
        "multimodal_data": [base64.b64encode(image).decode()] * 2,
    }
    one = _post(server, "/completion", {"prompt": prompt, "n_predict": 2, "temperature": 0}).json()
    two = _post(server, "/completion", {"prompt": prompt, "n_predict": 2, "temperature": 0}).json()
    assert one["tokens_evaluated"] == two["tokens_evaluated"] > 2 * N_IMAGE
    assert two["timings"]["prompt_n"] == 1 and two["tokens"] == one["tokens"]


# ---- bad input -----------------------------------------------------------------------------------


def test_bad_image_input_is_a_400_and_the_server_goes_on(server: str):
    png = base64.b64encode(IMAGE).decode()
    cases = [
        (_chat(server, [_image_part(b"this is not an image"), {"type": "text", "text": "?"}]), "not an image"),
        (_chat(server, [{"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}}]), "file:// URLs"),
        (
            _chat(server, [{"type": "image_url", "image_url": {"url": "file://a.png"}}]),
            "not allowed unless --media-path is specified",
        ),
        (_chat(server, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]), "base64"),
        (
            _post(
                server,
                "/completion",
                {"prompt": {"prompt_string": "<__media__> and <__media__>?", "multimodal_data": [png]}},
            ),
            "2 media markers",
        ),
        (
            _post(server, "/completion", {"prompt": {"prompt_string": "none here", "multimodal_data": [png]}}),
            "0 media markers",
        ),
        (
            _post(
                server, "/completion", {"prompt": {"prompt_string": "ends with <__media__>", "multimodal_data": [png]}}
            ),
            "ends with an image",
        ),
        (
            _post(
                server,
                "/v1/messages",
                {
                    "model": "m",
                    "max_tokens": 2,
                    "messages": [
                        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AAAA"}}]}
                    ],
                },
            ),
            "not an image",
        ),
    ]
    for response, says in cases:
        assert response.status_code == 400, response.text
        assert says in response.json()["error"]["message"], response.text
    # a PNG header declaring 30,000 x 30,000 pixels (2.7 GB decoded) in 33 bytes: refused unread
    started = time.perf_counter()
    bomb = _chat(server, [_image_part(_png_header(30000, 30000)), {"type": "text", "text": "?"}])
    assert bomb.status_code == 400, bomb.text
    assert "30000 x 30000 pixels" in bomb.json()["error"]["message"]
    assert time.perf_counter() - started < 1.0
    ok = _chat(
        server, [{"type": "text", "text": "Still there?"}, _image_part(OTHER_IMAGE), {"type": "text", "text": "."}]
    )
    assert ok.status_code == 200, ok.text
    assert httpx.get(server + "/health").json()["status"] == "ok"


def _png_header(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + b"\0\0\0\0"


def _decoders() -> list[int]:
    """The pids of the server's media decoder processes (its child of that name)."""
    server = SERVER_PID[0]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == server and b"llamactor.runtime.service.mediaproc" in cmdline:
            found.append(int(entry.name))
    return found


def test_a_decoder_that_dies_fails_its_request_alone(server: str):
    """Images are decoded in a process of the server's own: when it dies on a file (here it is
    stopped, then killed, while the request waits on it), that request gets a 400, requests
    without media are answered meanwhile, and the next image is decoded by a new one."""
    content = [{"type": "text", "text": "Decode me:"}, _image_part(IMAGE), {"type": "text", "text": "ok?"}]
    before = _chat(server, content)
    assert before.status_code == 200, before.text
    (decoder,) = _decoders()
    os.kill(decoder, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_chat, server, content)
        time.sleep(0.5)
        assert not waiting.done()
        text_only = _chat(server, [{"type": "text", "text": "Anyone there?"}])  # nobody else waits on it
        assert text_only.status_code == 200, text_only.text
        assert httpx.get(server + "/health").json()["status"] == "ok"
        os.kill(decoder, signal.SIGKILL)
        lost = waiting.result(timeout=30)
    assert lost.status_code == 400, lost.text
    assert "ended the decoder" in lost.json()["error"]["message"]
    after = _chat(server, content)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["message"] == before.json()["choices"][0]["message"]
    assert after.json()["usage"]["prompt_tokens"] == before.json()["usage"]["prompt_tokens"]
    assert _decoders() not in ([], [decoder])


async def test_images_without_a_projector_are_refused(make_config):
    async with Runtime.open(make_config()) as rt:
        with pytest.raises(RequestError, match="--mmproj"):
            await rt.chat([{"role": "user", "content": [_image_part(IMAGE)]}], max_tokens=2)
        with pytest.raises(RequestError, match="--mmproj"):
            await rt.complete("Look: <__media__>.", multimodal_data=[IMAGE], max_tokens=2)
        assert (await rt.complete("Hi", max_tokens=2)).n_predicted == 2


def test_a_projector_for_another_model_stops_startup(vision_files: tuple[Path, Path], tmp_path: Path):
    """n_embd 48 against the text model's 64: libmtmd refuses it in the engine process; exit 2."""
    model, _ = vision_files
    wrong = tinyvision.write_tiny_mmproj(tmp_path / "wrong.gguf", projection_dim=48)
    argv = [*LLAMACTOR, "serve", "-m", str(model), "--mmproj", str(wrong), "-t", "1", "--port", str(free_port())]
    done = subprocess.run(argv, capture_output=True, timeout=STARTUP_TIMEOUT_S)
    assert done.returncode == 2, done.stderr.decode()
    assert "mismatch between text model (n_embd = 64) and mmproj (n_embd = 48)" in done.stderr.decode()
    argv = [*LLAMACTOR, "serve", "-m", str(model), "--mmproj", str(tmp_path / "nope.gguf"), "--port", str(free_port())]
    missing = subprocess.run(argv, capture_output=True, timeout=30)
    assert missing.returncode == 2 and "--mmproj: multimodal projector file not found" in missing.stderr.decode()


async def test_image_token_bounds_and_batch_size_reach_libmtmd(vision_files: tuple[Path, Path]):
    """--image-min-tokens, --image-max-tokens and --mtmd-batch-max-tokens as llama-server takes
    them: a fixed-resolution projector keeps its count (and its answer) under them, one image token
    per encoded batch still answers the same; values that cannot be are exit-2 errors naming them."""
    from serveargs import parse_serve

    model, mmproj = vision_files
    given = ["-m", str(model), "--mmproj", str(mmproj), "-t", "1", "-np", "1", "-c", "1024"]
    bounds = ["--image-min-tokens", "4", "--image-max-tokens", "64", "--mtmd-batch-max-tokens", "1"]
    content = [{"type": "text", "text": "What is it?"}, _image_part(IMAGE)]
    answers = []
    for argv in (given, given + bounds):
        cfg = parse_serve(argv).config
        async with Runtime.open(cfg) as rt:
            out = await rt.chat([{"role": "user", "content": content}], max_tokens=4, temperature=0)
            answers.append((out.completion.n_prompt, out.completion.choices[0].tokens))
    assert cfg.image_min_tokens == 4 and cfg.image_max_tokens == 64 and cfg.mtmd_batch_max_tokens == 1
    assert answers[0] == answers[1]
    for bad, why in (
        (["--image-min-tokens", "0"], "--image-min-tokens must be a positive count"),
        (["--image-min-tokens", "9", "--image-max-tokens", "8"], "is below --image-min-tokens"),
        (["--mtmd-batch-max-tokens", "0"], "--mtmd-batch-max-tokens must be >= 1"),
    ):
        with pytest.raises(ConfigError, match=why):
            parse_serve(given + bad).config.validated()


# ---- stand-ins and the prefix rule -----------------------------------------------------------------


async def test_stand_ins_are_one_value_per_image_in_process(vision_files: tuple[Path, Path]):
    """In process (the engine beside admission): each distinct image gets its own stand-in
    token, the same file the same one; an image is served whole from the cache or not at all."""
    model, mmproj = vision_files
    config = RuntimeConfig(model=model, mmproj=mmproj, n_ctx=2048, parallel=1, threads=TEST_THREADS, isolate=False)
    async with Runtime.open(config) as rt:
        assert rt.admission is not None
        a = await rt.admission.admit(rt_request("x <__media__> y <__media__> z", [IMAGE, OTHER_IMAGE]))
        b = await rt.admission.admit(rt_request("x <__media__> y <__media__> z", [OTHER_IMAGE, IMAGE]))
        pa, pb = a.task.prompt, b.task.prompt
        spans = [(m.pos, m.end) for m in a.task.media]
        assert [m.n_pos for m in a.task.media] == [N_IMAGE, N_IMAGE]
        for (start, end), (other, _) in zip(spans, reversed(spans)):
            assert len(set(pa[start:end].tolist())) == 1 and pa[start] < -1
            assert pa[start] == pb[other]  # the same file, the same stand-in
        assert common_prefix(pa, pb) == spans[0][0]  # the prefixes part at the first image
        for admitted in (a, b):
            admitted.task.sink.close()
            admitted.events.close()
        files = [IMAGE, OTHER_IMAGE]
        out = await rt.complete("x <__media__> y <__media__> z", multimodal_data=files, max_tokens=3, temperature=0)
        again = await rt.complete("x <__media__> y <__media__> z", multimodal_data=files, max_tokens=3, temperature=0)
        assert again.choices[0].tokens == out.choices[0].tokens and again.n_cached == len(pa) - 1


def rt_request(prompt: str, files: list[bytes]) -> Any:
    from llamactor.protocol.request import GenerationRequest

    return GenerationRequest(prompt=prompt, multimodal_data=files, max_tokens=2)


def test_a_kept_prefix_never_ends_inside_an_image():
    tokens = np.array([1, 2, -5, -5, -5, 3, -6, -6, -6, -6, 4], dtype=np.int32)
    assert [media_floor(tokens, n) for n in range(len(tokens) + 1)] == [0, 1, 2, 2, 2, 5, 6, 6, 6, 6, 10, 11]
    chunk = MediaChunk(pos=2, n_pos=3, n_tokens=3, data=b"")
    assert chunk.end == 5


def test_image_sizes_are_read_from_the_headers():
    """The pixel cap reads the size each format's header declares, without decoding."""
    assert image_size(tinyvision.png_bytes(48, 32)) == (48, 32)
    assert image_size(_png_header(30000, 30000)) == (30000, 30000)
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0" + bytes(9)
    sof = b"\xff\xc2" + struct.pack(">HBHHB", 11, 8, 600, 800, 1) + bytes(3)  # progressive, 800 x 600
    assert image_size(b"\xff\xd8" + app0 + b"\xff\xff" + sof) == (800, 600)
    assert image_size(b"GIF89a" + struct.pack("<HH", 640, 480) + bytes(4)) == (640, 480)
    bmp = b"BM" + bytes(16) + struct.pack("<ii", 100, -50) + bytes(8)  # a top-down BMP: negative height
    assert image_size(bmp) == (100, 50)
    assert image_size(b"not an image at all") is None
    assert image_size(b"\xff\xd8\xff\xda" + bytes(8)) is None  # a scan before any frame header
    with pytest.raises(RequestError, match="more than the 89,478,485"):
        check_pixels(_png_header(10000, 9000), "image 1 of 1")
    check_pixels(_png_header(9000, 9000), "image 1 of 1")  # 81 million: under the cap
