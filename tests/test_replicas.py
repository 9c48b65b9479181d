"""Replicas on Ray Serve: one ingress, two engines, routed by what each has cached; a stream
outlives the replica serving it (SIGKILL) byte for byte.

One local Ray instance serves the whole module (started and stopped here, through Ray's API);
each test deploys its own replica set on it. Skipped when Ray is not installed
(``pip install 'llamactor[cluster]'``; ``make test`` installs it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import anyio
import httpx
import pytest
from conftest import free_port, past_first_event, serve_runtime, wait_healthy, wait_until

from llamactor.protocol.errors import ConfigError
from llamactor.runtime import Runtime
from llamactor.runtime.service.raycluster import start_local_ray

ray = pytest.importorskip("ray", reason="the cluster extra is not installed")

# alone on the machine: Ray's processes, and routing that hangs on when each replica answers
pytestmark = [pytest.mark.slow, pytest.mark.serial]

HOOKS = str(Path(__file__).with_name("enginehooks.py"))
GATHER = str(Path(__file__).with_name("gatherpolicy.py")) + ":GatherEight"  # same batches in every run
SHARED = " ".join(f"shared{i}" for i in range(14))  # a common prefix (~70 tokens): the 8 go to one replica
PROMPTS = [f"{SHARED} stream {i}: " + "abc " * i for i in range(8)]
# prompt and answer stay under 256 positions: llama.cpp pads the attended KV in steps of 256,
# and a resumed stream (its replay a few tokens off its neighbours') must not cross one
N_PREDICT = 150
KILL_AT = 50


@pytest.fixture(scope="module")
def local_ray():
    """A Ray instance for this module's replica sets (they leave a running Ray alone)."""
    start_local_ray(ray, num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def _listening(pid: int) -> list[tuple[str, str]]:
    """The TCP addresses process ``pid`` and its descendants listen on (address, process name)."""
    import psutil  # Ray's own copy (ray/thirdparty_files, on the path once ray is imported)

    me = psutil.Process(pid)
    found = []
    for proc in [me, *me.children(recursive=True)]:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((f"{conn.laddr.ip}:{conn.laddr.port}", proc.name()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _replicas(make_config, **overrides):
    base = {"replicas": "2", "replica_cpus": 0.5, "parallel": 8, "n_ctx": 8 * 512}
    return make_config(**{**base, **overrides})


async def _sse(client: httpx.AsyncClient, prompt: str, on_piece=None) -> tuple[str, list[str]]:
    """One /completion stream: the replica that served it and every SSE data payload, in order."""
    # cache_prompt off: no prefix sharing, so the 8 prefill as one batch in every run
    body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "ignore_eos": True, "stream": True}
    body["cache_prompt"] = False
    pieces: list[str] = []
    async with client.stream("POST", "/completion", json=body) as r:
        assert r.status_code == 200, await r.aread()
        replica = r.headers["x-llamactor-replica"]
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                pieces.append(line)
                if on_piece is not None:
                    on_piece(len(pieces), replica)
    return replica, pieces


def _content(pieces: list[str]) -> list[str]:
    return [json.loads(p[6:])["content"] for p in pieces]


def test_unreachable_ray_address_is_a_config_error(make_config):
    async def main() -> None:
        async with Runtime.open(make_config(replicas="2", ray_address="127.0.0.1:1")):
            pass

    with pytest.raises(ConfigError, match="cannot reach the Ray cluster at --ray-address 127.0.0.1:1"):
        anyio.run(main)


_HEAD = """
import sys, ray
ray.init(num_cpus=2, include_dashboard=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test closes it
ray.shutdown()
"""


def test_serve_joins_a_ray_cluster_started_elsewhere(tiny_model, tmp_path):
    """``llamactor serve --ray-address`` runs its replicas on a Ray cluster another process started
    (with token authentication on, Ray's default), and leaves that cluster running."""
    head = subprocess.Popen([sys.executable, "-c", _HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = head.stdout.readline().strip()
        assert ":" in address, address
        port = free_port()
        log = tmp_path / "serve.log"
        argv = ["serve", "-m", str(tiny_model), "--port", str(port), "-c", "512", "-np", "1", "-t", "1"]
        with log.open("wb") as err:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "llamactor.runtime.cli",
                    *argv,
                    "--replicas",
                    "1",
                    "--replica-cpus",
                    "0.5",
                    "--ray-address",
                    address,
                ],
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                wait_healthy(proc, f"http://127.0.0.1:{port}/health", 90)
                r = client.post("/completion", json={"prompt": "hi", "n_predict": 4})
                assert r.status_code == 200 and r.headers["x-llamactor-replica"], r.text
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        assert proc.returncode == 0, log.read_text()[-3000:]
        assert head.poll() is None  # the cluster it joined is still up
    finally:
        head.stdin.close()
        head.wait(timeout=60)
        head.stdout.close()


def test_without_ray_the_error_names_the_extra(make_config, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed

    async def main() -> None:
        async with Runtime.open(make_config(replicas="2")):
            pass

    with pytest.raises(ConfigError, match=r"pip install 'llamactor\[cluster\]'"):
        anyio.run(main)


async def test_a_replica_that_cannot_start_fails_the_start_with_its_error(local_ray, make_config):
    """What a replica's engine said when it could not start is the startup error (once: Ray does
    not retry it for a minute)."""
    cfg = _replicas(make_config, replicas="1", engine_hooks=f"{HOOKS}:NoSuchHooks")
    with anyio.fail_after(60), pytest.raises(ConfigError, match="replicas did not start.*NoSuchHooks"):
        async with Runtime.open(cfg):
            pass


async def test_a_killed_replica_resumes_every_stream_byte_for_byte(local_ray, make_config):
    cfg = _replicas(make_config, engine_hooks=f"{HOOKS}:Slower", scheduler=GATHER)
    async with Runtime.open(cfg) as rt, serve_runtime(rt) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            ref: list[tuple[str, list[str]]] = [("", [])] * len(PROMPTS)

            async def run(i: int, on_piece=None) -> None:
                ref_or_out[i] = await _sse(client, PROMPTS[i], on_piece)

            ref_or_out = ref
            async with anyio.create_task_group() as tg:  # uninterrupted
                for i in range(len(PROMPTS)):
                    tg.start_soon(run, i)
            served = {replica for replica, _ in ref}
            assert len(served) == 1  # the shared prefix kept them together
            props = (await client.get("/props")).json()["engine"]
            pids = {r["id"]: r["pid"] for r in props["replicas"]}
            assert len(pids) == 2
            victims: list[int] = []  # the replica serving the streams (cache_prompt off: either may)

            out: list[tuple[str, list[str]]] = [("", [])] * len(PROMPTS)
            ref_or_out = out
            killed = anyio.Event()

            def kill(n: int, replica: str) -> None:
                if n == KILL_AT and not killed.is_set():
                    assert pids[replica] > 1  # never a process group
                    victims.append(pids[replica])
                    os.kill(pids[replica], signal.SIGKILL)
                    killed.set()

            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(run, i, kill if i == 0 else None)
            assert killed.is_set()
            victim = victims[0]
            assert len({replica for replica, _ in out}) == 1  # the burst went to one replica
            for i in range(len(PROMPTS)):
                assert _content(out[i][1]) == _content(ref[i][1]), f"stream {i}"  # no gap, no duplicate
                assert out[i][1][-1] == ref[i][1][-1] or json.loads(out[i][1][-1][6:])["stop"]
            with pytest.raises(ProcessLookupError):  # nothing of the replica outlives it
                os.kill(victim, 0)
            metrics = (await client.get("/metrics")).text
            resumed = [ln for ln in metrics.splitlines() if ln.startswith("llamactor:requests_resumed_total")]
            assert resumed == ["llamactor:requests_resumed_total 8.0"], resumed

            async def two_up() -> bool:
                replicas = (await client.get("/props")).json()["engine"]["replicas"]
                return len(replicas) == 2 and victim not in {r["pid"] for r in replicas}

            with anyio.fail_after(60):  # Ray Serve starts a replica in the dead one's place
                while not await two_up():
                    await anyio.sleep(0.2)
            assert (await client.get("/health")).status_code == 200


STREAMS = {  # one stream in each streaming API: its path, its body, where a text delta is
    "native": ("/completion", {"prompt": "once upon a time", "n_predict": 60, "ignore_eos": True}),
    "completions": ("/v1/completions", {"prompt": "once upon a time", "max_tokens": 60, "ignore_eos": True}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tell a story"}], "max_tokens": 60}),
    "messages": (
        "/v1/messages",
        {"model": "m", "max_tokens": 60, "messages": [{"role": "user", "content": "tell a story"}]},
    ),
    "responses": ("/v1/responses", {"input": "tell a story", "max_output_tokens": 60}),
}


def _delta(payload: dict) -> str | None:
    """The text a streamed event adds, in any of the APIs (None: an event without text)."""
    if "content" in payload and isinstance(payload["content"], str):  # native
        return payload["content"]
    choices = payload.get("choices")
    if choices:
        c = choices[0]
        return c.get("text", (c.get("delta") or {}).get("content"))
    delta = payload.get("delta")
    if isinstance(delta, dict):  # Anthropic content_block_delta
        return delta.get("text")
    if payload.get("type") == "response.output_text.delta":
        return payload.get("delta")
    return None


async def _api_stream(client: httpx.AsyncClient, api: str, kill=None) -> tuple[str, list[str]]:
    path, body = STREAMS[api]
    deltas: list[str] = []
    async with client.stream("POST", path, json={**body, "stream": True, "temperature": 0}) as r:
        assert r.status_code == 200, await r.aread()
        replica = r.headers["x-llamactor-replica"]
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text = _delta(json.loads(line[6:]))
                if text:
                    deltas.append(text)
                    if kill is not None:
                        kill(len(deltas), replica)
    return replica, deltas


def _kill_at(at: int, pids: dict[str, int], killed: list[int], n: int, replica: str) -> None:
    """SIGKILL the replica serving a stream once it has ``at`` deltas."""
    if n == at and not killed:
        pid = pids[replica]
        assert pid > 1  # never a process group
        killed.append(pid)
        os.kill(pid, signal.SIGKILL)


async def test_one_stream_in_each_api_survives_its_replica(local_ray, make_config):
    """Alone on its replica (a batch of one, whatever happens), each API's stream is killed
    mid-way and goes on on the other replica: the same text deltas as uninterrupted."""
    cfg = _replicas(make_config, engine_hooks=f"{HOOKS}:Slower", parallel=2, n_ctx=2 * 512)
    async with Runtime.open(cfg) as rt, serve_runtime(rt) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:

            async def pids() -> dict[str, int]:
                replicas = (await client.get("/props")).json()["engine"]["replicas"]
                return {r["id"]: r["pid"] for r in replicas}

            for api in STREAMS:
                with anyio.fail_after(60):  # both replicas up (the last one killed is back)
                    while len(await pids()) < 2:
                        await anyio.sleep(0.2)
                _, ref = await _api_stream(client, api)
                killed: list[int] = []
                _, out = await _api_stream(client, api, partial(_kill_at, 15, await pids(), killed))
                assert killed, api
                assert out == ref, api  # no gap, no duplicate


def _family_prompt(f: int, q: int) -> str:
    system = " ".join(f"family{f} rule{k}" for k in range(80))  # about 1,000 tokens
    return f"{system}\nquestion {q}: what is {q} + {f}?"


async def _families(client: httpx.AsyncClient, rounds: int) -> tuple[dict[int, set[str]], int]:
    """Three families interleaved, one request at a time: who served each, prompt tokens processed."""
    served: dict[int, set[str]] = {0: set(), 1: set(), 2: set()}
    processed = 0
    for q in range(rounds):
        for f in range(3):
            r = await client.post(
                "/completion", json={"prompt": _family_prompt(f, q), "n_predict": 2, "temperature": 0}
            )
            assert r.status_code == 200, r.text
            served[f].add(r.headers["x-llamactor-replica"])
            processed += r.json()["timings"]["prompt_n"]
    return served, processed


async def test_families_stay_on_their_replica_and_prefill_less_than_power_of_two(local_ray, make_config):
    """Each family of requests sharing a long system prompt is served by one replica; the prompt
    tokens processed are at most 0.4x those of power-of-two routing over the same replicas (two
    slots each, no RAM cache: what a replica holds is what its slots hold)."""
    sizes = {"parallel": 2, "n_ctx": 2 * 2048, "cache_ram_mib": 0}
    results = {}
    for router in ("cache", "pow2"):
        async with Runtime.open(_replicas(make_config, replica_router=router, **sizes)) as rt, serve_runtime(rt) as url:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                # the cache router prefills each family once; power of two misses at random
                results[router] = await _families(client, rounds=16)
    served, processed = results["cache"]
    assert all(len(s) == 1 for s in served.values()), served
    assert processed <= 0.4 * results["pow2"][1], (processed, results["pow2"][1])


async def test_later_turns_of_a_conversation_return_to_its_replica(local_ray, make_config):
    async with Runtime.open(_replicas(make_config, parallel=4, n_ctx=4 * 1024)) as rt, serve_runtime(rt) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            hits = later = 0

            async def conversation(c: int) -> None:
                nonlocal hits, later
                messages = [{"role": "system", "content": f"You are assistant number {c}. " + "Be brief. " * 40}]
                home = ""
                for turn in range(4):
                    messages.append({"role": "user", "content": f"turn {turn} of conversation {c}"})
                    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
                    r = await client.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    replica = r.headers["x-llamactor-replica"]
                    if turn == 0:
                        home = replica
                    else:
                        later += 1
                        hits += replica == home
                    messages.append(r.json()["choices"][0]["message"])

            async with anyio.create_task_group() as tg:
                for c in range(4):
                    tg.start_soon(conversation, c)
    assert later == 12 and hits / later >= 0.95, (hits, later)


async def test_replica_set_serves_every_api_and_reports_its_replicas(local_ray, make_config):
    cfg = _replicas(make_config, parallel=2, n_ctx=2 * 512, embedding=True, pooling="mean")
    async with Runtime.open(cfg) as rt, serve_runtime(rt) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            r = await client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            )
            assert r.status_code == 200 and r.headers["x-llamactor-replica"]
            r = await client.post(
                "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            )
            assert r.status_code == 200 and r.json()["type"] == "message"
            slots = (await client.get("/slots")).json()
            assert [s["id"] for s in slots] == [0, 1, 2, 3]
            props = (await client.get("/props")).json()["engine"]
            assert len(props["replicas"]) == 2
            # every port the local Ray opened (GCS, raylet, workers, the replicas, the agents) is on loopback
            listening = _listening(os.getpid())
            assert len(listening) >= 5, listening
            assert [(a, name) for a, name in listening if not a.startswith(("127.", "::ffff:127.", "::1:"))] == []
            assert all(r["pid"] > 0 and r["engine_pid"] == r["pid"] and r["state"] == "up" for r in props["replicas"])
            text = (await client.get("/metrics")).text
            assert 'replica="' in text and "llamactor:replicas_up 2.0" in text
            r = await client.post("/completion", json={"prompt": "hi", "n_predict": "many"})
            assert r.status_code == 400  # a bad field: refused at the ingress, before any replica
            r = await client.post("/v1/embeddings", json={"input": ["one text", "another", "one text"]})
            assert r.status_code == 200, r.text
            vectors = [d["embedding"] for d in r.json()["data"]]
            assert len(vectors) == 3 and vectors[0] == vectors[2] != vectors[1] and any(vectors[1])
            r = await client.post("/slots/3?action=erase")  # the second replica's second slot
            assert r.status_code == 200 and r.json()["id_slot"] == 3, r.text
            assert (await client.post("/slots/4?action=erase")).status_code == 404
            # a client that leaves mid-stream: its request ends on its replica too
            body = {"prompt": "a long one", "n_predict": 400, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/completion", json=body) as r:
                await past_first_event(r)
            await wait_until(lambda: rt.in_flight() == 0)
            slots = (await client.get("/slots")).json()
            await wait_until(lambda: slots is not None)
            for _ in range(50):
                slots = (await client.get("/slots")).json()
                if not any(s["is_processing"] for s in slots):
                    break
                await anyio.sleep(0.1)
            assert not any(s["is_processing"] for s in slots), slots
        done = await rt.complete("the embedding API", max_tokens=4, temperature=0)  # as one runtime
        assert done.choices[0].finish_reason == "length" and done.n_predicted == 4
        await wait_until(lambda: rt.in_flight() == 0)


def _prompt_tokens(metrics: str) -> float:
    """Prompt tokens processed, summed over the replicas (``llamacpp:prompt_tokens_total``)."""
    return sum(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("llamacpp:prompt_tokens_total"))


async def test_a_drained_replica_moves_its_streams_with_their_kv(local_ray, make_config):
    """POST /replicas/{id}/drain mid-stream: every stream on that replica goes on on the other
    one from its KV (exported, imported into a free slot): all end with every token, none
    prefilled again, and the drained replica gets no new request."""
    cfg = _replicas(make_config, engine_hooks=f"{HOOKS}:Slower")
    async with Runtime.open(cfg) as rt, serve_runtime(rt) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            before = _prompt_tokens((await client.get("/metrics")).text)
            out: list[tuple[str, list[str]]] = [("", [])] * len(PROMPTS)
            stamps: list[list[float]] = [[] for _ in PROMPTS]
            reached = anyio.Event()
            source: list[str] = []
            report: dict = {}

            def piece(i: int, n: int, replica: str) -> None:
                stamps[i].append(anyio.current_time())
                if i == 0 and n == KILL_AT:
                    source.append(replica)
                    reached.set()

            async def run(i: int) -> None:
                out[i] = await _sse(client, PROMPTS[i], partial(piece, i))

            async def drain() -> None:
                await reached.wait()
                r = await client.post(f"/replicas/{source[0]}/drain")
                assert r.status_code == 200, r.text
                report.update(r.json())

            async with anyio.create_task_group() as tg:
                tg.start_soon(drain)
                for i in range(len(PROMPTS)):
                    tg.start_soon(run, i)
            assert {replica for replica, _ in out} == {source[0]}  # the shared prefix kept them together
            for i, (_, pieces) in enumerate(out):
                payloads = [json.loads(p[6:]) for p in pieces]
                assert payloads[-1]["stop"] and payloads[-1]["tokens_predicted"] == N_PREDICT, f"stream {i}"
                assert len([p for p in payloads if p["content"]]) <= N_PREDICT  # no duplicate
            assert report["streams"] == len(PROMPTS) and report["moved_with_kv"] == len(PROMPTS), report
            assert report["replayed"] == 0 and report["history_tokens_moved"] >= len(PROMPTS) * KILL_AT
            processed = _prompt_tokens((await client.get("/metrics")).text) - before
            prompts = sum([len(await rt.tokenize(p)) for p in PROMPTS])
            # the prompts once (on the drained replica) and one token a stream at the move, not
            # each stream's prompt and history again (the replay path's prefill)
            assert processed <= prompts + len(PROMPTS), (processed, prompts)
            gaps = [max(b - a for a, b in zip(s, s[1:])) for s in stamps]
            print(f"drain: {report}, prompt tokens {processed:g} (prompts {prompts}), max gap {max(gaps):.3f} s")
            # the drained replica gets no new request
            r = await client.post("/completion", json={"prompt": "after the drain", "n_predict": 4})
            assert r.status_code == 200 and r.headers["x-llamactor-replica"] != source[0]
            assert (await client.post("/replicas/nope/drain")).status_code == 404


async def test_a_prefix_cached_on_a_busy_replica_is_pulled_not_prefilled(local_ray, make_config):
    """One slot a replica: a long stream holds replica A; a request sharing its long prefix goes
    to B, which imports A's KV (exported from the busy slot) instead of prefilling the prefix,
    and answers as a server that prefilled it all (same greedy tokens)."""
    system = " ".join(f"system{i}" for i in range(100))
    first, second = f"{system} first question", f"{system} the second one"
    cfg = _replicas(make_config, parallel=1, n_ctx=1024, replica_pull="always", engine_hooks=f"{HOOKS}:Slower")
    greedy = {"temperature": 0, "ignore_eos": True, "cache_prompt": True}
    async with Runtime.open(make_config(parallel=1, n_ctx=1024)) as alone:
        expected = (await alone.complete(second, max_tokens=8, **greedy)).choices[0].tokens
        n_system = len(await alone.tokenize(system))
    async with Runtime.open(cfg) as rt, serve_runtime(rt) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            body = {"prompt": first, "n_predict": 300, "stream": True, **greedy}
            async with client.stream("POST", "/completion", json=body) as stream:
                await past_first_event(stream)
                holder = stream.headers["x-llamactor-replica"]
                loads = rt.engine._router().loads  # the router has heard that A's one slot is busy
                await wait_until(lambda: holder in loads and loads[holder].full(), timeout_s=30)
                r = await client.post("/completion", json={"prompt": second, "n_predict": 8, **greedy})
                assert r.status_code == 200, r.text
                assert r.headers["x-llamactor-replica"] != holder
                timings = r.json()["timings"]
                assert timings["cache_n"] >= n_system - 16, timings  # the prefix came from A
                assert timings["prompt_n"] < n_system // 4, timings
                assert tuple(r.json()["tokens"]) == tuple(expected)
            assert rt.engine.pulls == 1
            assert "llamactor:kv_pulls_total 1.0" in (await client.get("/metrics")).text


async def test_prefill_and_decode_apart_hand_each_request_over_with_its_kv(local_ray, make_config):
    """--prefill-replicas 1 of 2: a request's prompt is prefilled on the prefill replica, which
    gives its first token; its KV then goes to the decode replica, which gives the rest (one
    token decoded there again, nothing prefilled): the tokens of a lone server, for each of
    several requests at once."""
    prompts = [f"{SHARED} request {i}: " + "xyz " * i for i in range(4)]
    greedy = {"temperature": 0, "ignore_eos": True}
    async with Runtime.open(make_config(parallel=4, n_ctx=4 * 512)) as alone:
        expected = [(await alone.complete(p, max_tokens=24, **greedy)).choices[0].tokens for p in prompts]
    cfg = _replicas(make_config, parallel=4, n_ctx=4 * 512, prefill_replicas=1)
    async with Runtime.open(cfg) as rt, serve_runtime(rt) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            one = await client.post("/completion", json={"prompt": prompts[0], "n_predict": 24, **greedy})
            assert one.status_code == 200, one.text
            assert tuple(one.json()["tokens"]) == tuple(expected[0])
            assert one.json()["tokens_predicted"] == 24
            outs: list[dict] = [{}] * len(prompts)

            async def run(i: int) -> None:
                r = await client.post("/completion", json={"prompt": prompts[i], "n_predict": 24, **greedy})
                assert r.status_code == 200, r.text
                outs[i] = r.json()

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(run, i)
            assert all(o["tokens_predicted"] == 24 and len(o["tokens"]) == 24 for o in outs)
            assert rt.engine.handovers == 1 + len(prompts)
            short = await client.post("/completion", json={"prompt": prompts[1], "n_predict": 1, **greedy})
            assert short.json()["tokens"] == list(expected[1][:1])  # one token: the prefill replica's alone
            assert rt.engine.handovers == 1 + len(prompts)
    with pytest.raises(ConfigError, match="--prefill-replicas"):
        async with Runtime.open(_replicas(make_config, replicas="1", prefill_replicas=1)):
            pass


async def test_a_replica_ray_serve_stops_moves_its_streams_with_their_kv(local_ray, make_config):
    """POST /replicas/scale from 2 to 1 mid-stream: Ray Serve stops one replica gracefully; its
    streams move to the other with their KV before it goes (nothing prefilled again), every
    stream ends with every token, and the set goes on with one replica. A count out of range
    and a set that autoscales are refused."""
    families = [" ".join(f"family{f} word{k}" for k in range(30)) for f in range(2)]
    prompts = [f"{families[i % 2]} stream {i}: " + "abc " * i for i in range(8)]
    cfg = _replicas(make_config, engine_hooks=f"{HOOKS}:Slower")
    async with Runtime.open(cfg) as rt, serve_runtime(rt) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            before = _prompt_tokens((await client.get("/metrics")).text)
            out: list[tuple[str, list[str]]] = [("", [])] * len(prompts)
            reached = anyio.Event()

            def piece(i: int, n: int, replica: str) -> None:
                if i == 0 and n == KILL_AT:
                    reached.set()

            async def run(i: int) -> None:
                out[i] = await _sse(client, prompts[i], partial(piece, i))

            async def scale() -> None:
                await reached.wait()
                r = await client.post("/replicas/scale", json={"replicas": 1})
                assert r.status_code == 200 and r.json() == {"replicas": 1, "was": 2}, r.text

            async with anyio.create_task_group() as tg:
                tg.start_soon(scale)
                for i in range(len(prompts)):
                    tg.start_soon(run, i)
            for i, (_, pieces) in enumerate(out):
                payloads = [json.loads(p[6:]) for p in pieces]
                assert payloads[-1]["stop"] and payloads[-1]["tokens_predicted"] == N_PREDICT, f"stream {i}"
                assert len([p for p in payloads if p["content"]]) <= N_PREDICT  # no duplicate
            await wait_until(lambda: len(rt.engine.stopped_drains) == 1, timeout_s=30)
            report = rt.engine.stopped_drains[0]
            on_it = sum(replica == report["replica"] for replica, _ in out)
            print(f"scaled down: {report}, streams first served there {on_it}")
            assert report["streams"] == on_it >= 1 and report["moved_with_kv"] == on_it, report
            await wait_until(lambda: len(rt.engine._replica_ids()) == 1, timeout_s=60)
            # the replica left counts its own prompts and one token a moved stream, not the
            # moved streams' prompts and histories again (the replay path's prefill)
            processed = _prompt_tokens((await client.get("/metrics")).text)
            kept = sum(
                [len(await rt.tokenize(p)) for (replica, _), p in zip(out, prompts) if replica != report["replica"]]
            )
            assert before == 0 and processed <= kept + on_it, (processed, kept)
            assert f"llamactor:streams_moved_total {float(on_it)}" in (await client.get("/metrics")).text
            r = await client.post("/completion", json={"prompt": "after the scale", "n_predict": 4})
            assert r.status_code == 200 and r.headers["x-llamactor-replica"] != report["replica"]
            for bad in (0, 257, "two", True):
                r = await client.post("/replicas/scale", json={"replicas": bad})
                assert r.status_code == 400, r.text
