"""Record how llama-server schedules fixed bursts of prompts on the tiny test model.

Usage: ``.venv/bin/python ops/golden/record_schedule.py [/path/to/llama-server]``. Writes
tests/golden/llama_server_schedule.json, which tests/test_continuous_schedule.py replays
against llamactor's ``continuous`` policy.

Each scenario sends its prompts (token ids) as ONE ``/completion`` request with a list of
prompts: llama-server queues all of its tasks before its next step, so the burst arrives at
once, deterministically. With ``stream`` and ``return_progress`` every task reports, step by
step, how many of its prompt tokens are in (its chunks: how n_batch was shared). Recorded per
task: the processed counts, and the order in which the tasks got their first token (the step
that finishes a prompt samples its first token). The server runs on loopback with one thread and is stopped.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from typing import Any

from llamactor.ops.golden.record_golden import running_llama_server

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "golden" / "llama_server_schedule.json"
DEFAULT_SERVER = "/tmp/llama-server-build/bin/llama-server"
N_BATCH = 64
N_CTX = 4096  # per slot: N_CTX / slots
N_PREDICT = 4

# name -> (slots, prompt lengths in tokens, in arrival order)
SCENARIOS: dict[str, tuple[int, tuple[int, ...]]] = {
    "equal": (4, (100, 100, 100, 100)),  # equal prompts: one after another, in slot order
    "unequal": (4, (150, 30, 90, 70)),  # short and long prompts arriving together
    "queue": (3, (80, 40, 120, 60, 50, 90)),  # more prompts than slots: the later ones take freed slots
    "small": (4, (10, 20, 5, 15)),  # all prompts fit one step
}


def prompt_tokens(name: str, i: int, n: int) -> list[int]:
    """Distinct deterministic prompts (ids 3..402 of the tiny vocabulary), no shared prefix."""
    seed = sum(map(ord, name)) * 31 + i * 97
    return [3 + (seed + 13 * k + i) % 400 for k in range(n)]


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    chunks = []
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"llama-server refused {body}: {exc.read().decode()}") from None
    return chunks


def schedule_of(chunks: list[dict[str, Any]], n_tasks: int) -> dict[str, Any]:
    """Per task: its prompt-progress counts, step by step; and the order in which the tasks'
    prompts were through (each gets its first token in the step that finishes its prompt).

    Tokens are not recorded: llama-server's multi-prompt stream holds back a token that is an
    incomplete UTF-8 sequence and may never send it (the tiny model writes many such bytes)."""
    progress: list[list[int]] = [[] for _ in range(n_tasks)]
    first: list[int] = []
    for c in chunks:
        p = c.get("prompt_progress")
        if p is None:
            continue
        i = int(c.get("index", 0))
        progress[i].append(int(p["processed"]))
        if p["processed"] == p["total"] and i not in first:
            first.append(i)
    return {"progress": progress, "first_token_order": first}


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from tinymodel import write_tiny_model

    server = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_SERVER
    version = subprocess.run([server, "--version"], capture_output=True, text=True).stderr.strip().splitlines()[0]
    out: dict[str, Any] = {"llama_cpp": version, "n_batch": N_BATCH, "n_ctx": N_CTX, "n_predict": N_PREDICT}
    scenarios = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(pathlib.Path(tmp) / "tiny.gguf")
        for name, (slots, lengths) in SCENARIOS.items():
            flags = ("-np", str(slots), "-c", str(N_CTX), "-b", str(N_BATCH), "-ub", str(N_BATCH), "-t", "1")
            with running_llama_server(server, model, *flags, "--no-warmup") as url:
                prompts = [prompt_tokens(name, i, n) for i, n in enumerate(lengths)]
                body = {
                    "prompt": prompts,
                    "n_predict": N_PREDICT,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "return_progress": True,
                    "cache_prompt": True,
                }
                chunks = _stream(url + "/completion", body)
                scenarios.append(
                    {"name": name, "slots": slots, "lengths": list(lengths), **schedule_of(chunks, len(prompts))}
                )
    out["scenarios"] = scenarios
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}: {len(scenarios)} scenarios ({version})")


if __name__ == "__main__":
    main()
