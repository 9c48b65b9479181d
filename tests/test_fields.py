"""Field for field: each route answers with llama-server's keys, and restores its slot files.

The same requests as tests/golden/llama_server_fields.json (recorded from a llama-server built
here by ops/golden/record_fields.py, on the same model, the default SmolLM2, and command line) go
to ``llamactor serve``;
each answer's key paths (and its stream chunks') must be llama-server's, except the differences
listed below, each with its reason (docs/compatibility.md says the same). Only keys are compared:
the recorded file holds no value that a CPU could change.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llamactor.ops.golden.record_fields import CASES, FLAGS, send, shape
from llamactor.ops.golden.record_golden import running_llama_server
from llamactor.runtime.service.config import default_model_path

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN = json.loads((GOLDEN_DIR / "llama_server_fields.json").read_text())
SERVE = ("-m", "llamactor.runtime.cli", "serve")

# "case part" -> {"extra": keys only llamactor sends (a key listed covers the keys under it),
# "missing": keys only llama-server sends}; each with its reason, as docs/compatibility.md says
DIFFERENCES: dict[str, dict[str, set[str]]] = {
    # llamactor's own additions, beside every key of llama-server's: how the engine runs (its
    # process, restarts, llama.cpp build and devices), the context sizes (per request and in all),
    # the KV layout, pipeline groups, the scheduling policy, whether /infill serves this model
    "props keys": {"extra": {"engine", "infill", "kv_unified", "n_ctx", "n_ctx_total", "pipeline_groups", "scheduler"}},
    # what a slot does in llamactor's scheduler: its group, phase, prefill cohort, priority, age,
    # and the cached tokens of its sequence
    "slots keys": {"extra": {"[].age_s", "[].cohort", "[].group", "[].n_cached_tokens", "[].phase", "[].priority"}},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``llamactor serve`` on the recorded command line, with llama-server's slot file at hand."""
    import sys

    slots = tmp_path_factory.mktemp("slots")
    shutil.copyfile(GOLDEN_DIR / "llama_server_slot.bin", slots / "llama_server_slot.bin")
    flags = [*FLAGS, "--slot-save-path", str(slots)]
    with running_llama_server(sys.executable, default_model_path(), *flags, program=SERVE) as url:
        yield url


def test_every_route_answers_llama_servers_keys(server: str) -> None:
    """Per route (and per stream chunk, per Anthropic event), the key paths equal the recorded
    llama-server's, less the listed differences; a difference fixed or a new one fails here."""
    wrong = []
    for name, (method, path, body, stream) in CASES.items():
        recorded = GOLDEN["cases"][name]
        status, text = send(server, method, path, body)
        ours = shape(status, text, stream)
        assert ours["status"] == recorded["status"], (name, text[:300])
        for part in ("keys", "chunk_keys", "last_chunk_keys"):
            if part in recorded:
                wrong += _compare(name, part, set(recorded[part]), set(ours.get(part, [])))
        for event, keys in recorded.get("events", {}).items():
            wrong += _compare(name, f"event {event}", set(keys), set(ours.get("events", {}).get(event, [])))
    assert not wrong, "\n".join(wrong)


def _compare(name: str, part: str, theirs: set[str], ours: set[str]) -> list[str]:
    listed = DIFFERENCES.get(f"{name} {part}", {})
    allowed = listed.get("extra", set())
    extra, missing = ours - theirs, theirs - ours
    out = []
    unlisted = {k for k in extra if not any(k == a or k.startswith(a + ".") for a in allowed)}
    if unlisted or {a for a in allowed if a not in extra}:  # a listed key that is gone fails too
        out.append(f"{name} {part}: only llamactor has {sorted(extra)}")
    if missing != listed.get("missing", set()):
        out.append(f"{name} {part}: only llama-server has {sorted(missing)}")
    return out


def test_a_slot_file_saved_by_llama_server_restores_with_its_prefix_reused(server: str) -> None:
    """The slot file llama-server saved (its packed token layout) restores with the count it
    saved, and the request it was saved after reuses that prefix from the cache."""
    recorded: dict[str, Any] = GOLDEN["slot_file"]
    status, text = send(server, "POST", "/slots/1?action=restore", {"filename": "llama_server_slot.bin"})
    assert status == 200, text
    assert json.loads(text)["n_restored"] == recorded["n_saved"]
    status, text = send(server, "POST", "/completion", {**recorded["request"], "id_slot": 1})
    assert status == 200, text
    answer = json.loads(text)
    assert answer["timings"]["cache_n"] > 0 and answer["tokens_cached"] >= answer["timings"]["cache_n"]
