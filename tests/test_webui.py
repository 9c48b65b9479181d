"""The built-in page (chat playground, live view) in a real browser, and its /live stream.

The browser is the system's chromium (/usr/bin/chromium, installed by .ci/run) driven by
Playwright's Python package; no browser is downloaded. If chromium cannot start, these tests
fail with the reason: they never skip. A failing browser test saves a screenshot under its
pytest tmp dir (``screenshots/``) and names the file in the assertion message.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from conftest import free_port, open_server, serve_runtime, wait_until
from faults import Faults

from llamactor.protocol.events import Token
from llamactor.protocol.live import LiveGroup, LiveHistogram, LiveSnapshot
from llamactor.runtime import Runtime
from llamactor.runtime.http.live import LiveFeed, LiveFrame
from llamactor.runtime.service.core import RuntimeCore

pytestmark = pytest.mark.slow  # a headless browser per test

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
UI_TIMEOUT_MS = 30_000  # the CPU is shared: generous, and every wait is on a condition
KEY = "test-key-123"
ROOT = Path(__file__).resolve().parent.parent


# ---- the browser -------------------------------------------------------------------------------


@asynccontextmanager
async def browser_page(base_url: str, tmp_path: Path, name: str) -> AsyncIterator[Any]:
    """A chromium page; on any failure inside, a screenshot is saved and named in the error.

    Also fails the test if the page raised a JavaScript error or asked for anything outside
    the server (the page must need no CDN and no other origin).
    """
    try:
        from playwright.async_api import async_playwright
    except ImportError as exc:
        pytest.fail(f"playwright is not installed ({exc}): pip install -e '.[test]'")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"chromium is not installed at {CHROMIUM}: apt-get install -y chromium (.ci/run does it)")
    async with async_playwright() as pw:
        try:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        except Exception as exc:
            pytest.fail(f"chromium ({CHROMIUM}) could not start: {exc}")
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(UI_TIMEOUT_MS)
            js_errors: list[str] = []
            foreign: list[str] = []
            page.on("pageerror", lambda err: js_errors.append(str(err)))
            page.on("request", lambda req: None if req.url.startswith((base_url, "data:")) else foreign.append(req.url))
            try:
                yield page
                assert not js_errors, f"JavaScript errors on the page: {js_errors}"
                assert not foreign, f"the page requested other origins: {foreign}"
            except (Exception, pytest.fail.Exception) as exc:
                shot = tmp_path / "screenshots" / f"{name}.png"
                shot.parent.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(shot), full_page=True)
                raise AssertionError(f"{exc}\n(screenshot of the page: {shot})") from exc
        finally:
            await browser.close()


async def expect_ok(locator: Any, **checks: Any) -> None:
    from playwright.async_api import expect

    for check, value in checks.items():
        # to_be_visible=True: no argument; to_have_attribute=(name, value): two
        args = () if value is True else value if isinstance(value, tuple) else (value,)
        await getattr(expect(locator), check)(*args, timeout=UI_TIMEOUT_MS)


async def send_chat(page: Any, text: str, *, max_tokens: int = 16, extra: str = '{"ignore_eos": true}') -> Any:
    """Type a message with greedy settings; returns the locator of the finished reply."""
    await page.fill("#s-temperature", "0")
    await page.fill("#s-max_tokens", str(max_tokens))
    await page.fill("#s-extra", extra)
    before = await page.locator(".msg.assistant").count()
    await page.fill("#input", text)
    await page.press("#input", "Enter")
    reply = page.locator(".msg.assistant").nth(before)
    await expect_ok(reply, to_have_attribute=("data-finish", _any_value()))
    return reply


def _any_value() -> Any:
    return re.compile(r".+")


@asynccontextmanager
async def held(hold: threading.Event) -> AsyncIterator[None]:
    """Release held decode steps however the block ends, before the runtime closes (a step
    waiting on the event would keep its group, and so the runtime's shutdown, waiting)."""
    try:
        yield
    finally:
        hold.set()


async def test_a_browser_that_cannot_start_fails_with_its_reason(tmp_path: Path, monkeypatch) -> None:
    """The browser tests fail, never skip, when chromium cannot start, and say why."""
    broken = tmp_path / "chromium"
    broken.write_text("#!/bin/sh\necho 'no display for you' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setitem(globals(), "CHROMIUM", str(broken))
    with pytest.raises(pytest.fail.Exception, match="could not start"):
        async with browser_page("http://127.0.0.1:9", tmp_path, "never"):
            pass


# ---- chat -------------------------------------------------------------------------------------


async def test_chat_streams_a_reply(make_config, tmp_path: Path) -> None:
    """The chat page shows /props and streams a reply over /v1/chat/completions SSE; the
    reply equals the server's greedy answer to the same messages, with its token count and speed."""
    async with open_server(make_config(parallel=2)) as (rt, url):
        async with browser_page(url, tmp_path, "chat") as page:
            await page.goto(url + "/")
            await expect_ok(page.locator("#server-info"), to_contain_text="2 slots")
            await expect_ok(page.locator("#props"), to_contain_text="tiny.gguf")
            await expect_ok(page.locator("#props"), to_contain_text="device CPU")  # the engine's devices, memory
            await page.fill("#system", "You are terse.")
            reply = await send_chat(page, "Hello there", max_tokens=24)
            assert await reply.get_attribute("data-finish") == "length"
            assert await reply.get_attribute("data-tokens") == "24"
            assert int(await reply.get_attribute("data-chunks")) > 1  # it streamed, not one body
            stats = await reply.locator(".stats").text_content()
            assert "24 tokens" in stats and "tok/s" in stats and "first token" in stats, stats
            shown = await reply.locator(".text").text_content()
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "messages": [
                        {"role": "system", "content": "You are terse."},
                        {"role": "user", "content": "Hello there"},
                    ],
                    "temperature": 0,
                    "max_tokens": 24,
                    "ignore_eos": True,
                },
            )
        assert r.status_code == 200, r.text
        assert shown == r.json()["choices"][0]["message"]["content"]


async def test_chat_stop_cancels_the_request(make_config, tmp_path: Path) -> None:
    """Stop aborts the stream; the server cancels the request and frees its slot."""
    faults = Faults()
    hold = faults.hold = threading.Event()  # decode steps wait: the request is in flight until we say so
    async with open_server(make_config(parallel=2), hooks=faults) as (rt, url), held(hold):
        async with browser_page(url, tmp_path, "chat-stop") as page:
            await page.goto(url + "/")
            await page.fill("#s-extra", '{"ignore_eos": true}')
            await page.fill("#input", "Tell me everything")
            await page.click("#send")
            await wait_until(lambda: any(s.busy for s in rt.engine.slot_states()), timeout_s=30)
            await expect_ok(page.locator("#stop"), to_be_enabled=True)
            await page.click("#stop")
            reply = page.locator(".msg.assistant").first
            await expect_ok(reply, to_have_attribute=("data-finish", "stopped"))
            await expect_ok(reply.locator(".stats"), to_contain_text="stopped")
            hold.set()
            await wait_until(lambda: not any(s.busy for s in rt.engine.slot_states()), timeout_s=30)
            await expect_ok(page.locator("#send"), to_be_enabled=True)


# ---- live view -----------------------------------------------------------------------------------


async def test_live_view_shows_groups_slots_and_state_changes(make_config, tmp_path: Path) -> None:
    """2 groups x 2 slots are drawn; a held request's slot goes idle -> prefill ->
    generate (with its token count) -> idle, and the policy, queue and rates are shown."""
    faults = Faults()
    hold = faults.hold = threading.Event()
    config = make_config(parallel=4, pipeline_groups=2)
    async with open_server(config, hooks=faults) as (rt, url), held(hold):
        async with browser_page(url, tmp_path, "live") as page:
            await page.goto(url + "/#live")
            await expect_ok(page.locator("#groups .group"), to_have_count=2)
            for g in (0, 1):
                await expect_ok(page.locator(f'.group[data-group="{g}"] .slot'), to_have_count=2)
            await expect_ok(page.locator('.slot[data-state="idle"]'), to_have_count=4)
            await expect_ok(page.locator('[data-figure="scheduler"]'), to_contain_text="slo")
            await expect_ok(page.locator('[data-figure="queue"]'), to_contain_text="0 / 256")
            await expect_ok(page.locator("#live-status"), to_have_text="live")

            # one decode step per hold.set(): each step clears the hold again when it is done
            faults.on_step = lambda group, result: hold.clear()
            handle = await rt.submit("a prompt for the live view", max_tokens=6, ignore_eos=True, temperature=0)
            busy = page.locator('.slot[data-state="prefill"]')
            await expect_ok(busy, to_have_count=1)  # its prefill step is held
            await expect_ok(busy, to_contain_text="age")
            hold.set()  # the prefill step runs; the next (generation) step is held
            gen = page.locator('.slot[data-state="generate"]')
            await expect_ok(gen, to_have_count=1)
            await expect_ok(gen, to_have_attribute=("data-decoded", _any_value()))
            assert int(await gen.get_attribute("data-decoded")) >= 1
            faults.on_step = None
            hold.set()
            async with handle:
                async for _ in handle:
                    pass
            await expect_ok(page.locator('.slot[data-state="idle"]'), to_have_count=4)
            await expect_ok(page.locator("#ttft-note"), to_contain_text="1 in the last")


async def test_live_view_shows_a_group_that_is_down(make_config, tmp_path: Path) -> None:
    """A group past its restart limit is drawn as down, its slots too; the other serves on.
    The same through the embedding API (``rt.live_snapshot()``) and through /live."""
    faults = Faults()
    faults.decode_groups = {1}
    async with open_server(make_config(parallel=4, pipeline_groups=2, max_restarts=0), hooks=faults) as (rt, url):
        faults.fail_decode = 1
        with pytest.raises(Exception, match="injected decode failure"):
            await rt.complete("boom", max_tokens=4, id_slot=2, temperature=0)
        await wait_until(lambda: 1 in rt.engine.supervisor.snapshot().groups_down)
        snap = rt.live_snapshot()
        assert not snap.healthy and [g.up for g in snap.groups] == [True, False]
        assert [s.state for s in snap.groups[1].slots] == ["down", "down"]
        frame = await read_frames(url, 1)
        assert [g["up"] for g in frame[0]["snapshot"]["groups"]] == [True, False]
        async with browser_page(url, tmp_path, "live-down") as page:
            await page.goto(url + "/#live")
            await expect_ok(page.locator('.group[data-up="false"] .slot[data-state="down"]'), to_have_count=2)
            await expect_ok(page.locator('.group[data-up="true"] .slot[data-state="idle"]'), to_have_count=2)
            await expect_ok(page.locator('[data-figure="state"]'), to_contain_text="unhealthy")
            await expect_ok(page.locator('[data-figure="restarts"]'), to_contain_text="1 down")


# ---- API key ----------------------------------------------------------------------------------------


async def test_api_key_page_asks_for_the_key(make_config, tmp_path: Path) -> None:
    """With --api-key the page loads (it is public, as llama-server's), says clearly
    that a key is needed, refuses a wrong one, and works (props, live view, chat) with the right
    one. /live needs the key like every API path."""
    async with open_server(make_config(parallel=2, api_key=KEY)) as (rt, url):
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/")).status_code == 200
            assert (await client.get("/webui/app.js")).status_code == 200
            assert (await client.get("/live")).status_code == 401
            async with client.stream("GET", "/live", headers={"Authorization": f"Bearer {KEY}"}) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async with browser_page(url, tmp_path, "api-key") as page:
            await page.goto(url + "/#live")
            await expect_ok(page.locator("#banner"), to_be_visible=True)
            await expect_ok(page.locator("#banner"), to_contain_text="invalid or missing API key")
            await expect_ok(page.locator("#key-form"), to_be_visible=True)
            await expect_ok(page.locator("#live-status"), to_contain_text="401")
            await expect_ok(page.locator("#server-info"), to_have_text="API key needed")

            await page.fill("#key-input", "wrong")
            await page.click('#key-form button[type="submit"]')
            await expect_ok(page.locator("#key-message"), to_contain_text="refused")
            await expect_ok(page.locator("#banner"), to_be_visible=True)

            await page.fill("#key-input", KEY)
            await page.click('#key-form button[type="submit"]')
            await expect_ok(page.locator("#banner"), to_be_hidden=True)
            await expect_ok(page.locator("#groups .slot"), to_have_count=2)
            await expect_ok(page.locator("#server-info"), to_contain_text="2 slots")
            await page.click("#tab-chat")
            reply = await send_chat(page, "Hi", max_tokens=8)
            assert await reply.get_attribute("data-tokens") == "8"


# ---- --no-webui, the stream itself, packaging ----------------------------------------------------------


async def test_no_webui_turns_the_page_off(make_config) -> None:
    """``webui=False`` (``--no-webui``) answers 404 on / and the assets, as llama-server;
    the API, /live included, stays."""
    async with open_server(make_config(parallel=2, webui=False)) as (rt, url):
        async with httpx.AsyncClient(base_url=url) as client:
            for path in ("/", "/index.html", "/webui/app.js", "/webui/app.css"):
                r = await client.get(path)
                assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", path
            assert (await client.get("/props")).status_code == 200
        assert len(await read_frames(url, 1)) == 1
    async with open_server(make_config(parallel=2)) as (rt, url), httpx.AsyncClient(base_url=url) as client:
        r = await client.get("/")
        assert r.status_code == 200 and "<title>llamactor</title>" in r.text
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert (await client.get("/webui/index.html")).status_code == 404
        assert (await client.get("/webui/../pyproject.toml")).status_code == 404


def test_serve_no_webui_flag(tiny_model: Path) -> None:
    """``llamactor serve --no-webui`` as a user runs it: / is a 404, the API answers."""
    from test_cli import _wait_ready, serve_argv

    port = free_port()
    proc = subprocess.Popen(
        serve_argv(tiny_model, port, "1", "512", "--no-webui"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        assert httpx.get(url + "/").status_code == 404
        assert httpx.get(url + "/props").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)


async def read_frames(url: str, n: int, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    frames = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async with client.stream("GET", "/live", headers=headers) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    frames.append(json.loads(line[6:]))
                    if len(frames) == n:
                        break
    return frames


async def test_live_stream_takes_one_snapshot_per_tick_for_all_clients(make_config) -> None:
    """Three clients of /live share one snapshot per tick (not one per client), and
    get the same frames; no client connected, no snapshot taken."""
    async with Runtime.open(make_config(parallel=4, pipeline_groups=2)) as rt:
        calls = 0
        real = rt.read_live

        async def counted() -> LiveSnapshot:
            nonlocal calls
            calls += 1
            return await real()

        rt.read_live = counted  # type: ignore[method-assign]
        async with serve_runtime(rt) as url:
            await anyio.sleep(0.5)
            assert calls == 0  # nobody watches: nothing ticks
            got: list[list[dict[str, Any]]] = [[], [], []]

            async def client(i: int) -> None:
                got[i] = await read_frames(url, 8)

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(client, i)
        per_client = [len(frames) for frames in got]
        assert per_client == [8, 8, 8]
        assert calls <= 8 + 3, f"{calls} snapshots for 3 clients x 8 frames: one per client?"
        stamps = [{f["snapshot"]["at"] for f in frames} for frames in got]
        assert len(stamps[0] & stamps[1] & stamps[2]) >= 5  # the same ticks reached every client
        frame = got[0][-1]
        assert [len(g["slots"]) for g in frame["snapshot"]["groups"]] == [2, 2]
        assert frame["clients"] >= 1 and frame["tick_s"] > 0


async def test_live_feed_survives_its_producer_leaving() -> None:
    """The client that happens to produce a tick may leave mid-tick; the others go on."""
    seq = 0

    async def snapshot() -> LiveSnapshot:
        nonlocal seq
        seq += 1
        return _snapshot(at=float(seq), predicted=10 * seq)

    feed = LiveFeed(snapshot, tick_s=0.01)
    seen: list[bytes] = []

    async def reader(limit: int) -> None:
        async for frame in feed.frames():
            seen.append(frame)
            if len(seen) >= limit:
                return

    async with anyio.create_task_group() as tg:
        with anyio.move_on_after(0.025):
            await reader(10_000)  # the first client: produces, then is cancelled mid-sleep
        tg.start_soon(reader, len(seen) + 5)
    assert feed.clients == 0
    assert feed.ticks >= 5 and len(seen) >= 5


def _snapshot(at: float, predicted: int, prompt: int = 0, ttft: tuple[int, ...] = (0, 0, 0)) -> LiveSnapshot:
    group = LiveGroup(
        id=0,
        up=True,
        restarts=0,
        phase="none",
        cohort=0,
        waiting=0,
        tokens_predicted=predicted,
        prompt_tokens=prompt,
        n_decode=0,
        requests_failed=0,
        slots=(),
    )
    hist = LiveHistogram(bounds_s=(0.1, 1.0), counts=ttft, sum_s=0.0)
    return LiveSnapshot(
        at=at,
        state="ready",
        healthy=True,
        model="m",
        scheduler="s",
        uptime_s=at,
        queue_depth=0,
        queue_size=8,
        groups=(group,),
        ttft=hist,
        inter_token=None,
    )


def test_live_history_rates_series_and_recent_histograms() -> None:
    """Rates from cumulative counters (tok/s over the last seconds), one series point a
    second, and histograms of the last minute only."""
    from llamactor.runtime.http.live import History

    h = History()
    frame: LiveFrame | None = None
    for i in range(121):  # two minutes at 1 Hz: 50 tok/s generated, 200 prompt tok/s
        t = float(i)
        ttft = (i, 0, 0) if i <= 30 else (30, i - 30, 0)  # fast TTFTs in the first 30 s, slow after
        frame = h.add(_snapshot(at=1000 + t, predicted=50 * i, prompt=200 * i, ttft=ttft), t, clients=1, tick_s=1.0)
    assert frame is not None
    assert frame.rates.tok_s == pytest.approx(50) and frame.rates.prompt_tok_s == pytest.approx(200)
    assert frame.group_rates[0].tok_s == pytest.approx(50)
    assert len(frame.series.at) == 120 and set(frame.series.tok_s) == {50.0}
    assert frame.recent.window_s == pytest.approx(60) and frame.recent.ttft == [0, 60, 0]
    assert frame.snapshot.ttft is not None and frame.snapshot.ttft.counts == (30, 90, 0)
    assert msgspec.json.decode(msgspec.json.encode(frame))["rates"]["tok_s"] == pytest.approx(50)


def test_live_snapshot_before_open(make_config) -> None:
    """A runtime that is not serving reports its state and no groups (no exception)."""
    snap = RuntimeCore(make_config()).live_snapshot()
    assert (snap.state, snap.groups, snap.healthy) == ("created", (), False)


def test_package_data_ships_the_page(tmp_path: Path) -> None:
    """The page's files are package data (pyproject), so a non-editable install has them:
    setuptools' build step, run on a clean copy of the sources, puts them into the package."""
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "protocol", "runtime", "actors", "ops"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    out = tmp_path / "build"
    r = subprocess.run(
        [sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py", "--build-lib", str(out)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("index.html", "app.css", "app.js"):
        built = out / "llamactor" / "runtime" / "http" / "webui" / name
        assert built.is_file() and built.read_bytes() == (ROOT / "runtime" / "http" / "webui" / name).read_bytes()


def test_live_rates_come_from_the_snapshots_own_times() -> None:
    """A snapshot read late (its counters as they were a while ago) followed by a fresh one
    gives the real rate, not the tokens of the whole delay over one tick; the same snapshot
    twice adds nothing."""
    from llamactor.runtime.http.live import History

    h = History()
    for i in range(5):  # 100 tok/s, a viewer watching
        h.add(_snapshot(at=1000.0 + i, predicted=100 * i), float(i), clients=1, tick_s=1.0)
    # The viewer leaves for 30 s; when it is back the first snapshot is the last one read
    # (counters from t=1004), taken at feed time 35, then a fresh one at 35.25.
    stale = h.add(_snapshot(at=1004.0, predicted=400), 35.0, clients=1, tick_s=0.25)
    fresh = h.add(_snapshot(at=1034.25, predicted=400 + 3025), 35.25, clients=1, tick_s=0.25)
    assert stale.rates.tok_s == pytest.approx(100)
    assert fresh.rates.tok_s <= 100.0 + 1e-6  # was 3025 / 0.25 = 12,100 tok/s
    again = h.add(_snapshot(at=1034.25, predicted=3425), 35.5, clients=1, tick_s=0.25)
    assert again.rates.tok_s == fresh.rates.tok_s


async def test_a_client_that_connects_after_a_pause_gets_a_fresh_frame() -> None:
    """The last frame made before every viewer left is not what a new viewer sees first."""
    clock = [0.0]
    made: list[float] = []

    async def snapshot() -> LiveSnapshot:
        made.append(clock[0])
        return _snapshot(at=clock[0], predicted=0)

    feed = LiveFeed(snapshot, tick_s=0.25, clock=lambda: clock[0])
    async for _ in feed.frames():
        break  # a first viewer takes one frame (made at 0) and leaves
    clock[0] = 30.0  # half a minute later
    async for frame in feed.frames():
        assert json.loads(frame.decode().removeprefix("data: "))["snapshot"]["at"] == 30.0
        break
    assert made == [0.0, 30.0]


@pytest.mark.parametrize("isolate", [False, True])
async def test_first_live_frame_is_healthy_with_groups_and_ttft_counts_at_the_first_token(make_config, isolate):
    """A fresh server's first frame says ready and healthy, with its groups and an uptime; the
    time to first token is observed when the first token comes (a stream still generating is
    counted), in the engine's own process too."""
    cfg = make_config(parallel=2)
    async with Runtime.open(cfg, isolate=isolate) as rt, serve_runtime(rt) as url:
        [frame] = await read_frames(url, 1)
        snap = frame["snapshot"]
        assert (snap["state"], snap["healthy"]) == ("ready", True)
        assert len(snap["groups"]) == 1 and snap["uptime_s"] > 0
        handle = await rt.submit("hello", max_tokens=2000, ignore_eos=True, temperature=0)
        assert isinstance(await handle.first(), Token)  # the stream goes on generating

        async def counted() -> float:
            text = (await rt.metrics_text()).decode()
            line = next(x for x in text.splitlines() if x.startswith("llamactor:time_to_first_token_seconds_count"))
            return float(line.split()[-1])

        await wait_until_async(lambda: counted(), lambda n: n >= 1, timeout_s=10)
        assert not handle.closed and "generate" in {slot.state for slot in (await rt.read_live()).groups[0].slots}
        handle.close()


async def wait_until_async(get: Any, ok: Any, timeout_s: float) -> None:
    with anyio.fail_after(timeout_s):
        while not ok(await get()):
            await anyio.sleep(0.05)
