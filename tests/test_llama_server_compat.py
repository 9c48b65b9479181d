"""Coming from llama-server: its command line, its server-wide defaults and its response parts.

The command line: every option llama-server's ``--help`` lists (tests/llama_server_flags.txt, read from
the vendored ``common/arg.cpp``) is accepted by ``llamactor serve``, logged as ignored, or
refused with exit code 2 naming it; its ``LLAMA_ARG_*`` variables work; sampling flags set
the server's defaults for requests that leave a field out (HTTP and the embedding API).
The response parts: ``timings``, ``usage.prompt_tokens_details.cached_tokens``,
``system_fingerprint``, native ``generation_settings``/``tokens_cached``/``truncated``/
``stop_type``, and the ``exceed_context_size_error`` type with both sizes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import free_port, open_server
from serveargs import parse_serve as _parse

from llamactor.protocol.errors import ExceedContextSize
from llamactor.protocol.sampling import DEFAULT_SEED, SamplingParams
from llamactor.runtime import Runtime, cli, cliargs, cliflags, flagvalues
from llamactor.runtime.engine.rpc import list_devices

LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]
REFERENCE = Path(__file__).with_name("llama_server_flags.txt")
README = Path(__file__).resolve().parent.parent / "README.md"
STARTUP_TIMEOUT_S = 30
TIMING_KEYS = {
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
}
# Read only for downloads, and often set in users' shells: llamactor does not look at it.
UNREAD_VARIABLES = {"HF_TOKEN"}
ARGPARSE_OWN = {"-h", "--help", "--usage"}


def _reference() -> list[tuple[list[str], list[str], str, str]]:
    rows = []
    for line in REFERENCE.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        names, neg, env, takes = (part.strip() for part in line.split(";"))
        rows.append((names.split(), neg.split(), env, takes))
    return rows


def _table() -> dict[str, tuple[cliargs.Group, cliargs.Opt]]:
    return {name: (g, o) for g, o in cliargs.entries(cliflags.GROUPS) for name in o.spellings}


# ---- the table against llama-server's own list ------------------------------------------


def test_every_llama_server_option_and_variable_is_in_the_table():
    """Each spelling (and --no- spelling) and each variable of llama-server's options is
    in the flag table, and a switch is a switch, a value option takes a value."""
    table = _table()
    variables = {o.env for _, o in table.values() if o.env}
    rows = _reference()
    assert len(rows) > 250
    for names, neg, env, takes in rows:
        for name in names + neg:
            if name in ARGPARSE_OWN:
                continue
            assert name in table, f"llama-server's {name} is not in runtime/cliflags.py"
            _, o = table[name]
            assert (o.value is None) == (takes == "switch"), (name, o.value, takes)
        if env and env not in UNREAD_VARIABLES:
            assert env in variables, f"llama-server's variable {env} is not in runtime/cliflags.py"
    spellings = [n for _, o in cliargs.entries(cliflags.GROUPS) for n in o.spellings]
    assert len(spellings) == len(set(spellings)), "a spelling is in two groups"


_SAMPLE_VALUES = {
    "--model": "x.gguf",
    "--tools": "read_file",
    "--tools-runtime": "docker-container:abc",
    "--mcp-servers-json": "{}",
    "--flash-attn": "auto",
    "--split-mode": "layer",
    "--pooling": "mean",
    "--load-mode": "mmap",
    "--lazy-mode": "on",
    "--override-tensor": "attn=CPU",
    "--reasoning-format": "none",
    "--chat-template-kwargs": "{}",
    "--json-schema": "{}",
    "--samplers": "top_k",
    "--sampling-seq": "k",
    "--logit-bias": "1+1",
    "--gpu-layers": "1",
    "--device": "none",
    "--log-format": "json",
    "--log-colors": "auto",
    "--alias": "a",
    "--tensor-split": "1",
    "--api-key": "k",
    "--rpc": "127.0.0.1:1",
    "--scheduler": "continuous",
    "--dry-sequence-breaker": "x",
    "--seed": "7",
    "--lora-scaled": "a.gguf:0.5",
    "--rope-scaling": "yarn",
    "--override-kv": "general.name=str:x",
    "--control-vector-scaled": "a.gguf:0.5",
    "--spec-type": "ngram-simple",
}


@pytest.mark.slow
def test_every_llama_server_option_parses_and_is_sorted(tmp_path: Path):
    """``serve <option> [value]`` parses for every llama-server option (no "unrecognized
    arguments"), and lands in exactly one place: a field, the ignored list or the refused list."""
    file = tmp_path / "f.txt"
    file.write_text("{}\n")
    table = _table()
    counts = {"field": 0, "ignored": 0, "refused": 0}
    for names, neg, _env, takes in _reference():
        for name in names + neg:
            if name in ARGPARSE_OWN:
                continue
            _, o = table[name]
            if takes == "switch":
                value = []
            elif takes == "two":
                value = ["1", "2"]
            elif "file" in name or name == "-jf":
                value = [str(file)]
            else:
                value = [_SAMPLE_VALUES.get(o.names[-1], _SAMPLE_VALUES.get(name, "1"))]
            try:
                opts = _parse([name, *value])
                outcome = "ignored" if opts.ignored else "field"
            except cli.ConfigError as exc:
                assert name in str(exc), (name, str(exc))
                outcome = "refused"
            counts[outcome] += 1
    assert all(counts.values()), counts


def test_refused_message_names_every_refused_flag_and_accepts_harmless_values():
    """Flags that need a download are refused by name; ``--spec-type none`` is what llamactor
    does without speculation, and -ncmoe 0/-ncffn 0 place nothing."""
    with pytest.raises(cli.ConfigError) as info:
        _parse(["-hf", "org/m", "-hfd", "org/d", "--mmproj-url", "http://m.gguf"])
    for flag in ("-hf", "-hfd", "--mmproj-url"):
        assert flag in str(info.value)
    opts = _parse(["--spec-type", "none", "-ncmoe", "0", "-ncffn", "0", "--no-webui"])
    assert opts.ignored == () and opts.config.webui is False and opts.config.tensor_overrides == ()


def test_router_mode_and_sleep_flags_are_built():
    """llama-server's router mode and sleeping flags are built (tests/test_router_mode.py): none
    is refused; without -m they make the server a router, with -m the router's are ignored."""
    argv = ["--models-dir", "d", "--models-preset", "p.ini", "--models-max", "2", "--no-models-autoload"]
    opts = _parse([*argv, "--sleep-idle-seconds", "30"], {"LLAMA_ARG_MODELS_AUTOLOAD": "1"})
    assert opts.router and opts.ignored == () and opts.config.sleep_idle_seconds == 30
    assert (opts.models_dir, opts.models_preset, opts.models_max, opts.models_autoload) == ("d", "p.ini", 2, False)
    single = _parse(["-m", "x.gguf", *argv])
    assert not single.router and [flag for flag, _ in single.ignored] == argv[::2]  # each flag, not its value


def test_variables_and_command_line_precedence():
    """LLAMA_ARG_* variables set options (LLAMA_ARG_NO_* turns a switch off); a flag
    on the command line wins over its variable, as in llama-server."""
    env = {
        "LLAMA_ARG_TEMPERATURE": "0.25",
        "LLAMA_ARG_CTX_SIZE": "1024",
        "LLAMA_ARG_NO_CONT_BATCHING": "1",
        "LLAMA_ARG_KV_UNIFIED": "true",
        "LLAMA_API_KEY": "k1,k2",
        "LLAMA_ARG_TOP_K": "3",
        "LLAMA_ARG_ENDPOINT_SLOTS": "0",
        "LLAMA_ARG_ENDPOINT_METRICS": "1",
    }
    opts = _parse(["--top-k", "5"], env)
    cfg = opts.config
    assert cfg.sampling.temperature == 0.25 and cfg.sampling.top_k == 5  # the flag wins over LLAMA_ARG_TOP_K
    assert cfg.n_ctx == 1024 and cfg.kv_unified and cfg.scheduler == "no-cont-batching"
    assert cfg.api_keys == ("k1", "k2") and cfg.endpoint_slots is False and cfg.endpoint_metrics is True
    assert opts.ignored == ()
    with pytest.raises(SystemExit):
        _parse([], {"LLAMA_ARG_CTX_SIZE": "many"})
    with pytest.raises(cli.ConfigError, match="-nocb and --scheduler disagree"):
        _parse(["-nocb", "--scheduler", "cohort"])


def test_llama_server_value_forms():
    """llama-server's special values: -np/-t -1 (auto), -ngl all/auto, a bare -fa (older
    llama-server), --load-mode, -a with several aliases, -dev none, --rerank; KV types and cache."""
    default = cli.RuntimeConfig()
    cfg = _parse(shlex.split("-np -1 -t -1 -ngl all -fa -lm none -a second,first -dev none --context-shift")).config
    assert (cfg.parallel, cfg.threads) == (default.parallel, default.threads)
    assert cfg.n_gpu_layers == 999 and cfg.flash_attn == "on" and cfg.model_load_mode == "none"
    assert cfg.aliases == ("first", "second") and cfg.model_name == "first"  # llama-server's sorted set
    assert cfg.devices == () and cfg.context_shift is True
    assert _parse(["-ngl", "auto", "--no-mmap"]).config.n_gpu_layers == -1  # every layer on the GPUs there are
    kv = _parse(["-ctk", "q8_0", "-ctv", "q4_0", "--cache-ram", "0"]).config
    assert (kv.cache_type_k, kv.cache_type_v, kv.cache_ram_mib) == ("q8_0", "q4_0", 0)
    assert _parse(["--no-mmap"]).config.model_load_mode == "none"
    rerank = _parse(["--reranking"]).config
    assert rerank.embedding and rerank.pooling == "rank"
    opts = _parse(["-lm", "mlock", "--log-jsonl"])
    assert opts.log_format == "json" and opts.ignored == () and opts.config.model_load_mode == "mlock"
    with pytest.raises(SystemExit):
        _parse(["-c", "0"])  # the model's training context: not supported, said by argparse


def test_sampling_flags_build_the_server_defaults(tmp_path: Path):
    """llama-server's sampling flags, with its spellings and value forms, become
    ``RuntimeConfig.sampling``."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    cfg = _parse(
        shlex.split(
            "--temp -1 --top-k 7 --top-p 0.5 --min-p 0.1 --typical 0.9 --top-nsigma 1.5 --xtc-probability 0.2 "
            "--xtc-threshold 0.3 --repeat-last-n 32 --repeat-penalty 1.3 --presence-penalty 0.1 "
            "--frequency-penalty 0.2 --dry-multiplier 0.8 --dry-base 2 --dry-allowed-length 3 --dry-penalty-last-n 16 "
            "--dry-sequence-breaker a --dry-sequence-breaker b --dynatemp-range 0.5 --dynatemp-exp 2 --mirostat 2 "
            "--mirostat-lr 0.2 --mirostat-ent 4 -s -1 --samplers top_k;temperature -l 15+1 -l 16-inf "
            f"-jf {schema} --ignore-eos -n 9 -r STOP --no-cache-prompt"
        )
    ).config
    p = cfg.sampling
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.typical_p, p.top_n_sigma) == (0.0, 7, 0.5, 0.1, 0.9, 1.5)
    assert (p.xtc_probability, p.xtc_threshold, p.repeat_last_n, p.repeat_penalty) == (0.2, 0.3, 32, 1.3)
    assert (p.presence_penalty, p.frequency_penalty, p.dry_multiplier, p.dry_base) == (0.1, 0.2, 0.8, 2.0)
    assert (p.dry_allowed_length, p.dry_penalty_last_n, p.dry_sequence_breakers) == (3, 16, ("a", "b"))
    assert (p.dynatemp_range, p.dynatemp_exponent, p.mirostat, p.mirostat_eta, p.mirostat_tau) == (
        0.5,
        2.0,
        2,
        0.2,
        4.0,
    )
    assert p.seed == DEFAULT_SEED and p.samplers == ("top_k", "temperature")
    assert p.logit_bias == ((15, 1.0), (16, float("-inf"))) and "root" in p.grammar
    assert cfg.ignore_eos and cfg.n_predict_max == 9 and cfg.stop == ("STOP",) and not cfg.cache_prompt
    assert _parse(["--sampling-seq", "kt", "--seed", "42"]).config.sampling == SamplingParams(
        samplers=("top_k", "temperature"), seed=42
    )
    with pytest.raises(cli.ConfigError, match="--dry-sequence-breaker none"):
        _parse(["--dry-sequence-breaker", "none"])
    with pytest.raises(SystemExit):  # argparse names the flag and the bad value
        _parse(["--samplers", "top_k;nope"])


def test_docs_generate_the_flag_tables():
    """The docs' flag tables are generated from the option groups at build time (docs/hooks/flags.py),
    so they cannot drift from what ``llamactor serve`` parses."""
    docs = Path(__file__).resolve().parent.parent / "docs"
    assert "<!-- flags: llama-server -->" in (docs / "compatibility.md").read_text()
    assert "<!-- flags: serve -->" in (docs / "server.md").read_text()


# ---- llamactor serve as a llama-server user runs it ----------------------------------------


@contextmanager
def _serve(argv: list[str], env: dict[str, str] | None = None, scheme: str = "http") -> Iterator[tuple[str, list[str]]]:
    """A ``llamactor serve`` process on a free port; yields its URL and, after it stops, its log."""
    port = free_port()
    proc = subprocess.Popen(
        [*LLAMACTOR, "serve", "--port", str(port), "--host", "127.0.0.1", *argv],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    url = f"{scheme}://127.0.0.1:{port}"
    lines: list[str] = []
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "exited"
            assert time.monotonic() < deadline, "server did not become ready"
            try:
                if httpx.get(url + "/health", timeout=1, verify=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        yield url, lines
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        lines.extend(err.decode().splitlines())
    assert proc.returncode == 0, "\n".join(lines)


def _events(lines: list[str], event: str) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                out.append(record)
    return out


@pytest.mark.slow
def test_serves_with_the_flags_llama_cpps_own_server_tests_pass(tiny_model: Path, tmp_path: Path):
    """The flags tools/server/tests/utils.py passes to llama-server
    start ``llamactor serve``; it serves, the implemented ones work (alias, --no-slots, context,
    batch, n-predict, keys, chat template file, sampling defaults), and each flag with no
    meaning here is logged once with its reason."""
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nfile-key\n")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    (tmp_path / "slots").mkdir()
    argv = shlex.split(
        f"--temp 0.8 --seed 42 --model {tiny_model} --batch-size 64 --ubatch-size 32 --threads 1 --cont-batching "
        f"--metrics --no-slots --alias tinyllama --ctx-size 512 --parallel 2 -fa off --n-predict 6 "
        f"--slot-save-path {tmp_path / 'slots'} --api-key k1,k2 --api-key-file {keys} --no-ui --no-models-autoload "
        f"--jinja --reasoning-format none --chat-template-file {template} --offline --no-mmproj --check-tensors "
        f"--n-gpu-layers 99"
    )
    with _serve(argv, env={"LLAMA_ARG_REPEAT_PENALTY": "1.1"}) as (url, lines):
        assert httpx.get(url + "/v1/models").status_code == 401
        for key in ("k1", "k2", "file-key"):
            headers = {"Authorization": f"Bearer {key}"}
            models = httpx.get(url + "/v1/models", headers=headers)
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "tinyllama"
        props = httpx.get(url + "/props", headers=headers).json()
        assert props["total_slots"] == 2 and props["n_ctx"] == 256 and props["endpoint_slots"] is False
        assert httpx.get(url + "/slots", headers=headers).status_code == 501  # --no-slots
        assert props["chat_template"] == template.read_text()
        params = props["default_generation_settings"]["params"]
        assert params["temperature"] == 0.8 and params["seed"] == 42 and params["repeat_penalty"] == 1.1
        assert params["n_predict"] == 6 and props["default_generation_settings"]["n_ctx"] == 256
        r = httpx.post(url + "/completion", headers=headers, json={"prompt": "hello", "n_predict": 50})
        assert r.status_code == 200 and r.json()["tokens_predicted"] <= 6  # --n-predict caps
        assert httpx.get(url + "/", headers=headers).status_code == 404  # --no-ui
    ignored = {r["flag"]: r["reason"] for r in _events(lines, "flag_ignored")}
    assert len(_events(lines, "flag_ignored")) == len(ignored)  # one line each
    expected = {"--cont-batching", "--no-models-autoload", "--offline", "--check-tensors"}
    if all(name.startswith("CPU") for name, _ in list_devices()):
        expected.add("--n-gpu-layers")  # no GPU: the layers stay on the CPU, said once
    assert set(ignored) == expected, ignored
    assert "continuous batching is always on" in ignored["--cont-batching"]


@pytest.mark.slow
def test_log_flags_set_the_logs_of_every_process(tiny_model: Path, tmp_path: Path):
    """llama-server's logging flags reach the API process and the engine process alike:
    ``--log-file`` gets both processes' lines, as text with ``--log-format text``, coloured with
    ``--log-colors on``, without times with ``--no-log-timestamps``; ``--no-log-prefix`` drops the
    level; ``-lv 2`` keeps warnings only and ``--log-disable`` prints nothing at all."""
    base = ["-m", str(tiny_model), "-t", "1", "-c", "256", "-np", "1"]
    ask = {"prompt": "hello", "n_predict": 2}
    log_file = tmp_path / "server.log"
    text_flags = ["--log-file", str(log_file), "--log-format", "text", "--log-colors", "on", "--no-log-timestamps"]
    with _serve([*base, *text_flags, "-lv", "4"]) as (url, lines):
        assert httpx.post(url + "/completion", json=ask).status_code == 200
    written = log_file.read_text()
    for event in ("listening", "engine_build", "request_done"):  # the API process's, the engine's (two)
        assert event in written, written[-2000:]
    assert "\x1b[" in written and not re.search(r"\d{4}-\d\d-\d\dT\d\d:", written)
    assert all(line in written for line in lines if line.strip())  # stderr's lines are in the file too

    with _serve([*base, "--log-format", "json", "--no-log-prefix"]) as (url, lines):
        assert httpx.post(url + "/completion", json=ask).status_code == 200
    done = _events(lines, "request_done")
    assert len(done) == 1 and "level" not in done[0] and "timestamp" in done[0]

    with _serve([*base, "--log-format", "json", "-lv", "2"]) as (url, lines):
        assert httpx.post(url + "/completion", json=ask).status_code == 200
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert records == [r for r in records if r.get("level") in ("warning", "error", "critical")], records

    with _serve([*base, "--log-disable"]) as (url, lines):
        assert httpx.post(url + "/completion", json=ask).status_code == 200
    assert [line for line in lines if line.strip()] == []
    assert flagvalues.verbosity_level(0) == "critical" and flagvalues.verbosity_level(9) == "debug"


@pytest.mark.slow
def test_unbuilt_flags_exit_2_naming_them(tiny_model: Path):
    """A flag for a feature llamactor has not built stops startup with exit code 2 and a
    message naming it (and its variable, when that is how it came)."""
    cases = [
        (
            ["--model-url", "http://host/m.gguf", "--hf-repo-draft", "org/draft"],
            ["--model-url is not supported", "--hf-repo-draft is not supported"],
        ),
        (["-hf", "org/model"], ["-hf is not supported: llamactor never downloads models"]),
    ]
    for flags, messages in cases:
        proc = subprocess.run([*LLAMACTOR, "serve", "-m", str(tiny_model), *flags], capture_output=True, timeout=60)
        assert proc.returncode == 2, (flags, proc.stderr)
        for message in messages:
            assert message in proc.stderr.decode(), proc.stderr.decode()
    proc = subprocess.run(
        [*LLAMACTOR, "serve", "-m", str(tiny_model)],
        capture_output=True,
        timeout=60,
        env={**os.environ, "LLAMA_ARG_MMPROJ_URL": "http://host/m.gguf"},
    )
    assert proc.returncode == 2 and "LLAMA_ARG_MMPROJ_URL is not supported" in proc.stderr.decode()
    proc = subprocess.run([*LLAMACTOR, "serve", "--version"], capture_output=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.decode().startswith("llamactor ")


@pytest.mark.slow
def test_sampling_flags_are_the_servers_defaults(tiny_model: Path):
    """``--temp 0 --seed 42 --top-k 1`` (temperature and top-k from their variables)
    make a request that sends no sampling field greedy, on the native and the OpenAI API;
    ``--repeat-penalty 1.5`` changes the output of such a request, and a request's own field
    still wins over the server's default."""
    argv = ["-m", str(tiny_model), "-t", "1", "-c", "1024", "-np", "2", "--seed", "42", "--repeat-penalty", "1.5"]
    with _serve(argv, env={"LLAMA_ARG_TEMPERATURE": "0", "LLAMA_ARG_TOP_K": "1"}) as (url, _):

        def tokens(**fields: Any) -> list[int]:
            r = httpx.post(
                url + "/completion",
                json={"prompt": "The quick brown fox", "n_predict": 24, "ignore_eos": True, **fields},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        default = tokens()
        assert default == tokens() == tokens(temperature=0, top_k=1, repeat_penalty=1.5, seed=42)
        assert default != tokens(repeat_penalty=1.0)  # the server's penalty was in effect
        settings = httpx.post(url + "/completion", json={"prompt": "x", "n_predict": 1}).json()["generation_settings"]
        assert (settings["temperature"], settings["top_k"], settings["seed"], settings["repeat_penalty"]) == (
            0,
            1,
            42,
            1.5,
        )
        text = httpx.post(
            url + "/completion", json={"prompt": "The quick brown fox", "n_predict": 24, "ignore_eos": True}
        ).json()["content"]
        oai = httpx.post(
            url + "/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 24, "ignore_eos": True}
        ).json()
        assert oai["choices"][0]["text"] == text


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test certificate")
def test_ssl_flags_serve_https(tiny_model: Path, tmp_path: Path):
    """--ssl-cert-file and --ssl-key-file serve HTTPS, as in llama-server."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    argv = [
        "-m",
        str(tiny_model),
        "-t",
        "1",
        "-c",
        "512",
        "-np",
        "1",
        "--ssl-cert-file",
        str(cert),
        "--ssl-key-file",
        str(key),
    ]
    with _serve(argv, scheme="https") as (url, _):
        r = httpx.post(url + "/completion", json={"prompt": "hi", "n_predict": 2}, verify=False)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 2


# ---- defaults through the embedding API ------------------------------------------------------


async def test_embedding_api_takes_the_servers_defaults(make_config):
    """``Runtime.complete`` without a sampling keyword gets ``RuntimeConfig.sampling``
    (and the server's stop strings and ignore_eos), as HTTP requests do; its own keywords win."""
    prompt, never = "The quick brown fox", "<never-stop>"
    async with Runtime.open(make_config()) as rt:
        free = await rt.complete(prompt, max_tokens=24, temperature=0, ignore_eos=True)
        penalized = await rt.complete(prompt, max_tokens=24, temperature=0, repeat_penalty=1.5, ignore_eos=True)
    assert free.choices[0].tokens != penalized.choices[0].tokens
    text = penalized.text
    cut = next(i for i in range(4, len(text) - 3) if text.index(text[i : i + 3]) == i and "\ufffd" not in text[: i + 3])
    defaults = SamplingParams(temperature=0.0, repeat_penalty=1.5)
    async with Runtime.open(make_config(sampling=defaults, stop=(text[cut : cut + 3],), ignore_eos=True)) as rt:
        plain = await rt.complete(prompt, max_tokens=24)
        assert plain.text == text[:cut] and plain.stopping_word == text[cut : cut + 3]  # the server's stop string
        own = await rt.complete(prompt, max_tokens=24, stop=[never])
        assert own.choices[0].tokens == penalized.choices[0].tokens  # greedy, penalized, 24 tokens (ignore_eos)
        unpenalized = await rt.complete(prompt, max_tokens=24, stop=[never], repeat_penalty=1.0)
        assert unpenalized.choices[0].tokens == free.choices[0].tokens


async def test_openai_completions_default_length_follows_n_predict(make_config):
    """With -n, /v1/completions without max_tokens generates -n tokens (llama-server's
    default), not OpenAI's 16; a native request without n_predict is capped by it."""
    async with open_server(make_config(n_predict_max=7, ignore_eos=True)) as (_, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            oai = (await client.post("/v1/completions", json={"prompt": "hi", "temperature": 0})).json()
            assert oai["usage"]["completion_tokens"] == 7
            native = (await client.post("/completion", json={"prompt": "hi", "temperature": 0})).json()
            assert native["tokens_predicted"] == 7
            assert native["generation_settings"]["ignore_eos"] is True


# ---- response fields -------------------------------------------------------------------------


def _check_timings(t: dict[str, Any], *, n_prompt: int, n_predicted: int) -> None:
    assert set(t) == TIMING_KEYS
    assert t["prompt_n"] + t["cache_n"] == n_prompt and t["predicted_n"] == n_predicted
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0
    assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"])
    assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / (n_predicted - 1))
    assert t["predicted_per_second"] == pytest.approx(1e3 * (n_predicted - 1) / t["predicted_ms"])


def _sse(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_native_response_fields(make_config):
    """/completion has llama-server's timings, generation_settings, tokens_cached,
    truncated and stop_type, streaming (last chunk) and not; a repeated prompt shows its cache."""
    async with open_server(make_config()) as (_, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
        body = {
            "prompt": "Hello there, how are you",
            "n_predict": 5,
            "temperature": 0,
            "ignore_eos": True,
            "top_k": 3,
            "stop": ["never"],
        }
        first = (await client.post("/completion", json=body)).json()
        n_prompt = first["tokens_evaluated"]
        assert first["stop_type"] == "limit" and first["truncated"] is False
        assert first["tokens_cached"] == n_prompt + 5 - 1
        _check_timings(first["timings"], n_prompt=n_prompt, n_predicted=5)
        assert first["timings"]["cache_n"] == 0
        settings = first["generation_settings"]
        assert (settings["temperature"], settings["top_k"], settings["stop"], settings["n_predict"]) == (
            0.0,
            3,
            ["never"],
            5,
        )
        assert settings["samplers"][0] == "penalties" and "dry_sequence_breakers" in settings
        again = (await client.post("/completion", json=body)).json()
        assert again["timings"]["cache_n"] == n_prompt - 1  # all but the last prompt token reused
        r = await client.post("/completion", json={**body, "stream": True})
        last = _sse(r.text)[-1]
        assert last["stop"] is True and last["stop_type"] == "limit" and last["truncated"] is False
        _check_timings(last["timings"], n_prompt=n_prompt, n_predicted=5)
        assert last["generation_settings"]["stream"] is True


async def test_openai_response_fields(make_config):
    """Chat and completions carry system_fingerprint, timings and
    usage.prompt_tokens_details.cached_tokens; streams put timings on the last chunk (on the
    usage chunk when one is asked for), and /v1/completions' last chunk has usage too."""
    async with open_server(make_config()) as (_, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
        chat = {
            "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        }
        first = (await client.post("/v1/chat/completions", json=chat)).json()
        second = (await client.post("/v1/chat/completions", json=chat)).json()
        assert first["system_fingerprint"].startswith("llamactor-")
        n_prompt = first["usage"]["prompt_tokens"]
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1
        _check_timings(second["timings"], n_prompt=n_prompt, n_predicted=4)
        stream = _sse((await client.post("/v1/chat/completions", json={**chat, "stream": True})).text)
        assert all(c["system_fingerprint"] == first["system_fingerprint"] for c in stream)
        assert [c for c in stream if "timings" in c] == [stream[-1]]
        _check_timings(stream[-1]["timings"], n_prompt=n_prompt, n_predicted=4)
        usage_stream = _sse(
            (
                await client.post(
                    "/v1/chat/completions", json={**chat, "stream": True, "stream_options": {"include_usage": True}}
                )
            ).text
        )
        tail = usage_stream[-1]
        assert tail["choices"] == [] and "timings" in tail and "timings" not in usage_stream[-2]
        assert tail["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1
        completions = _sse(
            (
                await client.post(
                    "/v1/completions",
                    json={
                        "prompt": "Say hello",
                        "max_tokens": 3,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                    },
                )
            ).text
        )
        last = completions[-1]
        assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 3
        _check_timings(last["timings"], n_prompt=last["usage"]["prompt_tokens"], n_predicted=3)


async def test_exceed_context_size_error(make_config):
    """One context rule, llama-server's: a prompt longer than the slot context is its
    exceed_context_size_error (400, with n_prompt_tokens and n_ctx, in its words), over HTTP and
    as ExceedContextSize from complete and stream; a prompt that fits generates until the context
    ends (finish_reason length), whatever max_tokens asked."""
    long_prompt = "hello " * 600
    async with open_server(make_config(n_ctx=1024, parallel=2)) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            for path, body in (
                ("/completion", {"prompt": long_prompt}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_prompt}]}),
            ):
                r = await client.post(path, json=body)
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["type"] == "exceed_context_size_error" and error["code"] == 400
                assert error["n_ctx"] == 512 and error["n_prompt_tokens"] > 512
                said = f"request ({error['n_prompt_tokens']} tokens) exceeds the available context size (512 tokens)"
                assert said in error["message"]
            # the other half of the rule: a prompt that fits generates until the context ends
            fits = [5, 6, 7, 8] * 100  # 400 of the 512 positions
            r = await client.post("/completion", json={"prompt": fits, "n_predict": 100_000, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["stop_type"] == "limit" and r.json()["tokens_predicted"] == 512 - 400
            body = {"prompt": fits, "max_tokens": 100_000, "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 512 - 400
        with pytest.raises(ExceedContextSize) as info:
            await rt.complete(long_prompt)
        assert info.value.n_ctx == 512 and info.value.n_prompt_tokens > 512
        with pytest.raises(ExceedContextSize, match="exceeds the available context size"):
            async for _ in rt.stream(long_prompt):
                pass
        done = await rt.complete(fits, max_tokens=100_000, ignore_eos=True)
        assert done.choices[0].finish_reason == "length" and done.n_predicted == 512 - 400
        streamed = [e async for e in rt.stream(fits, max_tokens=100_000, ignore_eos=True) if hasattr(e, "token")]
        assert len(streamed) == 512 - 400


async def test_chat_template_override(make_config, tmp_path: Path):
    """--chat-template (Jinja source, or llama-server's name "chatml") and
    --chat-template-file replace the GGUF's template; --chat-template-kwargs reach it."""
    messages = [{"role": "user", "content": "hi"}]
    source = "{% for m in messages %}[{{ m['content'] }}|{{ flavor }}]{% endfor %}"
    async with Runtime.open(make_config(chat_template=source, chat_template_kwargs={"flavor": "x"})) as rt:
        assert rt.apply_chat_template(messages).startswith("[hi|")
    async with Runtime.open(make_config(chat_template="chatml")) as rt:
        assert rt.apply_chat_template(messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    file = tmp_path / "t.jinja"
    file.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    async with open_server(make_config(chat_template_file=str(file))) as (rt, url):
        assert rt.apply_chat_template(messages) == "<hi>"
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            assert (await client.get("/props")).json()["chat_template"] == file.read_text()
