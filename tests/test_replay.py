"""Trace record and replay: ``--record-trace FILE`` and ``llamactor replay``."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
from conftest import free_port, open_server
from test_cli import LLAMACTOR, _wait_ready, serve_argv

from llamactor.actors.policies import BUILTIN, resolve_policy
from llamactor.ops.bench.slo import LatencyReport
from llamactor.ops.replay.costfit import fit_costs
from llamactor.ops.replay.simgroup import SimulationError
from llamactor.ops.replay.simulate import simulate
from llamactor.ops.replay.tracefile import Step, load_trace
from llamactor.protocol.events import Token
from llamactor.runtime import Runtime, cli

CUSTOM = str(Path(__file__).resolve().parent.parent / "examples" / "custom_policy.py") + ":ShortestPromptFirst"


# ---- hand-made traces ------------------------------------------------------------------------


def linear_ms(prompt: int, generated: int, kv: int = 0, kv_ms: float = 0.0) -> float:
    return 2.0 + 0.05 * prompt + 1.5 * generated + kv_ms * kv


def steps_of(cost: Any, n: int = 60, kv_ms: float = 0.0) -> list[dict[str, Any]]:
    """Back-to-back steps (gap 0) whose cost is exactly ``cost(prompt, generated, kv)``."""
    out, t = [], 0.0
    for i in range(n):
        p, g, kv = (i * 37) % 300, (i * 5) % 9, (i * 113) % 2000
        ms = cost(p, g, kv, kv_ms)
        out.append(
            {
                "group": 0,
                "start": t,
                "ms": ms,
                "prompt": p,
                "generated": g,
                "slots": g + (p > 0),
                "kv": kv,
                "gap_ms": 0.0 if i else None,
            }
        )
        t += ms / 1e3
    return out


def write_trace(
    path: Path,
    requests: list[dict[str, Any]],
    steps: list[dict[str, Any]] | None = None,
    *,
    policy: str = "stall-free",
    n_slots: int = 4,
    n_batch: int = 512,
    groups: int = 1,
    options: dict[str, float] | None = None,
) -> Path:
    lines = [
        {
            "type": "header",
            "version": 1,
            "groups": groups,
            "n_slots": n_slots,
            "n_batch": n_batch,
            "policy": policy,
            "policy_options": {"prefill_budget": 16} if options is None else options,
        }
    ]
    lines += [{"type": "request", **r} for r in requests]
    lines += [{"type": "step", **s} for s in (steps if steps is not None else steps_of(linear_ms))]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def request(at: float, prompt: int, generated: int, **kw: Any) -> dict[str, Any]:
    return {"group": 0, "submitted": at, "prompt": prompt, "generated": generated, "finish": "length", **kw}


def mixed_requests() -> list[dict[str, Any]]:
    """Two streams generating while long prompts arrive (the benchmark's mixed workload, in miniature)."""
    streams = [request(0.0, 8, 300) for _ in range(2)]
    arrivals = [request(0.2 + 0.4 * i, 1000, 8) for i in range(3)]
    return streams + arrivals


def varied_requests() -> list[dict[str, Any]]:
    """More requests than slots, a cached prefix, n = 2, cancellations, a second group."""
    out = [request(0.01 * i, 40 + 37 * i, 5 + i % 7) for i in range(12)]
    out.append(request(0.05, 300, 20, cached=250))
    out.append(request(0.06, 120, 9, n=2, choices=[4, 5]))
    out.append(request(0.07, 200, 3, finish="cancelled"))
    out.append(request(0.08, 500, 0, finish="cancelled"))
    out.append(request(0.09, 64, 6, group=1))
    return out


# ---- the fit ------------------------------------------------------------------------------------


def test_fit_recovers_a_known_linear_cost(tmp_path: Path):
    """Steps that cost exactly 2 + 0.05 p + 1.5 g ms are fitted exactly (R^2 = 1), and the
    KV term is left out when it explains nothing; with a real KV term it is found."""
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [request(0.0, 10, 5)]))
    decode = fit_costs(trace.steps).decode
    assert not decode.uses_kv and decode.n_steps == 60
    assert decode.intercept_ms == pytest.approx(2.0, abs=1e-9)
    assert decode.per_prompt_ms == pytest.approx(0.05, abs=1e-9)
    assert decode.per_generated_ms == pytest.approx(1.5, abs=1e-9)
    assert decode.r2 == pytest.approx(1.0)
    assert fit_costs(trace.steps).ms(100, 3, 0) == pytest.approx(linear_ms(100, 3))  # no loop time: gaps are 0
    trace = load_trace(write_trace(tmp_path / "kv.jsonl", [request(0.0, 10, 5)], steps_of(linear_ms, kv_ms=0.002)))
    decode = fit_costs(trace.steps).decode
    assert decode.uses_kv and decode.per_kv_ms == pytest.approx(0.002, abs=1e-9)
    assert decode.per_prompt_ms == pytest.approx(0.05, abs=1e-9) and decode.r2 == pytest.approx(1.0)


def test_fit_adds_the_loop_gap_between_steps():
    """A simulated step lasts its decode time plus the group's loop time before the next
    step (fitted from the recorded gaps); a gap after an idle wait (None) is not loop time."""
    steps = []
    t = 0.0
    for i in range(40):
        ms = 3.0 + 0.5 * (i % 4)
        steps.append(Step(0, t, ms, 0, i % 4, gap_ms=None if i % 10 == 0 else 1.0 + 0.25 * ((i - 1) % 4)))
        t += (ms + 1.0) / 1e3
    cost = fit_costs(steps)
    assert cost.loop.n_steps == 36 and cost.decode.n_steps == 40
    assert cost.decode.intercept_ms == pytest.approx(3.0) and cost.decode.per_generated_ms == pytest.approx(0.5)
    assert cost.loop.intercept_ms == pytest.approx(1.0) and cost.loop.per_generated_ms == pytest.approx(0.25)
    assert cost.ms(0, 2, 0) == pytest.approx(3.0 + 1.0 + 1.5) and cost.decode_ms(0, 2, 0) == pytest.approx(4.0)


def test_fit_never_gives_a_token_a_negative_cost():
    """Steps whose measured cost falls as their prompt tokens rise (noise, or a trace of
    disconnects whose token counts move together) fit no negative cost per prompt token: that
    term is fixed at 0 and the others fitted again, so a bigger step never replays cheaper."""
    steps = [
        Step(
            group=0,
            start=i * 0.01,
            ms=5.0 + 1.5 * (i % 4) - 0.004 * ((i * 37) % 300),
            prompt=(i * 37) % 300,
            generated=i % 4,
            slots=1,
            kv=None,
            gap_ms=0.0 if i else None,
        )
        for i in range(60)
    ]
    unconstrained = np.linalg.lstsq(
        np.column_stack([np.ones(60), [s.prompt for s in steps], [s.generated for s in steps]]),
        np.asarray([s.ms for s in steps]),
        rcond=None,
    )[0]
    assert unconstrained[1] < 0  # what a plain least-squares fit gives these steps
    decode = fit_costs(steps).decode
    assert decode.per_prompt_ms == 0.0 and decode.per_generated_ms == pytest.approx(1.5, abs=0.05)
    model = fit_costs(steps)
    assert model.decode_ms(299, 2, 0) >= model.decode_ms(0, 2, 0)


def test_replay_counts_the_cancelled_requests(tmp_path: Path):
    """Requests the recording ended as cancelled stay in the replay's figures: a column counts
    them (recorded and replayed alike), they are never good, and the one that got tokens before
    its client left counts in the TTFT figures (its client waited for that token)."""
    reqs = [request(0.01 * i, 40, 5) for i in range(4)]
    reqs.append(request(0.05, 200, 3, finish="cancelled", first_token=0.3, finished=0.35, assigned=0.06))
    reqs.append(request(0.06, 500, 0, finish="cancelled"))
    path = write_trace(tmp_path / "t.jsonl", reqs)
    out = _replay_json(path, "--scheduler", "stall-free")
    recorded, replayed = out["recorded"], out["policies"][0]
    assert recorded["figures"]["ended_badly"] == 2 and replayed["figures"]["ended_badly"] == 2
    assert replayed["good"] <= 4 and replayed["unfinished"] == 0
    trace = load_trace(path)
    result = simulate(trace, resolve_policy("stall-free"), fit_costs(trace.steps))
    with_ended = LatencyReport.of(result.samples(), result.makespan_s, latency_of_ended=True)
    without = LatencyReport.of(result.samples(), result.makespan_s)
    ttft_of_cancelled = result.outcomes[4].ttft_s
    assert ttft_of_cancelled is not None
    ok_ttfts = [o.ttft_s for o in result.outcomes[:4] if o.ttft_s is not None]
    assert without.ttft_mean_ms == pytest.approx(1e3 * sum(ok_ttfts) / 4)
    assert with_ended.ttft_mean_ms == pytest.approx(1e3 * (sum(ok_ttfts) + ttft_of_cancelled) / 5)
    text = cli_output(path)
    header = next(line for line in text.splitlines() if line.startswith("policy"))
    assert header.split()[-1] == "cancelled"
    assert all(line.split()[-1] == "2" for line in text.splitlines() if line.startswith(("recorded", "stall-free")))


def cli_output(path: Path) -> str:
    proc = subprocess.run(
        [*LLAMACTOR, "replay", str(path), "--scheduler", "stall-free"], check=False, capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode()


# ---- the simulator ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*sorted(BUILTIN), CUSTOM])
def test_every_policy_replays_a_trace_to_the_end(tmp_path: Path, name: str):
    """Replay liveness and accounting: every built-in policy (and a custom one, loaded as
    ``--scheduler`` loads it) runs every recorded request to its end, generates exactly the
    recorded tokens and decodes exactly the prompt tokens the cache did not hold."""
    trace = load_trace(
        write_trace(
            tmp_path / "t.jsonl",
            varied_requests(),
            groups=2,
            options={"prefill_budget": 16, "cohort_max_generate_ms": 30.0},
        )
    )
    result = simulate(trace, resolve_policy(name), fit_costs(trace.steps))
    assert result.unfinished == 0
    assert result.generated_tokens == trace.generated_tokens == sum(r["generated"] for r in varied_requests())
    assert result.prompt_tokens == sum(r.prompt - r.cached for r in trace.requests)
    completed = [o for o, r in zip(result.outcomes, trace.requests) if r.ok]
    assert all(o.ok and o.ttft_s is not None and o.ttft_s > 0 for o in completed)
    assert not any(o.ok for o, r in zip(result.outcomes, trace.requests) if not r.ok)
    for o, r in zip(result.outcomes, trace.requests):
        assert o.n_generated == r.generated
        assert len(o.gaps_s) == sum(max(k - 1, 0) for k in r.per_choice)


@pytest.mark.slow
def test_simulation_is_deterministic(tmp_path: Path):
    """Replay is deterministic: the same trace and policy give the same numbers."""
    path = write_trace(tmp_path / "t.jsonl", varied_requests() + mixed_requests(), groups=2)
    for name in sorted(BUILTIN):
        runs = [simulate(load_trace(path), BUILTIN[name], fit_costs(load_trace(path).steps)) for _ in range(2)]
        assert runs[0] == runs[1], name
    outs = [_replay_json(path, "--scheduler", "cohort", "--scheduler", "stall-free") for _ in range(2)]
    assert outs[0] == outs[1]


@pytest.mark.slow
def test_continuous_stalls_streams_more_than_stall_free(tmp_path: Path):
    """Replaying the mixed workload shows the policies' known direction: continuous
    batching puts whole prompt chunks into the streams' steps (higher inter-token p99),
    stall-free bounds them (and so gives the long prompts their first token later)."""
    path = write_trace(tmp_path / "t.jsonl", mixed_requests(), options={"prefill_budget": 16})
    out = _replay_json(path, "--scheduler", "continuous", "--scheduler", "stall-free")
    cont, sf = (p["figures"] for p in out["policies"])
    assert cont["itl_p99_ms"] > 2 * sf["itl_p99_ms"]
    assert cont["ttft_p99_ms"] < sf["ttft_p99_ms"]
    assert all(p["unfinished"] == 0 for p in out["policies"])
    assert 0.0 <= cont["goodput"] <= 1.0 and 0.0 <= sf["goodput"] <= 1.0


def test_an_invalid_plan_is_reported(tmp_path: Path):
    """A custom policy that plans more prompt tokens than a slot has is named, exit 1."""
    (tmp_path / "greedy_policy.py").write_text(
        "from llamactor.actors.policy import Policy, StepPlan\n"
        "class TooMuch(Policy):\n"
        "    def plan(self, view, grant):\n"
        "        return StepPlan(prefill=tuple((s.local, s.prompt_left + 1) for s in view.slots if s.prompt_left))\n"
    )
    path = write_trace(tmp_path / "t.jsonl", [request(0.0, 10, 3)])
    with pytest.raises(SimulationError, match="prompt tokens left"):
        simulate(
            load_trace(path),
            resolve_policy(f"{tmp_path / 'greedy_policy.py'}:TooMuch"),
            fit_costs(load_trace(path).steps),
        )
    assert cli.main(["replay", str(path), "--scheduler", f"{tmp_path / 'greedy_policy.py'}:TooMuch"]) == 1


def _replay_json(path: Path, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [*LLAMACTOR, "replay", str(path), "--json", *args], check=False, capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def test_bad_input_exits_2(tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]):
    """A missing file, a file that is not a trace, a trace without steps and an unknown
    scheduler stop ``llamactor replay`` with exit status 2 and a message saying which."""
    good = write_trace(tmp_path / "t.jsonl", [request(0.0, 10, 3)])
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "other.jsonl").write_text('{"type": "request", "group": 0}\n')
    no_steps = write_trace(tmp_path / "nosteps.jsonl", [request(0.0, 10, 3)], steps=[])
    cases = [
        ([str(tmp_path / "missing.jsonl")], "cannot read"),
        ([str(tmp_path / "notes.txt")], "not a llamactor trace"),
        ([str(tiny_model)], "not a llamactor trace"),
        ([str(tmp_path / "other.jsonl")], "not a llamactor trace"),
        ([str(no_steps)], "no decode steps"),
        ([str(good), "--scheduler", "nope"], "unknown scheduler 'nope'"),
        ([str(good), "--scheduler", "no_such_module:Policy"], "cannot load scheduler"),
    ]
    for args, message in cases:
        assert cli.main(["replay", *args]) == 2, args
        err = capsys.readouterr().err
        assert "llamactor replay: error:" in err and message in err, (args, err)


# ---- recording from a live runtime -------------------------------------------------------------


async def _serve_mix(rt: Runtime) -> list[int]:
    """Concurrent requests, a cached-prefix repeat, n = 2, and one cancelled mid-stream."""
    generated: list[int] = []

    async def one(prompt: str, n_predict: int, **kw: Any) -> None:
        c = await rt.complete(prompt, max_tokens=n_predict, temperature=0, ignore_eos=True, **kw)
        generated.append(c.n_predicted)

    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(one, f"request {i} " + "word " * (20 * i + 5), 6 + i)
    await one("the same long prompt " * 10, 4)
    await one("the same long prompt " * 10, 4)  # its prefix is cached now
    await one("two choices", 5, n=2)
    handle = await rt.submit("cancel me " * 5, max_tokens=200, temperature=0, ignore_eos=True)
    async with handle:
        async for event in handle:
            if isinstance(event, Token):
                break  # leaving the block closes the stream: the group cancels the request
    generated.append(-1)
    return generated


def _check_recording(path: Path, rt: Runtime, n_requests: int) -> None:
    trace = load_trace(path)
    h = trace.header
    assert (h.groups, h.n_slots, h.n_batch, h.policy) == (
        rt.config.pipeline_groups,
        rt.config.slots_per_group,
        rt.config.n_batch,
        rt.config.scheduler,
    )
    assert h.n_ctx_slot == rt.config.ctx_per_request and h.model == Path(rt.config.model).name
    counters = rt.engine.metrics.groups
    assert len(trace.requests) == n_requests
    assert trace.generated_tokens == sum(c.tokens_predicted for c in counters)
    assert sum(s.generated for s in trace.steps) == sum(c.tokens_predicted for c in counters)
    assert sum(s.prompt for s in trace.steps) == sum(c.prompt_tokens for c in counters)
    assert sum(r.prompt - r.cached for r in trace.requests) == sum(c.prompt_tokens for c in counters)
    assert len(trace.steps) == sum(c.n_decode for c in counters)
    for r in trace.requests:
        assert r.assigned is not None and 0 <= r.submitted <= r.assigned
        if r.generated:
            assert r.first_token is not None and r.assigned <= r.first_token <= r.finished
    # a step that decoded rows names their KV cells; one that only sampled kept logits (a cohort's
    # release from its barrier) decoded nothing
    assert all(s.ms > 0 and s.kv is not None and (s.kv > 0) == (s.slots > 0) for s in trace.steps)


@pytest.mark.slow
async def test_runtime_records_a_trace_consistent_with_its_metrics(make_config, tmp_path: Path):
    """Recording through the embedding API: ``RuntimeConfig(record_trace=path)`` writes a header, one
    request line per request and one step line per decode step; counts of requests, generated
    and prompt tokens and steps equal the runtime's own metrics; the trace replays."""
    path = tmp_path / "run.jsonl"
    async with Runtime.open(make_config(parallel=2, record_trace=str(path), scheduler="stall-free")) as rt:
        generated = await _serve_mix(rt)
    _check_recording(path, rt, len(generated))
    trace = load_trace(path)
    assert sum(r.cached > 0 for r in trace.requests) >= 1
    assert [r.choices for r in trace.requests if r.n == 2] == [[5, 5]]
    cancelled = [r for r in trace.requests if r.finish == "cancelled"]
    assert len(cancelled) == 1 and 1 <= cancelled[0].generated < 200
    assert sorted(r.generated for r in trace.requests if r.ok) == sorted(g for g in generated if g >= 0)
    out = _replay_json(path)
    assert out["policies"][0]["scheduler"] == "stall-free" and out["policies"][0]["unfinished"] == 0
    assert out["policies"][0]["generated_tokens"] == trace.generated_tokens


async def test_http_server_records_a_trace(make_config, tmp_path: Path):
    """Recording through HTTP: requests served by /completion are recorded, cohort's held first tokens too."""
    path = tmp_path / "http.jsonl"
    async with open_server(make_config(parallel=2, record_trace=str(path), scheduler="cohort")) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:

            async def one(i: int) -> None:
                r = await client.post(
                    "/completion",
                    json={"prompt": f"hello {i} " * (3 + 5 * i), "n_predict": 7, "temperature": 0, "ignore_eos": True},
                )
                assert r.status_code == 200 and r.json()["tokens_predicted"] == 7

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
    _check_recording(path, rt, 4)
    assert all(r.generated == 7 and r.finish == "length" for r in load_trace(path).requests)


def test_bad_record_trace_path_is_refused(make_config, tmp_path: Path):
    """A trace path in a directory that does not exist is a startup error naming the flag."""
    from llamactor.protocol.errors import ConfigError

    with pytest.raises(ConfigError, match="--record-trace"):
        make_config(record_trace=str(tmp_path / "no" / "such" / "t.jsonl")).validated()


@pytest.mark.slow
def test_serve_record_trace_flag_then_replay(tiny_model: Path, tmp_path: Path):
    """Record and replay as a user runs them: ``llamactor serve --record-trace FILE``, requests over HTTP, SIGTERM
    (the last records are written at shutdown), then ``llamactor replay FILE`` prints the table;
    a bad path stops serve with exit code 2."""
    path = tmp_path / "served.jsonl"
    port = free_port()
    proc = subprocess.Popen(
        serve_argv(tiny_model, port, "2", "2048", "--scheduler", "continuous", "--record-trace", str(path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        for i in range(3):
            r = httpx.post(
                url + "/completion",
                json={"prompt": f"hi {i}", "n_predict": 5, "temperature": 0, "ignore_eos": True},
                timeout=30,
            )
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 5
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err.decode()
    trace = load_trace(path)
    assert len(trace.requests) == 3 and trace.generated_tokens == 15 and trace.header.policy == "continuous"
    out = subprocess.run([*LLAMACTOR, "replay", str(path)], check=False, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    text = out.stdout.decode()
    assert "recorded (continuous)" in text and "R^2" in text and "TTFT p50 ms" in text
    bad = subprocess.run(
        [
            *LLAMACTOR,
            "serve",
            "-m",
            str(tiny_model),
            "--port",
            str(free_port()),
            "--record-trace",
            str(tmp_path / "missing" / "t.jsonl"),
        ],
        check=False,
        capture_output=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "--record-trace" in bad.stderr.decode()
