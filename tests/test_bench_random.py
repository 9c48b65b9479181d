"""``llamactor bench --workload random``: the workload family, the chat dialect, the servers the
bench starts and stops, the noise band and the summary, against the tiny model.

The family is checked without a server (deterministic, every dimension covered, sizes within
bounds); runs are checked for consistency (every request completed, token counts equal the
server's), never for speed.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from pathlib import Path

import anyio
import pytest
from benchcli import json_of, run_cli
from conftest import open_server

from llamactor.ops.bench.apis import ChatApi, Dialogue, Message, NativeApi, OpenAIApi, TextRecord, Vocabulary
from llamactor.ops.bench.cli import EXIT_USAGE
from llamactor.ops.bench.launch import ServerCommand, ServerStartError, serving
from llamactor.ops.bench.phase import Request
from llamactor.ops.bench.random.randomfamily import ARRIVALS, DEFAULT_FAMILY, Family, fits_limit
from llamactor.ops.bench.random.randomload import LENGTH_KINDS, draw
from llamactor.ops.bench.random.randomrun import conversations_of, itl_percentile_good
from llamactor.ops.bench.random.randomworkload import RandomWorkload
from llamactor.ops.bench.random.verdict import (
    METRICS,
    MIN_BAND,
    Band,
    log_ratio,
    measure_band,
    middle,
    seed_table,
    tally,
    verdict,
)
from llamactor.ops.bench.runner import Common
from llamactor.ops.bench.stats import RequestRecord

SEEDS = range(300)
# A family the tiny model runs in well under a second per run.
TINY_FAMILY = {
    "npp": [8, 40],
    "ntg": [4, 12],
    "prefix_npp": [16, 48],
    "users": [2, 5],
    "requests_per_user": [1, 3],
    "nps": [2, 4],
    "duration_s": [0.5, 1.0],
    "max_requests": 16,
    "max_slot_context": 1024,
    "prompt_tok_s": 20000,
    "gen_tok_s": 300,
}
TINY = Family.from_dict(TINY_FAMILY)


def first_seed(family: Family, predicate) -> int:
    """The smallest seed whose draw satisfies ``predicate`` (draws are deterministic)."""
    return next(s for s in range(1000) if predicate(draw(s, family)))


# ---- the family -------------------------------------------------------------------------------


def test_draw_is_deterministic_and_covers_every_dimension() -> None:
    """The same seed draws the same workload; over many seeds every value of every dimension
    appears: arrival process, length kinds of prompts and outputs, prefix none / 1-3 prefixes,
    multi-turn none / some, each API, each -np."""
    seen: Counter[str] = Counter()
    for seed in SEEDS:
        wl = draw(seed)
        assert wl == draw(seed) and wl.seed == seed
        seen.update(
            [
                wl.arrival,
                wl.api,
                f"np{wl.np}",
                f"npp:{wl.npp.kind}",
                f"ntg:{wl.ntg.kind}",
                f"prefixes:{len(wl.prefix_lengths)}",
                "turns" if wl.later_turns else "single",
            ]
        )
        assert wl.summary().startswith(f"seed {seed}: ") and f"-np {wl.np} -c {wl.ctx}" in wl.summary()
    expected = (
        [*ARRIVALS, "native", "openai", "chat", "np4", "np8", "np16", "np32", "turns", "single"]
        + [f"{w}:{k}" for w in ("npp", "ntg") for k in LENGTH_KINDS]
        + [f"prefixes:{n}" for n in range(4)]
    )
    assert all(seen[k] >= 5 for k in expected), seen
    assert draw(1) != draw(2)


def test_draws_are_pinned() -> None:
    """Two draws written out: a change to the family, the drawing code or the random streams
    (a numpy release) shows here, since it changes what a seed means across machines."""
    assert draw(7).summary() == (
        "seed 7: poisson at 0.86x capacity, 12 requests, prompts lognormal:22:0.98, outputs uniform:11:169, "
        "prefix 69% of 3 (240, 211, 244 tok), turns 60% (5 later), api native, -np 32 -c 32768"
    )
    assert draw(42).summary() == (
        "seed 42: on/off at 1.65x capacity, ~4 per burst, idle 0.81x, 131 requests, prompts fixed:19, "
        "outputs fixed:9, no prefix, single turns, api chat, -np 8 -c 8192"
    )


def test_draw_sizes_stay_within_bounds() -> None:
    """Lengths, prefixes, shares, users and request counts within the family's bounds; the
    per-slot context a power of two >= 1024 that holds the largest request; later turns
    continue an earlier request (the same user's in a closed loop) with its whole history;
    a run is estimated at 15-40 s on the speed model, give or take a step."""
    fam = DEFAULT_FAMILY
    for seed in SEEDS:
        wl = draw(seed)
        assert fam.min_requests <= wl.n_requests <= fam.max_requests
        assert 12 <= wl.estimated_s <= 45, (seed, wl.estimated_s)
        assert wl.slot_context >= 1024 and wl.slot_context & (wl.slot_context - 1) == 0
        assert wl.slot_context <= fam.max_slot_context and wl.ctx == wl.np * wl.slot_context
        assert max(it.context + it.ntg for it in wl.items) <= fits_limit(wl.slot_context)
        assert all(fam.prefix_npp[0] <= n <= fam.prefix_npp[1] for n in wl.prefix_lengths)
        assert len(wl.prefix_lengths) <= fam.prefixes[1]
        assert wl.prefix_share == 0 or fam.prefix_share[0] <= wl.prefix_share <= fam.prefix_share[1]
        assert wl.turn_share == 0 or fam.turn_share[0] <= wl.turn_share <= fam.turn_share[1]
        if wl.open_loop:
            lo, hi = fam.rate_fraction if wl.arrival == "poisson" else fam.on_multiple
            assert lo <= wl.load <= hi and wl.users == 0
        else:
            assert fam.users[0] <= wl.users <= fam.users[1]
            assert fam.requests_per_user[0] <= wl.requests_per_user <= fam.requests_per_user[1]
            assert wl.n_requests == wl.users * wl.requests_per_user
        for i, it in enumerate(wl.items):
            assert fam.ntg[0] <= it.ntg <= fam.ntg[1] and 1 <= it.npp <= fam.npp[1]
            if it.follows is None:
                head = wl.prefix_lengths[it.prefix] if it.prefix is not None else 0
                assert it.context == head + it.npp
            else:
                prev = wl.items[it.follows]
                assert it.follows < i and it.prefix == prev.prefix
                assert it.context == prev.context + prev.ntg + it.npp
                if not wl.open_loop:
                    assert it.user == prev.user == i % wl.users
        followed = [it.follows for it in wl.items if it.follows is not None]
        assert len(followed) == len(set(followed))  # a turn is continued at most once


def test_arrival_times_follow_the_process() -> None:
    """Closed loops stagger users (burst: all at 0); poisson arrivals scale with the measured
    capacity; on/off leaves idle gaps; open loops refuse to run without a capacity."""
    closed = draw(first_seed(DEFAULT_FAMILY, lambda w: w.arrival == "closed"))
    times = closed.arrival_times(None)
    assert times == [it.user * closed.stagger_s for it in closed.items] and closed.stagger_s > 0
    burst = draw(first_seed(DEFAULT_FAMILY, lambda w: w.arrival == "burst"))
    assert set(burst.arrival_times(None)) == {0.0}
    poisson = draw(first_seed(DEFAULT_FAMILY, lambda w: w.arrival == "poisson" and w.n_requests > 10))
    slow, fast = poisson.arrival_times(1.0), poisson.arrival_times(2.0)
    assert slow[0] == 0.0 and slow == sorted(slow) and fast == pytest.approx([t / 2 for t in slow])
    onoff = draw(first_seed(DEFAULT_FAMILY, lambda w: w.arrival == "onoff" and w.n_requests > 3 * w.burst_requests))
    at = onoff.arrival_times(1.0)
    off_s = onoff.off_factor * onoff.burst_requests
    assert at == sorted(at) and max(b - a for a, b in zip(at, at[1:])) >= off_s
    with pytest.raises(ValueError, match="capacity"):
        poisson.arrival_times(None)


def test_family_overrides_are_checked() -> None:
    """``--family`` overrides: unknown keys and bad bounds are refused, naming them."""
    assert TINY.npp == (8, 40) and TINY.apis == DEFAULT_FAMILY.apis
    with pytest.raises(ValueError, match="unknown family setting 'nope'"):
        Family.from_dict({"nope": 1})
    with pytest.raises(ValueError, match="npp"):
        Family.from_dict({"npp": [50, 10]})
    with pytest.raises(ValueError, match="apis"):
        Family.from_dict({"apis": ["grpc"]})


# ---- the dialects ---------------------------------------------------------------------------


VOCAB = Vocabulary({1: "The", 2: " river", 3: " bread", 4: " of"})


def test_chat_dialect_body_and_stream_decoding() -> None:
    """Chat: a plain prompt is one user message of its pieces' text; a dialogue sends its
    messages (shared prefix as the system message, an earlier answer as text). The stream: the
    role chunk carries no token, each content chunk one, usage gives the server's count, the
    answer's text is kept when asked, data: [DONE] ends it."""
    api = ChatApi(VOCAB)
    body = api.body([1, 2, 4, 3], 16, 0.0, cache_prompt=True)
    assert body["messages"] == [{"role": "user", "content": "The river of bread"}]
    assert (body["max_tokens"], body["ignore_eos"], body["cache_prompt"], body["stream"]) == (16, True, True, True)
    assert body["stream_options"] == {"include_usage": True}
    prompt = Dialogue(
        [Message("system", (1, 2)), Message("user", (3,)), Message("assistant", text=" Hi!"), Message("user", (4,))]
    )
    assert list(prompt) == [1, 2, 3, 4]
    assert api.body(prompt, 4, 0.0)["messages"] == [
        {"role": "system", "content": "The river"},
        {"role": "user", "content": " bread"},
        {"role": "assistant", "content": " Hi!"},
        {"role": "user", "content": " of"},
    ]
    rec = api.new_record(4, keep=True)
    assert isinstance(rec, TextRecord)
    frames = [
        b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}',
        b'{"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}',
        b'{"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}',
        b'{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}',
        b'{"choices":[],"usage":{"completion_tokens":3,"prompt_tokens":9,"total_tokens":12}}',
        b"[DONE]",
    ]
    for t, frame in enumerate(frames):
        api.apply(rec, b"data", frame, float(t))
    api.finish(rec)
    assert rec.ok and rec.event_times == [1.0, 2.0] and rec.event_tokens == [1, 1]
    assert (rec.n_generated, rec.n_prompt_server, "".join(rec.text)) == (3, 9, "Hello")
    cut = api.new_record(4, keep=False)
    api.apply(cut, b"data", frames[1], 0.0)
    api.finish(cut)
    assert not cut.ok and "[DONE]" in (cut.error or "") and not isinstance(cut, TextRecord)
    err = api.new_record(4, keep=False)
    api.apply(err, b"error", b'{"message":"context full"}', 0.0)
    assert err.error == "context full"


def test_completion_dialects_with_dialogues() -> None:
    """Native sends a dialogue's ids; OpenAI completions send its ids, or its text once an
    earlier answer is known only as text, and keep the answer's text when asked."""
    ids_only = Dialogue([Message("system", (1,)), Message("user", (2, 3))])
    assert NativeApi().body(ids_only, 4, 0.0)["prompt"] == [1, 2, 3]
    api = OpenAIApi(VOCAB)
    assert api.body(ids_only, 4, 0.0)["prompt"] == [1, 2, 3]
    with_text = Dialogue([*ids_only.messages, Message("assistant", text=" yes"), Message("user", (4,))])
    assert api.body(with_text, 4, 0.0)["prompt"] == "The river bread yes of"
    rec = api.new_record(3, keep=True)
    api.apply(rec, b"data", b'{"choices":[{"text":" a","finish_reason":null}]}', 1.0)
    api.apply(rec, b"data", b'{"choices":[{"text":"","finish_reason":"length"}],"usage":{"completion_tokens":2}}', 2.0)
    api.apply(rec, b"data", b"[DONE]", 3.0)
    assert isinstance(rec, TextRecord) and rec.text == [" a"] and rec.n_generated == 2 and rec.ok


# ---- conversations and goodput ----------------------------------------------------------------


async def test_conversations_build_later_turns_from_answers() -> None:
    """A later turn is its previous turn's messages + the answer (ids from the native dialect,
    text from the others) + its own new message, sent once the previous turn has ended; a
    failed previous turn leaves the answer out and is counted."""
    wl = draw(first_seed(TINY, lambda w: w.open_loop and w.later_turns >= 2 and w.prefix_lengths), TINY)
    texts = [[100 + i] * it.npp for i, it in enumerate(wl.items)]
    book = conversations_of(wl, [[7] * n for n in wl.prefix_lengths], texts)
    i = next(k for k, it in enumerate(wl.items) if it.follows is not None)
    j = wl.items[i].follows
    first = await book.request(j)
    assert first.keep_ids and first.cache_prompt and first.tag == j
    got: list[Request] = []

    async def later() -> None:
        got.append(await book.request(i))

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        await anyio.wait_all_tasks_blocked()
        assert got == []  # waits for its previous turn
        answer = RequestRecord(0.0, len(first.prompt), token_ids=[5, 6], done_s=1.0, n_generated_server=2)
        book.done(j, answer)
    (req,) = got
    assert list(req.prompt) == list(first.prompt) + [5, 6] + texts[i]
    assert req.prompt.messages[-2] == Message("assistant", (5, 6)) and req.n_predict == wl.items[i].ntg

    text_book = conversations_of(wl, [[7] * n for n in wl.prefix_lengths], texts)
    first = await text_book.request(j)
    text_book.done(j, TextRecord(0.0, 3, done_s=1.0, text=["Hi", " there"]))
    req = await text_book.request(i)
    assert req.prompt.messages[-2] == Message("assistant", text="Hi there") and req.prompt.has_text

    broken = conversations_of(wl, [[7] * n for n in wl.prefix_lengths], texts)
    first = await broken.request(j)
    broken.done(j, RequestRecord(0.0, 3, error="HTTP 500"))
    req = await broken.request(i)
    assert broken.broken == 1 and list(req.prompt) == list(first.prompt) + texts[i]


def test_goodput_percentile_form() -> None:
    """The percentile form judges a request by its own inter-token gap percentile, so stalls
    among fast tokens fail it where the mean form passes."""
    common = Common(slo_ttft_ms=500, slo_itl_ms=100)
    gaps = [0.02] * 16 + [0.2] * 4
    times = [0.1 + sum(gaps[:k]) for k in range(len(gaps) + 1)]
    stall = RequestRecord(0.0, 4, event_times=times, event_tokens=[1] * len(times), done_s=2.0)
    assert stall.tpot_s is not None and stall.tpot_s * 1000 <= 100  # mean form: good
    assert itl_percentile_good(stall, common, 50.0) and not itl_percentile_good(stall, common, 90.0)
    single = RequestRecord(0.0, 4, event_times=[0.2], event_tokens=[1], done_s=0.3)
    assert itl_percentile_good(single, common, 90.0)
    late = RequestRecord(0.0, 4, event_times=[0.6, 0.61], event_tokens=[1, 1], done_s=0.7)
    assert not itl_percentile_good(late, common, 90.0)


# ---- verdict ------------------------------------------------------------------------------------


def figs(**kw: float) -> dict[str, float]:
    base = dict(ttft_mean_ms=100.0, ttft_p50_ms=90.0, itl_p99_ms=50.0, goodput=0.8, goodput_pct=0.5, makespan_s=10.0)
    return {**base, **kw}


def test_ratios_band_and_wins_ties_losses() -> None:
    """Ratios are taken within each pair and their median quoted; the band is the largest
    |log ratio| of the reference against itself; a ratio outside it is a win or a loss by
    the metric's direction, inside it a tie; 0 against 0 is a tie, anything against 0 a win."""
    assert log_ratio(0.0, 0.0) == 0.0 and log_ratio(0.0, 0.5) == math.inf and log_ratio(None, 1.0) is None
    assert middle([3.0, None, 1.0, 2.0]) == 2.0 and middle([1.0, math.inf]) == 1.0 and middle([]) is None
    runs = {
        ("ref", 0): figs(),
        ("ref", 1): figs(ttft_mean_ms=200.0),
        ("ref~self", 0): figs(ttft_mean_ms=110.0),
        ("ref~self", 1): figs(ttft_mean_ms=212.0, goodput=0.82),
        ("b", 0): figs(ttft_mean_ms=50.0, goodput=0.0, makespan_s=10.2),
        ("b", 1): figs(ttft_mean_ms=100.0, goodput=0.0, makespan_s=10.1),
    }
    table = seed_table(7, ["ref", "ref~self", "b"], runs)
    assert table.medians["ref"]["ttft_mean_ms"] == 150.0
    assert math.exp(table.log_ratios["b"]["ttft_mean_ms"]) == pytest.approx(0.5)
    assert table.log_ratios["b"]["goodput"] == -math.inf
    same = {("ref~self", p): runs[("ref", p)] for p in (0, 1)}
    quiet = seed_table(8, ["ref", "ref~self", "b"], {**runs, **same})
    band = measure_band([table, quiet], "ref~self")  # the largest over seeds of the median pair ratio
    assert band.log_band["ttft_mean_ms"] == pytest.approx((math.log(1.1) + math.log(1.06)) / 2)
    assert band.log_band["itl_p99_ms"] == MIN_BAND  # identical figures: the floor
    result = tally([table], ["b"], band)["b"]
    by_key = {m.key: m for m in METRICS}
    assert (result["ttft_mean_ms"].wins, result["goodput"].losses, result["itl_p99_ms"].ties) == (1, 1, 1)
    assert verdict(math.log(1.015), by_key["makespan_s"], band.log_band["makespan_s"]) == "loss"
    assert verdict(None, by_key["makespan_s"], 0.1) == "n/a"
    assert Band.from_json(band.to_json(), "file").log_band == band.log_band
    with pytest.raises(ValueError, match="log_band"):
        Band.from_json({"log_band": {"ttft_mean_ms": -1}}, "file")


# ---- servers the bench starts -----------------------------------------------------------------


FAKE_SERVER = """
import http.server, signal, subprocess, sys
port, pid_file, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(pid_file, "w").write(str(child.pid))
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "crash":
    print("fatal: no model here", flush=True)
    sys.exit(3)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.mark.parametrize("mode", ["polite", "stubborn"])
async def test_started_servers_are_stopped_with_their_children(tmp_path: Path, mode: str) -> None:
    """A started server answers /health on its port; stopping it ends it and the child it
    started in a session of its own (as llamactor's engine), SIGKILL after the grace period
    for one that ignores SIGTERM."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    pid_file = tmp_path / "child.pid"
    cmd = ServerCommand.parse(f"fake={sys.executable} {script} {{port}} {pid_file} {mode} {{np}} {{ctx}}")
    async with serving([cmd], np=2, ctx=1024, log_dir=tmp_path, grace_s=0.5) as (server,):
        assert server.url.startswith("http://127.0.0.1:") and server.argv[-2:] == ["2", "1024"]
        child = int(pid_file.read_text())
        assert not gone(child) and not gone(server.proc.pid)
    assert server.proc.returncode is not None
    with anyio.fail_after(5):
        while not gone(child):
            await anyio.sleep(0.01)


async def test_a_server_that_fails_to_start_is_named_with_its_log(tmp_path: Path) -> None:
    """A server exiting before /health answers: the error names it and quotes its log; its
    child is stopped too."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    pid_file = tmp_path / "child.pid"
    cmd = ServerCommand.parse(f"broken={sys.executable} {script} {{port}} {pid_file} crash")
    with pytest.raises(ServerStartError, match=r"server broken exited with status 3(.|\n)*fatal: no model here"):
        async with serving([cmd], np=1, ctx=1024, log_dir=tmp_path, grace_s=0.5):
            pass
    child = int(pid_file.read_text())
    with anyio.fail_after(5):
        while not gone(child):
            await anyio.sleep(0.01)


def test_serve_templates() -> None:
    """NAME=COMMAND with {port}, {np}, {ctx} filled in (and $VAR expanded); a command without
    {port}, with an unknown placeholder, or without a name is refused."""
    os.environ["LLAMACTOR_TEST_MODEL"] = "/m.gguf"
    cmd = ServerCommand.parse('x=serve -m $LLAMACTOR_TEST_MODEL --port {port} -np {np} -c {ctx} --alias "a b"')
    assert cmd.argv(port=8, np=4, ctx=4096) == [
        "serve",
        "-m",
        "/m.gguf",
        "--port",
        "8",
        "-np",
        "4",
        "-c",
        "4096",
        "--alias",
        "a b",
    ]
    assert cmd.sized and cmd.key(4, 4096) == cmd.key(4, 4096) and "--port 0" in cmd.key(4, 4096)
    for bad, why in (("x=serve -np {np}", "{port}"), ("x=serve {port} {gpu}", "gpu"), ("serve {port}", "NAME=COMMAND")):
        with pytest.raises(ValueError, match=why):
            ServerCommand.parse(bad)


# ---- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "random"], "needs servers"),
        (["--workload", "random", "--url", "http://127.0.0.1:9", "--noise-band"], "--noise-band"),
        (["--workload", "random", "--serve", "a=x {port}", "--band-out", "f"], "--band-out"),
        (["--workload", "random", "--serve", "a=x {port}", "--noise-band", "--band-file", "f"], "--band-file"),
        (["--workload", "random", "--serve", "a=x {port}", "--serve", "a=y {port}"], "names must differ"),
        (["--workload", "random", "--serve", "a=x {port}", "--seed", "1,2", "--seeds", "3"], "--seeds"),
        (["--workload", "random", "--serve", "a=x {port}", "--family", '{"nps": []}'], "--family"),
        (["--workload", "random", "--serve", "a=x {port}", "--slo-itl-pct", "0"], "--slo-itl-pct"),
        (["--url", "http://127.0.0.1:9", "--seed", "1,2"], "--seed"),
        (["--url", "http://127.0.0.1:9", "--api", "chat"], "--api chat"),
        (["--serve", "a=x {port}"], "--url is required"),
    ],
)
async def test_bad_random_settings_exit_2(capsys, argv: list[str], message: str) -> None:
    """Bad settings of --workload random (and its flags elsewhere) exit 2 before anything runs."""
    rc, out, err = await run_cli(capsys, *argv)
    assert rc == EXIT_USAGE and message in err and err.startswith("llamactor bench: error:"), err


async def test_random_suite_against_fixed_servers(make_config, capsys, tmp_path: Path) -> None:
    """One seed (open loop, shared prefixes, later turns, chat) on two running servers, two
    pairs: every request completes, tokens equal the servers' counters, the capacity is
    calibrated once and cached in the file, and the JSON has per-seed, per-server and per-pair
    figures, medians, ratios, the band and the summary."""
    seed = first_seed(TINY, lambda w: w.open_loop and w.later_turns and w.prefix_lengths)
    calibration = tmp_path / "calibration.json"
    async with open_server(make_config(parallel=4)) as (_, url_a), open_server(make_config(parallel=4)) as (_, url_b):
        argv = ["--workload", "random", "--url", url_a, "--vs", url_b, "--seed", str(seed), "--pairs", "2"]
        argv += ["--family", json.dumps(TINY_FAMILY), "--api", "chat", "--calibration", str(calibration), "--json"]
        rc, out, err = await run_cli(capsys, *argv)
    assert rc == 0, err
    doc = json_of(out)
    (per_seed,) = doc["per_seed"]
    assert doc["seeds"] == [seed] and doc["reference"] == "A" and not doc["seeds_picked_at_random"]
    assert per_seed["workload"]["api"] == "chat" and per_seed["workload"]["later_turns"] > 0
    assert [(r["server"], r["pair"]) for r in per_seed["runs"]] == [("A", 0), ("B", 0), ("A", 1), ("B", 1)]
    for run in per_seed["runs"]:
        fig, res = run["figures"], run["result"]
        assert (fig["failed"], res["broken_turns"]) == (0, 0) and fig["ok"] == per_seed["workload"]["n_requests"]
        assert fig["diff_percent"] == 0.0 and 0 <= fig["goodput_pct"] <= 1 and fig["makespan_s"] > 0
    assert set(per_seed["ratios"]["B"]) == {m.key for m in METRICS}
    assert per_seed["calibration"]["capacity_rps"] > 0 and not per_seed["calibration"]["cached"]
    assert list(json.loads(calibration.read_text()).values()) == [per_seed["calibration"]["capacity_rps"]]
    assert doc["band"]["source"].startswith("not measured")
    assert sum(doc["summary"]["B"]["makespan_s"].values()) == 1
    assert doc["notes"] == [] or all("client used" in n for n in doc["notes"])


def processes_running(text: str) -> list[int]:
    """Pids of the processes whose command line contains ``text``."""
    out = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in path.read_bytes().decode("utf-8", "replace") and not gone(int(path.parent.name)):
                out.append(int(path.parent.name))
        except OSError:
            pass  # ended while we looked
    return out


@pytest.mark.slow
async def test_random_bench_starts_two_llamactor_servers(tiny_model: Path, capsys, tmp_path: Path) -> None:
    """The whole command as a user runs it: two ``llamactor serve`` servers started with the
    drawn -np and -c, one seed, one pair, the noise band from a second instance of the first;
    the per-seed rows and the summary printed; every server process gone afterwards, engine
    children included (their pids read from the servers' logs)."""
    seed = first_seed(TINY, lambda w: not w.open_loop and w.prefix_lengths and w.api == "native")
    serve = f"{Path(sys.executable).parent / 'llamactor'} serve -m {tiny_model} --host 127.0.0.1 --port {{port}}"
    serve += " -np {np} -c {ctx} -t 1"
    logs = tmp_path / "logs"
    rc, out, err = await run_cli(
        capsys,
        *("--workload", "random", "--seed", str(seed), "--pairs", "1", "--family", json.dumps(TINY_FAMILY)),
        *("--serve", f"default={serve}", "--serve", f"continuous={serve} --scheduler continuous", "--noise-band"),
        *("--serve-logs", str(logs)),
    )
    assert rc == 0, err
    wl: RandomWorkload = draw(seed, TINY)
    assert f"starting 3 server(s) with -np {wl.np} -c {wl.ctx}" in err
    assert wl.summary() in out and "default~self" in out and "wins/ties/losses against default" in out
    assert "noise band (measured on 1 seed(s)" in out
    row = next(line for line in out.splitlines() if line.startswith("continuous "))  # its seed row
    assert row.split()[-2:] == [str(wl.n_requests), "0"]  # ok, failed
    engines = [
        json.loads(line)["pid"]
        for log in logs.glob("*.log")
        for line in log.read_text().splitlines()
        if '"engine_ready"' in line
    ]
    assert len(engines) == 3
    with anyio.fail_after(5):
        while processes_running(str(tiny_model)) or not all(gone(pid) for pid in engines):
            await anyio.sleep(0.05)
