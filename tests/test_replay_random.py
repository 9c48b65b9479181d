"""``llamactor replay --workload random``: the bench's random workloads against policies, offline."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_cli import LLAMACTOR
from test_replay import request, write_trace

from llamactor.actors.policies import BUILTIN, resolve_policy
from llamactor.ops.bench.random.randomfamily import DEFAULT_FAMILY, Family
from llamactor.ops.bench.random.randomload import draw
from llamactor.ops.replay.costfit import fit_costs
from llamactor.ops.replay.replayrandom import replay_random, simulated_capacity, workload_trace
from llamactor.ops.replay.simulate import simulate
from llamactor.ops.replay.tracefile import load_trace

CLOSED, BURST, POISSON, ONOFF = 9, 0, 7, 2  # seeds whose draw has that arrival process
OPTIONS = {"prefill_budget": 512.0, "target_itl_ms": 200.0, "target_ttft_ms": 2000.0, "cohort_max_generate_ms": 0.0}


@pytest.fixture
def costs(tmp_path: Path):
    return load_trace(
        write_trace(tmp_path / "costs.jsonl", [request(0.0, 10, 5)], policy="continuous", options=OPTIONS)
    )


def test_the_seeds_draw_what_the_tests_say():
    assert [draw(s).arrival for s in (CLOSED, BURST, POISSON, ONOFF)] == ["closed", "burst", "poisson", "onoff"]
    assert draw(CLOSED).later_turns > 0 and draw(ONOFF).later_turns > 0 and draw(BURST).prefix_lengths


def test_a_closed_loop_user_sends_its_next_request_when_its_previous_one_ended(costs):
    """Each user's requests run one after another (the same user's previous one ended first),
    and the users start at their stagger, as the bench's client sends them."""
    wl = draw(CLOSED)
    trace, after = workload_trace(wl, costs, None)
    assert after == {i: i - wl.users for i in range(wl.users, wl.n_requests)}
    assert [r.submitted for r in trace.requests[: wl.users]] == pytest.approx(wl.arrival_times(None)[: wl.users])
    result = simulate(trace, resolve_policy("continuous"), fit_costs(costs.steps), OPTIONS, after)
    assert result.unfinished == 0
    for i, j in after.items():
        assert result.outcomes[i].submitted >= result.outcomes[j].ended - 1e-9
    # The run is closed: more users than slots would queue, but never more than one request per user.
    assert len(result.outcomes) == wl.n_requests


def test_later_turns_reuse_their_conversation_and_shared_prefixes_are_cached_after_the_first_round(costs):
    wl = draw(CLOSED)
    trace, _ = workload_trace(wl, costs, None)
    for i, (it, rec) in enumerate(zip(wl.items, trace.requests)):
        assert rec.prompt == it.context and rec.generated == it.ntg
        if it.follows is not None:
            prev = wl.items[it.follows]
            assert rec.cached == prev.context + prev.ntg
        elif it.prefix is not None:
            first_round = not any(wl.items[j].prefix == it.prefix for j in range(i - wl.users + 1))
            assert rec.cached == (0 if first_round else wl.prefix_lengths[it.prefix])
        else:
            assert rec.cached == 0


def test_an_open_loop_later_turn_waits_for_the_turn_it_continues(costs):
    wl = draw(ONOFF)
    trace, after = workload_trace(wl, costs, 1.0)
    assert after == {i: it.follows for i, it in enumerate(wl.items) if it.follows is not None}
    assert [r.submitted for r in trace.requests] == pytest.approx(wl.arrival_times(1.0))
    result = simulate(trace, resolve_policy("slo"), fit_costs(costs.steps), OPTIONS, after)
    assert result.unfinished == 0
    for i, j in after.items():
        assert result.outcomes[i].submitted >= max(result.outcomes[j].ended, trace.requests[i].submitted) - 1e-9


def test_open_loop_capacity_is_measured_like_the_bench_and_scales_the_arrivals(costs):
    wl = draw(POISSON)
    cost = fit_costs(costs.steps)
    capacity = simulated_capacity(wl, costs, resolve_policy("continuous"), cost, OPTIONS)
    assert 0 < capacity < float("inf")
    [run] = replay_random(
        POISSON, DEFAULT_FAMILY, costs, cost, [("continuous", resolve_policy("continuous"))], OPTIONS, 2000, 150
    )
    assert run.capacity_rps == pytest.approx(capacity)
    [given] = replay_random(
        POISSON,
        DEFAULT_FAMILY,
        costs,
        cost,
        [("continuous", resolve_policy("continuous"))],
        OPTIONS,
        2000,
        150,
        2 * capacity,
    )
    assert given.capacity_rps == pytest.approx(2 * capacity)
    assert given.result.makespan_s < run.result.makespan_s  # twice the rate: the same requests sooner


@pytest.mark.parametrize("seed", [CLOSED, BURST, POISSON, ONOFF])
def test_every_built_in_policy_finishes_every_random_workload(seed: int, costs):
    classes = [(name, cls) for name, cls in sorted(BUILTIN.items())]
    runs = replay_random(seed, DEFAULT_FAMILY, costs, fit_costs(costs.steps), classes, OPTIONS, 2000, 150)
    assert [r.scheduler for r in runs] == [name for name, _ in classes]
    for r in runs:
        assert r.result.unfinished == 0, r.scheduler
        assert r.report.n == draw(seed).n_requests and r.report.ttft_p50_ms is not None


def test_the_command_prints_a_row_per_seed_and_policy(tmp_path: Path):
    costs = write_trace(tmp_path / "costs.jsonl", [request(0.0, 10, 5)], policy="continuous", options=OPTIONS)
    args = ["replay", "--workload", "random", "--seed", f"{BURST},{POISSON}", "--costs", str(costs)]
    out = subprocess.run(
        [*LLAMACTOR, *args, "--scheduler", "slo", "--scheduler", "continuous", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(r["seed"], r["scheduler"]) for r in rows] == [
        (BURST, "slo"),
        (BURST, "continuous"),
        (POISSON, "slo"),
        (POISSON, "continuous"),
    ]
    assert all(r["unfinished"] == 0 and r["figures"]["ttft_p50_ms"] is not None for r in rows)
    assert rows[2]["capacity_rps"] > 0 and rows[0]["capacity_rps"] is None
    text = subprocess.run([*LLAMACTOR, *args], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"seed {BURST}: burst") and "continuous" in text.stdout  # the recorded policy


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ([], "--seed"),
        (["--seed", "1"], "--costs"),
        (["--seed", "x", "--costs", "{costs}"], "integers"),
        (["--seed", "1", "--costs", "{costs}", "--family", '{"npp": [5]}'], "npp"),
        (["--seed", "1", "--costs", "{costs}", "--capacity", "0"], "--capacity"),
        (["--seed", "1", "--costs", "/nonexistent.jsonl"], "nonexistent"),
        (["--seed", "1", "--costs", "{costs}", "--scheduler", "nope"], "nope"),
        (["{costs}", "--seed", "1", "--costs", "{costs}"], "not a trace"),
    ],
)
def test_bad_input_is_refused_with_exit_2(extra: list[str], says: str, tmp_path: Path):
    costs = str(write_trace(tmp_path / "costs.jsonl", [request(0.0, 10, 5)], options=OPTIONS))
    args = [a.replace("{costs}", costs) for a in extra]
    out = subprocess.run(
        [*LLAMACTOR, "replay", "--workload", "random", *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert says in out.stderr and out.stdout == ""


def slow_ms(prompt: int, generated: int, kv: int = 0, kv_ms: float = 0.0) -> float:
    """A machine where a 1,000-token prompt takes 3 s: no burst prompt can make 2 s."""
    return 60.0 + 3.0 * prompt + 10.0 * generated


def test_in_a_burst_nobody_can_serve_in_time_slo_gives_first_tokens_in_llama_servers_order(tmp_path: Path):
    """32 users x 2 distinct 1,000-token prompts: every prompt misses 2 s whatever the order.
    Fed oldest first, a user's second request waits behind every older prompt and most first
    tokens come at the end; the default feeds them as llama-server does (by slot), so its
    median first token is llama-server's order's, not several times later."""
    from test_replay import steps_of

    costs = load_trace(
        write_trace(tmp_path / "slow.jsonl", [request(0.0, 10, 5)], steps_of(slow_ms), policy="slo", options=OPTIONS)
    )
    family = Family.from_dict(
        {
            "arrivals": ["burst"],
            "npp": [1000, 1000],
            "ntg": [32, 32],
            "users": [32, 32],
            "requests_per_user": [2, 2],
            "nps": [32],
            "duration_s": [200, 300],
            "apis": ["native"],
        }
    )
    seed = next(s for s in range(50) if not draw(s, family).prefix_lengths and not draw(s, family).later_turns)
    classes = [(name, resolve_policy(name)) for name in ("slo", "continuous")]
    slo, continuous = replay_random(seed, family, costs, fit_costs(costs.steps), classes, OPTIONS, 2000, 150)
    assert slo.result.unfinished == continuous.result.unfinished == 0
    assert slo.report.ttft_p50_ms <= 1.5 * continuous.report.ttft_p50_ms, (slo.report, continuous.report)
    assert slo.report.makespan_s <= 1.2 * continuous.report.makespan_s
