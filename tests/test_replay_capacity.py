"""``llamactor replay --capacity-run``: a capacity run's attainment predicted offline, the front
end's measured cost included."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_cli import LLAMACTOR
from test_replay import request, write_trace

from llamactor.actors.policies import resolve_policy
from llamactor.ops.replay.costfit import fit_costs
from llamactor.ops.replay.replaycapacity import CapacityRun, replay_capacity
from llamactor.ops.replay.tracefile import load_trace

OPTIONS = {"prefill_budget": 512.0, "target_itl_ms": 200.0, "target_ttft_ms": 2000.0, "cohort_max_generate_ms": 0.0}


def capacity_json(path: Path, *, seed: int | None = 3, rates: tuple[float, ...] = (0.5, 50.0)) -> Path:
    """A ``bench --capacity --json`` output as the replay reads it (server B measured at ``rates``)."""
    doc = {
        "shape": "sharegpt",
        "arrivals": "poisson",
        "requests_per_point": 12,
        "slo": {"ttft_ms_per_token": 5.0, "ttft_floor_ms": 50.0, "tpot_ms": 200.0},
        "capacity_rps": {"A": 0.5, "B": 0.5},
        "curve": {
            name: [
                {"rate": r, "attainment": 1.0, "stopped": False, "front_ms": {"p50": 20.0 + r, "p99": 40.0}}
                for r in rates
            ]
            for name in ("A", "B")
        },
    }
    if seed is not None:
        doc["seed"] = seed
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


@pytest.fixture
def costs(tmp_path: Path) -> Path:
    return write_trace(tmp_path / "costs.jsonl", [request(0.0, 10, 5)], policy="continuous", options=OPTIONS)


def test_the_front_end_cost_is_measured_unloaded_and_counts_against_the_ttft_slo(tmp_path: Path, costs: Path):
    run = CapacityRun.load(str(capacity_json(tmp_path / "run.json")), "B")
    assert run.front_ms() == 20.5  # p50 at the lowest rate: queueing at higher ones is the simulator's
    trace = load_trace(costs)
    classes = [("continuous", resolve_policy("continuous"))]
    free = replay_capacity(run, trace, fit_costs(trace.steps), classes, OPTIONS, 0.0)
    slow = replay_capacity(run, trace, fit_costs(trace.steps), classes, OPTIONS, 1e6)
    assert [p.rate for p in free] == [0.5, 50.0]
    assert free[0].predicted["continuous"] == 1.0  # one request at a time meets 5x its own latency
    assert free[1].predicted["continuous"] < free[0].predicted["continuous"]  # 100x the rate queues
    assert all(p.predicted["continuous"] == 0.0 for p in slow)  # a front end slower than every SLO


def test_the_command_prints_measured_beside_predicted(tmp_path: Path, costs: Path):
    run = capacity_json(tmp_path / "run.json")
    args = [*LLAMACTOR, "replay", "--capacity-run", str(run), "--costs", str(costs), "--scheduler", "slo"]
    out = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["front_ms"] == 20.5 and [p["rate"] for p in doc["points"]] == [0.5, 50.0]
    assert all(0.0 <= p["predicted"]["slo"] <= 1.0 and p["measured"] == 1.0 for p in doc["points"])
    text = subprocess.run([*args, "--front-ms", "0"], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "front end 0 ms a request" in text.stdout, text.stderr


@pytest.mark.parametrize(
    ("make", "extra", "message"),
    [
        (lambda p: capacity_json(p), [], "--costs"),
        (lambda p: capacity_json(p, seed=None), ["--costs", "{costs}"], "seed"),
        (lambda p: capacity_json(p), ["--costs", "{costs}", "--server", "C"], "no server 'C'"),
        (lambda p: capacity_json(p), ["--costs", "{costs}", "--front-ms", "-1"], "--front-ms"),
    ],
)
def test_bad_capacity_replays_exit_2(tmp_path: Path, costs: Path, make, extra: list[str], message: str):
    run = make(tmp_path / "run.json")
    argv = [a.replace("{costs}", str(costs)) for a in extra]
    out = subprocess.run(
        [*LLAMACTOR, "replay", "--capacity-run", str(run), *argv], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr
