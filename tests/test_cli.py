"""``llamactor serve`` as a user runs it: a real process on loopback (/health, CLI flags, env)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port
from serveargs import parse_serve

pytestmark = pytest.mark.slow  # a server subprocess per test

LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]
STARTUP_TIMEOUT_S = 30


def serve_argv(model: Path, port: int, n_slots: int | str, n_ctx: int | str, *more: str) -> list[str]:
    """``llamactor serve`` of ``model`` on loopback ``port``, one thread a context, as the
    process tests start it: ``n_slots`` slots over ``n_ctx`` cells, then ``more`` flags."""
    argv = ["serve", "-m", str(model), "--port", str(port), "-t", "1", "-np", str(n_slots), "-c", str(n_ctx)]
    return [*LLAMACTOR, *argv, *more]


def _wait_ready(url: str, proc: subprocess.Popen) -> list[int]:
    statuses = []
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "exited"
        try:
            r = httpx.get(url + "/health", timeout=1)
            statuses.append(r.status_code)
            if r.status_code == 200:
                return statuses
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    raise AssertionError("server did not become ready")


def test_serve_process_end_to_end(tiny_model: Path):
    """The serve command: env + flags (long ones also with ``_`` for ``-``, as llama-server reads
    them), /health 200 once loaded, a completion, clean SIGTERM exit."""
    port = free_port()
    env = {**os.environ, "LLAMA_ARG_N_PARALLEL": "2", "LLAMA_ARG_CTX_SIZE": "2048"}
    underscored = ["--backend_sampling", "--ubatch_size=256", "--n_predict", "5"]
    proc = subprocess.Popen(
        [*LLAMACTOR, "serve", "-m", str(tiny_model), "--port", str(port), "-t", "1", "--metrics", *underscored],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        statuses = _wait_ready(url, proc)
        assert set(statuses) <= {200, 503}
        props = httpx.get(url + "/props").json()
        assert props["total_slots"] == 2 and props["n_ctx"] == 1024
        r = httpx.post(url + "/completion", json={"prompt": "hi", "n_predict": 50, "temperature": 0})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 5  # --n_predict caps it
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err.decode()
    logs = err.decode()
    assert '"event": "request_done"' in logs  # JSON logs when stderr is not a TTY
    assert '"n_predicted": 5' in logs


def test_serve_refuses_bad_configuration(tiny_model: Path):
    """Startup errors are clear and name the values, exit code 2."""
    cases = [
        (["-np", "3", "--pipeline-groups", "2"], "--parallel (3) must be a multiple of --pipeline-groups (2)"),
        (["-np", "2", "--pipeline-groups", "4"], "--pipeline-groups (4) must not exceed --parallel (2)"),
        (["--pipeline-groups", "0"], "--pipeline-groups must be >= 1, got 0"),
        (["--scheduler", "nope"], "unknown scheduler 'nope'"),
    ]
    for flags, message in cases:
        proc = subprocess.run(
            [*LLAMACTOR, "serve", "-m", str(tiny_model), "--port", str(free_port()), *flags],
            capture_output=True,
            timeout=30,
        )
        assert proc.returncode == 2, (flags, proc.stderr)
        assert message in proc.stderr.decode(), proc.stderr.decode()
    proc = subprocess.run([*LLAMACTOR, "serve", "-m", "/nonexistent.gguf"], capture_output=True, timeout=30)
    assert proc.returncode == 2 and "model file not found" in proc.stderr.decode()


def _serve_from(cwd: Path, tiny_model: Path, scheduler: str) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "llamactor"),
            "serve",
            "-m",
            str(tiny_model),
            "--port",
            str(port),
            "-t",
            "1",
            "-np",
            "2",
            "-c",
            "2048",
            "--scheduler",
            scheduler,
        ],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        assert httpx.get(url + "/props").json()["scheduler"] == scheduler
        r = httpx.post(url + "/completion", json={"prompt": "hi", "n_predict": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 5
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err.decode()


def test_scheduler_by_file_path_from_another_directory(tiny_model: Path, tmp_path: Path):
    """The console script, started outside the repository, loads a policy by
    absolute file path; and by module path from its working directory (as uvicorn does)."""
    example = Path(__file__).resolve().parent.parent / "examples" / "custom_policy.py"
    _serve_from(tmp_path, tiny_model, f"{example}:ShortestPromptFirst")
    (tmp_path / "my_policy.py").write_text(example.read_text())
    _serve_from(tmp_path, tiny_model, "my_policy:ShortestPromptFirst")


def test_without_np_one_request_may_use_the_whole_context(tiny_model: Path):
    """As llama-server: without -np the 4 slots share one KV pool (unified), so a prompt of -c
    minus the output's length is served; with -np they split -c (and such a prompt is refused)."""
    port = free_port()
    argv = [*LLAMACTOR, "serve", "-m", str(tiny_model), "--port", str(port), "-t", "1", "-c", "1024"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        props = httpx.get(url + "/props").json()
        assert props["total_slots"] == 4 and props["kv_unified"] is True
        prompt = [5, 6, 7, 8] * 252  # 1,008 of the 1,024 positions
        r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": 16, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["tokens_evaluated"] == 1008 and r.json()["tokens_predicted"] == 16
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    split = parse_serve(["-m", str(tiny_model), "-c", "1024", "-np", "4"]).config
    assert not split.kv_unified and split.validated().ctx_per_request == 256
    assert parse_serve(["-m", str(tiny_model), "-c", "1024", "--no-kv-unified"]).config.kv_unified is False
