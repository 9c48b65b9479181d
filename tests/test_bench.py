"""The benchmark harness (``llamactor bench``) against the in-process server on the tiny model.

The harness's figures are checked for consistency, not for speed: token counts equal to what
the server reports, TTFT within request latency, no negative or NaN figure, failures counted.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace

import pytest
from conftest import open_server

from llamactor.ops.bench.apis import SseDecoder
from llamactor.ops.bench.client import parse_metric
from llamactor.ops.bench.compare import Run, pair_ratios, parse_sweep, run_matrix
from llamactor.ops.bench.http1 import _Connection
from llamactor.ops.bench.loadgen import ClosedLoop
from llamactor.ops.bench.progress import NoProgress
from llamactor.ops.bench.prompts import PromptSource
from llamactor.ops.bench.report import notes, render_ratios, render_runs, to_json
from llamactor.ops.bench.runner import Common, run_workload
from llamactor.ops.bench.stats import CrossCheck, RequestRecord
from llamactor.ops.bench.targets import Target
from llamactor.ops.bench.workloads import Cohort, Mixed

USERS, REQUESTS, NPP, NTG = 3, 2, 16, 12


def closed(**overrides) -> ClosedLoop:
    return replace(ClosedLoop(users=USERS, requests=REQUESTS, npp=NPP, ntg=NTG), **overrides)


def run_of(url: str, result) -> Run:
    return Run(Target("A", url), None, 0, result)


def assert_sane(value, where: str) -> None:
    """Every figure is None (not measured) or a finite non-negative number; recurse into dicts."""
    if isinstance(value, dict):
        for k, v in value.items():
            assert_sane(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            assert_sane(v, f"{where}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        assert math.isfinite(value) and value >= 0, f"{where} = {value}"


def assert_request_consistent(rec: RequestRecord, npp: int, ntg: int, api: str = "native") -> None:
    assert rec.ok, rec.error
    assert rec.n_generated == ntg
    # native events carry token ids; OpenAI chunks carry text, and a token that ends inside a
    # UTF-8 sequence has no text of its own, so it has no chunk
    assert sum(rec.event_tokens) == ntg if api == "native" else 1 <= sum(rec.event_tokens) <= ntg
    assert rec.n_prompt_server == npp
    assert rec.ttft_s is not None and rec.latency_s is not None
    assert 0 <= rec.ttft_s <= rec.latency_s
    assert all(g >= 0 for g in rec.gaps_s())


# ---- closed loop ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("api", ["native", "openai"])
async def test_closed_loop_counts_match_server(make_config, api: str) -> None:
    """Closed-loop users; generated tokens equal the server's tokens_predicted delta
    (0 % difference), TTFT <= latency for every request, no negative or NaN figure."""
    async with open_server(make_config(parallel=4)) as (_, url):
        res = await run_workload(url, closed(common=Common(api=api)))
    assert (res.ok, res.failed, res.warmup_failed) == (USERS * REQUESTS, 0, 0)
    assert res.generated_tokens == USERS * REQUESTS * NTG
    assert res.cross_check == CrossCheck(USERS * REQUESTS * NTG, USERS * REQUESTS * NTG, 0.0)
    assert res.prompt_mismatches == 0
    for rec in res.records:
        assert_request_consistent(rec, NPP, NTG, api)
    assert res.ttft.n == USERS * REQUESTS
    assert res.ttft.p50_ms <= res.latency.p50_ms and res.ttft.max_ms <= res.latency.max_ms
    assert res.tok_s is not None and res.tok_s > 0 and res.wall_s > 0
    assert_sane(to_json([run_of(url, res)], []), "json")


async def test_failed_requests_are_counted(make_config) -> None:
    """Requests refused by a full queue (HTTP 503) count as failed, with their error; the
    cross-check still matches because refused requests generate nothing."""
    async with open_server(make_config(parallel=1, queue_size=0)) as (_, url):
        res = await run_workload(url, closed(users=4, requests=1, ntg=24))
    assert res.ok + res.failed == 4
    assert res.failed >= 1 and res.ok >= 1
    assert any("503" in e for e in res.errors)
    assert res.cross_check.diff_percent == 0.0
    assert any("failed" in line for line in notes([run_of(url, res)]))


@pytest.mark.slow
async def test_cli_bench_json_subprocess(make_config) -> None:
    """``llamactor bench --json`` as a user runs it: exit 0, one run, figures consistent."""
    import anyio

    async with open_server(make_config(parallel=4)) as (_, url):
        cmd = [
            sys.executable,
            "-m",
            "llamactor.runtime.cli",
            "bench",
            "--url",
            url,
            "--users",
            "2",
            "--requests",
            "2",
            "--npp",
            str(NPP),
            "--ntg",
            str(NTG),
            "--json",
        ]
        proc = await anyio.run_process(cmd, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    out = json.loads(proc.stdout)
    (run,) = out["runs"]
    fig = run["figures"]
    assert (fig["ok"], fig["failed"], fig["server_tokens"], fig["diff_percent"]) == (4, 0, 4 * NTG, 0.0)
    assert fig["ttft_p50_ms"] <= run["result"]["latency"]["p50_ms"]
    assert out["notes"] == [] or all("client used" in n for n in out["notes"])
    assert_sane(out["runs"], "runs")


@pytest.mark.slow
async def test_vs_alternates_servers_and_prints_ratios(make_config) -> None:
    """``--vs`` runs A B A B with the same prompts per pair and gives per-pair B/A ratios
    and their median, for each point of a sweep."""
    async with open_server(make_config(parallel=2)) as (_, url_a), open_server(make_config(parallel=2)) as (_, url_b):
        points = parse_sweep("users=1,2", closed(requests=1, ntg=8))
        runs = await run_matrix(
            [Target("A", url_a), Target("B", url_b)], points, 2, lambda label, n: NoProgress(label, n)
        )
    assert [(r.point, r.pair, r.target.label) for r in runs] == [
        (p, pair, t) for p in ("users=1", "users=2") for pair in (0, 1) for t in ("A", "B")
    ]
    for r in runs:
        assert r.result.failed == 0 and r.result.cross_check.diff_percent == 0.0
    # the same prompts went to A and B within a pair: same lengths and token counts as sent
    ratios = pair_ratios(runs)
    assert [(x.point, x.pair) for x in ratios] == [
        ("users=1", 0),
        ("users=1", 1),
        ("users=1", None),
        ("users=2", 0),
        ("users=2", 1),
        ("users=2", None),
    ]
    assert all(v is not None and v > 0 for x in ratios for v in x.ratios.values())
    assert "median" in render_ratios(ratios) and "users=2" in render_runs(runs)


# ---- scheduling workloads -------------------------------------------------------------------


@pytest.mark.slow
async def test_mixed_workload(make_config) -> None:
    """Streams generate while long prompts arrive at set times; reports stream gap
    p50/p99/max, arrival TTFT, prefill tok/s and makespan, and that arrivals met the streams."""
    wl = Mixed(streams=2, npp=8, ntg=400, arrival_npp=600, arrival_ntg=4, arrivals_s=(0.01, 0.03))
    async with open_server(make_config(parallel=4, n_batch=128, n_ubatch=128)) as (_, url):
        res = await run_workload(url, wl)
    assert (res.ok, res.failed) == (4, 0)
    assert res.arrivals_during_streams == 2 and res.notes() == []
    streams, arrivals = res.records[:2], res.records[2:]
    for rec in streams:
        assert_request_consistent(rec, 8, 400)
    for rec in arrivals:
        assert_request_consistent(rec, 600, 4)
    assert res.stream_gap.n == 2 * 399
    assert res.stream_gap.p50_ms <= res.stream_gap.p99_ms <= res.stream_gap.max_ms
    assert len(res.arrival_ttft_ms) == 2 and all(t is not None for t in res.arrival_ttft_ms)
    assert res.prefill_tok_s > 0
    assert res.makespan_s * 1000 >= max(res.arrival_ttft_ms)
    assert res.cross_check.diff_percent == 0.0
    assert res.slo.n == 4 and 0 <= res.slo.goodput_share <= 1  # goodput over streams and arrivals
    assert_sane(res.figures(), "figures")


async def test_cohort_workload(make_config) -> None:
    """Prompts of unequal length (several n_batch chunks each) arrive together; time
    until every prompt is prefilled is the largest TTFT; generation tok/s and makespan."""
    wl = Cohort(npps=(150, 300, 600), ntg=16)
    async with open_server(make_config(parallel=4, n_batch=128, n_ubatch=128)) as (_, url):
        res = await run_workload(url, wl)
    assert (res.ok, res.failed) == (3, 0)
    for rec, n in zip(res.records, wl.npps):
        assert_request_consistent(rec, n, 16)
    assert res.all_prefilled_s is not None
    assert res.all_prefilled_s == pytest.approx(max(res.ttft_ms) / 1000, abs=0.05)
    assert res.all_prefilled_s <= res.makespan_s
    assert res.gen_tok_s is not None and res.gen_tok_s > 0
    assert res.cross_check.diff_percent == 0.0
    assert res.slo.n == 3 and 0 <= res.slo.goodput_share <= 1 and res.slo.ttft_p50_ms <= res.slo.ttft_p99_ms
    assert_sane(res.figures(), "figures")


# ---- pure parts ----------------------------------------------------------------------------


def test_sse_decoder_handles_any_split() -> None:
    """Events are decoded the same whatever the network chunking."""
    stream = b'data: {"a": 1}\r\n\r\n: comment\n\ndata: {"b": 2}\n\nerror: {"c": 3}\n\n'
    whole = SseDecoder().feed(stream)
    assert whole == [(b"data", b'{"a": 1}'), (b"data", b'{"b": 2}'), (b"error", b'{"c": 3}')]
    dec = SseDecoder()
    assert [ev for i in range(len(stream)) for ev in dec.feed(stream[i : i + 1])] == whole


def test_http1_chunked_parser_handles_any_split() -> None:
    """The lean client undoes chunked framing for any split, with receive times kept."""
    import asyncio

    body = [b'data: {"x": 1}\n\n', b'data: {"x": 22}\n\n']
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    wire += b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in body) + b"0\r\n\r\n"

    async def parse(step: int) -> bytes:
        got = bytearray()

        class FakeTransport:
            def write(self, data: bytes) -> None:
                pass

        conn = _Connection()
        conn.connection_made(FakeTransport())  # type: ignore[arg-type]
        done = conn.send(b"", lambda status, piece, now: got.extend(piece))
        for i in range(0, len(wire), step):
            conn.data_received(wire[i : i + step])
        assert await done == 200 and conn.reusable
        return bytes(got)

    for step in (1, 3, 7, len(wire)):
        assert asyncio.run(parse(step)) == b"".join(body)


def test_metric_parse_sums_series() -> None:
    """tokens_predicted_total is summed over group-labelled series, or read unlabelled."""
    labelled = (
        '# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total{group="0"} 12.0\n'
        'llamacpp:tokens_predicted_total{group="1"} 30.0\nllamacpp:tokens_predicted_seconds_total 9.0\n'
    )
    assert parse_metric(labelled, "llamacpp:tokens_predicted_total") == 42.0
    assert parse_metric("llamacpp:tokens_predicted_total 7\n", "llamacpp:tokens_predicted_total") == 7.0
    assert parse_metric("other 1\n", "llamacpp:tokens_predicted_total") is None
    assert CrossCheck.of(110, 0.0, 100.0).diff_percent == pytest.approx(10.0)
    assert CrossCheck.of(5, None, 3.0).diff_percent is None


def test_prompts_distinct_and_deterministic() -> None:
    """Prompts are exact ids, pairwise distinct, and the same for the same seed."""
    a, b = PromptSource([5, 6], seed=1), PromptSource([5, 6], seed=1)
    drawn = [a.take(6) for _ in range(40)]
    assert len({tuple(p) for p in drawn}) == 40 and all(len(p) == 6 for p in drawn)
    assert drawn == [b.take(6) for _ in range(40)]
