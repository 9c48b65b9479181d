"""The chat and traffic-shape workloads of ``llamactor bench`` (burst, shared-prefix, chat, poisson) and the
latency / goodput figures every workload reports, against the in-process tiny-model server.

Consistency, not speed: token counts equal the server's counters, goodput within [0, 1],
TTFT p50 <= p99, prompt tokens processed <= sent, deterministic schedules, bad specs exit 2.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from benchcli import bench_args, json_of, run_cli
from conftest import open_server

from llamactor.ops.bench.chatload import Chat, ChatFeed
from llamactor.ops.bench.cli import EXIT_USAGE, workload_from_args
from llamactor.ops.bench.compare import Run, pair_ratios, parse_sweep
from llamactor.ops.bench.latency import LATENCY_KEYS, RATIO_KEYS, latency_of, sample_of
from llamactor.ops.bench.lengths import LengthDist, Shape, load_lengths
from llamactor.ops.bench.loadgen import ClosedLoop
from llamactor.ops.bench.phase import Request
from llamactor.ops.bench.prompts import PromptSource
from llamactor.ops.bench.report import render_ratios, render_runs, to_json
from llamactor.ops.bench.runner import Common, run_workload
from llamactor.ops.bench.slo import LatencyReport, Sample
from llamactor.ops.bench.stats import RequestRecord
from llamactor.ops.bench.targets import Target
from llamactor.ops.bench.traffic import Burst, Poisson, SharedPrefix, arrival_times

NO_SERVER = "http://127.0.0.1:9"  # validation fails before any request is sent


def assert_latency_sane(fig: dict, n_ok: int | None = None) -> None:
    """The figures every workload reports (ops.bench.slo): goodput within [0, 1], p50 <= p99."""
    for k in LATENCY_KEYS:
        assert k in fig, k
    assert 0.0 <= fig["goodput"] <= 1.0
    assert fig["ttft_p50_ms"] <= fig["ttft_p99_ms"]
    assert fig["itl_p50_ms"] <= fig["itl_p99_ms"]
    assert fig["ttft_mean_ms"] > 0 and fig["makespan_s"] > 0
    assert fig["goodput_rps"] == pytest.approx(fig["goodput"] * (n_ok or fig["ok"]) / fig["makespan_s"], rel=1e-6)


# ---- burst ------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_burst_cli_vs_reports_latency_goodput_and_ratios(make_config, capsys) -> None:
    """Burst through ``llamactor bench --workload burst --vs``: every run's tokens equal the
    server's counter, TTFT/ITL/makespan/goodput in the figures, and B/A of TTFT mean/p50, ITL
    p99, makespan and goodput in the ratios."""
    async with open_server(make_config(parallel=4)) as (_, url_a), open_server(make_config(parallel=4)) as (_, url_b):
        rc, out, err = await run_cli(
            capsys,
            "--url",
            url_a,
            "--vs",
            url_b,
            "--workload",
            "burst",
            "--users",
            "3",
            "--requests",
            "2",
            "--npp",
            "48",
            "--ntg",
            "8",
            "--json",
        )
    assert rc == 0, err
    doc = json_of(out)
    assert [r["server"] for r in doc["runs"]] == ["A", "B"]
    for run in doc["runs"]:
        fig = run["figures"]
        assert run["workload"] == "burst" and run["result"]["npp"] == 48
        assert (fig["ok"], fig["failed"], fig["server_tokens"], fig["diff_percent"]) == (6, 0, 6 * 8, 0.0)
        assert_latency_sane(fig)
        assert run["result"]["slo"]["slo_ttft_ms"] == 2000 and run["result"]["slo"]["slo_itl_ms"] == 150
    (ratio,) = [r for r in doc["ratios"] if r["pair"] is None]
    assert set(RATIO_KEYS) | {"tok_s"} <= set(ratio["ratios"])
    assert all(v is not None and v > 0 for v in ratio["ratios"].values())


def test_burst_and_shared_prefix_defaults() -> None:
    """Burst defaults to 32 users x 2 requests of 1000 prompt tokens and 64 generated;
    shared-prefix to a 1000-token prefix with 32-token suffixes; chat to 24 x 4 turns."""
    assert workload_from_args(bench_args("--url", NO_SERVER, "--workload", "burst")) == Burst()
    assert (Burst().users, Burst().requests, Burst().npp, Burst().ntg) == (32, 2, 1000, 64)
    sp = workload_from_args(bench_args("--url", NO_SERVER, "--workload", "shared-prefix"))
    assert isinstance(sp, SharedPrefix) and (sp.prefix_npp, sp.npp, sp.users) == (1000, 32, 32)
    chat = workload_from_args(
        bench_args(
            "--url", NO_SERVER, "--workload", "chat", "--conversations", "9", "--turns", "2", "--prefix-npp", "5"
        )
    )
    assert chat == Chat(conversations=9, turns=2, prefix_npp=5)
    assert (Chat().conversations, Chat().turns, Chat().users, Chat().prefix_npp, Chat().npp, Chat().ntg) == (
        24,
        4,
        8,
        200,
        64,
        64,
    )
    assert workload_from_args(bench_args("--url", NO_SERVER)) == ClosedLoop()


# ---- shared prefix ----------------------------------------------------------------------------


def test_shared_prefix_plan() -> None:
    """Every measured prompt is the one prefix + a distinct suffix, sent with cache_prompt;
    warm-up prompts do not start with the prefix (the measured phase starts cold)."""
    wl = SharedPrefix(users=3, requests=2, prefix_npp=20, npp=4, ntg=3, common=Common(warmup=1))
    warm, jobs = wl.plan(PromptSource(range(1, 50), seed=3))
    reqs = [r for j in jobs for r in j.requests]
    prefix = reqs[0].prompt[:20]
    assert len(reqs) == 6 and all(r.prompt[:20] == prefix and len(r.prompt) == 24 and r.cache_prompt for r in reqs)
    assert len({tuple(r.prompt[20:]) for r in reqs}) == 6
    assert all(r.prompt[:20] != prefix and not r.cache_prompt for j in warm for r in j.requests)


async def test_shared_prefix_workload(make_config) -> None:
    """Shared prefix against the server: token counts equal the server's, prompt tokens the
    server processed (its llamacpp:prompt_tokens_total) fewer than sent, as it reuses the prefix."""
    wl = SharedPrefix(users=3, requests=2, prefix_npp=96, npp=8, ntg=8)
    async with open_server(make_config(parallel=4)) as (_, url):
        res = await run_workload(url, wl)
    assert (res.ok, res.failed, res.workload) == (6, 0, "shared-prefix")
    assert all(r.n_prompt_server == 104 and r.n_generated == 8 for r in res.records)
    assert res.cross_check.diff_percent == 0.0 and res.cross_check.server_tokens == 48
    assert res.prompt_tokens_sent == 6 * 104
    assert res.prompt_tokens_server is not None and 6 * 8 <= res.prompt_tokens_server < res.prompt_tokens_sent
    fig = res.figures()
    assert fig["prompt_processed"] == res.prompt_tokens_server and 0 < fig["processed_share"] < 1
    assert_latency_sane(fig)
    assert "prompt processed" in render_runs([Run(Target("A", url), None, 0, res)])


# ---- chat ---------------------------------------------------------------------------------------


async def test_chat_feed_history_order_and_waiting() -> None:
    """Turns go round-robin across conversations; a turn's prompt is the system text, the
    earlier user texts and replies, and the new text; a turn waits while its conversation's
    previous turn is in flight; a failed turn skips the rest of its conversation."""
    system, texts = [1, 1], [[[10], [11], [12]], [[20], [21], [22]]]
    feed = ChatFeed(system, texts, ntg=2)

    def reply(req: Request, ids: list[int], ok: bool = True) -> None:
        rec = RequestRecord(
            sent_s=1.0,
            n_prompt_sent=len(req.prompt),
            token_ids=ids,
            n_generated_server=len(ids),
            done_s=2.0 if ok else None,
            error=None if ok else "HTTP 500",
        )
        feed.done(req, rec)

    a, b = await feed.take(), await feed.take()
    assert (a.tag, a.prompt, b.tag, b.prompt) == ((0, 0), [1, 1, 10], (1, 0), [1, 1, 20])
    assert a.cache_prompt and a.keep_ids and a.n_predict == 2
    reply(a, [5, 6])
    c = await feed.take()
    assert (c.tag, c.prompt) == ((0, 1), [1, 1, 10, 5, 6, 11])
    got: list[Request] = []

    async def worker() -> None:
        got.append(await feed.take())  # (1, 1): waits for (1, 0), still in flight

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        await anyio.wait_all_tasks_blocked()  # the worker is parked in take()
        assert got == []
        reply(b, [7, 8], ok=False)  # (1, 0) fails: (1, 1) and (1, 2) are skipped
        await anyio.wait_all_tasks_blocked()
        assert got == []  # now at (0, 2), waiting for (0, 1)
        reply(c, [9, 9])
    (last,) = got
    assert last.tag == (0, 2) and last.prompt == [1, 1, 10, 5, 6, 11, 9, 9, 12]
    reply(last, [3, 3])
    assert await feed.take() is None
    assert feed.skipped == 2 and set(feed.records) == {(0, 0), (1, 0), (0, 1), (0, 2)}


async def test_chat_workload(make_config) -> None:
    """Chat against the server: more conversations than slots; each turn's prompt holds
    the history with the server's replies; first and later turns reported apart; prompt tokens
    processed (server counter) <= sent; generated tokens equal the server's counter."""
    wl = Chat(conversations=5, turns=3, users=2, prefix_npp=16, npp=8, ntg=6)
    async with open_server(make_config(parallel=2)) as (_, url):
        res = await run_workload(url, wl)
    assert (res.ok, res.failed, res.skipped, res.short_replies) == (15, 0, 0, 0)
    assert res.cross_check.server_tokens == 15 * 6 and res.cross_check.diff_percent == 0.0
    # records in round-robin order: turn t of conversation c has the history of t turns
    for i, rec in enumerate(res.records):
        t = i // 5
        assert rec.n_prompt_sent == rec.n_prompt_server == 16 + t * (8 + 6) + 8
        assert rec.token_ids is not None and len(rec.token_ids) == 6
    assert (res.first_turns.n, res.later_turns.n) == (5, 10)
    assert res.prompt_tokens_sent == sum(r.n_prompt_sent for r in res.records)
    assert res.prompt_tokens_server is not None and 0 < res.prompt_tokens_server <= res.prompt_tokens_sent
    fig = res.figures()
    assert fig["first_ttft_p50_ms"] <= fig["first_ttft_p99_ms"] and fig["later_ttft_p50_ms"] <= fig["later_ttft_p99_ms"]
    assert fig["later_ttft_mean_ms"] > 0 and fig["prompt_processed"] <= fig["prompt_sent"]
    assert_latency_sane(fig)
    assert res.notes() == []
    doc = to_json([Run(Target("A", url), None, 0, res)], [])
    assert doc["runs"][0]["result"]["later_turns"]["n"] == 10


# ---- poisson --------------------------------------------------------------------------------------


def test_arrival_times_deterministic_with_the_right_mean_gap() -> None:
    """Open-loop arrivals: the first at 0, exponential gaps of mean 1/rate, the same for
    a seed and different for another."""
    a = arrival_times(4001, 20.0, seed=7)
    assert a == arrival_times(4001, 20.0, seed=7) and a != arrival_times(4001, 20.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert a[-1] / 4000 == pytest.approx(1 / 20.0, rel=0.06)
    gaps = sorted(y - x for x, y in zip(a, a[1:]))
    assert gaps[len(gaps) // 2] == pytest.approx(0.05 * 0.693, rel=0.1)  # exponential median: ln 2 / rate
    assert arrival_times(0, 1.0, 0) == [] and arrival_times(1, 1.0, 0) == [0.0]
    wl = Poisson(rate=5.0, requests=30, npp_dist=LengthDist.parse("uniform:3:9", "--npp-dist"))
    assert wl.schedule() == wl.schedule()
    assert all(3 <= s.npp <= 9 and s.ntg == 128 for s in wl.schedule())


def test_length_distributions_parse_and_draw() -> None:
    """fixed:N, uniform:LO:HI (inclusive), lognormal:MEDIAN:SIGMA (clamped to >= 1)."""
    import numpy as np

    rng = np.random.default_rng(0)
    assert LengthDist.parse("fixed:5", "--npp-dist").draw(rng, 3) == [5, 5, 5]
    uni = LengthDist.parse("uniform:3:7", "--npp-dist").draw(rng, 500)
    assert set(uni) == {3, 4, 5, 6, 7}
    logn = LengthDist.parse("lognormal:200:0.5", "--npp-dist").draw(rng, 2001)
    assert sorted(logn)[1000] == pytest.approx(200, rel=0.1) and min(logn) >= 1
    assert min(LengthDist.parse("lognormal:1:4", "--ntg-dist").draw(rng, 500)) == 1
    assert [str(LengthDist.parse(s, "x")) for s in ("fixed:5", "uniform:3:7", "lognormal:200:0.5")] == [
        "fixed:5",
        "uniform:3:7",
        "lognormal:200:0.5",
    ]
    for bad in (
        "uniform:5",
        "lognormal:x:1",
        "fixed:0",
        "uniform:9:3",
        "gauss:1:2",
        "fixed:1.5",
        "lognormal:0:1",
        "lognormal:5:-1",
        "fixed",
        "",
    ):
        with pytest.raises(ValueError, match="--npp-dist"):
            LengthDist.parse(bad, "--npp-dist")


def test_lengths_file_cycles_and_keeps_times(tmp_path: Path) -> None:
    """--lengths: JSONL lines cycled to --requests; with "at" the file's own arrival times,
    repeated one mean gap after the last; without, Poisson arrivals at --rate."""
    timed = tmp_path / "timed.jsonl"
    timed.write_text('{"npp": 4, "ntg": 2, "at": 0.5}\n\n{"npp": 6, "ntg": 3, "at": 0}\n')
    shapes = load_lengths(str(timed))
    assert shapes == (Shape(4, 2, 0.5), Shape(6, 3, 0.0))
    wl = Poisson(requests=5, lengths=shapes, lengths_file=str(timed))
    assert wl.schedule() == [Shape(6, 3, 0.0), Shape(4, 2, 0.5), Shape(6, 3, 0.75), Shape(4, 2, 1.25), Shape(6, 3, 1.5)]
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"npp": 4, "ntg": 2}\n{"npp": 6, "ntg": 3}\n')
    sched = Poisson(rate=10.0, requests=3, lengths=load_lengths(str(plain))).schedule()
    assert [(s.npp, s.ntg) for s in sched] == [(4, 2), (6, 3), (4, 2)]
    assert [s.at for s in sched] == arrival_times(3, 10.0, 0)
    with pytest.raises(ValueError, match="exclude"):
        Poisson(rate=1.0, requests=2, lengths=shapes)


async def test_poisson_workload_open_loop(make_config) -> None:
    """Poisson against the server: every request leaves at its own arrival time (open
    loop), with the drawn prompt and output lengths; tokens equal the server's counter."""
    wl = Poisson(
        rate=40.0,
        requests=8,
        npp_dist=LengthDist.parse("uniform:8:24", "--npp-dist"),
        ntg_dist=LengthDist.parse("lognormal:6:0.5", "--ntg-dist"),
    )
    sched = wl.schedule()
    async with open_server(make_config(parallel=4)) as (_, url):
        res = await run_workload(url, wl)
    assert (res.ok, res.failed) == (8, 0)
    t0 = min(r.sent_s for r in res.records)
    for rec, shape in zip(res.records, sched):
        assert (rec.n_prompt_server, rec.n_generated) == (shape.npp, shape.ntg)
        assert shape.at - 0.01 <= rec.sent_s - t0 <= shape.at + 0.5  # never before its arrival time
    assert res.cross_check.server_tokens == sum(s.ntg for s in sched) and res.cross_check.diff_percent == 0.0
    assert res.lag_max_ms is not None and 0 <= res.lag_max_ms < 1000
    assert res.offered_rps == pytest.approx(7 / sched[-1].at)
    assert_latency_sane(res.figures())


async def test_poisson_cli_with_a_timed_lengths_file(make_config, capsys, tmp_path: Path) -> None:
    """``--workload poisson --lengths FILE`` through the CLI: lines cycled to --requests,
    their "at" times used; the cross-check holds."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"npp": 12, "ntg": 4, "at": 0}\n{"npp": 20, "ntg": 5, "at": 0.02}\n')
    async with open_server(make_config(parallel=4)) as (_, url):
        rc, out, err = await run_cli(
            capsys,
            "--url",
            url,
            "--workload",
            "poisson",
            "--lengths",
            str(trace),
            "--requests",
            "5",
            "--slo-ttft-ms",
            "5000",
            "--slo-itl-ms",
            "500",
            "--json",
        )
    assert rc == 0, err
    (run,) = json_of(out)["runs"]
    fig = run["figures"]
    assert (fig["ok"], fig["server_tokens"], fig["diff_percent"]) == (5, 4 + 5 + 4 + 5 + 4, 0.0)
    assert run["result"]["slo"]["slo_ttft_ms"] == 5000 and run["result"]["lengths_file"] == str(trace)
    assert_latency_sane(fig)


def test_sweep_over_rate() -> None:
    """``--sweep rate=...`` gives one poisson point per rate (floats allowed)."""
    points = parse_sweep("rate=1,2.5", Poisson(rate=1.0, requests=4))
    assert [(p, w.rate) for p, w in points] == [("rate=1.0", 1.0), ("rate=2.5", 2.5)]
    wl = workload_from_args(bench_args("--url", NO_SERVER, "--workload", "poisson", "--sweep", "rate=3,4"))
    assert isinstance(wl, Poisson) and wl.rate == 3.0
    with pytest.raises(ValueError, match="--rate"):
        parse_sweep("rate=0", Poisson(rate=1.0))


# ---- bad specs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--workload", "poisson", "--rate", "2", "--npp-dist", "uniform:5"], "--npp-dist"),
        (["--workload", "poisson", "--rate", "2", "--ntg-dist", "lognormal:x:1"], "--ntg-dist"),
        (["--workload", "poisson", "--rate", "0"], "--rate"),
        (["--workload", "poisson"], "--rate"),
        (["--workload", "poisson", "--lengths", "/nonexistent/lengths.jsonl"], "--lengths"),
        (["--workload", "poisson", "--rate", "1", "--npp", "5", "--npp-dist", "fixed:3"], "--npp"),
        (["--workload", "poisson", "--rate", "1", "--requests", "0"], "--requests"),
        (["--workload", "chat", "--api", "openai"], "--api"),
        (["--workload", "chat", "--turns", "0"], "--turns"),
        (["--workload", "chat", "--conversations", "0"], "--conversations"),
        (["--workload", "shared-prefix", "--prefix-npp", "0"], "--prefix-npp"),
        (["--workload", "burst", "--users", "0"], "--users"),
        (["--slo-ttft-ms", "0"], "--slo-ttft-ms"),
        (["--slo-itl-ms", "-5"], "--slo-itl-ms"),
    ],
)
async def test_bad_specs_exit_2_naming_the_flag(capsys, argv: list[str], flag: str) -> None:
    """A bad workload setting exits 2 before any request, with a message naming the flag."""
    rc, out, err = await run_cli(capsys, "--url", NO_SERVER, *argv)
    assert rc == EXIT_USAGE and out == ""
    assert flag in err and err.startswith("llamactor bench: error:")


async def test_bad_lengths_file_lines_exit_2(capsys, tmp_path: Path) -> None:
    """--lengths: a line that is not {"npp": int >= 1, "ntg": int >= 1[, "at": s >= 0]}, an
    empty file, or "at" on some lines only: exit 2 naming --lengths and the line."""
    for text, why in (
        ('{"npp": 4}\n', "line 1"),
        ('{"npp": 4, "ntg": 2}\nnot json\n', "line 2"),
        ('{"npp": 0, "ntg": 2}\n', "npp"),
        ('{"npp": 4, "ntg": 2, "at": -1}\n', "at"),
        ("\n", "no lines"),
        ('{"npp": 4, "ntg": 2, "at": 1}\n{"npp": 4, "ntg": 2}\n', "all or none"),
    ):
        path = tmp_path / "bad.jsonl"
        path.write_text(text)
        rc, _, err = await run_cli(
            capsys, "--url", NO_SERVER, "--workload", "poisson", "--rate", "1", "--lengths", str(path)
        )
        assert rc == EXIT_USAGE and "--lengths" in err and why in err, (text, err)


# ---- latency and goodput (ops.bench.slo) on every workload ----------------------------------------------


def test_latency_report_edge_cases() -> None:
    """Goodput: no samples gives no figures (not 0 or NaN); a single-token request is
    judged on TTFT alone; a failed request counts in the total and is never good."""
    empty = LatencyReport.of([], 0.0)
    assert (empty.n, empty.good, empty.goodput_share, empty.goodput_rps, empty.ttft_p50_ms, empty.itl_p99_ms) == (
        0,
        0,
        None,
        None,
        None,
        None,
    )
    single = Sample(ok=True, ttft_s=0.5, gaps_s=[], n_generated=1)
    assert single.tpot_s is None and single.good(2000, 150) and not single.good(400, 150)
    failed = Sample(ok=False, ttft_s=0.1, gaps_s=[0.01], n_generated=2)
    slow_tpot = Sample(ok=True, ttft_s=0.1, gaps_s=[0.2, 0.2], n_generated=3)
    rep = LatencyReport.of([single, failed, slow_tpot], makespan_s=2.0)
    assert (rep.n, rep.good, rep.goodput_share, rep.goodput_rps) == (3, 1, pytest.approx(1 / 3), 0.5)
    assert rep.ttft_p50_ms == pytest.approx(300.0) and rep.itl_p99_ms == pytest.approx(200.0)  # failed: no figures
    # the client's records: a failed request (never finished) becomes a never-good sample
    ok_rec = RequestRecord(
        sent_s=0.0, n_prompt_sent=4, event_times=[0.1, 0.15], event_tokens=[1, 1], done_s=0.15, n_generated_server=2
    )
    failed_rec = RequestRecord(sent_s=0.0, n_prompt_sent=4, event_times=[0.1], event_tokens=[1], error="HTTP 503")
    assert sample_of(failed_rec).ok is False and sample_of(ok_rec).tpot_s == pytest.approx(0.05)
    rep = latency_of([ok_rec, failed_rec], 1.0, Common(slo_ttft_ms=200, slo_itl_ms=60))
    assert (rep.good, rep.goodput_share) == (1, 0.5)
    assert latency_of([ok_rec], 1.0, Common(slo_ttft_ms=50)).good == 0


async def test_closed_loop_reports_goodput_in_table_json_and_ratios(make_config) -> None:
    """The old closed workload reports TTFT mean/p50/p99, ITL p50/p99, makespan and
    goodput (table, JSON) and compares TTFT, ITL p99, makespan and goodput under --vs."""
    async with open_server(make_config(parallel=2)) as (_, url):
        a = await run_workload(url, ClosedLoop(users=2, requests=2, npp=8, ntg=6))
        b = await run_workload(url, ClosedLoop(users=2, requests=2, npp=8, ntg=6, common=Common(seed=1)))
    assert a.slo.n == 4 and a.slo.makespan_s == a.wall_s
    assert_latency_sane(a.figures())
    runs = [Run(Target("A", url), None, 0, a), Run(Target("B", url), None, 0, b)]
    table = render_runs(runs)
    assert "goodput" in table and "TTFT mean ms" in table and "ITL p99 ms" in table and "TTFT <= 2000 ms" in table
    ratios = pair_ratios(runs)
    assert set(RATIO_KEYS) <= set(ratios[-1].ratios) and "B/A goodput" in render_ratios(ratios)
    assert set(LATENCY_KEYS) <= set(to_json(runs, ratios)["runs"][0]["figures"])
