"""llama-server flags that place, load and render, started as a user starts them: a real
``llamactor serve`` process per case (the engine in its own process, as by default).

-ot/--override-tensor, -cmoe, -ncmoe, -ncffn (tensor buffer type overrides: which tensors
their patterns placed, and exit 2 for an unknown buffer type), --load-mode and the older
--no-mmap/--mlock (seen in the engine process's memory maps and locked memory), --lazy-mode
(in the model parameters llama.cpp is given), --kv-unified-per-slot (the context of one
request), -sp/--special (special tokens in the text), --path (static files), --spec-default and
ngram-mod, the lookup caches (-lcs/-lcd, ngram-cache), --adaptive-target/--adaptive-decay
(adaptive-p) and --completion-bash.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import pytest
from conftest import free_port
from serveargs import parse_serve

from llamactor.runtime.engine import model as model_module
from llamactor.runtime.engine import ngramcache
from llamactor.runtime.engine.backends import cpu_buffer_types
from llamactor.runtime.engine.model import Model
from llamactor.runtime.engine.placement import buffer_types
from llamactor.runtime.presets import load_models
from llamactor.runtime.service.engineoptions import load_options

pytestmark = pytest.mark.slow  # a server process per test

LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]
STARTUP_TIMEOUT_S = 60
BASE = ["-t", "1", "-np", "1", "-c", "512"]


@contextmanager
def serve(argv: list[str]) -> Iterator[tuple[str, subprocess.Popen, list[dict[str, Any]]]]:
    """A ``llamactor serve`` process on a free loopback port: its URL, the process and, once it
    stopped, its JSON log records."""
    port = free_port()
    proc = subprocess.Popen(
        [*LLAMACTOR, "serve", "--host", "127.0.0.1", "--port", str(port), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    records: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "exited"
            assert time.monotonic() < deadline, "server did not become ready"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        yield url, proc, records
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        records.extend(json.loads(line) for line in err.decode().splitlines() if line.startswith("{"))
    assert proc.returncode == 0, err.decode()


def refused(argv: list[str]) -> str:
    """The stderr of a ``llamactor serve`` that must stop with exit code 2."""
    proc = subprocess.run(
        [*LLAMACTOR, "serve", "--host", "127.0.0.1", "--port", str(free_port()), *argv],
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 2, (argv, proc.stderr.decode())
    return proc.stderr.decode()


def complete(url: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(url + "/completion", json={"temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (the engine process is a child of the server)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def mapped_and_locked(pid: int, path: Path) -> tuple[bool, int]:
    """Whether any process of the server maps the model file, and their locked memory in kB."""
    mapped, locked = False, 0
    for p in descendants(pid):
        mapped |= str(path) in Path(f"/proc/{p}/maps").read_text()
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmLck:"):
                locked += int(line.split()[1])
    return mapped, locked


def token_id(url: str, text: str) -> int:
    (token,) = httpx.post(url + "/tokenize", json={"content": text}).json()["tokens"]
    return token


# ---- tensor buffer type overrides --------------------------------------------------------------


def test_override_tensor_places_the_matched_tensors(tiny_model: Path):
    """-ot PATTERN=CPU,... and -ncffn N reach llama.cpp's tensor_buft_overrides: the engine logs
    each tensor their patterns placed (as llama.cpp reports them), and the model serves."""
    argv = [*BASE, "-m", str(tiny_model), "-ot", r"blk\.1\.attn_q=CPU,output_norm=CPU", "-ncffn", "1"]
    with serve(argv) as (url, _, records):
        assert complete(url, prompt="hello", n_predict=4)["tokens_predicted"] == 4
    (placed,) = [r["tensors"] for r in records if r.get("event") == "tensor_overrides"]
    assert set(placed) == {
        "blk.1.attn_q.weight",
        "output_norm.weight",
        "blk.0.ffn_gate.weight",
        "blk.0.ffn_down.weight",
        "blk.0.ffn_up.weight",
    }
    # "on the CPU" is the CPU's own buffer type or one of its extra ones that this build has and
    # this CPU runs (AMX, CPU_REPACK): llama.cpp prefers those where they take the tensor
    assert set(placed.values()) <= set(cpu_buffer_types()), placed


def test_cpu_moe_flags_start_on_a_dense_model(tiny_model: Path):
    """-cmoe and -ncmoe place MoE expert weights: a dense model has none, so nothing is placed
    (their patterns are given to llama.cpp all the same) and it serves."""
    env_argv = [*BASE, "-m", str(tiny_model), "-cmoe", "-ncmoe", "2"]
    with serve(env_argv) as (url, _, records):
        assert complete(url, prompt="hello", n_predict=2)["tokens_predicted"] == 2
    assert [r["tensors"] for r in records if r.get("event") == "tensor_overrides"] == [{}]


def test_override_tensor_errors_exit_2(tiny_model: Path):
    """An unknown buffer type stops startup naming it and listing the available ones (as
    llama-server prints them); a part without '=' and a negative -ncmoe are argparse errors; a
    pattern that is no regular expression is llama.cpp's load error."""
    err = refused(["-m", str(tiny_model), "-ot", "attn=NOPE"])
    known = ", ".join(sorted(buffer_types()))  # the build's devices: CPU, and GPUs where built with some
    assert "unknown buffer type 'NOPE'" in err and f"available buffer types: {known}" in err
    assert "is not PATTERN=BUFFER_TYPE" in refused(["-m", str(tiny_model), "-ot", "attn"])
    assert "must be >= 0" in refused(["-m", str(tiny_model), "-ncmoe", "-1"])
    assert "regular expression" in refused([*BASE, "-m", str(tiny_model), "-ot", "[=CPU"])


# ---- load and lazy modes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "mapped", "locked"),
    [
        ([], True, False),  # auto: mmap
        (["--no-mmap"], False, False),
        (["-lm", "none"], False, False),
        (["--mlock"], True, True),  # older llama-server: mmap and mlock
        (["--no-mmap", "--mlock"], False, True),
        (["--load-mode", "mlock"], False, True),
    ],
)
def test_load_mode_reaches_llama_cpp(tiny_model: Path, flags: list[str], mapped: bool, locked: bool):
    """--load-mode and the older --no-mmap/--mlock decide how llama.cpp reads the weights: the
    engine process maps the model file or not, and locks memory or not."""
    with serve([*BASE, "-m", str(tiny_model), *flags]) as (url, proc, _):
        assert complete(url, prompt="hi", n_predict=2)["tokens_predicted"] == 2
        is_mapped, kb_locked = mapped_and_locked(proc.pid, tiny_model)
    assert is_mapped is mapped and (kb_locked > 0) is locked, (is_mapped, kb_locked)


def test_load_and_lazy_modes_are_the_model_parameters(tiny_model: Path, monkeypatch: pytest.MonkeyPatch):
    """What llama.cpp is given for -lzm and -lm (a tiny llama model has no tensor lazy reading
    would apply to, so the parameters are read where the model loads)."""
    seen: list[tuple[int, int]] = []
    real = llama_cpp.llama_model_load_from_file

    def load(path: bytes, params: Any) -> Any:
        seen.append((params.load_mode, params.lazy_mode))
        return real(path, params)

    monkeypatch.setattr(model_module.llama_cpp, "llama_model_load_from_file", load)
    for argv, expected in [
        ([], (llama_cpp.LLAMA_LOAD_MODE_AUTO, llama_cpp.LLAMA_LAZY_MODE_AUTO)),
        (["-lzm", "on", "-lm", "dio"], (llama_cpp.LLAMA_LOAD_MODE_DIRECT_IO, llama_cpp.LLAMA_LAZY_MODE_ON)),
        (["--lazy-mode", "off", "--no-mmap"], (llama_cpp.LLAMA_LOAD_MODE_NONE, llama_cpp.LLAMA_LAZY_MODE_OFF)),
    ]:
        cfg = parse_serve(["-m", str(tiny_model), *argv]).config.validated()
        Model(cfg.model, load_options(cfg)).close()
        assert seen[-1] == expected, argv
    with serve([*BASE, "-m", str(tiny_model), "-lzm", "on"]) as (url, _, _):
        assert complete(url, prompt="hi", n_predict=2)["tokens_predicted"] == 2
    assert "must be one of on, auto, off" in refused(["-m", str(tiny_model), "--lazy-mode", "sometimes"])
    assert "--load-mode and --mmap/--no-mmap/--mlock disagree" in refused(
        ["-m", str(tiny_model), "-lm", "mmap", "--no-mmap"]
    )


# ---- context, text, files ----------------------------------------------------------------------


def test_kv_unified_per_slot_sizes_and_caps_a_requests_context(tiny_model: Path):
    """--kv-unified-per-slot N: without -c the context is -np x N; a request's context is at most
    N (with -kvu a slot could otherwise use all of it): a longer prompt is refused, naming N."""
    argv = ["-t", "1", "-np", "2", "-kvu", "--kv-unified-per-slot", "64", "-m", str(tiny_model)]
    with serve(argv) as (url, _, _):
        props = httpx.get(url + "/props").json()
        assert props["n_ctx"] == 64 and props["default_generation_settings"]["n_ctx"] == 64
        r = httpx.post(url + "/completion", json={"prompt": "word " * 80, "n_predict": 1})
        assert r.status_code == 400 and r.json()["error"]["n_ctx"] == 64, r.text
        assert complete(url, prompt="hi", n_predict=4)["tokens_predicted"] == 4
    with serve([*BASE, "-kvu", "--kv-unified-per-slot", "100", "-m", str(tiny_model)]) as (url, _, _):
        assert httpx.get(url + "/props").json()["n_ctx"] == 100  # with -c: only the cap
    assert "--kv-unified-per-slot must be >= 0" in refused(["-m", str(tiny_model), "--kv-unified-per-slot", "-5"])


def test_kv_unified_per_slot_in_router_presets(tmp_path: Path):
    """Router mode: a model's preset (or the router's command line) with --kv-unified-per-slot
    and no context size gets -np x N, as a single model does; a context size given wins."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    preset = tmp_path / "p.ini"
    preset.write_text(f"[a]\nmodel = {model}\nnp = 3\nkv-unified-per-slot = 100\n[b]\nmodel = {model}\nc = 512\n")
    alone = load_models(None, str(preset), parse_serve([]).given).specs
    assert [(spec.config.n_ctx, spec.config.ctx_per_request) for spec in alone] == [(300, 100), (512, 128)]
    given = parse_serve(["--kv-unified-per-slot", "64"]).given
    specs = {spec.name: spec.config for spec in load_models(None, str(preset), given).specs}
    assert (specs["a"].n_ctx, specs["a"].ctx_per_request) == (192, 64)  # the command line's N over the preset's
    assert (specs["b"].n_ctx, specs["b"].kv_unified_per_slot) == (512, 64)


def test_special_renders_special_tokens(tiny_model: Path):
    """-sp: a generated special token is its text (llama-server's --special), the end-of-generation
    token included, and /detokenize renders it so too; without it they render empty."""
    for flags, im_start, eos in ([], "", ""), (["-sp"], "<|im_start|>", "<|eos|>"):
        with serve([*BASE, "-m", str(tiny_model), *flags]) as (url, _, _):
            forced = complete(url, prompt="hi", n_predict=2, logit_bias=[[token_id(url, "<|im_start|>"), 100]])
            assert forced["content"] == im_start * 2
            ended = complete(url, prompt="hi", n_predict=8, logit_bias=[[token_id(url, "<|eos|>"), 100]])
            assert ended["content"] == eos and ended["stop_type"] == "eos"
            detokenized = httpx.post(url + "/detokenize", json={"tokens": [token_id(url, "<|im_start|>")]})
            assert detokenized.json()["content"] == im_start  # the API process renders them alike


def test_path_serves_static_files(tiny_model: Path, tmp_path: Path):
    """--path DIR: its files at / (index.html for /), the API's routes as before, a missing file
    the server's 404; a directory that does not exist stops startup."""
    (tmp_path / "index.html").write_text("<h1>mine</h1>")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "data.json").write_text('{"x": 1}')
    with serve([*BASE, "-m", str(tiny_model), "--path", str(tmp_path)]) as (url, _, _):
        assert httpx.get(url + "/").text == "<h1>mine</h1>"
        r = httpx.get(url + "/sub/data.json")
        assert r.status_code == 200 and r.json() == {"x": 1} and r.headers["content-type"] == "application/json"
        missing = httpx.get(url + "/nothing.txt")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
        assert httpx.post(url + "/sub/data.json").status_code == 404
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert complete(url, prompt="hi", n_predict=2)["tokens_predicted"] == 2
    assert "--path: not a directory" in refused(["-m", str(tiny_model), "--path", str(tmp_path / "none")])


# ---- speculation, sampling ---------------------------------------------------------------------


def test_spec_default_and_ngram_mod_draft_long_repeats(tiny_model: Path):
    """--spec-default is llama-server's default speculation, ngram-mod (a 24-token window, drafts
    of 48 to 64 tokens): an output that repeats a long passage of its prompt (a grammar makes the
    random model write it) gets drafts of at least 48 tokens, accepted. --spec-type ngram-mod's
    own flags shorten them; out-of-range values stop startup."""
    words = [f"w{i}" for i in range(90)]
    prompt = " ".join(words) + " " + " ".join(words[:20])
    grammar = 'root ::= "' + "".join(f" {w}" for w in words[20:]) + '"'
    body = {"prompt": prompt, "n_predict": 200, "grammar": grammar, "id_slot": 0}
    with serve([*BASE, "-c", "1024", "-m", str(tiny_model), "--spec-default"]) as (url, _, _):
        out = complete(url, **body)
        slot = httpx.get(url + "/slots").json()[0]
        assert slot["speculative"] is True and out["timings"]["draft_n"] == slot["draft_n"]
        assert slot["draft_n"] >= 48 and slot["draft_n"] / slot["draft_n_steps"] >= 48
        assert slot["draft_n_accepted"] >= 48
    argv = ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "8", "--spec-ngram-mod-n-max", "6"]
    with serve([*BASE, "-c", "1024", "-m", str(tiny_model), *argv, "--spec-ngram-mod-n-min", "2"]) as (url, _, _):
        out = complete(url, **body)
        slot = httpx.get(url + "/slots").json()[0]
        assert slot["draft_n_steps"] > 10 and slot["draft_n"] <= 6 * slot["draft_n_steps"]
        assert slot["draft_n_accepted"] > slot["draft_n"] // 2
    assert "--spec-ngram-mod-n-match must be between 1 and 1024" in refused(
        ["-m", str(tiny_model), "--spec-default", "--spec-ngram-mod-n-match", "0"]
    )


def test_adaptive_p_sampler(tiny_model: Path):
    """--adaptive-target/--adaptive-decay set the server's defaults of the request fields
    adaptive_target/adaptive_decay; with "adaptive_p" in the samplers it picks the token: a
    negative target is dist's pick (the same tokens for a seed), a target of 0 others."""
    argv = [*BASE, "-m", str(tiny_model), "--adaptive-target", "0", "--adaptive-decay", "0.5"]
    body = {"prompt": "hello", "n_predict": 24, "temperature": 1.5, "top_k": 0, "min_p": 0, "top_p": 1, "seed": 7}
    with serve(argv) as (url, _, _):
        params = httpx.get(url + "/props").json()["default_generation_settings"]["params"]
        assert (params["adaptive_target"], params["adaptive_decay"]) == (0.0, 0.5)
        dist = complete(url, **body)
        adaptive = complete(url, **body, samplers=["temperature", "adaptive_p"])
        off = complete(url, **body, samplers=["temperature", "adaptive_p"], adaptive_target=-1)
        assert off["content"] == dist["content"] and adaptive["content"] != dist["content"]
        assert adaptive["generation_settings"]["adaptive_target"] == 0.0
        for field, value in (("adaptive_target", 1.5), ("adaptive_decay", 1.0)):
            r = httpx.post(url + "/completion", json={**body, field: value})
            assert r.status_code == 400 and field in r.json()["error"]["message"]


# ---- the command line itself -------------------------------------------------------------------


def test_completion_bash_prints_a_working_script(tmp_path: Path):
    """--completion-bash prints a bash completion script and exits 0 without loading anything;
    sourced, it completes ``llamactor serve --override-t`` to the options starting so, and the
    word after -m to GGUF files."""
    proc = subprocess.run([*LLAMACTOR, "serve", "--completion-bash"], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    script = proc.stdout.decode()
    assert "complete -F _llamactor_completions llamactor" in script
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    (tmp_path / "c.sh").write_text(script)
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "m.txt").write_bytes(b"")

    def complete_words(*words: str) -> list[str]:
        probe = (
            f"source {tmp_path / 'c.sh'}; COMP_WORDS=({' '.join(words)}); COMP_CWORD={len(words) - 1}; "
            '_llamactor_completions; echo "${COMPREPLY[@]}"'
        )
        out = subprocess.run([bash, "-c", probe], capture_output=True, text=True, timeout=30, cwd=tmp_path)
        return sorted(out.stdout.split())

    assert complete_words("llamactor", "serve", "--override-t") == ["--override-tensor", "--override-tensor-draft"]
    assert complete_words("llamactor", "se") == ["serve"]
    assert complete_words("llamactor", "serve", "-m", "m") == ["m.gguf"]


# ---- lookup caches -----------------------------------------------------------------------------

PASSAGE = "QZXJVKWPFGBMHDLCRNSTYUIOAE0123456789"  # distinct characters: no n-gram repeats in it


def test_lookup_caches_draft_and_the_dynamic_one_is_kept(tiny_model: Path, tmp_path: Path):
    """-lcd: an output no request saw before gets no draft; once earlier requests' tokens are in
    the dynamic cache (merged as the slot's next request starts) the same output is drafted and
    accepted; the cache is written when the server stops. -lcs with that file as the static
    cache drafts it from the first request. A missing or malformed cache file is exit 2."""
    dynamic = tmp_path / "dynamic.bin"
    body = {"prompt": "hello", "n_predict": 48, "grammar": f'root ::= "{PASSAGE}"', "id_slot": 0}
    with serve([*BASE, "-m", str(tiny_model), "--spec-type", "ngram-cache", "-lcd", str(dynamic)]) as (url, _, _):
        runs = [complete(url, **body) for _ in range(3)]
        assert {r["content"] for r in runs} == {PASSAGE}
        assert [r["timings"].get("draft_n_accepted", 0) for r in runs[:2]] == [0, 0]  # none, then counts of 1
        assert runs[2]["timings"]["draft_n_accepted"] > 0
        assert not dynamic.exists()  # written when the server stops
    cache = ngramcache.load(dynamic)
    assert max(count for part in cache.values() for count in part.values()) >= 3  # three requests' tokens
    with serve([*BASE, "-m", str(tiny_model), "-lcs", str(dynamic)]) as (url, _, _):
        first = complete(url, **body)
        assert first["content"] == PASSAGE and first["timings"]["draft_n_accepted"] >= first["tokens_predicted"] // 2
        assert httpx.get(url + "/slots").json()[0]["speculative"] is True
    assert "file not found" in refused(["-m", str(tiny_model), "-lcs", str(tmp_path / "none.bin")])
    (tmp_path / "bad.bin").write_bytes(b"\x01\x00\x00\x00\x02")
    assert "is not a llama.cpp n-gram lookup cache" in refused(
        [*BASE, "-m", str(tiny_model), "-lcs", str(tmp_path / "bad.bin")]
    )
    assert "does not use the lookup caches" in refused(
        ["-m", str(tiny_model), "--spec-type", "ngram-simple", "-lcd", str(dynamic)]
    )


def test_ngram_cache_file_format():
    """The files are llama.cpp's: per n-gram its 4 tokens (-1 padded) and follower count, then
    (token, count) pairs, int32 little-endian; a save loads back equal."""
    import struct

    raw = struct.pack("<5i", 5, 6, -1, -1, 2) + struct.pack("<4i", 7, 3, 9, 1)
    path = Path(tempfile.mkdtemp()) / "c.bin"
    path.write_bytes(raw)
    cache = ngramcache.load(path)
    assert cache == {(5, 6, -1, -1): {7: 3, 9: 1}}
    ngramcache.update(cache, [1, 2, 3], 3)
    ngramcache.save(cache, path)
    assert ngramcache.load(path) == cache and path.read_bytes().startswith(raw[:20])
    assert ngramcache.draft([4, 5, 6], 4, {}, {}, cache) == [7]  # static 2-gram (5, 6): 3 of 4 say 7
