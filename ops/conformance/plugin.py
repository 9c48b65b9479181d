"""pytest plugin that runs llama.cpp's server test suite offline, on local models.

Loaded into the vendored suite's run with ``-p llamactor.ops.conformance.plugin`` by
``ops/conformance/run.py`` (``make conformance``); never imported by llamactor itself. The suite
(``tools/server/tests``: ``utils.ServerProcess`` starts the binary that LLAMA_SERVER_BIN_PATH
names) asks for Hugging Face models with ``--hf-repo``/``--hf-file`` and downloads LoRA adapters,
draft models and images with ``utils.download_file``. This plugin, without editing a vendored
file:

* maps every hub model it can to a local GGUF given by environment variables (``--model PATH``
  instead of ``--hf-repo``), and skips, with the reason, a test that asks for one it cannot;
* maps the LoRA adapter and draft model URLs to local files (and skips on any other URL);
* turns ``ServerPreset.load_all`` (the session-start pre-download) into a no-op;
* starts every server with one thread (``--threads 1``) unless the test chose a count;
* stubs the ``wget`` module the suite imports (it is only used for downloads);
* fails a test that runs longer than CONFORMANCE_TEST_TIMEOUT_S seconds (SIGALRM, main thread);
* skips whole files listed in CONFORMANCE_SKIP_FILES (``name.py=reason;...``);
* waits before each test while the file CONFORMANCE_PAUSE_FILE exists (a benchmark that wants
  the machine quiet creates it).

Environment (set by ops/conformance/run.py):
  CONFORMANCE_TEXT_MODEL      the GGUF for every text model (SmolLM2-135M-Instruct)
  CONFORMANCE_TINY_MODEL      tests/tinymodel.py's model (the base of the LoRA adapter)
  CONFORMANCE_TINY_LORA       tests/tinylora.py's adapter for it
  CONFORMANCE_TINY_FIM_MODEL  tinymodel's model with fill-in-the-middle tokens (the infill model)
  CONFORMANCE_TINY_RERANKER   tests/tinyreranker.py's reranker
"""

from __future__ import annotations

import os
import signal
import sys
import time
import types
from collections.abc import Generator
from typing import Any

import pytest

# The suite's stories/tinyllama/bert presets and the models they stand for. A key is
# (hf_repo, hf_file); hf_file None matches any file of the repo.
TEXT = "text"
INFILL = "infill"
RERANKER = "reranker"
HUB_MODELS: dict[tuple[str, str | None], str] = {
    ("ggml-org/test-model-stories260K", None): TEXT,
    ("ggml-org/test-model-stories260K-infill", None): INFILL,
    ("ggml-org/stories15M_MOE", None): TEXT,
    ("ggml-org/models", "bert-bge-small/ggml-model-f16.gguf"): TEXT,
    ("ggml-org/models", "tinyllamas/stories260K.gguf"): TEXT,
    ("ggml-org/models", "jina-reranker-v1-tiny-en/ggml-model-f16.gguf"): RERANKER,
}
# Hub models no local file stands for, with the reason the test is skipped.
UNSUBSTITUTED = {
    "ggml-org/tinygemma3-GGUF": "multimodal: needs tinygemma3 and its mmproj from the hub",
    "ggml-org/models": "needs a hub model (split GGUF) with no local substitute",
}
LORA_URL_SUFFIX = "/stories15M_MOE/resolve/main/moe_shakespeare15M.gguf"
DRAFT_URL_SUFFIX = "/tiny-llamas/resolve/main/stories15M-q4_0.gguf"


def _env_path(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise pytest.UsageError(f"{name} is not set: run the suite through ops/conformance/run.py")
    return value


def _wget_stub() -> types.ModuleType:
    """The suite imports ``wget`` at module level, for downloads only; offline it is never used."""
    stub = types.ModuleType("wget")

    def download(url: str, out: str | None = None) -> str:
        pytest.skip(f"needs a download: {url}")

    stub.download = download  # type: ignore[attr-defined]
    return stub


sys.modules.setdefault("wget", _wget_stub())


def _substitute(server: Any) -> None:
    """Rewrite one ServerProcess's hub model into a local ``--model`` before it starts."""
    repo = server.model_hf_repo
    if repo is not None:
        base = repo.split(":", 1)[0]
        kind = HUB_MODELS.get((base, server.model_hf_file)) or HUB_MODELS.get((base, None))
        if kind is None:
            reason = UNSUBSTITUTED.get(base, f"needs the hub model {repo} {server.model_hf_file or ''}".strip())
            pytest.skip(reason)
        lora = os.environ.get("CONFORMANCE_TINY_LORA")
        if kind == RERANKER:
            server.model_file = _env_path("CONFORMANCE_TINY_RERANKER")
        elif kind == INFILL:
            # SmolLM2's GGUF names no fill-in-the-middle tokens: /infill answers 501 on it.
            server.model_file = _env_path("CONFORMANCE_TINY_FIM_MODEL")
        elif server.lora_files and lora in server.lora_files:
            # The adapter is tinylora's: its base model must be tinymodel's.
            server.model_file = _env_path("CONFORMANCE_TINY_MODEL")
        else:
            server.model_file = _env_path("CONFORMANCE_TEXT_MODEL")
        server.model_hf_repo = None
        server.model_hf_file = None
    if server.mmproj_url:
        pytest.skip("multimodal: needs an mmproj from the hub")
    if server.n_threads is None:
        server.n_threads = 1


def _download_file(url: str, output_file_path: str | None = None) -> str:
    if url.endswith(LORA_URL_SUFFIX):
        return _env_path("CONFORMANCE_TINY_LORA")
    if url.endswith(DRAFT_URL_SUFFIX):
        return _env_path("CONFORMANCE_TEXT_MODEL")
    pytest.skip(f"needs a download: {url}")


def pytest_configure(config: pytest.Config) -> None:
    # The suite's conftest.py (loaded before this hook) has imported utils from the suite folder.
    import utils

    original_start = utils.ServerProcess.start

    def start(self: Any, *args: Any, **kwargs: Any) -> None:
        _substitute(self)
        original_start(self, *args, **kwargs)

    utils.ServerProcess.start = start
    utils.ServerPreset.load_all = staticmethod(lambda: None)
    utils.download_file = _download_file


def _skipped_files() -> dict[str, str]:
    skipped = {}
    for entry in os.environ.get("CONFORMANCE_SKIP_FILES", "").split(";"):
        if "=" in entry:
            name, reason = entry.split("=", 1)
            skipped[name.strip()] = reason.strip()
    return skipped


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skipped = _skipped_files()
    for item in items:
        reason = skipped.get(item.path.name)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


PAUSE_POLL_S = 20.0


def pytest_runtest_setup(item: pytest.Item) -> None:
    pause_file = os.environ.get("CONFORMANCE_PAUSE_FILE")
    while pause_file and os.path.exists(pause_file):
        time.sleep(PAUSE_POLL_S)


class TimeLimitExceeded(Exception):
    """A test ran past CONFORMANCE_TEST_TIMEOUT_S."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    limit_s = float(os.environ.get("CONFORMANCE_TEST_TIMEOUT_S", "0"))
    if limit_s <= 0:
        return (yield)

    def expire(signum: int, frame: object) -> None:
        raise TimeLimitExceeded(f"test ran past {limit_s:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
