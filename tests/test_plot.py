"""``llamactor bench --plot FILE.png`` draws sweeps and the mixed workload.

No benchmark runs here: the results are made by the workloads' own ``summarize`` from
synthetic request records, so the plot reads exactly the objects a real run produces.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

from llamactor.ops.bench import cli as bench
from llamactor.ops.bench.compare import Run
from llamactor.ops.bench.loadgen import ClosedLoop
from llamactor.ops.bench.phase import Job, PhaseResult, Request
from llamactor.ops.bench.plot import PlotUnavailable, require_matplotlib, save_plot
from llamactor.ops.bench.stats import CrossCheck, RequestRecord
from llamactor.ops.bench.targets import Target
from llamactor.ops.bench.workloads import Cohort, Mixed

pytestmark = pytest.mark.slow  # matplotlib renders a figure per test

A, B = Target("A", "http://127.0.0.1:8080"), Target("B", "http://127.0.0.1:8081")


def _record(sent: float, ttft: float, gap: float, n: int, stall: float = 0.0) -> RequestRecord:
    """A request whose tokens come every ``gap`` seconds, one gap ``stall`` seconds longer."""
    times = [sent + ttft]
    for i in range(1, n):
        times.append(times[-1] + gap + (stall if i == n // 3 else 0.0))
    return RequestRecord(
        sent_s=sent,
        n_prompt_sent=16,
        event_times=times,
        event_tokens=[1] * n,
        done_s=times[-1],
        ended_s=times[-1],
        n_generated_server=n,
        n_prompt_server=16,
    )


def _phase(jobs: list[Job], records: list[list[RequestRecord]]) -> PhaseResult:
    end = max(r.done_s or 0.0 for recs in records for r in recs)
    n = sum(r.n_generated for recs in records for r in recs)
    return PhaseResult(
        jobs=jobs, records=records, t0_s=0.0, end_s=end, client_cpu_s=0.01, cross_check=CrossCheck(n, n, 0.0)
    )


def closed_run(target: Target, users: int, speed: float) -> Run:
    """One closed-loop run: ``users`` users of two requests each; ``speed`` scales the gaps."""
    workload = ClosedLoop(users=users, requests=2, npp=16, ntg=12)
    jobs = [Job("user", (Request([1] * 16, 12),) * 2) for _ in range(users)]
    records = [[_record(s, 0.02 * users / speed, 0.01 * users / speed, 12) for s in (0.0, 0.5)] for _ in range(users)]
    return Run(target, f"users={users}", 0, workload.summarize(_phase(jobs, records), 0))


def mixed_run(target: Target, stall_s: float) -> Run:
    workload = Mixed(streams=2, npp=8, ntg=40, arrival_npp=64, arrival_ntg=4, arrivals_s=(0.2,))
    jobs = [Job("stream", (Request([1] * 8, 40),)) for _ in range(2)]
    jobs.append(Job("arrival", (Request([1] * 64, 4),), offset_s=0.2))
    streams = [[_record(0.0, 0.01, 0.02, 40, stall=stall_s)] for _ in range(2)]
    return Run(target, None, 0, workload.summarize(_phase(jobs, streams + [[_record(0.2, 0.15, 0.02, 4)]]), 0))


def assert_png(path: Path, min_bytes: int = 10_000) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert len(data) > min_bytes, f"{path} is only {len(data)} bytes: an empty plot?"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_sweep_plot_one_line_per_server(tmp_path: Path) -> None:
    """A users sweep with --vs (A and B, two points each) draws tok/s and TTFT against users."""
    runs = [closed_run(t, users, speed) for users in (1, 2, 4) for t, speed in ((A, 1.0), (B, 1.5))]
    out = save_plot(runs, tmp_path / "sweep.png")
    width, height = assert_png(out)
    assert width > 800 and height > 300


def test_mixed_plot_one_panel_per_run(tmp_path: Path) -> None:
    """The mixed workload draws the streams' inter-token gaps over time, one panel per run."""
    one = assert_png(save_plot([mixed_run(A, 0.3)], tmp_path / "mixed1.png"))
    two = assert_png(save_plot([mixed_run(A, 0.3), mixed_run(B, 0.05)], tmp_path / "mixed2.png"))
    assert two[1] > one[1]  # a second run adds a panel


def test_cohort_plot(tmp_path: Path) -> None:
    workload = Cohort(npps=(32, 64), ntg=8)
    jobs = [Job("cohort", (Request([1] * n, 8),)) for n in (32, 64)]
    records = [[_record(0.0, 0.1, 0.01, 8)], [_record(0.0, 0.2, 0.01, 8)]]
    run = Run(A, None, 0, workload.summarize(_phase(jobs, records), 0))
    assert_png(save_plot([run], tmp_path / "cohort.png"))


def test_missing_matplotlib_is_a_clear_error_before_any_request(tmp_path: Path, monkeypatch, capsys) -> None:
    """Without matplotlib, ``bench --plot`` exits 2 naming the extra to install, and sends
    nothing (the URL points at a closed port: a request would fail differently)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes ``import matplotlib`` raise ImportError
    with pytest.raises(PlotUnavailable, match=r"llamactor\[plot\]"):
        require_matplotlib()
    parser = _bench_parser()
    args = parser.parse_args(["bench", "--url", "http://127.0.0.1:9", "--plot", str(tmp_path / "x.png")])
    assert bench.run_bench(args) == bench.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install 'llamactor[plot]'" in err
    assert not (tmp_path / "x.png").exists()


def _bench_parser():
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_bench_parser(parser.add_subparsers(dest="command"))
    return parser
