"""Many models in one server (llama-server's router mode) and sleeping on idle.

``llamactor serve`` without ``-m`` and with ``--models-dir``/``--models-preset`` serves every
model found, each in an engine process of its own, loaded on a request's first use and routed
by the request's ``model`` field; past ``--models-max`` the least recently used idle model is
unloaded. ``GET /models`` lists each with llama-server's status object; ``POST /models/load`` and
``/models/unload`` load and unload; the errors are llama-server's. ``--sleep-idle-seconds``
stops an idle engine's process, and the next request starts it again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import TEST_THREADS, free_port, serve_runtime, wait_until
from serveargs import parse_serve
from tinymodel import write_tiny_model

from llamactor.protocol.errors import ConfigError
from llamactor.runtime import Runtime, cliargs, cliflags
from llamactor.runtime.presetfiles import parse_ini
from llamactor.runtime.presets import load_models
from llamactor.runtime.service.modeltable import ModelSpec, ModelStatus, ModelView, evictions

pytestmark = pytest.mark.slow  # server processes, each starting engine processes

LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]
SMALL = ["-c", "256", "-np", "1", "-t", str(TEST_THREADS), "-b", "64", "-ub", "64"]
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two tiny models that answer differently (other seeds, other weights) and a truncated one."""
    folder = tmp_path_factory.mktemp("models")
    write_tiny_model(folder / "alpha.gguf", seed=1)
    beta = write_tiny_model(folder / "beta.gguf", seed=2).read_bytes()
    (folder / "broken.gguf").write_bytes(beta[: len(beta) // 2])  # tensor data past the end of the file
    (folder / "mmproj-alpha.gguf").write_bytes(b"")  # a companion file, never a model of its own
    return folder


@contextmanager
def _router(argv: list[str], log: Path) -> Iterator[httpx.Client]:
    """A ``llamactor serve`` process on a free port (its log, JSON lines, in ``log``); yields a
    client on it, and stops it with SIGTERM on the way out (it must exit 0)."""
    port = free_port()
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [*LLAMACTOR, "serve", "--port", str(port), *SMALL, *argv],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "LLAMACTOR_LOG_FORMAT": "json"},
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT_S) as client:
            deadline = time.monotonic() + TIMEOUT_S
            while True:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the router did not start"
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.05)
            yield client
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=TIMEOUT_S)
    assert proc.returncode == 0, log.read_text()


def _events(log: Path, event: str) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                out.append(record)
    return out


def _statuses(client: httpx.Client) -> dict[str, dict[str, Any]]:
    r = client.get("/models")
    assert r.status_code == 200, r.text
    return {m["id"]: m["status"] for m in r.json()["data"]}


def _wait_status(client: httpx.Client, model: str, value: str) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        status = _statuses(client)[model]
        if status["value"] == value:
            return status
        assert time.monotonic() < deadline, f"{model} stayed {status}"
        time.sleep(0.02)


def _complete(client: httpx.Client, model: str, **query: str) -> httpx.Response:
    body = {"model": model, "prompt": "The quick brown fox", "n_predict": 8, "temperature": 0, "ignore_eos": True}
    return client.post("/completion", json=body, params=query)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_models_take_turns_past_models_max(models_dir: Path, tmp_path: Path):
    """With --models-max 1, requests alternating between two models all succeed, each with its
    own model's answer (loaded on first use, the other unloaded for it, as least recently used);
    requests for both at once wait for their turn; GET /models shows llama-server's status
    objects; every load and unload is logged; /metrics labels each model's series."""
    log = tmp_path / "router.log"
    with _router(["--models-dir", str(models_dir), "--models-max", "1", "--metrics"], log) as client:
        listed = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["alpha", "beta", "broken"]  # the mmproj file is no model
        alpha = listed[0]
        assert alpha["object"] == "model" and alpha["source"] == "models_dir" and alpha["can_remove"] is False
        assert alpha["status"]["value"] == "unloaded" and "--model" in alpha["status"]["args"]
        assert alpha["architecture"] == {"input_modalities": ["text"], "output_modalities": ["text"]}

        answers: dict[str, list[int]] = {}
        for model in ("alpha", "beta", "alpha", "beta"):
            r = _complete(client, model)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            assert answers.setdefault(model, r.json()["tokens"]) == r.json()["tokens"]
            statuses = _statuses(client)
            assert statuses[model]["value"] == "loaded"
            assert statuses["beta" if model == "alpha" else "alpha"]["value"] == "unloaded"
        assert answers["alpha"] != answers["beta"]

        with ThreadPoolExecutor(6) as pool:  # both at once: one model at a time serves its requests
            done = list(pool.map(lambda m: _complete(client, m), ["alpha", "beta"] * 3))
        assert all(r.status_code == 200 for r in done), [r.text for r in done]
        assert all(r.json()["tokens"] == answers[r.json()["model"]] for r in done)

        metrics = client.get("/metrics").text
        loaded = next(name for name, s in _statuses(client).items() if s["value"] == "loaded")
        assert f'llamacpp:tokens_predicted_total{{model="{loaded}"}}' in metrics
        assert f'llamactor:group_tokens_predicted_total{{group="0",model="{loaded}"}}' in metrics
        assert 'llamactor:model_loaded{model="alpha"}' in metrics
        assert client.get("/metrics", params={"model": loaded}).text.count('model="') == 0  # its own, as alone
    loads, unloads = _events(log, "model_loaded"), _events(log, "model_unloaded")
    assert [e["model"] for e in loads[:4]] == ["alpha", "beta", "alpha", "beta"]
    assert [e["reason"] for e in unloads[:3]] == ["lru", "lru", "lru"]
    assert len(_events(log, "model_loading")) == len(loads) and len(unloads) == len(loads)  # the last at shutdown
    assert unloads[-1]["reason"] == "shutdown"


def test_load_unload_and_errors(models_dir: Path, tmp_path: Path):
    """POST /models/load and /models/unload as llama-server's; its errors: no model named 400,
    an unknown one 400 (404 for /models/load), one not loaded with autoload off 400. A model
    file that fails to load fails its requests with the loader's message (500) and is listed as
    failed, while the other models serve."""
    log = tmp_path / "router.log"
    with _router(["--models-dir", str(models_dir), "--no-models-autoload"], log) as client:
        r = _complete(client, "alpha")
        assert r.status_code == 400 and r.json()["error"]["message"] == "model is not loaded"
        assert client.post("/models/load", json={"model": "alpha"}).json() == {"success": True}
        again = client.post("/models/load", json={"model": "alpha"})
        assert again.status_code == 400 and again.json()["error"]["message"] == "model is already running"
        _wait_status(client, "alpha", "loaded")
        assert _complete(client, "alpha").status_code == 200
        assert client.get("/props", params={"model": "alpha"}).json()["model_alias"] == "alpha"

        unknown = _complete(client, "gamma")
        assert unknown.status_code == 400 and unknown.json()["error"] == {
            "message": "model 'gamma' not found",
            "type": "invalid_request_error",
            "code": 400,
        }
        missing = client.post("/completion", json={"prompt": "x"})
        assert missing.status_code == 400 and "model name is missing" in missing.json()["error"]["message"]
        load_unknown = client.post("/models/load", json={"model": "gamma"})
        assert load_unknown.status_code == 404 and load_unknown.json()["error"]["type"] == "not_found_error"
        assert client.post("/models/unload", json={"model": "gamma"}).status_code == 400

        broken = _complete(client, "broken", autoload="true")  # ?autoload= overrides the server's
        assert broken.status_code == 500, broken.text
        message = broken.json()["error"]["message"]
        assert message.startswith("model 'broken' failed to load: llama.cpp could not load the model")
        assert "data is not within the file bounds" in message  # llama.cpp's own words
        failed = _statuses(client)["broken"]
        assert failed["value"] == "unloaded" and failed["failed"] is True and failed["exit_code"] == 1
        assert _complete(client, "alpha").status_code == 200  # the others keep serving

        assert client.post("/models/unload", json={"model": "alpha"}).json() == {"success": True}
        _wait_status(client, "alpha", "unloaded")
        not_running = client.post("/models/unload", json={"model": "alpha"})
        assert not_running.status_code == 400 and not_running.json()["error"]["message"] == "model is not running"
        props = client.get("/props").json()
        assert props["role"] == "router" and props["max_instances"] == 4 and props["models_autoload"] is False
    assert [e["reason"] for e in _events(log, "model_unloaded")] == ["unload"]
    failures = _events(log, "model_load_failed")
    assert len(failures) == 1 and failures[0]["model"] == "broken"


def test_preset_file_and_a_sleeping_model(models_dir: Path, tmp_path: Path):
    """A preset file names models by file, adds options and aliases to models-dir models and loads
    one at startup; with --sleep-idle-seconds 1 an idle model's engine process exits (listed as
    "sleeping", its pid gone) and its next request starts it again and succeeds."""
    preset = tmp_path / "models.ini"
    preset.write_text(
        "version = 1\n"
        "[*]\n"
        "n-predict = 4 ; every model\n"
        "[alpha]\n"
        "alias = first\n"
        "load-on-startup = true\n"
        "[gamma]\n"
        f"model = {models_dir / 'beta.gguf'}\n"
        "LLAMA_ARG_N_PREDICT = 2\n"
    )
    log = tmp_path / "router.log"
    argv = ["--models-dir", str(models_dir), "--models-preset", str(preset), "--sleep-idle-seconds", "1"]
    with _router(argv, log) as client:
        listed = {m["id"]: m for m in client.get("/models").json()["data"]}
        assert set(listed) == {"alpha", "beta", "broken", "gamma"}
        assert listed["alpha"]["aliases"] == ["first"] and listed["alpha"]["source"] == "preset"
        gamma = listed["gamma"]["status"]["preset"]
        assert gamma.startswith("[gamma]\n") and "\nmodel = " in gamma and "\nn-predict = 2\n" in gamma
        _wait_status(client, "alpha", "sleeping")  # loaded at startup, idle since

        def awake_pid() -> int:
            """A request for alpha by its alias (the preset's [*] caps it at 4 tokens), then its
            engine's pid (asked again if it fell asleep in between)."""
            while True:
                r = _complete(client, "first")
                assert r.status_code == 200 and r.json()["tokens_predicted"] == 4, r.text
                pid = client.get("/props", params={"model": "alpha"}).json()["engine"]["pid"]
                if pid is not None:
                    return pid

        pid = awake_pid()
        _wait_status(client, "alpha", "sleeping")
        deadline = time.monotonic() + TIMEOUT_S
        while not _gone(pid):
            assert time.monotonic() < deadline, "the sleeping engine's process is still there"
            time.sleep(0.02)
        props = client.get("/props", params={"model": "alpha"}).json()  # no wake: /props is exempt
        assert props["is_sleeping"] is True and props["engine"]["pid"] is None
        assert awake_pid() != pid  # the next request started a new engine process
        assert _complete(client, "gamma").json()["tokens_predicted"] == 2  # its own section wins
    loads = _events(log, "model_loaded")
    assert loads[0]["model"] == "alpha" and _events(log, "model_loading")[0]["reason"] == "startup"
    assert _events(log, "engine_sleeping") and _events(log, "engine_waking")


async def test_one_model_sleeps_when_idle(tiny_model: Path):
    """--sleep-idle-seconds for a one-model server: the engine process exits after a second
    without requests (/health stays 200, /props says is_sleeping, /metrics answers without waking
    it), and the next request starts it again and succeeds."""
    cfg = parse_serve(["-m", str(tiny_model), *SMALL, "--sleep-idle-seconds", "1", "--metrics"]).config

    def asleep(pid: int | None) -> bool:
        return rt.engine_status().state == "sleeping" and (pid is None or _gone(pid))

    async with Runtime.open(cfg) as rt, serve_runtime(rt) as url, httpx.AsyncClient(base_url=url) as client:
        await wait_until(lambda: asleep(None), timeout_s=TIMEOUT_S)
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/props")).json()["is_sleeping"] is True
        metrics = (await client.get("/metrics")).content  # the engine's series as it fell asleep
        assert b"llamacpp:tokens_predicted_total" in metrics and b"llamactor:engine_sleeping 1.0" in metrics
        assert rt.engine_status().state == "sleeping" and rt.engine_status().pid is None  # a scrape is no request
        for _ in range(2):
            r = await client.post("/completion", json={"prompt": "hello", "n_predict": 4}, timeout=TIMEOUT_S)
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
            pid = rt.engine_status().pid
            assert pid is not None and (await client.get("/props")).json()["is_sleeping"] is False
            await wait_until(lambda pid=pid: asleep(pid), timeout_s=TIMEOUT_S)  # idle again: its process is gone
        assert rt.engine_status().restarts == 0  # sleeping is no death


# ---- without a server ----------------------------------------------------------------------


def _given(argv: list[str], environ: dict[str, str] | None = None) -> cliargs.Parsed:
    return parse_serve(argv, environ).given


def test_preset_options_and_precedence(tmp_path: Path):
    """Preset keys are llama-server's flags without dashes, short forms or variables; a switch
    takes true/false (a no- spelling reversed); the model's options go: variables < [*] < its
    section < the command line. A refused flag stops startup naming the model."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    preset = tmp_path / "p.ini"
    preset.write_text(
        "; comment\n[*]\nc = 1024\nno-cache-prompt = true\ntemp = 0.5\n"
        f"[m]\nmodel = {model}\nLLAMA_ARG_CTX_SIZE = 2048\ntop-k = 3\nstop-timeout = 5\n"
    )
    given = _given(["--temp", "0.25"], {"LLAMA_ARG_TOP_K": "9", "LLAMA_ARG_N_PREDICT": "7"})
    (spec,) = load_models(None, str(preset), given).specs
    cfg = spec.config
    assert (spec.name, cfg.alias, cfg.model_name, spec.source, spec.stop_timeout_s) == ("m", "m", "m", "preset", 5.0)
    assert cfg.n_ctx == 2048 and cfg.cache_prompt is False  # its section over [*]
    assert cfg.sampling.temperature == 0.25  # the command line over the preset
    assert cfg.sampling.top_k == 3 and cfg.n_predict_max == 7  # the preset over a variable
    assert parse_ini("a = b # c\n[x:q8_0]\nk=v\n") == {"default": {"a": "b"}, "x:Q8_0": {"k": "v"}}
    preset.write_text(f"[m]\nmodel = {model}\ncontrol-vector-layer-range = 1 2\nhf-repo = x/y\n")
    with pytest.raises(ConfigError, match=r"model m .*-hf.* is not supported"):
        load_models(None, str(preset), _given([]))
    preset.write_text(f"[m]\nmodel = {model}\nno-such-flag = 1\n")
    with pytest.raises(ConfigError, match="no-such-flag"):
        load_models(None, str(preset), _given([]))


def test_models_list_shows_no_secrets(tmp_path: Path):
    """GET /models shows each model's command line (``status.args``, ``status.preset``) but never
    the values of the flags that hold secrets or name other machines: MCP servers' tokens, an ssh
    target, keys."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    preset = tmp_path / "p.ini"
    mcp = json.dumps({"mcpServers": {"x": {"command": "true", "env": {"TOKEN": "s3cret-token"}}}})
    preset.write_text(f"[m]\nmodel = {model}\nmcp-servers-json = {mcp}\nhf-token = s3cret-hf\n")
    argv = ["--tools-runtime", "ssh:admin@db.internal", "--api-key", "s3cret-key"]
    (spec,) = load_models(None, str(preset), _given(argv), argv).specs
    shown = " ".join(spec.args) + spec.preset
    assert "--mcp-servers-json" in shown and "REDACTED" in shown
    for secret in ("s3cret", "admin@db.internal"):
        assert secret not in shown, shown


def test_models_dir_layout(tmp_path: Path):
    """llama-server's models folder: a .gguf file is a model named after it, a subfolder a model
    named after the subfolder (its first shard when split, a draft file its --model-draft);
    projector files are never models. A flag a preset gives that means nothing here is reported
    for a log line, with its model."""
    for name in ("a.gguf", "mmproj-a.gguf", "notes.txt", "split/m-00002-of-00002.gguf", "split/m-00001-of-00002.gguf"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    for name in ("withdraft/model.gguf", "withdraft/mtp-model.gguf", "withdraft/mmproj-f16.gguf", "empty/x.bin"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    preset = tmp_path / "p.ini"
    preset.write_text("[a]\ncont-batching = true\nlog-format = text\nport = 9\n")
    found = load_models(str(tmp_path), str(preset), _given([]))
    specs = {s.name: s for s in found.specs}
    assert sorted(specs) == ["a", "split", "withdraft"]
    assert Path(str(specs["split"].config.model)).name == "m-00001-of-00002.gguf"
    draft = specs["withdraft"].config.spec_draft_model
    assert draft is not None and Path(draft).name == "mtp-model.gguf"
    assert [(model, flag) for model, flag, _ in found.ignored] == [("a", "--cont-batching"), ("a", "--log-format")]


def test_router_flags_parse():
    """The router's flags are llama-server's: with -m they are logged and ignored, as the
    one-model server has no use for them; --sleep-idle-seconds takes -1 or a positive count."""
    opts = parse_serve(["--models-dir", "d", "--models-max", "2", "--no-models-autoload"])
    assert opts.router and (opts.models_dir, opts.models_max, opts.models_autoload) == ("d", 2, False)
    single = parse_serve(["-m", "x.gguf", "--models-max", "2"])
    assert not single.router and [flag for flag, _ in single.ignored] == ["--models-max"]
    assert [flag for flag, _ in parse_serve(["--no-models-autoload"]).ignored] == ["--no-models-autoload"]
    assert parse_serve(["--sleep-idle-seconds", "5"]).config.sleep_idle_seconds == 5
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit):
            parse_serve(["--sleep-idle-seconds", bad])
    assert {g.title for g, o in cliargs.entries(cliflags.GROUPS) if "--models-dir" in o.names} == {
        "Many models (router mode)"
    }


def _view(name: str, status: ModelStatus, last_used: float = 0.0, **kw: Any) -> ModelView:
    return ModelView(spec=ModelSpec(name=name, config=parse_serve([]).config), status=status, last_used=last_used, **kw)


def test_evictions_unload_the_least_recently_used_idle_models():
    """A model waiting for a slot unloads the least recently used idle model; one serving a
    request, one already stopping, and one waited for are never taken; nothing without a limit."""
    loaded, unloaded = ModelStatus.LOADED, ModelStatus.UNLOADED
    views = [_view("a", loaded, 2.0), _view("b", ModelStatus.SLEEPING, 1.0), _view("c", unloaded)]
    assert evictions(views, ["c"], models_max=2) == ["b"]
    assert evictions(views, ["c"], models_max=3) == []  # a slot is free
    assert evictions(views, ["c"], models_max=0) == []  # no limit
    assert evictions(views, [], models_max=1) == []
    busy = [_view("a", loaded, 2.0), _view("b", loaded, 1.0, in_use=1), _view("c", unloaded)]
    assert evictions(busy, ["c"], models_max=2) == ["a"]
    stopping = [_view("a", loaded, 2.0), _view("b", loaded, 1.0, stopping=True), _view("c", unloaded)]
    assert evictions(stopping, ["c"], models_max=2) == []  # b's slot is on its way
    assert evictions([_view("a", loaded), _view("c", unloaded)], ["c", "a"], models_max=1) == []
