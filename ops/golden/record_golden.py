"""llama-server's token ids for fixed requests on the tiny test model, and llamactor's beside them.

    .venv/bin/python ops/golden/record_golden.py [--check] [/path/to/llama-server]

``--check``: llama-server (built on this machine with the same CMake arguments as llamactor's
build, as ``make conformance`` builds it) and llamactor serve the tiny model, one slot and one
thread each, and every request below is sent to both: the token ids must be equal, case by case
(exit 1 naming those that differ). This is the token-for-token parity check; it needs a
llama-server built here because seeded samples on the tiny model's nearly flat logits depend on
the CPU kernels (tests/test_parity.py checks the sampler chain against a reference computed
through the same libllama instead, on any machine).

Without ``--check`` it records llama-server's answers in tests/golden/llama_server_tokens.json,
whose requests tests/test_parity.py sends (the token ids are kept per CPU class, as recorded).
The servers run on loopback and are stopped afterwards.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "golden" / "llama_server_tokens.json"
DEFAULT_SERVER = "/tmp/llama-build/bin/llama-server"
PROMPT = "the quick brown fox jumps over the lazy dog. hello world, the cat sat on the mat"
N = 24
_BASE: dict[str, Any] = {"prompt": PROMPT, "n_predict": N, "ignore_eos": True, "cache_prompt": False}

# name -> extra request fields; every case is non-trivial sampling on the tiny model.
CASES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "temp_seed": {"temperature": 0.8, "seed": 42},
    "temp_high_seed": {"temperature": 1.5, "seed": 7, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    "top_k_p_min_p": {"temperature": 1.2, "seed": 3, "top_k": 20, "top_p": 0.9, "min_p": 0.02},
    "penalties": {
        "temperature": 1.0,
        "seed": 11,
        "repeat_penalty": 1.3,
        "repeat_last_n": 32,
        "frequency_penalty": 0.4,
        "presence_penalty": 0.3,
    },
    "typical": {"temperature": 1.0, "seed": 5, "typical_p": 0.8, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    "mirostat_v1": {"temperature": 1.0, "seed": 9, "mirostat": 1, "mirostat_tau": 4.0, "mirostat_eta": 0.2},
    "mirostat_v2": {"temperature": 1.0, "seed": 9, "mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.1},
    "xtc": {
        "temperature": 1.0,
        "seed": 13,
        "xtc_probability": 0.7,
        "xtc_threshold": 0.05,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
    },
    "dry": {
        "temperature": 0.7,
        "seed": 17,
        "dry_multiplier": 1.5,
        "dry_base": 1.75,
        "dry_allowed_length": 1,
        "dry_penalty_last_n": 64,
    },
    "top_n_sigma_dynatemp": {
        "temperature": 1.0,
        "seed": 21,
        "top_n_sigma": 2.0,
        "dynatemp_range": 0.5,
        "dynatemp_exponent": 1.5,
    },
    "samplers_order": {
        "temperature": 0.9,
        "seed": 23,
        "samplers": ["temperature", "top_k", "min_p"],
        "top_k": 30,
        "min_p": 0.03,
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"llama-server refused {body}: {exc.read().decode()}") from None


@contextmanager
def running_llama_server(server: str, model: pathlib.Path, *flags: str, program: tuple[str, ...] = ()) -> Iterator[str]:
    """``server`` (with ``program``'s words first: llamactor's ``serve``) serving ``model`` on a
    free loopback port with ``flags``, healthy: its URL. Stopped on the way out."""
    port = _free_port()
    proc = subprocess.Popen(
        [server, *program, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from tinymodel import cpu_class, write_tiny_model

    args = [a for a in sys.argv[1:] if a != "--check"]
    server = args[0] if args else DEFAULT_SERVER
    if "--check" in sys.argv[1:]:
        sys.exit(check(server, write_tiny_model))
    version = subprocess.run([server, "--version"], capture_output=True, text=True).stderr.strip().splitlines()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(pathlib.Path(tmp) / "tiny.gguf")
        with running_llama_server(server, model, "-np", "1", "-t", "1", "-c", "2048", "--no-webui") as url:
            cases = []
            for name, fields in CASES.items():
                request = {**_BASE, **fields, "return_tokens": True}
                res = _post(url + "/completion", request)
                cases.append({"name": name, "request": request, "tokens": res["tokens"]})
    here = cpu_class()
    old = {c["name"]: c for c in json.loads(OUT.read_text())["cases"]} if OUT.exists() else {}
    merged = []
    for case in cases:
        prior = old.get(case["name"])
        tokens = dict(prior["tokens"]) if prior and prior["request"] == case["request"] else {}
        tokens[here] = case["tokens"]
        merged.append({**case, "tokens": dict(sorted(tokens.items()))})
    document = {"llama_cpp": version, "server": "llama-server", "model": "tests/tinymodel.py", "cases": merged}
    OUT.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {OUT} ({len(cases)} cases on {here}, {version})")


def check(server: str, write_tiny_model: Any) -> int:
    """Every case's token ids from llama-server and from llamactor, compared; 0 when all equal."""
    flags = ("-np", "1", "-t", "1", "-c", "2048")
    llamactor = str(ROOT / ".venv" / "bin" / "llamactor")
    differ = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(pathlib.Path(tmp) / "tiny.gguf")
        with (
            running_llama_server(server, model, *flags, "--no-webui") as ref,
            running_llama_server(llamactor, model, *flags, program=("serve",)) as ours,
        ):
            for name, fields in CASES.items():
                request = {**_BASE, **fields, "return_tokens": True}
                same = _post(ref + "/completion", request)["tokens"] == _post(ours + "/completion", request)["tokens"]
                print(f"{name:<22} {'same' if same else 'DIFFERENT'}")
                differ += [] if same else [name]
    print(f"{len(CASES) - len(differ)} of {len(CASES)} cases give llama-server's token ids")
    return 1 if differ else 0


if __name__ == "__main__":
    main()
