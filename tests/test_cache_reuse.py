"""Cache reuse (``--cache-reuse N``, the request field ``n_cache_reuse``), through a real server.

A slot holds prompt A = P + X + Y and its continuation. The next prompt drops X (P + Y): past
the common prefix P, the run Y of the slot's cache is moved into place by a KV position shift
instead of being prefilled again, so ``timings.cache_n`` counts it and ``prompt_n`` does not.
A moved run keeps the KV it was computed with (after X), so the continuation is not a cold
run's: it is llama-server's for the same requests (``EXPECTED``, recorded from the llama-server
built from the vendored llama.cpp with ``--cache-reuse 16``, same model and flags).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinyvision
from conftest import free_port, wait_healthy

from llamactor.protocol.request import GenerationRequest
from llamactor.runtime import Runtime, RuntimeConfig

LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]
STARTUP_TIMEOUT_S = 60

P = list(range(40, 80))  # the common prefix
X = list(range(100, 140))  # dropped by the second prompt
Y = list(range(150, 230))  # found again past the prefix
Z = list(range(236, 256))  # inserted after the prefix instead
FIRST = P + X + Y
REMOVED = P + Y
N_PREDICT = 12
# llama-server's continuation of REMOVED after FIRST with --cache-reuse 16 (a cold run's differs)
EXPECTED = [48, 204, 389, 101, 304, 373, 210, 89, 245, 161, 328, 52]
# and of REMOVED + TAIL: new text after the moved run
TAIL = [30, 31, 32]
EXPECTED_TAIL = [452, 183, 73, 19, 373, 210, 89, 245, 161, 91, 101, 304]


@contextmanager
def _serve(tiny_model: Path, *flags: str) -> Iterator[str]:
    port = free_port()
    # one slot, and no host-memory prompt cache (a state it restores would hide what cache reuse did)
    argv = ["-m", str(tiny_model), "-c", "1024", "-np", "1", "-t", "1", "--cache-ram", "0"]
    proc = subprocess.Popen(
        [*LLAMACTOR, "serve", *argv, "--host", "127.0.0.1", "--port", str(port), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url + "/health", STARTUP_TIMEOUT_S)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()


def _complete(url: str, prompt: list[int], **fields: Any) -> tuple[list[int], int, int]:
    """Greedy tokens, ``timings.cache_n`` and ``timings.prompt_n`` of one /completion."""
    body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "top_k": 1, "ignore_eos": True, **fields}
    r = httpx.post(url + "/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["tokens"], out["timings"]["cache_n"], out["timings"]["prompt_n"]


@pytest.mark.slow
def test_a_dropped_chunk_is_reused_not_prefilled(tiny_model: Path):
    """With ``--cache-reuse 16`` the second prompt prefills only its last token (Y is moved into
    place), and continues as llama-server does; without the flag Y is prefilled again and the
    continuation is the cold run's. The request field turns it on and off per request."""
    reused = len(P) + len(Y) - 1  # the last prompt token is always decoded again
    with _serve(tiny_model, "--cache-reuse", "16") as url:
        _complete(url, FIRST)
        tokens, cache_n, prompt_n = _complete(url, REMOVED)
        assert (cache_n, prompt_n) == (reused, 1)
        assert tokens == EXPECTED
        cold, cache_n, _ = _complete(url, REMOVED, cache_prompt=False)
        assert cache_n == 0
        _complete(url, FIRST)
        assert _complete(url, REMOVED, n_cache_reuse=0)[1:] == (len(P), len(Y))
        r = httpx.post(url + "/completion", json={"prompt": REMOVED, "n_cache_reuse": -1}, timeout=60)
        assert r.status_code == 400 and "n_cache_reuse" in r.text
        _complete(url, FIRST)
        assert _complete(url, REMOVED + TAIL) == (EXPECTED_TAIL, len(P) + len(Y), len(TAIL))
        # inserted text: nothing past the prefix continues the new prompt (as in llama-server)
        _complete(url, FIRST)
        assert _complete(url, P + Z + X + Y)[1:] == (len(P), len(Z) + len(X) + len(Y))
    with _serve(tiny_model) as url:
        _complete(url, FIRST)
        tokens, cache_n, prompt_n = _complete(url, REMOVED)
        assert (cache_n, prompt_n) == (len(P), len(Y))
        assert tokens == cold
        _complete(url, FIRST)
        tokens, cache_n, prompt_n = _complete(url, REMOVED, n_cache_reuse=16)
        assert (cache_n, prompt_n, tokens) == (reused, 1, EXPECTED)
        # a run shorter than N is not taken
        _complete(url, FIRST)
        assert _complete(url, REMOVED, n_cache_reuse=len(Y))[1] == len(P)


@pytest.mark.slow
def test_bad_cache_reuse_exits_2(tiny_model: Path):
    for value, message in (("abc", "invalid int value"), ("-1", "--cache-reuse must be >= 0")):
        proc = subprocess.run(
            [*LLAMACTOR, "serve", "-m", str(tiny_model), "--cache-reuse", value],
            capture_output=True,
            timeout=60,
            env={**os.environ},
        )
        assert proc.returncode == 2, proc.stderr.decode()
        assert message in proc.stderr.decode(), proc.stderr.decode()


async def test_cells_shared_with_another_slot_stay_in_place(make_config):
    """With a unified KV the n = 2 choices of a request share their prompt's cells. Cache reuse
    on one of their slots moves none of them (that would move them for the other slot too): the
    other slot then continues its prompt as before. Cells of its own are moved as usual."""
    cfg = make_config(parallel=2, n_ctx=1024, kv_unified=True, cache_ram_mib=0, cache_reuse=16)
    greedy: dict[str, Any] = {"max_tokens": N_PREDICT, "temperature": 0, "ignore_eos": True}
    async with Runtime.open(cfg) as rt:
        first = await rt.complete(FIRST, n=2, **greedy)
        assert first.choices[0].tokens == first.choices[1].tokens
        second = await rt.complete(REMOVED, id_slot=0, **greedy)
        assert second.n_cached == len(P)
        again = await rt.complete(FIRST, id_slot=1, **greedy)
        assert again.n_cached == len(FIRST) - 1 and again.choices[0].tokens == first.choices[0].tokens
        # once slot 1 holds something else, slot 0's cells are its own again and are moved
        await rt.complete([7] * 64, id_slot=1, **greedy)
        await rt.complete(FIRST, id_slot=0, **greedy)
        assert (await rt.complete(REMOVED, id_slot=0, **greedy)).n_cached == len(P) + len(Y) - 1


async def test_runs_around_images_are_text_only(tmp_path: Path):
    """With ``--mmproj`` (where llama-server turns cache reuse off) the text between images is
    reused; an image is never part of a moved run: one removed with its text goes, one the new
    prompt has where the slot's cache differs is decoded again, at its new place."""
    model, mmproj = tinyvision.write_tiny_vision(tmp_path)
    image = tinyvision.png_bytes(48, 32, seed=11)
    p = " ".join(f"p{i}" for i in range(12))
    x = " " + " ".join(f"x{i}" for i in range(12))
    y = " " + " ".join(f"y{i}" for i in range(16))
    t = " tail words"
    cfg = RuntimeConfig(
        model=model, mmproj=mmproj, n_ctx=2048, parallel=1, threads=1, isolate=False, cache_ram_mib=0, cache_reuse=16
    )
    async with Runtime.open(cfg) as rt:

        async def run(prompt: str, n_images: int) -> tuple[int, list[int], tuple[int, ...]]:
            """``n_cached``, the prompt's tokens and the continuation of one request."""
            files = [image] * n_images
            assert rt.admission is not None
            admitted = await rt.admission.admit(GenerationRequest(prompt=prompt, multimodal_data=files, max_tokens=2))
            tokens = admitted.task.prompt.tolist()
            admitted.task.sink.close()
            admitted.events.close()
            out = await rt.complete(prompt, multimodal_data=files, max_tokens=4, temperature=0, ignore_eos=True)
            return out.n_cached, tokens, out.choices[0].tokens

        def image_at(tokens: list[int]) -> int:
            return next(i for i, tok in enumerate(tokens) if tok < 0)

        # the image in the prefix: the run after it is moved
        await run(p + " <__media__>" + x + y, 1)
        n_cached, tokens, _ = await run(p + " <__media__>" + y, 1)
        assert n_cached == len(tokens) - 1
        # the image in the removed part goes with it
        await run(p + x + " <__media__>" + y, 1)
        n_cached, tokens, _ = await run(p + y, 0)
        assert n_cached == len(tokens) - 1
        # the image where the new prompt parts from the cache: decoded again, nothing moved
        await run(p + x + " <__media__>" + y, 1)
        n_cached, tokens, _ = await run(p + " <__media__>" + y, 1)
        assert n_cached == image_at(tokens)
        # a run stops before an image: the image is decoded again at its new place, then the text
        await run(p + x + y + " <__media__>" + t, 1)
        n_cached, tokens, out = await run(p + y + " <__media__>" + t, 1)
        assert n_cached == image_at(tokens) and n_cached > len(p.split()) + 16 and len(out) == 4
