"""Speculative decoding per group (one draft context each), n-gram (prompt lookup) and a draft model.

Identity horizon, measured on the tiny model (8 repetitive prompts, concurrent, greedy,
``--spec-ngram-simple-size-n`` 1, 2, 3 and 12, ``pipeline_groups`` 1 and 2, and the model as its
own draft): the tokens were identical to plain decoding over each slot's whole context (up to
1,000 generated tokens per prompt, about 7,900 per run), although llama.cpp verifies a draft in
one multi-token batch, which is not bit-identical to one-token steps. The tests below assert
256 tokens per prompt (llama.cpp's own test asks for 16); a real model with closer logits may
part earlier, as it may between two batch sizes without speculation. Measured on gemma3-270m
(a "repeat this text" prompt, not part of the suite): identical through the 47 repeated tokens,
then parted at the first near-tie after the text, where llama.cpp alone, without llamactor,
moves the top logit by 0.16 between one-token steps and a 16-token batch (top-2 gap 0.54 vs
0.10); with 1-token drafts it stayed identical over all 120 tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest
from conftest import open_server

from llamactor.actors.policies import BUILTIN
from llamactor.protocol.messages import Speculation
from llamactor.protocol.sampling import SamplingParams
from llamactor.runtime import ConfigError, RequestError, Runtime
from llamactor.runtime.service.config import RuntimeConfig, default_model_path
from llamactor.runtime.service.speculation import resolve_speculation, server_speculation

PROMPTS = [
    "repeat this text: the cat sat on the mat. the cat sat on the mat. the cat sat on",
    "one two three four five six seven eight nine ten one two three four five six seven",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "a b c d e f a b c d e f a b c",
    "Hello world hello world hello world",
    "1 2 3 4 5 1 2 3 4 5 1 2 3",
    "def main(): return main() def main(): return",
    "héllo 世界 🙂 héllo 世界 🙂 héllo",
]
N_PREDICT = 256
NGRAM = {"spec_type": "ngram-simple", "spec_ngram_size_n": 2}  # short keys: many drafts on the tiny model
LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]


async def _greedy(rt: Runtime, prompts: list[str], n_predict: int = N_PREDICT, **fields) -> list[tuple[int, ...]]:
    """Every prompt at once (mixed batches), greedy."""
    out: list[tuple[int, ...]] = [()] * len(prompts)

    async def one(i: int) -> None:
        done = await rt.complete(prompts[i], max_tokens=n_predict, temperature=0, ignore_eos=True, **fields)
        out[i] = done.choices[0].tokens

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return out


def _spec_counters(rt: Runtime) -> dict[str, float]:
    """llama-server's spec_decode_* counters summed over the groups."""
    out: dict[str, float] = {}
    for line in rt.engine.metrics.render().decode().splitlines():
        if line.startswith("llamacpp:spec_decode_num_") and "per_pos" not in line:
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value
    return out


@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 2])
async def test_ngram_greedy_output_identical_and_drafts_accepted(make_config, groups):
    """Greedy output with n-gram speculation equals plain decoding for N = 1 and 2
    groups (8 concurrent prompts, 256 tokens each; horizon in the module docstring), drafts were
    verified and accepted in every group, and the counters are llama-server's."""
    cfg = make_config(parallel=8, pipeline_groups=groups)
    async with Runtime.open(cfg) as rt:
        plain = await _greedy(rt, PROMPTS)
        assert _spec_counters(rt) == {  # off: nothing drafted, and the series exist
            "llamacpp:spec_decode_num_draft_tokens_total": 0.0,
            "llamacpp:spec_decode_num_accepted_tokens_total": 0.0,
            "llamacpp:spec_decode_num_drafts_total": 0.0,
        }
        assert not any(s.speculative for s in rt.engine.slot_states())
    async with Runtime.open(make_config(parallel=8, pipeline_groups=groups, **NGRAM)) as rt:
        spec = await _greedy(rt, PROMPTS)
        counters = _spec_counters(rt)
        metrics = rt.engine.metrics.render().decode()
        assert all(s.speculative for s in rt.engine.slot_states())
    assert spec == plain
    assert counters["llamacpp:spec_decode_num_accepted_tokens_total"] > 0
    assert (
        counters["llamacpp:spec_decode_num_draft_tokens_total"]
        >= counters["llamacpp:spec_decode_num_accepted_tokens_total"]
    )
    for g in range(groups):
        assert f'llamactor:group_spec_decode_num_accepted_tokens_per_pos_total{{group="{g}",position="0"}}' in metrics


@pytest.mark.slow
async def test_draft_model_same_model_identical_with_full_acceptance(make_config, tiny_model):
    """A draft model (-md) with one draft context per group: the model as its own
    draft gives the same greedy tokens and every draft token is accepted."""
    async with Runtime.open(make_config(parallel=4, pipeline_groups=2)) as rt:
        plain = await _greedy(rt, PROMPTS[:4])
    async with Runtime.open(
        make_config(parallel=4, pipeline_groups=2, spec_draft_model=str(tiny_model), spec_draft_n_max=6)
    ) as rt:
        spec = await _greedy(rt, PROMPTS[:4])
        counters = _spec_counters(rt)
        assert rt.config.spec_type == "draft-simple"
        # speculative.p_min: the draft stops below that top-10 probability (1: nearly never drafts)
        picky = await rt.complete(PROMPTS[0], max_tokens=64, temperature=0, ignore_eos=True, speculative_p_min=1.0)
        eager = await rt.complete(PROMPTS[0], max_tokens=64, temperature=0, ignore_eos=True)
        assert picky.choices[0].tokens == eager.choices[0].tokens == plain[0][:64]
        assert picky.n_draft < eager.n_draft
    assert spec == plain
    drafted = counters["llamacpp:spec_decode_num_draft_tokens_total"]
    assert drafted > 0 and counters["llamacpp:spec_decode_num_accepted_tokens_total"] == drafted
    # every draft but the last of each request is full length
    assert drafted >= 4 * (N_PREDICT - 6 - 1) * 6 / 7


async def test_metrics_slots_and_request_fields_over_http(make_config):
    """/metrics counts drafts per group, /slots shows ``speculative`` and the draft counters
    (llama-server's timings names draft_n, draft_n_accepted, which the response's timings carry
    too), and the request fields
    speculative.n_max / n_min / p_min are read (n_max 0 turns it off for that request, a small
    n_max bounds each draft) and checked (400 naming the field)."""
    body = {"prompt": PROMPTS[1], "n_predict": 96, "temperature": 0, "ignore_eos": True, "id_slot": 0}
    async with open_server(make_config(parallel=2, **NGRAM)) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            plain = (await client.post("/completion", json={**body, "speculative.n_max": 0})).json()
            slot = (await client.get("/slots")).json()[0]
            assert slot["speculative"] is True and "draft_n" not in slot  # off for that request
            assert _spec_counters(rt)["llamacpp:spec_decode_num_drafts_total"] == 0
            r = await client.post("/completion", json=body)
            assert r.status_code == 200 and r.json()["tokens"] == plain["tokens"]
            slot = (await client.get("/slots")).json()[0]
            assert slot["draft_n_accepted"] > 0 and slot["draft_n"] >= slot["draft_n_accepted"]
            timings = r.json()["timings"]  # llama-server adds these when drafts were verified
            assert (timings["draft_n"], timings["draft_n_accepted"]) == (slot["draft_n"], slot["draft_n_accepted"])
            assert "draft_n" not in plain["timings"]
            metrics = (await client.get("/metrics")).text
            series = 'llamactor:group_spec_decode_num_accepted_tokens_total{group="0"}'
            assert f"{series} {slot['draft_n_accepted']:.1f}" in metrics
            small = await client.post(
                "/v1/completions",
                json={
                    "prompt": PROMPTS[1],
                    "max_tokens": 96,
                    "temperature": 0,
                    "ignore_eos": True,
                    "id_slot": 0,
                    "speculative.n_max": 2,
                    "speculative.n_min": 1,
                    "speculative.p_min": 0.5,
                },
            )
            assert small.status_code == 200
            slot = (await client.get("/slots")).json()[0]
            assert 0 < slot["draft_n"] <= 2 * slot["draft_n_steps"]
            assert small.json()["choices"][0]["text"] == plain["content"]
            for field, value in (
                ("speculative.n_max", -1),
                ("speculative.n_min", -3),
                ("speculative.p_min", 1.5),
                ("speculative.n_min", "x"),
            ):
                for path, extra in (
                    ("/completion", {}),
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                ):
                    r = await client.post(path, json={"prompt": "hi", "n_predict": 2, **extra, field: value})
                    assert r.status_code == 400 and field in r.text, (path, field, r.text)
        # the embedding API: the same fields as keyword arguments
        off = await rt.complete(PROMPTS[1], max_tokens=96, temperature=0, ignore_eos=True, speculative_n_max=0)
        on = await rt.complete(PROMPTS[1], max_tokens=96, temperature=0, ignore_eos=True, speculative_n_max=4)
        assert off.choices[0].tokens == on.choices[0].tokens == tuple(plain["tokens"])
        assert off.n_draft == 0 and 0 < on.n_draft_accepted <= on.n_draft
        with pytest.raises(RequestError, match="speculative.p_min"):
            await rt.complete("hi", max_tokens=2, speculative_p_min=-0.5)


def test_admission_resolves_the_request_fields_over_the_servers_limits():
    """A task carries its draft settings resolved: n_max at most the server's (0: none), n_min and
    p_min the request's where given, else the server's for its kind of speculation."""
    ngram = server_speculation(RuntimeConfig(spec_type="ngram-simple", spec_ngram_size_m=16, spec_draft_n_min=2))
    assert ngram == Speculation(16, 2, 0.0)
    mod = RuntimeConfig(spec_type="ngram-mod", spec_ngram_mod_n_max=64, spec_ngram_mod_n_min=48, spec_draft_p_min=0.5)
    assert server_speculation(mod) == Speculation(64, 48, 0.0)
    assert server_speculation(RuntimeConfig(spec_type="draft-simple", spec_draft_p_min=0.5)) == Speculation(3, 0, 0.5)
    assert server_speculation(RuntimeConfig()) is None
    for fields, resolved in (
        ({}, Speculation(16, 2, 0.0)),
        ({"speculative_n_max": 40, "speculative_n_min": 0, "speculative_p_min": 0.25}, Speculation(16, 0, 0.25)),
        ({"speculative_n_max": 3}, Speculation(3, 2, 0.0)),
        ({"speculative_n_max": 0}, None),
    ):
        assert resolve_speculation(SamplingParams(**fields), ngram) == resolved
        assert resolve_speculation(SamplingParams(**fields), None) is None


def test_bad_speculation_settings_refused(make_config, tiny_model):
    """Bad speculation settings are refused at startup with a message naming them."""
    for overrides, message in (
        ({"spec_type": "ngram-map-k"}, "--spec-type must be one of"),
        ({"spec_type": "ngram-simple", "spec_ngram_size_n": 0}, "--spec-ngram-simple-size-n"),
        ({"spec_type": "ngram-simple", "spec_ngram_size_m": 2000}, "--spec-ngram-simple-size-m"),
        ({"spec_draft_p_min": 1.5}, "--spec-draft-p-min"),
        ({"spec_draft_n_max": -1}, "--spec-draft-n-max"),
        ({"spec_type": "draft-simple"}, "needs a draft model"),
        ({"spec_draft_model": "/nonexistent/draft.gguf"}, "draft model file not found"),
        ({"spec_type": "ngram-simple", "spec_draft_model": str(tiny_model)}, "one kind of speculation"),
    ):
        with pytest.raises(ConfigError, match=message):
            make_config(**overrides).validated()


async def test_draft_model_with_another_vocabulary_refused(make_config):
    """Speculation bad input: a draft model whose vocabulary differs from the target's stops startup,
    naming it (SmolLM2 as the draft of the tiny model)."""
    draft = str(default_model_path())
    with pytest.raises(ConfigError, match="vocabulary does not match") as info:
        async with Runtime.open(make_config(parallel=1, spec_draft_model=draft)):
            pass
    assert draft in str(info.value)


@pytest.mark.slow
def test_cli_flags_and_exit_2(tiny_model: Path):
    """Speculation flags as llama-server spells them: an unbuilt --spec-type and a draft model with
    another vocabulary exit with code 2 naming them; the older --draft-max is read as
    --spec-draft-n-max."""
    env = {**os.environ, "LLAMA_ARG_DRAFT_MAX": "7"}
    for flags, message in (
        (["--spec-type", "ngram-map-k4v"], "argument --spec-type: ngram-map-k4v is not built"),
        (["-md", str(default_model_path())], "vocabulary does not match"),
        (["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "0"], "--spec-ngram-simple-size-n"),
    ):
        proc = subprocess.run(
            [*LLAMACTOR, "serve", "-m", str(tiny_model), "-t", "1", "--port", "0", *flags],
            check=False,
            capture_output=True,
            timeout=120,
            env=env,
        )
        assert proc.returncode == 2, (flags, proc.stderr.decode()[-2000:])
        assert message in proc.stderr.decode(), proc.stderr.decode()[-2000:]


def test_cli_reads_the_speculation_flags(tiny_model: Path):
    """Every speculation flag lands in its config field (older llama-server's --draft-max too)."""
    from test_llama_server_compat import _parse

    opts = _parse(
        [
            "-m",
            str(tiny_model),
            "--spec-type",
            "ngram-simple",
            "--spec-ngram-simple-size-n",
            "4",
            "--spec-ngram-simple-size-m",
            "16",
            "--draft-max",
            "5",
            "--spec-draft-n-min",
            "2",
            "--draft-p-min",
            "0.25",
            "-md",
            str(tiny_model),
            "-ngld",
            "0",
            "-devd",
            "CPU",
        ]
    )
    c = opts.config
    assert (
        c.spec_type,
        c.spec_ngram_size_n,
        c.spec_ngram_size_m,
        c.spec_draft_n_max,
        c.spec_draft_n_min,
        c.spec_draft_p_min,
        c.spec_draft_model,
        c.spec_draft_n_gpu_layers,
        c.spec_draft_devices,
    ) == ("ngram-simple", 4, 16, 5, 2, 0.25, str(tiny_model), 0, ("CPU",))
    assert _parse(["--spec-type", "none,draft-simple"]).config.spec_type == "draft-simple"
    assert _parse([], {"LLAMA_ARG_SPEC_TYPE": "ngram-simple"}).config.spec_type == "ngram-simple"


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(BUILTIN))
async def test_every_policy_with_speculation(make_config, policy):
    """Speculation under every built-in scheduling policy: greedy output as without speculation."""
    prompts = PROMPTS[:4]
    async with Runtime.open(make_config(parallel=4, scheduler=policy)) as rt:
        plain = await _greedy(rt, prompts, 64)
    async with Runtime.open(make_config(parallel=4, scheduler=policy, **NGRAM)) as rt:
        spec = await _greedy(rt, prompts, 64)
        assert _spec_counters(rt)["llamacpp:spec_decode_num_accepted_tokens_total"] > 0
    assert spec == plain


@pytest.mark.slow
async def test_request_features_with_speculation(make_config):
    """Speculation with the request's other features: stop strings, n_predict, n > 1 (each choice
    speculates on its own slot), n_probs (the probabilities come from the verify batch's
    rows), seeded sampling (valid, and repeatable), and the end of the slot's context."""
    prompt = PROMPTS[0]
    async with Runtime.open(make_config(parallel=2, n_ctx=1024)) as rt:
        ref = await rt.complete(prompt, max_tokens=200, temperature=0, ignore_eos=True)
        probs_ref = await rt.complete(prompt, max_tokens=40, temperature=0, ignore_eos=True, n_probs=3)
        full_ref = await rt.complete(prompt, max_tokens=-1, temperature=0, ignore_eos=True)
    stop = ref.text[60:66]
    assert stop and stop in ref.text
    async with Runtime.open(make_config(parallel=2, n_ctx=1024, **NGRAM)) as rt:
        stopped = await rt.complete(prompt, max_tokens=200, temperature=0, ignore_eos=True, stop=[stop])
        assert stopped.finish_reason == "stop" and stopped.text == ref.text[: ref.text.index(stop)]
        for n in (1, 7, 33):
            short = await rt.complete(prompt, max_tokens=n, temperature=0, ignore_eos=True)
            assert short.choices[0].tokens == ref.choices[0].tokens[:n] and short.finish_reason == "length"
        two = await rt.complete(prompt, max_tokens=100, temperature=0, ignore_eos=True, n=2)
        assert [c.tokens for c in two.choices] == [ref.choices[0].tokens[:100]] * 2
        probs = await rt.complete(prompt, max_tokens=40, temperature=0, ignore_eos=True, n_probs=3)
        assert probs.choices[0].tokens == probs_ref.choices[0].tokens
        events = [e async for e in rt.stream(prompt, max_tokens=40, temperature=0, ignore_eos=True, n_probs=3)]
        tokens = [e for e in events if type(e).__name__ == "Token"]
        assert len(tokens) == 40 and all(len(t.top) == 3 and t.logprob is not None for t in tokens)
        seeded = [await rt.complete(prompt, max_tokens=80, temperature=0.9, seed=42, ignore_eos=True) for _ in range(2)]
        assert seeded[0].n_predicted == 80 and seeded[0].choices[0].tokens == seeded[1].choices[0].tokens
        full = await rt.complete(prompt, max_tokens=-1, temperature=0, ignore_eos=True)
        assert full.finish_reason == "length" and full.choices[0].tokens == full_ref.choices[0].tokens
        assert _spec_counters(rt)["llamacpp:spec_decode_num_accepted_tokens_total"] > 0


async def test_cancel_mid_draft_leaves_the_slot_consistent(make_config):
    """A client that leaves while its slot speculates ends the request; the rejected
    drafts' KV cells are gone, so the slot's cached prompt is reused exactly afterwards (the same
    greedy tokens as a fresh runtime, with the prefix taken from the cache)."""
    prompt = PROMPTS[1]
    async with Runtime.open(make_config(parallel=1)) as rt:
        ref = await rt.complete(prompt, max_tokens=120, temperature=0, ignore_eos=True)
    async with Runtime.open(make_config(parallel=1, **NGRAM)) as rt:
        seen = 0
        async for event in rt.stream(prompt, max_tokens=400, temperature=0, ignore_eos=True):
            seen += 1
            if seen == 50:
                break  # the stream closes: the group ends the request after its step
        await _wait_idle(rt)
        assert _spec_counters(rt)["llamacpp:spec_decode_num_drafts_total"] > 0
        again = await rt.complete(prompt, max_tokens=120, temperature=0, ignore_eos=True)
        assert again.n_cached > 0
        assert again.choices[0].tokens == ref.choices[0].tokens


async def _wait_idle(rt: Runtime) -> None:
    with anyio.fail_after(10):
        while any(s.busy for s in rt.engine.slot_states()):
            await anyio.sleep(0.01)


async def test_drafts_fit_the_batch(make_config, monkeypatch):
    """A step never exceeds n_batch: drafts (up to 48 tokens here) are cut to the room the
    plan's prompt and generate rows leave, and the output is still plain greedy's."""
    import llama_cpp

    sizes: list[int] = []
    real = llama_cpp.llama_decode

    def counting(ctx, batch):  # contexts bind llama_decode when they are made
        sizes.append(batch.n_tokens)
        return real(ctx, batch)

    prompts = PROMPTS[:2]
    async with Runtime.open(make_config(parallel=2, n_batch=8, n_ubatch=8)) as rt:
        plain = await _greedy(rt, prompts, 128)
    monkeypatch.setattr(llama_cpp, "llama_decode", counting)
    async with Runtime.open(
        make_config(parallel=2, n_batch=8, n_ubatch=8, spec_type="ngram-simple", spec_ngram_size_n=2)
    ) as rt:
        spec = await _greedy(rt, prompts, 128)
        counters = _spec_counters(rt)
    assert spec == plain
    assert counters["llamacpp:spec_decode_num_accepted_tokens_total"] > 0
    assert max(sizes) == 8  # full steps happen, none larger
