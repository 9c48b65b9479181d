"""``llamactor bench --capacity``: the search, the SLOs, the shapes, and one run against two servers."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys

import pytest
from conftest import open_server

from llamactor.ops import capacity
from llamactor.ops.runner import Common
from llamactor.ops.stats import RequestRecord
from llamactor.ops.traffic import LengthDist


async def test_the_search_lands_within_its_precision_of_a_step():
    """Attainment that falls below the target past a known rate: each server's capacity is
    within the stated precision below it, in a bounded number of points, found in turn."""
    steps = {"A": 3.3, "B": 0.7}
    order = []

    async def attainment(name: str, rate: float) -> float:
        order.append(name)
        return 1.0 if rate <= steps[name] else 0.5

    brackets = await capacity.search(["A", "B"], attainment, start=1.0, precision=0.1)
    for name, step in steps.items():
        b = brackets[name]
        assert b.capacity <= step < b.capacity * 1.1, (name, b.capacity)
        assert len(b.curve) <= capacity.MAX_POINTS
    assert order[:4] == ["A", "B", "A", "B"]  # the servers take turns


def test_slos_scale_the_reference_and_a_request_must_meet_both():
    slo = capacity.Slo.scaled(ref_ttft_ms_per_token=0.5, ref_tpot_ms=10.0, scale=5)
    assert (slo.ttft_ms_per_token, slo.tpot_ms) == (2.5, 50.0)

    def rec(ttft_ms: float, tpot_ms: float, npp: int = 100) -> RequestRecord:
        r = RequestRecord(sent_s=0.0, n_prompt_sent=npp, done_s=1.0, n_generated_server=11)
        r.event_times = [ttft_ms / 1e3, ttft_ms / 1e3 + 10 * tpot_ms / 1e3]
        return r

    assert slo.met(rec(ttft_ms=slo.floor_ms + 250, tpot_ms=50))
    assert not slo.met(rec(ttft_ms=slo.floor_ms + 251, tpot_ms=50))
    assert not slo.met(rec(ttft_ms=10, tpot_ms=51))
    failed = rec(10, 10)
    failed.error = "boom"
    assert not slo.met(failed)


def test_shapes_and_arrivals_are_seeded_and_bursty_keeps_the_mean_rate():
    rag = capacity.schedule("rag", "poisson", 2.0, 200, seed=3)
    assert rag == capacity.schedule("rag", "poisson", 2.0, 200, seed=3)
    assert all(1000 <= s.npp <= 3000 and 32 <= s.ntg <= 128 for s in rag)
    share = capacity.schedule("sharegpt", "poisson", 2.0, 200, seed=3)
    assert statistics.median(s.npp for s in share) == pytest.approx(250, rel=0.25)
    for arrivals, cv_range in (("poisson", (0.8, 1.2)), ("bursty", (1.5, 3.0))):
        times = capacity.arrival_gaps(4000, 5.0, seed=1, arrivals=arrivals)
        gaps = [b - a for a, b in zip(times, times[1:])]
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(0.2, rel=0.1), arrivals
        assert cv_range[0] < statistics.pstdev(gaps) / mean < cv_range[1], arrivals


def test_cli_refuses_what_capacity_does_not_take():
    cmd = [sys.executable, "-m", "llamactor.runtime.cli", "bench", "--capacity", "--url", "http://127.0.0.1:9"]
    out = subprocess.run([*cmd, "--sweep", "rate=1,2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--capacity" in out.stderr


@pytest.mark.slow
async def test_capacity_of_two_servers(make_config, monkeypatch):
    """Two servers on the tiny model: references, SLOs, a capacity each, the ratio, the curves."""
    monkeypatch.setitem(capacity.SHAPES, "tiny", (LengthDist("fixed", 16), LengthDist("fixed", 6)))
    async with open_server(make_config(parallel=2)) as (_, url_a), open_server(make_config(parallel=2)) as (_, url_b):
        figures = await capacity.run_capacity(
            {"A": url_a, "B": url_b},
            shape="tiny",
            requests=6,
            precision=1.0,
            start_rate=8.0,
            common=Common(warmup=0, timeout_s=60),
        )
    assert set(figures["capacity_rps"]) == {"A", "B"}
    for name in ("A", "B"):
        curve = figures["curve"][name]
        assert 1 <= len(curve) <= capacity.MAX_POINTS
        assert all(0.0 <= a <= 1.0 and r > 0 for r, a in curve)
        ref = figures["reference"][name]
        assert ref["ttft_ms_per_token"] > 0 and ref["tpot_ms"] > 0
    assert figures["slo"]["tpot_ms"] == pytest.approx(
        figures["slo_scale"] * min(figures["reference"][n]["tpot_ms"] for n in ("A", "B"))
    )
    if figures["capacity_rps"]["A"] > 0:
        assert math.isclose(figures["ratio"], figures["capacity_rps"]["B"] / figures["capacity_rps"]["A"])
    text = capacity.render(figures)
    assert "requests/s" in text and "attainment curve" in text
