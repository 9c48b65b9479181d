"""llama-server's response fields, route by route, for the side-by-side field test.

    .venv/bin/python ops/golden/record_fields.py [/path/to/llama-server]

Starts llama-server (built here, as ``make conformance`` builds it; default
/tmp/llama-server-build/bin/llama-server) on the default SmolLM2 model with a migrating user's command
line, sends every request in ``CASES`` and records, per request, the set of key paths of its
answer (``timings.prompt_n``, ``choices[].delta.content``, ...) and, for streams, of its chunks,
into tests/golden/llama_server_fields.json. Only keys are kept, never values: the file is the
same on any CPU. It also saves one slot with llama-server (tests/golden/llama_server_slot.bin,
its own file layout) for the slot-restore test.

tests/test_fields.py sends the same requests to llamactor and compares the key sets, less the
differences it lists (each with its reason, as docs/compatibility.md gives them).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from llamactor.ops.golden.record_golden import running_llama_server
from llamactor.runtime.service.config import default_model_path

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "golden" / "llama_server_fields.json"
SLOT_FILE = ROOT / "tests" / "golden" / "llama_server_slot.bin"
DEFAULT_SERVER = "/tmp/llama-server-build/bin/llama-server"
ALIAS = "smol"
# a migrating user's command line. The model is the default SmolLM2 (installed by setup): the tiny
# random test model writes partial UTF-8 pieces, for which llama-server leaves logprobs out
FLAGS = ("-c", "4096", "-np", "4", "-t", "1", "--jinja", "--metrics", "--alias", ALIAS, "--no-webui")
SLOT_PROMPT = {"prompt": "the cat sat on the mat", "n_predict": 4, "temperature": 0, "id_slot": 0}

_CHAT = [{"role": "user", "content": "hello there"}]
# name -> (method, path, body or None, stream)
CASES: dict[str, tuple[str, str, dict[str, Any] | None, bool]] = {
    "completion": ("POST", "/completion", {"prompt": "hello world", "n_predict": 4, "temperature": 0}, False),
    "completion_stream": (
        "POST",
        "/completion",
        {"prompt": "hello world", "n_predict": 4, "temperature": 0, "stream": True},
        True,
    ),
    "completion_probs": (
        "POST",
        "/completion",
        {"prompt": "hello world", "n_predict": 2, "temperature": 0, "n_probs": 2},
        False,
    ),
    "v1_completions": ("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 4, "temperature": 0}, False),
    "v1_completions_stream": (
        "POST",
        "/v1/completions",
        {"prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True},
        True,
    ),
    "chat": ("POST", "/v1/chat/completions", {"messages": _CHAT, "max_tokens": 4, "temperature": 0}, False),
    "chat_stream": (
        "POST",
        "/v1/chat/completions",
        {"messages": _CHAT, "max_tokens": 4, "temperature": 0, "stream": True},
        True,
    ),
    "chat_logprobs": (
        "POST",
        "/v1/chat/completions",
        {"messages": _CHAT, "max_tokens": 2, "temperature": 0, "logprobs": True, "top_logprobs": 2},
        False,
    ),
    "anthropic": ("POST", "/v1/messages", {"model": ALIAS, "max_tokens": 4, "messages": _CHAT}, False),
    "anthropic_stream": (
        "POST",
        "/v1/messages",
        {"model": ALIAS, "max_tokens": 4, "messages": _CHAT, "stream": True},
        True,
    ),
    "anthropic_count_tokens": ("POST", "/v1/messages/count_tokens", {"model": ALIAS, "messages": _CHAT}, False),
    "tokenize": ("POST", "/tokenize", {"content": "hello world", "with_pieces": True}, False),
    "detokenize": ("POST", "/detokenize", {"tokens": [5, 6, 7]}, False),
    "apply_template": ("POST", "/apply-template", {"messages": _CHAT}, False),
    "props": ("GET", "/props", None, False),
    "slots": ("GET", "/slots", None, False),
    "health": ("GET", "/health", None, False),
    "v1_models": ("GET", "/v1/models", None, False),
    "lora_adapters": ("GET", "/lora-adapters", None, False),
    "error_bad_messages": ("POST", "/v1/chat/completions", {"messages": "not a list"}, False),
}


def key_paths(value: Any, prefix: str = "") -> set[str]:
    """Every key path in ``value``: ``a.b`` for nested objects, ``a[].b`` inside lists."""
    out: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out.add(path)
            out |= key_paths(item, path)
    elif isinstance(value, list):
        for item in value:
            out |= key_paths(item, f"{prefix}[]")
    return out


def sse_events(raw: str) -> Iterator[tuple[str, Any]]:
    """(event name, JSON data) of each server-sent event; ``[DONE]`` and pings are left out."""
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        name, data = "", ""
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data += line[5:].strip()
        if data and data != "[DONE]":
            yield name, json.loads(data)


def shape(status: int, body: str, stream: bool) -> dict[str, Any]:
    """A response's recorded shape: status, keys, and for a stream its chunks' keys (all but the
    last, and the last), per event name where the stream names its events (Anthropic's)."""
    if not stream or status != 200:
        return {"status": status, "keys": sorted(key_paths(json.loads(body)))}
    events = list(sse_events(body))
    named: dict[str, set[str]] = {}
    for name, data in events:
        if name:
            named.setdefault(name, set()).update(key_paths(data))
    if named:
        return {"status": status, "events": {k: sorted(v) for k, v in sorted(named.items())}}
    chunks = [data for _, data in events]
    middle: set[str] = set()
    for data in chunks[:-1]:
        middle |= key_paths(data)
    return {"status": status, "chunk_keys": sorted(middle), "last_chunk_keys": sorted(key_paths(chunks[-1]))}


def send(url: str, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def main() -> None:
    server = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_SERVER
    version = subprocess.run([server, "--version"], capture_output=True, text=True).stderr.strip().splitlines()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model = default_model_path()
        slots = pathlib.Path(tmp) / "slots"
        slots.mkdir()
        with running_llama_server(server, model, *FLAGS, "--slot-save-path", str(slots)) as url:
            cases = {}
            for name, (method, path, body, stream) in CASES.items():
                status, text = send(url, method, path, body)
                cases[name] = {"method": method, "path": path, "body": body, **shape(status, text, stream)}
            status, text = send(url, "POST", "/completion", SLOT_PROMPT)
            assert status == 200, text
            status, text = send(url, "POST", "/slots/0?action=save", {"filename": "slot.bin"})
            assert status == 200, text
            saved = json.loads(text)["n_saved"]
            shutil.copyfile(slots / "slot.bin", SLOT_FILE)
    document = {
        "llama_cpp": version,
        "server": "llama-server",
        "model": model.name,
        "flags": list(FLAGS),
        "slot_file": {"request": SLOT_PROMPT, "n_saved": saved},
        "cases": cases,
    }
    OUT.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {OUT} ({len(cases)} requests, {version}) and {SLOT_FILE} ({saved} tokens)")


if __name__ == "__main__":
    main()
