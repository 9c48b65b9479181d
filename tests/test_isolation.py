"""The engine in a child process; requests survive its death (a pause, not an error).

The engine process is killed (SIGKILL, as the OOM killer or a llama.cpp abort ends it) or hangs
(the watchdog); the API process restarts it and resumes every request in flight by replaying
its delivered tokens one decode step at a time, so greedy streams continue byte for byte.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest
from conftest import serve_app, serve_runtime, slots_free, wait_until
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from llamactor.protocol.errors import ConfigError
from llamactor.protocol.events import Done, Token
from llamactor.protocol.messages import Submit
from llamactor.protocol.request import GenerationRequest
from llamactor.runtime import Runtime
from llamactor.runtime.service.handles import collect

pytestmark = pytest.mark.slow  # engine processes killed and restarted, seconds each

HOOKS = str(Path(__file__).with_name("enginehooks.py"))
SLOW = f"{HOOKS}:Slow"
PROMPTS = [[5 + j, 6, 7, 8, 9, 10 + j] * 4 for j in range(8)]
N_PREDICT = 240
KILL_AT = 80


async def _streams(rt, kill: bool) -> tuple[list[list[int]], list[str]]:
    """The 8 prompts at once, greedy; with ``kill``, the engine process gets SIGKILL once the
    first stream has ``KILL_AT`` tokens."""
    handles = [await rt.submit(p, max_tokens=N_PREDICT, temperature=0, ignore_eos=True) for p in PROMPTS]
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    texts = [""] * len(PROMPTS)

    async def read(i: int) -> None:
        async for ev in handles[i]:
            if isinstance(ev, Token):
                tokens[i].append(ev.token)
                texts[i] += ev.text
                if kill and i == 0 and len(tokens[0]) == KILL_AT:
                    os.kill(rt.engine.process.pid, signal.SIGKILL)
            elif isinstance(ev, Done):
                assert ev.text == texts[i] and ev.n_predicted == N_PREDICT

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(read, i)
    return tokens, texts


async def test_replayed_tokens_continue_the_stream_in_process(make_config):
    """The engine side of a resume: a task carrying delivered tokens replays them (no events)
    and continues exactly where the uninterrupted run went; Done has the whole text."""
    async with Runtime.open(make_config(parallel=2)) as rt:
        full = await rt.complete(PROMPTS[0], max_tokens=64, temperature=0, ignore_eos=True)
        ref = list(full.choices[0].tokens)
        admitted = await rt.admission.admit(
            GenerationRequest(prompt=PROMPTS[0], max_tokens=64, cache_prompt=False, ignore_eos=True, temperature=0)
        )
        task, recv = msgspec.structs.replace(admitted.task, replay=(tuple(ref[:20]),)), admitted.events
        rt.engine.supervisor.try_tell(Submit(task))
        with recv:
            events = [ev async for ev in recv]
    assert [ev.token for ev in events if isinstance(ev, Token)] == ref[20:]
    assert events[-1].text == full.choices[0].text and events[-1].n_predicted == 64


async def test_killed_engine_resumes_every_stream_byte_for_byte(make_config):
    """8 concurrent greedy streams, SIGKILL mid-stream: all 8 complete, each identical
    to an uninterrupted run (tokens and text); /health went 503 and back to 200; /metrics counts
    the restart and the 8 resumes."""
    cfg = make_config(parallel=8, engine_hooks=SLOW)  # the streams are still running when it dies
    async with Runtime.open(cfg, isolate=True) as rt:
        ref_tokens, ref_texts = await _streams(rt, kill=False)
    async with Runtime.open(cfg, isolate=True) as rt, serve_runtime(rt) as url:
        seen: list[int] = []
        async with httpx.AsyncClient(base_url=url, timeout=30) as client, anyio.create_task_group() as tg:

            async def watch() -> None:
                while True:
                    seen.append((await client.get("/health")).status_code)
                    await anyio.sleep(0.01)

            tg.start_soon(watch)
            tokens, texts = await _streams(rt, kill=True)
            await wait_until(lambda: seen and seen[-1] == 200)
            tg.cancel_scope.cancel()
        metrics = (await rt.metrics_text()).decode()
    assert tokens == ref_tokens and texts == ref_texts
    assert 503 in seen and seen[-1] == 200
    assert "llamactor:engine_restarts_total 1.0" in metrics
    assert "llamactor:requests_resumed_total 8.0" in metrics
    assert "llamacpp:tokens_predicted_total" in metrics  # the engine's own counters come through


async def test_fast_resume_prefills_the_delivered_tokens_with_the_prompt(make_config):
    """--resume fast: the delivered tokens join the prompt (one prefill instead of one step per
    token); every stream still ends with its whole budget and a Done whose text is what was
    streamed; the pause of each resumed request is measured."""
    async with Runtime.open(make_config(parallel=8, resume="fast", engine_hooks=SLOW), isolate=True) as rt:
        tokens, texts = await _streams(rt, kill=True)  # _streams checks Done.text and n_predicted
        pauses = rt.engine.counters.resume_ms
    assert all(len(t) == N_PREDICT for t in tokens)
    assert len(pauses) == 8 and all(p > 0 for p in pauses)


async def test_a_request_resumes_at_most_resume_max_times(make_config):
    from llamactor.protocol.errors import LlamactorError

    async with Runtime.open(make_config(parallel=2, resume_max=0, engine_hooks=SLOW), isolate=True) as rt:
        handle = await rt.submit(PROMPTS[0], max_tokens=400, temperature=0, ignore_eos=True)
        n = 0
        with pytest.raises(LlamactorError, match="died 1 times while serving this request"):
            async for ev in handle:
                n += isinstance(ev, Token)
                if n == 20:
                    os.kill(rt.engine.process.pid, signal.SIGKILL)
        after = await collect(await rt.submit(PROMPTS[1], max_tokens=8, temperature=0))  # the engine is back
    assert after.n_predicted == 8


async def test_n_choices_logprobs_and_stop_strings_survive_a_resume(make_config):
    """n = 2 choices with logprobs and a stop string, the engine killed mid-stream: each choice
    ends once, with its budget or its stop string, its Done text equal to what was streamed for
    it, and tokens after the resume still carry logprobs."""
    from llamactor.protocol.events import Done

    async with Runtime.open(make_config(parallel=4, engine_hooks=SLOW), isolate=True) as rt:
        ref = await collect(await rt.submit(PROMPTS[3], max_tokens=150, temperature=0, ignore_eos=True, n=2, n_probs=2))
        stop = _late_substring(ref.choices[0].text)  # a stop string the run reaches late, after the kill
        handle = await rt.submit(
            PROMPTS[3], max_tokens=150, temperature=0, ignore_eos=True, n=2, n_probs=2, stop=[stop]
        )
        texts = ["", ""]
        dones: dict[int, Done] = {}
        after: list[float | None] = []
        killed = False
        async for ev in handle:
            if isinstance(ev, Token):
                texts[ev.index] += ev.text
                if killed:
                    after.append(ev.logprob)
                if not killed and len(texts[0]) > 40:
                    killed = True
                    os.kill(rt.engine.process.pid, signal.SIGKILL)
            elif isinstance(ev, Done):
                assert ev.index not in dones
                dones[ev.index] = ev
        assert rt.engine.counters.resumed == 1
    assert sorted(dones) == [0, 1]
    for i in (0, 1):
        assert dones[i].text == texts[i] and dones[i].finish_reason == "stop" and dones[i].stopping_word == stop
        assert texts[i] == ref.choices[i].text[: ref.choices[i].text.index(stop)]
    assert after and all(lp is not None for lp in after)


def _late_substring(text: str, size: int = 6) -> str:
    """A piece of ``text`` whose first occurrence is in its last third."""
    for k in range(len(text) - size, len(text) * 2 // 3, -1):
        if text.index(text[k : k + size]) == k and text[k : k + size].strip():
            return text[k : k + size]
    raise AssertionError(f"no late unique piece in {text!r}")


async def test_watchdog_restarts_a_hung_engine(make_config, tmp_path, monkeypatch):
    """A decode step that never returns (injected in the first engine's 30th step):
    the watchdog ends that engine within its limit, the requests complete."""
    monkeypatch.setenv("LLAMACTOR_TEST_MARKS", str(tmp_path))
    cfg = make_config(parallel=4, watchdog_s=1.0, engine_hooks=f"{HOOKS}:HangOnce")
    async with Runtime.open(cfg, isolate=True) as rt:
        with anyio.fail_after(60):
            outs = [
                await collect(await rt.submit(p, max_tokens=64, temperature=0, ignore_eos=True)) for p in PROMPTS[:4]
            ]
        counters = rt.engine.counters
    assert all(o.n_predicted == 64 for o in outs)
    assert counters.watchdog_kills == 1 and counters.restarts == 1 and "watchdog" in counters.last_exit


async def test_requests_wait_for_a_restarting_engine_then_overflow_gets_503(make_config, tmp_path, monkeypatch):
    """Requests that arrive while the engine restarts are served after it, none lost;
    past the queue bound they get 503 + Retry-After."""
    monkeypatch.setenv("LLAMACTOR_TEST_MARKS", str(tmp_path))
    monkeypatch.setenv("LLAMACTOR_TEST_START_S", "3")
    cfg = make_config(parallel=2, queue_size=3, engine_hooks=f"{HOOKS}:SlowRestart")
    async with Runtime.open(cfg, isolate=True) as rt, serve_runtime(rt) as url:
        os.kill(rt.engine.process.pid, signal.SIGKILL)
        await wait_until(lambda: rt.health() == "restarting")
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            answers: list[httpx.Response] = []

            async def one(i: int) -> None:
                answers.append(await client.post("/completion", json={"prompt": PROMPTS[i], "n_predict": 8}))

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(one, i)
                await wait_until(lambda: len(rt.engine.journal) == 3)
                over = await client.post("/completion", json={"prompt": PROMPTS[3], "n_predict": 8})
                assert rt.health() == "restarting"
    assert over.status_code == 503 and over.headers["Retry-After"] == "1"
    assert "restarting" in over.json()["error"]["message"]
    assert sorted(r.status_code for r in answers) == [200, 200, 200]
    assert all(r.json()["tokens_predicted"] == 8 for r in answers)


async def test_an_embedding_app_keeps_serving_while_the_engine_restarts(make_config):
    """A Starlette app embedding the runtime keeps answering its own routes while the
    engine is killed, and the runtime's requests resume."""
    cfg = make_config(parallel=4, engine_hooks=SLOW)
    async with Runtime.open(cfg, isolate=True) as rt:
        ref = await collect(await rt.submit(PROMPTS[1], max_tokens=200, temperature=0, ignore_eos=True))
        app = Starlette(
            routes=[Route("/own", lambda request: PlainTextResponse("still here")), Mount("/llm", app=rt.asgi_app())]
        )
        async with serve_app(app, "/own") as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {"prompt": PROMPTS[1], "n_predict": 200, "temperature": 0, "ignore_eos": True, "stream": True}
            tokens: list[int] = []
            own: list[int] = []
            async with client.stream("POST", "/llm/completion", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    chunk = json.loads(line[6:])
                    tokens += chunk.get("tokens") or []
                    if len(tokens) == 50 and rt.engine.counters.restarts == 0 and not own:
                        os.kill(rt.engine.process.pid, signal.SIGKILL)
                        await wait_until(lambda: rt.health() == "restarting")
                        own.append((await client.get("/own")).status_code)
        counters = rt.engine.counters
    assert own == [200]
    assert tokens == list(ref.choices[0].tokens)
    assert counters.restarts == 1 and counters.resumed == 1  # it was still running when the engine died


async def test_hooks_need_the_engine_in_this_process(make_config):
    from faults import Faults

    with pytest.raises(ConfigError, match="engine_hooks"):
        async with Runtime.open(make_config(), hooks=Faults(), isolate=True):
            pass


async def test_a_broken_engine_config_fails_the_start(make_config):
    with pytest.raises(ConfigError, match="engine process ended before it was ready"):
        async with Runtime.open(make_config(engine_hooks="no_such_module:Hooks"), isolate=True):
            pass


async def test_embeddings_and_rerank_are_served_by_the_engine_process(make_config, tmp_path):
    """--embedding with the engine in a child process: /v1/embeddings and Runtime.embed give the
    in-process vectors; rerank too (a tiny reranker)."""
    import numpy as np
    from tinyreranker import write_tiny_reranker

    cfg = make_config(parallel=2, embedding=True, pooling="mean")
    texts = ["the quick brown fox", "hello there"]
    async with Runtime.open(cfg) as rt:
        ref = await rt.embed(texts)
    async with Runtime.open(cfg, isolate=True) as rt, serve_runtime(rt) as url:
        out = await rt.embed(texts)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.post("/v1/embeddings", json={"input": texts[0]})
    assert out.n_tokens == ref.n_tokens and out.pooling == "mean"
    for a, b in zip(out.vectors, ref.vectors):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert r.status_code == 200
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], ref.vectors[0], atol=1e-6)
    reranker = write_tiny_reranker(tmp_path / "rr.gguf")
    rcfg = make_config(model=reranker, parallel=2, embedding=True)
    docs = ["a cat sat", "the fox ran", "a cat sat"]
    async with Runtime.open(rcfg) as rt:
        want = await rt.rerank("where is the cat", docs)
    async with Runtime.open(rcfg, isolate=True) as rt:
        got = await rt.rerank("where is the cat", docs)
    assert [x.index for x in got] == [x.index for x in want]
    np.testing.assert_allclose([x.score for x in got], [x.score for x in want], atol=1e-5)


async def test_a_killed_rpc_worker_is_waited_for_and_the_streams_resume(make_config, monkeypatch):
    """The model split over a loopback ggml-rpc worker and the local CPU; the worker is
    killed mid-run (the engine aborts with it) and started again on its port: the restarted
    engine waits for it, loads, and the streams complete byte for byte; this process never exits."""
    import subprocess

    from conftest import free_port
    from test_rpc import LLAMACTOR, _wait_port, stop

    port = free_port()

    def worker() -> subprocess.Popen:
        proc = subprocess.Popen(
            [*LLAMACTOR, "worker", "--port", str(port), "-t", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait_port(port, proc)
        return proc

    cfg = make_config(
        parallel=4,
        rpc_servers=(f"127.0.0.1:{port}",),
        devices=("RPC0", "CPU"),
        tensor_split=(1.0, 1.0),
        watchdog_s=10.0,
        engine_hooks=SLOW,
    )
    prompts = PROMPTS[:4]
    procs = [worker()]
    try:
        async with Runtime.open(cfg, isolate=True) as rt:
            # The restarted engine probes the worker's port before it loads: note a probe that
            # finds nobody there, so the worker comes back only while the engine waits for it.
            engine_module = sys.modules[type(rt.engine).__module__]
            probe, missed = engine_module.reachable, anyio.Event()

            async def reachable(endpoint: str) -> bool:
                up = await probe(endpoint)
                if not up:
                    missed.set()
                return up

            monkeypatch.setattr(engine_module, "reachable", reachable)
            # The reference runs the same four streams side by side: a batch of one and a batch
            # of four round differently on some CPUs, and the nearly flat tiny model shows it.
            first = [await rt.submit(p, max_tokens=120, temperature=0, ignore_eos=True) for p in prompts]
            ref = [list((await collect(h)).choices[0].tokens) for h in first]
            handles = [await rt.submit(p, max_tokens=120, temperature=0, ignore_eos=True) for p in prompts]
            tokens: list[list[int]] = [[] for _ in prompts]

            async def restart_worker() -> None:
                stop(procs[-1])
                await wait_until(lambda: rt.health() == "restarting", timeout_s=30)
                await missed.wait()  # the new engine found the worker gone and waits for it
                procs.append(await anyio.to_thread.run_sync(worker))

            async def read(i: int, tg) -> None:
                async for ev in handles[i]:
                    if isinstance(ev, Token):
                        tokens[i].append(ev.token)
                        if i == 0 and len(tokens[0]) == 40:
                            tg.start_soon(restart_worker)

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    for i in range(len(prompts)):
                        tg.start_soon(read, i, tg)
            assert rt.engine.counters.restarts >= 1 and rt.health() == "ok"
        assert tokens == [list(seq) for seq in ref]
    finally:
        for p in procs:
            stop(p)


async def test_rpc_fallback_local_loads_the_model_here_when_the_worker_stays_away(make_config):
    """--rpc-fallback local: the worker dies and does not come back; after --rpc-wait-s the new
    engine loads the whole model locally and the streams complete (the split and the local
    model decode alike, so greedy output is unchanged)."""
    import subprocess

    from conftest import free_port
    from test_rpc import LLAMACTOR, _wait_port, stop

    port = free_port()
    proc = subprocess.Popen(
        [*LLAMACTOR, "worker", "--port", str(port), "-t", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_port(port, proc)
        cfg = make_config(
            parallel=2,
            rpc_servers=(f"127.0.0.1:{port}",),
            devices=("RPC0", "CPU"),
            tensor_split=(1.0, 1.0),
            rpc_fallback="local",
            rpc_wait_s=1.0,
            engine_hooks=SLOW,
        )
        async with Runtime.open(cfg, isolate=True) as rt:
            ref = list(
                (await collect(await rt.submit(PROMPTS[2], max_tokens=80, temperature=0, ignore_eos=True)))
                .choices[0]
                .tokens
            )
            handle = await rt.submit(PROMPTS[2], max_tokens=80, temperature=0, ignore_eos=True)
            tokens: list[int] = []
            with anyio.fail_after(60):
                async for ev in handle:
                    if isinstance(ev, Token):
                        tokens.append(ev.token)
                        if len(tokens) == 20:
                            stop(proc)
            assert rt.engine._local and rt.health() == "ok"
        assert tokens == ref
    finally:
        stop(proc)


async def test_a_request_the_client_leaves_is_closed_on_both_ends(make_config):
    """A handle closed mid-stream (the client left) closes the task's own stream too, at once:
    before, the journal dropped it open and its garbage collection warned (ResourceWarning,
    which failed the fuzz run's teardown); the engine stops the request and the slot frees."""
    async with Runtime.open(make_config(parallel=2, engine_hooks=SLOW), isolate=True) as rt:
        handle = await rt.submit(PROMPTS[0], max_tokens=N_PREDICT, temperature=0, ignore_eos=True)
        async with handle:  # as the HTTP stream does when its client disconnects
            async for ev in handle:
                if isinstance(ev, Token):
                    break
        assert handle.task.id not in rt.engine.journal
        with pytest.raises(anyio.ClosedResourceError):
            handle.task.sink.send_nowait(
                Done(
                    index=0,
                    finish_reason="stop",
                    text="",
                    stopping_word="",
                    n_prompt=1,
                    n_cached=0,
                    n_predicted=0,
                    prompt_ms=0.0,
                    predicted_ms=0.0,
                    slot=0,
                )
            )
        await slots_free(rt)
        again = await collect(await rt.submit(PROMPTS[1], max_tokens=8, temperature=0, ignore_eos=True))
        assert len(again.choices[0].tokens) == 8


async def test_a_request_that_kills_the_engine_before_its_first_token_fails_alone(make_config):
    """A request that aborts the engine while its first token is sampled (a llama.cpp abort in
    its sampler chain) counts its deaths like a started one: it fails after --resume-max resumes
    with the message saying so, and the engine stays up. Before, it went back in after every
    restart until the restart budget was spent and the engine stayed down (503 for everyone):
    the fuzz run's side-by-side batches found such a request. The engine's blackbox says which
    request it died sampling, so a request streaming beside it is resumed every time and ends
    byte for byte as it does alone (its deaths were not its own)."""
    from llamactor.protocol.errors import LlamactorError

    poison = [77, 5, 6, 7, 8]  # enginehooks.AbortOnPoison.POISON first
    cfg = make_config(parallel=4, resume_max=2, engine_hooks=f"{HOOKS}:AbortOnPoison")
    async with Runtime.open(cfg, isolate=True) as rt:
        alone = await collect(await rt.submit(PROMPTS[1], max_tokens=120, temperature=0, ignore_eos=True))
        beside = await rt.submit(PROMPTS[1], max_tokens=120, temperature=0, ignore_eos=True)
        tokens: list[int] = []
        async for ev in beside:
            if isinstance(ev, Token):
                tokens.append(ev.token)
                if len(tokens) == 10:
                    with pytest.raises(LlamactorError, match="died 3 times while serving this request"):
                        await collect(await rt.submit(poison, max_tokens=8, temperature=0))
        assert tokens == list(alone.choices[0].tokens)
        assert rt.engine.counters.restarts == 3 and rt.engine.counters.resumed >= 3
        await wait_until(lambda: rt.health() == "ok", timeout_s=30)
        after = await collect(await rt.submit(PROMPTS[2], max_tokens=8, temperature=0, ignore_eos=True))
        assert len(after.choices[0].tokens) == 8


def test_blackbox_points_at_a_request_only_when_it_can(tmp_path):
    """engine.blackbox: a death inside sampling or a start points at those requests; inside a
    decode (any request of the batch) or outside llama.cpp's per-request calls, at none (every
    request counts it, as before). What the engine wrote survives it (a file both map)."""
    from llamactor.runtime.engine.blackbox import DECODE, SAMPLE, START, Blackbox

    api = Blackbox(tmp_path / "box", create=True)
    engine = Blackbox(tmp_path / "box", create=False)
    assert api.suspects() is None  # idle
    engine.enter(0, SAMPLE, 41)
    engine.enter(1, START, 7)
    assert api.suspects() == {41, 7}
    engine.enter(2, DECODE)
    assert api.suspects() is None  # a batch was in llama_decode: no single culprit
    engine.leave(2)
    engine.leave(0)
    assert api.suspects() == {7}
    del engine
    api.clear()
    assert api.suspects() is None


def test_the_engine_dies_with_the_api_process(make_config, tmp_path):
    """An API process killed outright (SIGKILL, the OOM killer) takes its engine with it, also
    an engine stuck inside a decode step (HangOnce: the 30th step never returns, so it would not
    see its socket close): the kernel tells it (PR_SET_PDEATHSIG) and it ends, removing the API
    process's temporary folder (socket, config, black box). Before, such an engine lived on with
    its memory and cores, and later the folder stayed behind."""
    import subprocess
    import sys
    import time

    cfg = make_config(parallel=2, engine_hooks=f"{HOOKS}:HangOnce")
    (tmp_path / "cfg.pickle").write_bytes(__import__("pickle").dumps(cfg))
    script = tmp_path / "app.py"
    script.write_text(
        "import pickle, sys, anyio\n"
        "from llamactor.runtime import Runtime\n"
        "async def main():\n"
        f"    cfg = pickle.loads(open({str(tmp_path / 'cfg.pickle')!r}, 'rb').read())\n"
        "    async with Runtime.open(cfg, isolate=True) as rt:\n"
        "        print(rt.engine.process.pid, rt.engine.folder, flush=True)\n"
        "        h = await rt.submit([5, 6, 7, 8], max_tokens=200, temperature=0, ignore_eos=True)\n"
        "        async for _ in h:\n"
        "            pass\n"
        "anyio.run(main)\n"
    )
    log = open(tmp_path / "app.log", "wb")  # noqa: SIM115 - closed in finally
    app = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=log,
        env={**os.environ, "LLAMACTOR_TEST_MARKS": str(tmp_path)},
    )
    try:
        assert app.stdout is not None
        line = b""
        while not line.split(b" ")[0].isdigit():  # the engine's own log lines share this stdout
            line = app.stdout.readline()
            assert line, (tmp_path / "app.log").read_text()[-3000:]
        pid, folder = line.decode().split()
        engine_pid = int(pid)
        assert Path(folder).is_dir()
        deadline = time.monotonic() + 60
        while not (tmp_path / "hung").exists():  # the request reaches the 30th step and hangs there
            assert time.monotonic() < deadline and app.poll() is None, (tmp_path / "app.log").read_text()[-3000:]
            time.sleep(0.02)
        os.kill(app.pid, signal.SIGKILL)
        app.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(engine_pid, 0)
            except ProcessLookupError:
                break
            with open(f"/proc/{engine_pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    break  # a zombie: dead, waiting for a reaper
            time.sleep(0.05)
        else:
            os.kill(engine_pid, signal.SIGKILL)
            raise AssertionError("the engine outlived its API process")
        assert not Path(folder).exists()  # its socket, config and black box went with it
    finally:
        if app.poll() is None:
            app.kill()
        app.wait(10)
        assert app.stdout is not None
        app.stdout.close()
        log.close()
