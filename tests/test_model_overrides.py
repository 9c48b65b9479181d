"""llama-server's model overrides: ``--override-kv``, the RoPE/YaRN flags and control vectors.

Each flag is shown through a real server on loopback, built from the command line as
``llamactor serve`` builds it (``parse_serve``), with the engine in its child process (the
default) unless a test says otherwise: the values must reach the contexts there. The control
vector is written at test time (``write_control_vector``: the layout llama.cpp's
cvector-generator writes, one F32 ``direction.N`` per layer), as tests/tinylora.py writes a
LoRA adapter. Bad values and files stop ``llamactor serve`` with exit code 2 naming them.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import httpx
import llama_cpp
import numpy as np
import pytest
from conftest import free_port, open_server
from serveargs import parse_serve
from tinymodel import IM_START_TOKEN, N_EMBD, N_LAYER

from llamactor.protocol.errors import ConfigError
from llamactor.runtime import cli
from llamactor.runtime.engine.controlvector import control_vector_for, load_control_vector
from llamactor.runtime.engine.overrides import KvOverride, RopeOptions, kv_override_array, parse_kv_override
from llamactor.runtime.service.config import config_from_wire, config_to_wire
from llamactor.runtime.service.engineoptions import draft_load_options, load_options, rope_options

LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]
# long and varied enough that RoPE changes reach the greedy tokens of the random tiny model
PROMPT = (
    "It reads the prompt, then it writes tokens one at a time until the request is done. Many "
    "requests may share one model, and each of them has its own sequence in the batch. The server "
    "should stream the text back to the client as soon as it is ready. What is the time? Where are you going?"
)
N_PREDICT = 12
SERVE = ["-t", "1", "-c", "1024", "-np", "1"]
STRONG = 4.0  # a control vector this strong takes over the tiny model's greedy output


def write_control_vector(
    path: Path, directions: dict[str, np.ndarray] | None = None, *, seed: int = 3, n_embd: int = N_EMBD
) -> Path:
    """A control vector GGUF: ``directions`` by tensor name, or one random ``direction.N`` of
    ``n_embd`` values per layer N >= 1 of the tiny model (llama.cpp never steers layer 0)."""
    if directions is None:
        rng = np.random.default_rng(seed)
        directions = {f"direction.{n}": rng.standard_normal(n_embd).astype(np.float32) for n in range(1, N_LAYER)}
    writer = gguf.GGUFWriter(path, "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    writer.add_uint32("controlvector.layer_count", len(directions))
    for name, values in directions.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def cvec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_control_vector(tmp_path_factory.mktemp("cvec") / "steer.gguf")


async def _serve(tiny_model: Path, flags: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start a server with ``flags`` as ``llamactor serve`` would; its greedy tokens for PROMPT,
    its /props, the /tokenize of "hello" with special tokens, and (with --embedding) the
    embedding of "hello"."""
    config = parse_serve(["-m", str(tiny_model), *SERVE, *flags], env).config
    async with open_server(config) as (rt, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
        r = await client.post(
            "/completion",
            json={
                "prompt": PROMPT,
                "n_predict": N_PREDICT,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
            },
        )
        assert r.status_code == 200, r.text
        out: dict[str, Any] = {"tokens": r.json()["tokens"], "isolated": rt.engine_status().isolated}
        out["props"] = (await client.get("/props")).json()
        out["bos"] = (await client.post("/tokenize", json={"content": "hello", "add_special": True})).json()["tokens"]
        r = await client.post("/tokenize", json={"content": IM_START_TOKEN, "parse_special": True})
        out["im_start"] = r.json()["tokens"][0]
        if config.embedding:
            r = await client.post("/v1/embeddings", json={"input": "hello"})
            assert r.status_code == 200, r.text
            out["embedding"] = np.array(r.json()["data"][0]["embedding"])
    return out


# ---- the command line -----------------------------------------------------------------------


def test_override_kv_forms_as_llama_server():
    """--override-kv KEY=TYPE:VALUE: comma-separated (a quoted field may hold a comma, as
    llama-server's CSV row) and repeatable, in order; int, float, bool, str; the typed
    overrides cross to the engine process unchanged."""
    opts = parse_serve(
        [
            "--override-kv",
            'tokenizer.ggml.add_bos_token=bool:false,"general.name=str:a,b"',
            "--override-kv",
            "llama.context_length=int:-2,llama.rope.freq_base=float:1e4",
        ]
    )
    assert opts.config.kv_overrides == (
        KvOverride("tokenizer.ggml.add_bos_token", "bool", False),
        KvOverride("general.name", "str", "a,b"),
        KvOverride("llama.context_length", "int", -2),
        KvOverride("llama.rope.freq_base", "float", 10000.0),
    )
    wire = config_from_wire(config_to_wire(opts.config))
    assert wire.kv_overrides == opts.config.kv_overrides
    assert [type(o.value) for o in wire.kv_overrides] == [bool, str, int, float]
    assert parse_kv_override("k=str:") == KvOverride("k", "str", "")  # an empty string is a value
    assert parse_kv_override("a=str:b=c:d") == KvOverride("a", "str", "b=c:d")  # split at the first '=' and ':'


def test_override_array_is_llama_h_layout(make_config):
    """The array handed to llama_model_params.kv_overrides is llama.h's: ``{tag; char key[128];
    union {int64; double; bool; char[128]}}`` (264 bytes, the union at 136), each entry's
    value in its union member, ended by an entry with an empty key. The engine's model, the
    draft model and the API process's vocabulary all load with the overrides, and every
    context gets the RoPE/YaRN values (``RopeOptions``: llama.cpp's defaults when unset)."""
    entry = llama_cpp.llama_model_kv_override
    assert ctypes.sizeof(entry) == 264 and entry.value.offset == 136 and entry.key.size == 128
    overrides = (
        KvOverride("a", "int", -(2**63)),
        KvOverride("b", "float", 0.5),
        KvOverride("c", "bool", True),
        KvOverride("d", "str", "x" * 127),
    )
    array = kv_override_array(overrides)
    assert len(array) == 5 and array[4].key == b""
    assert [e.key for e in array[:4]] == [b"a", b"b", b"c", b"d"]
    assert [e.tag for e in array[:4]] == [
        llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT,
        llama_cpp.LLAMA_KV_OVERRIDE_TYPE_FLOAT,
        llama_cpp.LLAMA_KV_OVERRIDE_TYPE_BOOL,
        llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR,
    ]
    values = (array[0].value.val_i64, array[1].value.val_f64, array[2].value.val_bool, array[3].value.val_str)
    assert values == (-(2**63), 0.5, True, b"x" * 127)
    cfg = make_config(kv_overrides=overrides, rope_scaling="yarn", rope_freq_scale=0.25, yarn_beta_fast=8.0)
    assert load_options(cfg).kv_overrides == draft_load_options(cfg).kv_overrides == overrides
    rope = rope_options(cfg)
    assert (rope.scaling_type, rope.freq_scale, rope.yarn_beta_fast) == (
        llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN,
        0.25,
        8,
    )
    defaults = llama_cpp.llama_context_default_params()
    assert rope_options(make_config()) == RopeOptions()
    assert all(getattr(defaults, name) == value for name, value in RopeOptions().settings().items())


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("tokenizer.ggml.add_bos_token", "must be KEY=TYPE:VALUE"),
        ("k=int", "the type must be one of int, float, bool, str"),
        ("k=hex:ff", "the type must be one of int, float, bool, str"),
        ("k=bool:yes", "true or false"),
        ("k=int:12abc", "not a number"),
        ("k=float:", "not a number"),
        ("=int:1", "the key is empty"),
        ("a=int:1,", "must be KEY=TYPE:VALUE"),  # llama-server's CSV row keeps the empty field
        ("k" * 128 + "=int:1", "longer than 127 bytes"),
        ("k=str:" + "v" * 128, "cannot exceed 127 bytes"),
    ],
)
def test_bad_override_kv_exits_2_naming_it(value: str, why: str, capsys: pytest.CaptureFixture[str]):
    """A malformed --override-kv is argparse's error (exit code 2) naming the flag and saying why."""
    with pytest.raises(SystemExit) as exc:
        parse_serve(["--override-kv", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --override-kv" in err and why in err, err


def test_rope_flags_and_their_variables():
    """Each RoPE/YaRN flag sets its field; --rope-scale N is --rope-freq-scale 1/N; the
    LLAMA_ARG_* variables set them too and the command line wins; the defaults are the model's."""
    default = cli.RuntimeConfig()
    assert (default.rope_scaling, default.rope_freq_base, default.rope_freq_scale, default.yarn_orig_ctx) == (
        "",
        0,
        0,
        0,
    )
    assert (default.yarn_ext_factor, default.yarn_attn_factor, default.yarn_beta_slow, default.yarn_beta_fast) == (
        -1,
        -1,
        -1,
        -1,
    )
    argv = "--rope-scaling yarn --rope-scale 4 --rope-freq-base 5e5 --yarn-orig-ctx 2048 --yarn-ext-factor 0.5 "
    argv += "--yarn-attn-factor 1.5 --yarn-beta-slow 2 --yarn-beta-fast 16"
    cfg = parse_serve(argv.split()).config
    assert (cfg.rope_scaling, cfg.rope_freq_scale, cfg.rope_freq_base, cfg.yarn_orig_ctx) == ("yarn", 0.25, 5e5, 2048)
    assert (cfg.yarn_ext_factor, cfg.yarn_attn_factor, cfg.yarn_beta_slow, cfg.yarn_beta_fast) == (0.5, 1.5, 2, 16)
    assert parse_serve(["--rope-freq-scale", "0.125"]).config.rope_freq_scale == 0.125
    env = {
        "LLAMA_ARG_ROPE_SCALING_TYPE": "linear",
        "LLAMA_ARG_ROPE_SCALE": "2",
        "LLAMA_ARG_ROPE_FREQ_BASE": "100",
        "LLAMA_ARG_YARN_ORIG_CTX": "512",
        "LLAMA_ARG_YARN_EXT_FACTOR": "0",
        "LLAMA_ARG_YARN_ATTN_FACTOR": "2",
        "LLAMA_ARG_YARN_BETA_SLOW": "3",
        "LLAMA_ARG_YARN_BETA_FAST": "30",
    }
    cfg = parse_serve(["--rope-freq-base", "200"], env).config
    assert (cfg.rope_scaling, cfg.rope_freq_scale, cfg.rope_freq_base, cfg.yarn_orig_ctx) == ("linear", 0.5, 200, 512)
    assert (cfg.yarn_ext_factor, cfg.yarn_attn_factor, cfg.yarn_beta_slow, cfg.yarn_beta_fast) == (0, 2, 3, 30)
    with pytest.raises(ConfigError, match="--rope-scale and --rope-freq-scale disagree"):
        parse_serve(["--rope-scale", "2", "--rope-freq-scale", "0.25"])
    assert parse_serve(["--rope-scale", "4", "--rope-freq-scale", "0.25"]).config.rope_freq_scale == 0.25


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--rope-scaling", "ntk"], None),
        (["--rope-scale", "0"], None),
        (["--rope-scale", "x"], None),
        (["--yarn-orig-ctx", "1.5"], None),
        ([], {"LLAMA_ARG_ROPE_SCALING_TYPE": "dynamic"}),
        (["--control-vector-scaled", "a.gguf"], None),
        (["--control-vector-scaled", "a.gguf:1:2"], None),
        (["--control-vector-scaled", "a.gguf:big"], None),
        (["--control-vector-layer-range", "1"], None),
    ],
)
def test_bad_rope_and_control_vector_values_exit_2(argv: list[str], env: dict[str, str] | None):
    with pytest.raises(SystemExit) as exc:
        parse_serve(argv, env)
    assert exc.value.code == 2


def test_values_llama_cpp_cannot_take_are_config_errors(make_config):
    """RoPE/YaRN values that are not finite numbers, a negative --yarn-orig-ctx, a bad
    override built in code: ConfigError naming the flag (exit code 2 from the command line)."""
    for fields, flag in (
        (dict(rope_freq_base=float("nan")), "--rope-freq-base"),
        (dict(rope_freq_scale=float("inf")), "--rope-freq-scale"),
        (dict(yarn_ext_factor=float("nan")), "--yarn-ext-factor"),
        (dict(yarn_attn_factor=float("-inf")), "--yarn-attn-factor"),
        (dict(yarn_beta_slow=float("nan")), "--yarn-beta-slow"),
        (dict(yarn_beta_fast=float("nan")), "--yarn-beta-fast"),
        (dict(yarn_orig_ctx=-1), "--yarn-orig-ctx"),
        (dict(rope_scaling="ntk"), "--rope-scaling"),
        (dict(kv_overrides=(KvOverride("k", "int", "1"),)), "--override-kv"),
        (dict(kv_overrides=(KvOverride("k", "uint", 1),)), "--override-kv"),
        (dict(control_vectors=(("nope.gguf", 1.0),)), "nope.gguf"),
    ):
        with pytest.raises(ConfigError, match=flag):
            make_config(**fields).validated()


def test_control_vector_flags(tmp_path: Path):
    """--control-vector (comma-separated, scale 1) and --control-vector-scaled FNAME:SCALE keep
    command-line order, repeatable; --control-vector-layer-range START END."""
    a, b, c = (str(tmp_path / name) for name in ("a.gguf", "b.gguf", "c.gguf"))
    opts = parse_serve(
        ["--control-vector", f"{a},{b}", "--control-vector-scaled", f"{c}:-0.5,{a}:2", "--control-vector", c]
        + ["--control-vector-layer-range", "1", "3"]
    )
    assert opts.config.control_vectors == ((a, 1.0), (b, 1.0), (c, -0.5), (a, 2.0), (c, 1.0))
    assert opts.config.control_vector_layers == (1, 3)
    assert config_from_wire(config_to_wire(opts.config)).control_vector_layers == (1, 3)
    assert cli.RuntimeConfig().control_vector_layers == (-1, -1)


# ---- loading a control vector as llama-server does ----------------------------------------------


def test_control_vectors_sum_scaled_directions(tmp_path: Path):
    """common_control_vector_load: each file's directions times its scale, summed per layer
    into one buffer from layer 1 (a layer absent is zeros; "direction.01" is layer 1 too, as
    std::stoi reads it); the layer range defaults to 1 .. the model's last layer."""
    rng = np.random.default_rng(0)
    a1, a3, a1b, b1, b2 = (rng.standard_normal(4).astype(np.float32) for _ in range(5))
    first = write_control_vector(tmp_path / "a.gguf", {"direction.1": a1, "direction.3": a3, "direction.01": a1b})
    second = write_control_vector(tmp_path / "b.gguf", {"direction.2": b2, "direction.1": b1})
    n_embd, data = load_control_vector([(str(first), 2.0), (str(second), -1.0)])
    assert n_embd == 4 and data.dtype == np.float32
    expected = np.concatenate([2 * a1 + 2 * a1b - b1, -b2, 2 * a3])
    np.testing.assert_allclose(data, expected, rtol=1e-6)
    cvec = control_vector_for([(str(first), 1.0)], (-1, 0), 4, 24)
    assert (cvec.layer_start, cvec.layer_end, cvec.n_embd) == (1, 24, 4)
    cvec = control_vector_for([(str(first), 1.0)], (2, 5), 4, 24)
    assert (cvec.layer_start, cvec.layer_end) == (2, 5)
    with pytest.raises(ConfigError, match="a.gguf: 4 values per layer, the model's n_embd is 64"):
        control_vector_for([(str(first), 1.0)], (-1, -1), 64, 2)


def test_malformed_control_vector_files_are_config_errors(tmp_path: Path, tiny_model: Path):
    """Files llama-server would skip with an error line (and go on without any control vector)
    are a ConfigError naming the file: exit code 2 from the command line."""
    f32 = np.ones(4, dtype=np.float32)
    cases = {
        "missing.gguf": None,
        "text.gguf": "not a gguf",
        "empty.gguf": {},
        "zero.gguf": {"direction.0": f32},
        "name.gguf": {"direction.x": f32},
        "other.gguf": {"direction.1": f32, "bias.1": f32},
        "f16.gguf": {"direction.1": f32.astype(np.float16)},
        "2d.gguf": {"direction.1": np.ones((2, 4), dtype=np.float32)},
        "sizes.gguf": {"direction.1": f32, "direction.2": np.ones(5, dtype=np.float32)},
    }
    for name, content in cases.items():
        path = tmp_path / name
        if isinstance(content, str):
            path.write_text(content)
        elif content is not None:
            write_control_vector(path, content)
        with pytest.raises(ConfigError, match=name):
            load_control_vector([(str(path), 1.0)])
    good = write_control_vector(tmp_path / "good.gguf", {"direction.1": f32})
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:40])  # ends inside its header
    wide = write_control_vector(tmp_path / "wide.gguf", {"direction.1": np.ones(8, dtype=np.float32)})
    for files in ([(str(cut), 1.0)], [(str(tiny_model), 1.0)], [(str(good), 1.0), (str(wide), 1.0)]):
        with pytest.raises(ConfigError, match=Path(files[-1][0]).name):
            load_control_vector(files)


# ---- through a server ------------------------------------------------------------------------


@pytest.mark.slow
async def test_control_vector_steers_the_server(tiny_model: Path, cvec: Path, tmp_path: Path):
    """A strong control vector changes the greedy output and the embeddings (set on every
    context: the group's and the embedding context, in the engine process), the same in a
    second run; directions that sum to zero, or a layer range without the vector's layer (the
    tiny model has two layers: llama.cpp steers layer 1 only), give the plain output."""
    embed = ["--embedding", "--pooling", "mean"]
    plain = await _serve(tiny_model, embed)
    strong = ["--control-vector-scaled", f"{cvec}:{STRONG}"]
    steered = await _serve(tiny_model, [*embed, *strong])
    assert steered["isolated"] and plain["isolated"]
    assert steered["tokens"] != plain["tokens"]
    assert not np.allclose(steered["embedding"], plain["embedding"], atol=1e-3)
    again = await _serve(tiny_model, strong)
    assert again["tokens"] == steered["tokens"]
    summed = await _serve(tiny_model, ["--control-vector", f"{cvec},{cvec}", "--control-vector-scaled", f"{cvec}:-2"])
    assert summed["tokens"] == plain["tokens"]
    assert (await _serve(tiny_model, [*strong, "--control-vector-layer-range", "2", "2"]))["tokens"] == plain["tokens"]
    assert (await _serve(tiny_model, [*strong, "--control-vector-layer-range", "0", "1"]))["tokens"] == steered[
        "tokens"
    ]


@pytest.mark.slow
async def test_rope_overrides_change_the_servers_output(tiny_model: Path):
    """--rope-freq-base (or its variable) and --rope-scale N (--rope-freq-scale 1/N) change the
    greedy output and the embeddings (every context, in the engine process); --rope-scaling none with the other
    values at their defaults is the plain output (the tiny model has no RoPE scaling)."""
    embed = ["--embedding", "--pooling", "mean"]
    plain = await _serve(tiny_model, embed)
    base = await _serve(tiny_model, [*embed, "--rope-freq-base", "100"])
    assert base["isolated"] and base["tokens"] != plain["tokens"]
    assert not np.allclose(base["embedding"], plain["embedding"], atol=1e-3)
    assert (await _serve(tiny_model, [], {"LLAMA_ARG_ROPE_FREQ_BASE": "100"}))["tokens"] == base["tokens"]
    scaled = await _serve(tiny_model, ["--rope-scale", "4"])
    assert scaled["tokens"] != plain["tokens"]
    assert (await _serve(tiny_model, ["--rope-freq-scale", "0.25"]))["tokens"] == scaled["tokens"]
    assert (await _serve(tiny_model, ["--rope-scaling", "none"]))["tokens"] == plain["tokens"]


@pytest.mark.slow
async def test_each_yarn_flag_reaches_the_context(tiny_model: Path):
    """Against YaRN scaling by 4 (itself not the plain output), each YaRN flag changes the
    greedy output; --yarn-attn-factor counts where llama.cpp keeps it, without YaRN's
    extrapolation (which sets the factor itself). In this process (--no-isolate): the engine
    process is shown by the other tests, and these values cross to it in the config as theirs."""
    plain = await _serve(tiny_model, ["--no-isolate"])
    yarn = ["--no-isolate", "--rope-scaling", "yarn", "--rope-scale", "4"]
    scaled = await _serve(tiny_model, yarn)
    assert not scaled["isolated"] and scaled["tokens"] != plain["tokens"]
    for flag, value in (
        ("--yarn-orig-ctx", "64"),
        ("--yarn-ext-factor", "0"),
        ("--yarn-beta-slow", "4"),
        ("--yarn-beta-fast", "8"),
    ):
        assert (await _serve(tiny_model, [*yarn, flag, value]))["tokens"] != scaled["tokens"], flag
    attn = await _serve(tiny_model, ["--no-isolate", "--yarn-attn-factor", "2"])
    assert attn["tokens"] != plain["tokens"]


@pytest.mark.slow
async def test_override_kv_reaches_the_api_process_and_the_engine(tiny_model: Path):
    """--override-kv where llama.cpp reads the key: the BOS id in /props and /tokenize (the API
    process's vocabulary), add_bos_token (no BOS, so the greedy output changes), and in the
    engine process llama.rope.freq_base (the same output as --rope-freq-base) and
    llama.context_length (YaRN's original context: the same output as --yarn-orig-ctx)."""
    plain = await _serve(tiny_model, [])
    im_start = plain["im_start"]
    assert plain["props"]["bos_token"] == "<|bos|>" and plain["bos"][0] != im_start
    bos = await _serve(tiny_model, ["--override-kv", f"tokenizer.ggml.bos_token_id=int:{im_start}"])
    assert bos["isolated"] and bos["props"]["bos_token"] == IM_START_TOKEN
    assert bos["bos"] == [im_start, *plain["bos"][1:]]
    no_bos = await _serve(tiny_model, ["--override-kv", "tokenizer.ggml.add_bos_token=bool:false"])
    assert no_bos["bos"] == plain["bos"][1:] and no_bos["tokens"] != plain["tokens"]
    flag = await _serve(tiny_model, ["--rope-freq-base", "100"])
    override = await _serve(tiny_model, ["--override-kv", "llama.rope.freq_base=float:100"])
    assert override["tokens"] == flag["tokens"] != plain["tokens"]
    yarn = ["--rope-scaling", "yarn", "--rope-scale", "4"]
    orig_ctx = await _serve(tiny_model, [*yarn, "--yarn-orig-ctx", "64"])
    trained = await _serve(tiny_model, [*yarn, "--override-kv", "llama.context_length=int:64"])
    assert trained["tokens"] == orig_ctx["tokens"] != (await _serve(tiny_model, yarn))["tokens"]


@pytest.mark.slow
def test_bad_overrides_stop_serve_with_exit_2(tiny_model: Path, cvec: Path, tmp_path: Path):
    """``llamactor serve`` stops with exit code 2 and a message naming what is wrong: a
    malformed --override-kv, one llama.cpp cannot load the model with, a missing control
    vector file, a malformed one, one made for a model of another size (found in the engine
    process), a --rope-scale of 0, a --yarn-orig-ctx below 0."""
    malformed = tmp_path / "malformed.gguf"
    malformed.write_bytes(b"GGUF\x03\x00\x00\x00")
    narrow = write_control_vector(tmp_path / "narrow.gguf", n_embd=N_EMBD // 2)
    cases = [
        (["--override-kv", "tokenizer.ggml.add_bos_token=bool:0"], "--override-kv"),
        (["--override-kv", "tokenizer.ggml.pre=str:no-such-pre"], "--override-kv"),
        (["--control-vector", str(tmp_path / "missing.gguf")], "missing.gguf"),
        (["--control-vector", f"{cvec},{malformed}"], "malformed.gguf"),
        (["--control-vector-scaled", f"{narrow}:1"], "narrow.gguf"),
        (["--rope-scale", "0"], "--rope-scale"),
        (["--yarn-orig-ctx", "-1"], "--yarn-orig-ctx"),
    ]
    for flags, name in cases:
        proc = subprocess.run(
            [*LLAMACTOR, "serve", "-m", str(tiny_model), *SERVE, "--port", str(free_port()), *flags],
            capture_output=True,
            timeout=60,
        )
        err = proc.stderr.decode()
        assert proc.returncode == 2 and name in err, (flags, err)
        assert "Traceback" not in err, (flags, err)
