"""``llamactor bench --capacity``: the search, the SLOs, the shapes and arrivals (no server), and
one run of the command against a real ``llamactor serve`` on the tiny model.

The search is checked against fake attainment functions with a known step, so where it must
land is known exactly; the end-to-end run checks the output's structure, never speed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, wait_healthy

from llamactor.ops.bench import capacity, chatburst
from llamactor.ops.bench.capacity_cli import render
from llamactor.ops.bench.capacity_shapes import OPEN_CONVERSATIONS, SHAPES, arrival_times, items, workload
from llamactor.ops.bench.cli import add_bench_parser, run_bench
from llamactor.ops.bench.stats import RequestRecord

E2E_BUDGET_S = 60.0  # the end-to-end run on the tiny model takes a few seconds; this bounds a hang


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


# ---- the search ----------------------------------------------------------------------------


@pytest.mark.parametrize("precision", [0.1, 0.25])
async def test_search_lands_within_its_precision_of_a_step(precision: float) -> None:
    """Attainment 1 up to a known rate, 0.5 above: each server's capacity is the bracket's low
    end, within ``precision`` below the step, in no more points than doubling plus bisection
    need; the servers take turns (A then B) at every step."""
    steps = {"A": 3.3, "B": 0.7, "C": 41.0}
    order: list[str] = []

    async def attainment(name: str, rate: float) -> float:
        order.append(name)
        return 1.0 if rate <= steps[name] else 0.5

    brackets = await capacity.search(list(steps), attainment, start=1.0, precision=precision)
    for name, step in steps.items():
        b = brackets[name]
        assert b.bounded and b.lo is not None and b.hi is not None
        assert b.lo <= step < b.hi <= b.lo * (1 + precision), (name, b.lo, b.hi)
        assert b.capacity == b.lo
        assert len(b.curve) <= capacity.max_points_needed(1.0, step, precision) <= capacity.MAX_POINTS
    assert order[:6] == ["A", "B", "C"] * 2


async def test_search_without_a_bracket_stops_at_max_points() -> None:
    """A server that meets the target at every rate (or at none) is measured at most
    ``MAX_POINTS`` times and reported unbounded (capacity: the highest rate met, or 0)."""

    async def always(name: str, rate: float) -> float:
        return 1.0 if name == "fast" else 0.0

    brackets = await capacity.search(["fast", "slow"], always, start=1.0, precision=0.1)
    fast, slow = brackets["fast"], brackets["slow"]
    assert len(fast.curve) == len(slow.curve) == capacity.MAX_POINTS
    assert not fast.bounded and fast.capacity == 2.0 ** (capacity.MAX_POINTS - 1)
    assert not slow.bounded and slow.capacity == 0.0 and slow.hi == 2.0 ** -(capacity.MAX_POINTS - 1)


# ---- the SLOs -------------------------------------------------------------------------------


def record(ttft_ms: float, tpot_ms: float, npp: int = 100, server_npp: int | None = None) -> RequestRecord:
    """A completed request of 11 tokens with the given TTFT and TPOT."""
    r = RequestRecord(sent_s=0.0, n_prompt_sent=npp, done_s=1.0, n_generated_server=11, n_prompt_server=server_npp)
    r.event_times = [ttft_ms / 1e3, (ttft_ms + 10 * tpot_ms) / 1e3]
    return r


def test_slos_are_the_scale_times_the_faster_reference() -> None:
    """Each SLO is scale x the faster server's unloaded figure (both servers the same SLO); the
    TTFT SLO grows with the request's prompt tokens over a fixed floor."""
    refs = {"A": (0.4, 30.0), "B": (0.5, 20.0)}
    which, slo = capacity.reference_slo(refs, scale=5)
    assert which == {"ttft": "A", "tpot": "B"}
    assert (slo.ttft_ms_per_token, slo.tpot_ms) == pytest.approx((2.0, 100.0))
    assert slo.ttft_ms(100) == pytest.approx(capacity.TTFT_FLOOR_MS + 200.0)
    assert capacity.reference_slo({"A": (0.4, 30.0)}, 2)[1].tpot_ms == pytest.approx(60.0)


def test_a_request_must_meet_both_slos() -> None:
    slo = capacity.Slo.scaled(ref_ttft_ms_per_token=0.5, ref_tpot_ms=10.0, scale=5)
    edge = slo.floor_ms + 250  # 2.5 ms x 100 prompt tokens
    assert slo.met(record(ttft_ms=edge - 1, tpot_ms=50))
    assert not slo.met(record(ttft_ms=edge + 1, tpot_ms=50))
    assert not slo.met(record(ttft_ms=10, tpot_ms=51))
    # the server's own prompt count (template, history) is the request's prompt tokens
    assert slo.met(record(ttft_ms=edge + 100, tpot_ms=10, server_npp=140))
    failed = record(10, 10)
    failed.error = "boom"
    assert not slo.met(failed)
    one_token = RequestRecord(0.0, 100, event_times=[0.01], done_s=0.02, n_generated_server=1)
    assert slo.met(one_token)  # no TPOT: judged on TTFT alone


# ---- shapes and arrivals ------------------------------------------------------------------------


def test_shapes_are_seeded_and_keep_their_ranges() -> None:
    for name, shape in SHAPES.items():
        drawn = items(shape, 300, seed=3)
        assert drawn == items(shape, 300, seed=3) and drawn != items(shape, 300, seed=4), name
        assert all(1 <= it.npp <= shape.npp_max and 1 <= it.ntg <= shape.ntg_max for it in drawn), name
    rag = items(SHAPES["rag"], 300, seed=3)
    assert all(1000 <= it.npp <= 3000 and 32 <= it.ntg <= 128 and it.follows is None for it in rag)
    share = items(SHAPES["sharegpt"], 300, seed=3)
    assert statistics.median(it.npp for it in share) == pytest.approx(200, rel=0.2)
    assert statistics.median(it.ntg for it in share) == pytest.approx(80, rel=0.2)
    assert all(it.follows is None and it.context == it.npp for it in share)  # no shared history


def test_multiturn_history_grows_turn_by_turn() -> None:
    """Each later turn's prompt is its previous turn's prompt and answer plus a new message;
    conversations of ``turns`` turns, interleaved ``OPEN_CONVERSATIONS`` at a time."""
    shape = SHAPES["multiturn"]
    drawn = items(shape, 48, seed=1)
    firsts = [i for i, it in enumerate(drawn) if it.follows is None]
    assert len(firsts) == 48 // shape.turns  # 12 conversations of 4 turns
    for i, it in enumerate(drawn):
        if it.follows is not None:
            prev = drawn[it.follows]
            assert it.follows == i - OPEN_CONVERSATIONS
            assert it.context == prev.context + prev.ntg + it.npp > prev.context
    depth = {i: 1 if it.follows is None else 0 for i, it in enumerate(drawn)}
    for i, it in enumerate(drawn):
        if it.follows is not None:
            depth[i] = depth[it.follows] + 1
    assert max(depth.values()) == shape.turns


def test_arrivals_keep_the_mean_rate_and_bursty_is_burstier() -> None:
    """Both processes have the requested mean rate; bursty's gaps (gamma, shape < 1) vary more
    than Poisson's (coefficient of variation about 2 against 1); seeded."""
    cvs = {}
    for arrivals in ("poisson", "bursty"):
        times = arrival_times(5000, 4.0, seed=1, arrivals=arrivals)
        assert times == arrival_times(5000, 4.0, seed=1, arrivals=arrivals) and times[0] == 0.0
        gaps = [b - a for a, b in zip(times, times[1:])]
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(0.25, rel=0.08), arrivals
        cvs[arrivals] = statistics.pstdev(gaps) / mean
    assert cvs["poisson"] == pytest.approx(1.0, abs=0.1)
    assert cvs["bursty"] > 1.5 * cvs["poisson"]


def test_one_request_sequence_scaled_by_the_rate() -> None:
    """The workload a rate sends: the same lengths at every rate, arrival times scaled by
    1 / rate (what RandomRun computes from the rate given as its capacity)."""
    wl = workload(SHAPES["sharegpt"], "bursty", 20, seed=2)
    assert wl.api == "chat" and wl.n_requests == 20
    for rate in (0.5, 3.0):
        assert wl.arrival_times(rate) == pytest.approx(arrival_times(20, rate, 2, "bursty"), abs=1e-5)
    ref = workload(SHAPES["multiturn"], "poisson", 4, seed=2, closed=True)
    assert ref.n_requests == 4 and all(it.follows is None for it in ref.items)  # first turns, one at a time
    assert ref.arrival_times(None) == [0.0] * 4 and ref.users == 1


# ---- the command ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--capacity"], "needs --url"),
        (["--capacity", "--url", "http://127.0.0.1:9", "--sweep", "rate=1,2"], "--sweep"),
        (["--capacity", "--url", "http://127.0.0.1:9", "--arrivals", "1,2"], "--arrivals poisson or bursty"),
        (["--capacity", "--url", "http://127.0.0.1:9", "--capacity-precision", "0"], "--capacity-precision"),
        (["--capacity", "--url", "http://127.0.0.1:9", "--slo-scale", "-1"], "--slo-scale"),
        (["--workload", "mixed", "--url", "http://127.0.0.1:9", "--arrivals", "bursty"], "arrival process"),
    ],
)
def test_bad_capacity_settings_exit_2(capsys, argv: list[str], message: str) -> None:
    assert run_bench(bench_args(*argv)) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("llamactor bench: error:"), err


@pytest.mark.slow
def test_capacity_command_against_llamactor_serve(tiny_model: Path, tmp_path: Path, capsys) -> None:
    """``llamactor bench --capacity --vs`` against a real ``llamactor serve`` (A and B the same
    server, so a ratio exists): the JSON has both references, the SLOs, a capacity per server,
    the ratio B/A, and a curve per server; the text form and the plot are written too."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("wb")
    argv = [str(Path(sys.executable).parent / "llamactor"), "serve", "-m", str(tiny_model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "-t", "1", "-np", "2", "-c", "4096", "--metrics"]
    # the slo policy with its objective relative to the machine, as the capacity runs measure it
    argv += ["--slo-ttft-ms", "0", "--slo-itl-ms", "0", "--slo-itl-pct", "mean"]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, url + "/health", 60)
        began = time.monotonic()
        plot = tmp_path / "capacity.png"
        flags = ["--capacity", "--url", url, "--vs", url, "--capacity-requests", "3", "--capacity-precision", "1.0"]
        flags += ["--rate", "4", "--timeout", "30", "--seed", "5"]
        assert run_bench(bench_args(*flags, "--json", "--plot", str(plot))) == 0
        out = capsys.readouterr().out
        elapsed = time.monotonic() - began
        # --at-rates: the given rate only, every request measured, the front end's share reported
        fixed = ["--capacity", "--url", url, "--capacity-requests", "3", "--at-rates", "0.5", "--timeout", "30"]
        assert run_bench(bench_args(*fixed, "--json")) == 0
        at_rate = capsys.readouterr().out
        # the chat burst's own client, against the same server twice (A then B)
        burst = ["--url", url, "--vs", url, "--pairs", "1", "--users", "2", "--words", "20", "--max-tokens", "2"]
        assert chatburst.main(burst) == 0
        burst_out = capsys.readouterr().out
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert elapsed < E2E_BUDGET_S
    doc = json.loads(out[out.index("{\n") :])
    assert set(doc["reference"]) == {"A", "B"} and doc["shape"] == "sharegpt" and doc["arrivals"] == "poisson"
    for ref in doc["reference"].values():
        assert ref["ttft_ms_per_token"] > 0 and ref["tpot_ms"] > 0
    assert doc["slo"]["tpot_ms"] == pytest.approx(5 * min(r["tpot_ms"] for r in doc["reference"].values()))
    assert set(doc["capacity_rps"]) == {"A", "B"}
    for name in ("A", "B"):
        curve = doc["curve"][name]
        assert 1 <= len(curve) <= capacity.MAX_POINTS and curve[0]["requests"] == 3
        assert all(0.0 <= p["attainment"] <= 1.0 and p["rate"] > 0 for p in curve)
        assert [p["rate"] for p in curve] == sorted(p["rate"] for p in curve)
        assert doc["capacity_rps"][name] in [0.0] + [p["rate"] for p in curve if p["attainment"] >= 0.9]
    caps = doc["capacity_rps"]
    assert doc["ratio"] is None if caps["A"] == 0 else math.isclose(doc["ratio"], caps["B"] / caps["A"])
    assert plot.stat().st_size > 0
    text = render(doc)
    assert "requests/s" in text and "attainment curve" in text
    fixed_doc = json.loads(at_rate[at_rate.index("{\n") :])
    (point,) = fixed_doc["curve"]["A"]
    assert point["rate"] == 0.5 and point["requests"] == 3 and not point["stopped"]
    # every streamed chat answer ends with llama-server's timings; the server's prompt time is
    # inside the client's TTFT
    assert point["front_ms"] is not None and 0 <= point["front_ms"]["p50"] <= point["front_ms"]["p99"]
    assert "client TTFT minus the server's prompt time" in render(fixed_doc)
    assert burst_out.count("pair 0 http") == 2 and "B/A median over pairs: ttft_mean_s" in burst_out
    assert ("B/A capacity" in text) == (caps["A"] > 0)
