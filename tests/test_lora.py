"""LoRA adapters: flags, /lora-adapters, the request field, one set per batch.

The adapter is tinylora.py's random LoRA for the tiny model, written at test time.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from conftest import free_port, open_server, wait_until
from faults import Faults
from serveargs import parse_serve
from tinylora import write_tiny_lora

from llamactor.actors.loraturns import LoraTurns
from llamactor.actors.trace import TraceViolation, check_lora_exclusion, check_phase_exclusion
from llamactor.protocol.errors import ConfigError, RequestError
from llamactor.protocol.plan import StepPlan
from llamactor.runtime import LoraScale, Runtime

LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]
POLICIES = ["continuous", "stall-free", "cohort", "serial-prefill", "no-cont-batching"]
EXCLUSIVE = ["cohort", "serial-prefill", "no-cont-batching"]
PROMPT = "The quick brown fox"
N_PREDICT = 12
GREEDY = dict(max_tokens=N_PREDICT, temperature=0, ignore_eos=True, cache_prompt=False)
ONE = [{"id": 0, "scale": 1.0}]
HALF = [{"id": 0, "scale": 0.5}]
OFF = [{"id": 0, "scale": 0.0}]


@pytest.fixture(scope="session")
def tiny_lora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_lora(tmp_path_factory.mktemp("lora") / "tiny-lora.gguf")


@pytest.fixture
def lora_config(make_config, tiny_lora: Path):
    def make(**kw: Any):
        base: dict[str, Any] = dict(lora=((str(tiny_lora), 1.0),), n_batch=64, n_ubatch=64, prefill_budget=32)
        base.update(kw)
        return make_config(**base)

    return make


async def _tokens(rt: Runtime, prompt: str = PROMPT, **kw: Any) -> tuple[int, ...]:
    c = await rt.complete(prompt, **GREEDY, **kw)
    return c.choices[0].tokens


async def test_scale_zero_is_the_base_model_and_scale_one_differs(make_config, lora_config):
    """An adapter at scale 0 gives the base model's tokens; scale 1 and 0.5 change them;
    a request without ``lora`` uses the global scale (1 here, 0 with --lora-init-without-apply)."""
    async with Runtime.open(make_config()) as rt:
        base = await _tokens(rt)
    async with Runtime.open(lora_config()) as rt:
        off, one, half, default = (
            await _tokens(rt, lora=OFF),
            await _tokens(rt, lora=ONE),
            await _tokens(rt, lora=HALF),
            await _tokens(rt),
        )
        assert await _tokens(rt, lora=[]) == one  # an empty list is no list, as in llama-server
    assert off == base
    assert one != base and half != base and half != one
    assert default == one
    async with Runtime.open(lora_config(lora_init_without_apply=True)) as rt:
        assert rt.lora_adapters()[0]["scale"] == 0.0
        assert await _tokens(rt) == base
        assert await _tokens(rt, lora=ONE) == one


# ---- different sets never share a step, under every policy ----------------------------------

MIX = {  # name -> (prompt, lora, n)
    "one": (PROMPT, ONE, 1),
    "none": ("Hello world", OFF, 1),
    "half": ("What is the time?", HALF, 2),
}


async def _run(config, names: list[str]) -> tuple[dict[str, tuple[tuple[int, ...], ...]], list[Any]]:
    """Greedy tokens of the named MIX requests, all assigned before any decode step runs (as
    conftest.greedy_together), and the groups' step traces."""
    faults = Faults()
    faults.hold = threading.Event()
    out: dict[str, tuple[tuple[int, ...], ...]] = {}
    async with Runtime.open(config, hooks=faults) as rt:

        async def one(name: str) -> None:
            prompt, lora, n = MIX[name]
            c = await rt.complete(prompt, n=n, lora=lora, **GREEDY)
            out[name] = tuple(ch.tokens for ch in c.choices)

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(one, name)
            try:
                busy = sum(MIX[name][2] for name in names)
                await wait_until(lambda: sum(rt.engine.supervisor.snapshot().busy) == busy, timeout_s=30)
            finally:
                faults.hold.set()
        trace = [rec for g in rt.engine.supervisor.groups for rec in g.trace]
    return out, trace


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", POLICIES)
async def test_lora_sets_never_share_a_step(lora_config, scheduler):
    """Requests with three LoRA sets (scale 1, none, scale 0.5 with n = 2) run at
    once; the trace shows no step mixing sets, the sets taking turns step by step (but under
    no-cont-batching, which runs them one after another), the cohort barrier kept (exclusive
    policies); and each request's tokens are those it gets alone."""
    config = lora_config(scheduler=scheduler, trace_steps=True)
    alone_one, _ = await _run(config, ["one"])
    alone_half, _ = await _run(config, ["half"])
    together, trace = await _run(config, list(MIX))
    check_lora_exclusion(trace)
    if scheduler in EXCLUSIVE:
        check_phase_exclusion(trace)
    decoded = [next(iter(rec.lora.values())) for rec in trace if rec.lora]
    assert len(set(decoded)) == 3
    runs = 1 + sum(a != b for a, b in zip(decoded, decoded[1:]))
    if scheduler != "no-cont-batching":  # that one starts no prompt while a slot generates: sets run one by one
        assert runs > len(set(decoded)), f"the sets never took turns: {decoded}"
    assert together["one"] == alone_one["one"]
    assert together["half"] == alone_half["half"]
    assert together["half"][0] == together["half"][1]  # greedy n = 2: both choices alike


def test_lora_turns_rotate_and_keep_releases():
    """Narrowing a plan keeps one set's rows (and every release), round robin over sets."""
    sets = {0: (), 1: ((0, 1.0),), 2: ((0, 0.5),), 3: ((0, 1.0),)}
    plan = StepPlan(prefill=((0, 4), (1, 4)), generate=(2, 3), release=(5,))
    turns = LoraTurns()
    seen = []
    for _ in range(6):
        p = turns.narrow(plan, sets.__getitem__)
        assert p.release == (5,)
        rows = [local for local, _ in p.prefill] + list(p.generate)
        assert {sets[r] for r in rows} == {p.lora}
        seen.append(p.lora)
    assert seen[:3] == sorted(set(sets.values())) and seen[3:] == seen[:3]
    assert turns.narrow(StepPlan(release=(1,)), sets.__getitem__) == StepPlan(release=(1,))


def test_check_lora_exclusion_catches_a_mixed_step():
    from llamactor.actors.trace import StepRecord

    ok = StepRecord(0, 1, (0,), (1,), (), {}, {0: ((0, 1.0),), 1: ((0, 1.0),)})
    bad = StepRecord(0, 2, (0,), (1,), (), {}, {0: ((0, 1.0),), 1: ()})
    check_lora_exclusion([ok])
    with pytest.raises(TraceViolation):
        check_lora_exclusion([ok, bad])


async def test_each_group_context_applies_its_own_sets(lora_config):
    """LoRA with pipeline groups: the adapters are loaded once and each group's context switches
    its own active set; both groups give each set's tokens."""
    async with Runtime.open(lora_config()) as rt:
        expected = {name: await _tokens(rt, lora=lora) for name, lora in (("one", ONE), ("off", OFF))}
    async with Runtime.open(lora_config(pipeline_groups=2)) as rt:
        got: dict[tuple[int, str], tuple[int, ...]] = {}

        async def one(slot: int, name: str, lora: list[dict[str, float]]) -> None:
            got[(slot, name)] = await _tokens(rt, lora=lora, id_slot=slot)

        async with anyio.create_task_group() as tg:
            for slot in (0, 2):  # group 0 and group 1
                tg.start_soon(one, slot, "one", ONE)
                tg.start_soon(one, slot + 1, "off", OFF)
    assert got == {(s + k, name): expected[name] for s in (0, 2) for k, name in ((0, "one"), (1, "off"))}


# ---- the KV of one set is never reused by another -----------------------------------------


async def test_slot_cache_is_not_reused_across_lora_sets(lora_config):
    """A slot's cached prompt computed under another LoRA set is not reused (llama-server
    clears it); under the same set it is; tokens stay those of a fresh run."""
    long_prompt = PROMPT + " jumps over the lazy dog. Hello world, this is a tiny model"
    async with Runtime.open(lora_config(parallel=1, cache_ram_mib=0)) as rt:
        fresh_off = await _tokens(rt, long_prompt, lora=OFF)
        await rt.slot_action(0, "erase")
        fresh_one = await _tokens(rt, long_prompt, lora=ONE)
        c = await rt.complete(long_prompt, **{**GREEDY, "cache_prompt": True}, lora=OFF)
        assert c.n_cached == 0 and c.choices[0].tokens == fresh_off
        c = await rt.complete(long_prompt, **{**GREEDY, "cache_prompt": True}, lora=OFF)
        assert c.n_cached > 0 and c.choices[0].tokens == fresh_off
        c = await rt.complete(long_prompt, **{**GREEDY, "cache_prompt": True}, lora=ONE)
        assert c.n_cached == 0 and c.choices[0].tokens == fresh_one


async def test_host_prompt_cache_keys_on_the_lora_set(lora_config):
    """A state saved to the host prompt cache under one LoRA set is restored only
    for a prompt with the same set."""
    conversation = PROMPT + " jumps over the lazy dog. Hello world, this is a tiny model for testing"
    other = "0123456789 function return value " * 3
    async with Runtime.open(lora_config(parallel=1)) as rt:
        cached = dict(GREEDY, cache_prompt=True)
        await rt.complete(conversation, lora=ONE, **cached)
        await rt.complete(other, lora=OFF, **cached)  # takes the slot: the lora-1 state goes to the cache
        assert rt.engine.prompt_cache is not None and rt.engine.prompt_cache.statistics().saves == 1
        c = await rt.complete(conversation + " again", lora=OFF, **cached)
        assert c.n_cached <= 1 and rt.engine.prompt_cache.statistics().hits == 0  # at most the BOS the slot holds
        c = await rt.complete(conversation + " again", lora=ONE, **cached)
        assert c.n_cached > 1 and rt.engine.prompt_cache.statistics().hits == 1


# ---- HTTP: /lora-adapters and the request field ---------------------------------------------


async def test_lora_adapters_endpoints(lora_config, tiny_lora):
    """GET lists the adapters; POST sets the global scales (adapters not listed: 0) that
    requests without ``lora`` use; bad bodies are 400 naming the field."""
    async with open_server(lora_config()) as (rt, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
        one = await _tokens(rt, lora=ONE)
        half = await _tokens(rt, lora=HALF)
        off = await _tokens(rt, lora=OFF)
        r = await client.get("/lora-adapters")
        assert r.status_code == 200
        assert r.json() == [{"id": 0, "path": str(tiny_lora), "scale": 1.0, "task_name": "", "prompt_prefix": ""}]
        body = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        r = await client.post("/lora-adapters", json=[{"id": 0, "scale": 0.5}])
        assert r.status_code == 200 and r.json() == {"success": True}
        assert (await client.get("/lora-adapters")).json()[0]["scale"] == 0.5
        assert tuple((await client.post("/completion", json=body)).json()["tokens"]) == half
        assert (await client.post("/lora-adapters", json=[])).status_code == 200  # not listed: 0
        assert (await client.get("/lora-adapters")).json()[0]["scale"] == 0.0
        assert tuple((await client.post("/completion", json=body)).json()["tokens"]) == off
        assert tuple((await client.post("/completion", json={**body, "lora": ONE})).json()["tokens"]) == one
        for bad, needle in (
            ([{"id": 3, "scale": 1}], "id"),
            ([{"id": 0, "scale": "x"}], "scale"),
            ({"id": 0, "scale": 1}, "array"),
            ([1, 2], "object"),
        ):
            r = await client.post("/lora-adapters", json=bad)
            assert r.status_code == 400, (bad, r.text)
            assert needle in r.json()["error"]["message"], r.text
        assert (await client.get("/lora-adapters")).json()[0]["scale"] == 0.0  # nothing changed


async def test_request_lora_on_every_api(lora_config):
    """The request field ``lora`` on /completion, /v1/completions, /v1/chat/completions
    and through ``Runtime`` (complete and chat) gives the adapter's tokens."""
    messages = [{"role": "user", "content": "Hello"}]
    async with (
        open_server(lora_config(lora_init_without_apply=True)) as (rt, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        one, base = await _tokens(rt, lora=ONE), await _tokens(rt)
        assert one != base
        one_text = (await rt.complete(PROMPT, lora=ONE, **GREEDY)).choices[0].text
        chat_one = (await rt.chat(messages, lora=ONE, **GREEDY)).message.content
        chat_base = (await rt.chat(messages, **GREEDY)).message.content
        assert chat_one != chat_base
        r = await client.post(
            "/completion",
            json={
                "prompt": PROMPT,
                "n_predict": N_PREDICT,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
                "lora": ONE,
            },
        )
        assert r.status_code == 200 and tuple(r.json()["tokens"]) == one
        assert r.json()["generation_settings"]["lora"] == [{"id": 0, "scale": 1.0}]
        oai = {"max_tokens": N_PREDICT, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "lora": ONE, **oai})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == one_text
        r = await client.post("/v1/chat/completions", json={"messages": messages, "lora": ONE, **oai})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == chat_one
        r = await client.post("/v1/chat/completions", json={"messages": messages, **oai})
        assert r.json()["choices"][0]["message"]["content"] == chat_base


@pytest.mark.parametrize("path", ["/completion", "/v1/completions", "/v1/chat/completions"])
async def test_bad_lora_field_is_a_400_naming_it(lora_config, path):
    """LoRA bad input: an id that does not exist, a scale that is not a number, a ``lora`` that
    is not a list of objects: 400 naming the field; the server goes on serving."""
    base: dict[str, Any] = {"max_tokens": 2, "n_predict": 2}
    base |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    async with open_server(lora_config()) as (rt, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
        for bad in (
            [{"id": 7, "scale": 1.0}],
            [{"id": -1, "scale": 1.0}],
            [{"id": 0, "scale": "big"}],
            [{"id": 0, "scale": True}],
            {"id": 0, "scale": 1.0},
            [0.5],
            "all",
            [{"scale": 1.0}],
        ):
            r = await client.post(path, json={**base, "lora": bad})
            assert r.status_code == 400, (bad, r.text)
            assert "lora" in r.json()["error"]["message"], r.text
        assert (await client.post(path, json={**base, "lora": [{"id": 0, "scale": 1}]})).status_code == 200


async def test_bad_lora_through_runtime(lora_config, make_config):
    """LoRA bad input through the embedding API: RequestError naming the field."""
    async with Runtime.open(lora_config()) as rt:
        for bad in (
            [{"id": 1, "scale": 1.0}],
            [{"id": 0, "scale": "x"}],
            [{"id": 0, "scale": float("nan")}],
            {"id": 0},
            [7],
            [{"scale": 1.0}],
        ):
            with pytest.raises(RequestError, match="lora"):
                await rt.complete("hi", max_tokens=2, lora=bad)
        with pytest.raises(RequestError, match="body"):
            rt.set_lora_adapters([{"id": 2, "scale": 1.0}])
        with pytest.raises(RequestError, match=r"lora\[0\]"):  # the typed field: id/scale objects
            await rt.complete("hi", max_tokens=2, lora=[(0, 0.25)])
        assert await rt.complete("hi", max_tokens=2, lora=[LoraScale(id=0, scale=0.25)])
    async with Runtime.open(make_config()) as rt:  # no adapter loaded
        with pytest.raises(RequestError, match="no adapter is loaded"):
            await rt.complete("hi", max_tokens=2, lora=ONE)
        assert rt.lora_adapters() == []


async def test_nan_logits_from_a_huge_scale_fail_that_request_alone(lora_config):
    """LoRA bad input: a scale so large the logits turn NaN would make llama.cpp's grammar
    sampler abort the process (found by the fuzzer); the request gets a 400 naming ``lora``,
    streaming or not, and the server goes on."""
    grammar = 'root ::= "yes" | "no"'
    async with open_server(lora_config()) as (rt, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
        for extra in ({"temperature": 0}, {"seed": 3}, {"stream": True}):
            body = {"prompt": PROMPT, "n_predict": 4, "grammar": grammar, "lora": [{"id": 0, "scale": 1e30}], **extra}
            r = await client.post("/completion", json=body)
            assert r.status_code == 400 and "lora" in r.json()["error"]["message"], r.text
        r = await client.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "grammar": grammar})
        assert r.status_code == 200 and r.json()["content"] in ("yes", "no")
        assert rt.engine.supervisor.restarts == [0]


# ---- startup ------------------------------------------------------------------------------


def test_lora_flags(tiny_lora, tmp_path):
    """--lora (comma-separated, repeatable), --lora-scaled FNAME:SCALE, in command-line
    order; --lora-init-without-apply; a bad --lora-scaled value exits 2 (argparse)."""
    a, b, c = str(tiny_lora), str(tmp_path / "b.gguf"), str(tmp_path / "c.gguf")
    opts = parse_serve(["--lora", a, "--lora-scaled", f"{b}:0.5,{c}:-1", "--lora", f"{c},{a}"])
    assert opts.config.lora == ((a, 1.0), (b, 0.5), (c, -1.0), (c, 1.0), (a, 1.0))
    assert not opts.config.lora_init_without_apply
    assert parse_serve(["--lora", a, "--lora-init-without-apply"]).config.lora_init_without_apply
    for bad in ("x.gguf", "x.gguf:1:2", "x.gguf:big"):
        with pytest.raises(SystemExit) as exc:
            parse_serve(["--lora-scaled", bad])
        assert exc.value.code == 2


@pytest.mark.slow
def test_missing_or_invalid_adapter_file_exits_2(tiny_model, tiny_lora, tmp_path, make_config):
    """LoRA bad input at startup: a missing adapter file and a file llama.cpp refuses as an
    adapter (here the base model itself) stop `llamactor serve` with exit code 2 naming it."""
    with pytest.raises(ConfigError, match="nope.gguf"):
        make_config(lora=(("nope.gguf", 1.0),)).validated()
    proc = subprocess.run(
        [*LLAMACTOR, "serve", "-m", str(tiny_model), "--port", str(free_port()), "--lora", str(tmp_path / "nope.gguf")],
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "nope.gguf" in proc.stderr.decode(), proc.stderr.decode()
    proc = subprocess.run(
        [*LLAMACTOR, "serve", "-m", str(tiny_model), "--port", str(free_port()), "-t", "1", "--lora", str(tiny_model)],
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "LoRA adapter" in proc.stderr.decode() and str(tiny_model) in proc.stderr.decode()
