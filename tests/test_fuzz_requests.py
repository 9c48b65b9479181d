"""Property-based fuzzing of the request surface against a running server.

Every field of ``/completion``, ``/v1/completions`` and ``/v1/chat/completions`` is drawn from
valid values, edge values and wrong types, in combination (n, stop, logprobs, penalties, DRY,
XTC, mirostat, grammar/json_schema (repetition counts about and past the caps among them),
logit_bias, seed, id_slot, stream, prompts past the cap per request), and sent to a real
server (Hypercorn + the runtime on the tiny model, in a thread of its own). Properties:

- every answer is 200 or a 4xx with an OpenAI-shaped error body (no 5xx: nothing here is an
  engine fault);
- every request ends within a deadline, streaming ones included (the stream is read to its end);
- no group restarts, and afterwards /health is 200 and a plain request succeeds.

``make test`` runs ``LLAMACTOR_FUZZ_EXAMPLES`` examples (default 150); set it higher for a
longer hunt. The number run is printed and checked.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from conftest import TEST_THREADS, serve_runtime
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamactor.runtime import Runtime, RuntimeConfig

pytestmark = pytest.mark.slow  # hypothesis fuzzing against live servers

EXAMPLES = int(os.environ.get("LLAMACTOR_FUZZ_EXAMPLES", "150"))
DEADLINE_S = 30.0
PARALLEL = 4
N_CTX = 2048  # 512 tokens per slot: a fuzzed unlimited n_predict still ends quickly

# ---- value strategies -------------------------------------------------------------------

junk = st.one_of(
    st.none(),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.booleans(),
)
edge_floats = st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, -1e30, 2.0, 100.0])
floats = st.one_of(edge_floats, st.floats(-5, 5, allow_nan=False), st.floats(allow_nan=False, allow_infinity=False))
small_ints = st.one_of(st.sampled_from([-2, -1, 0, 1, 2, 3, 64, 2**31 - 1, 2**31, -(2**31)]), st.integers(-10, 100))


def weighted(common: st.SearchStrategy, rare: st.SearchStrategy, p_rare: float) -> st.SearchStrategy:
    """``rare`` with probability about ``p_rare``, else ``common`` (one_of does not weight)."""
    return st.floats(0, 1).flatmap(lambda u: rare if u < p_rare else common)


def maybe_junk(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly the field's own type, rarely a wrong one (so most requests reach the engine)."""
    return weighted(valid, junk, 1 / 12)


# Drawn once per example (shared by every field of it, and by every request of a batch): whether
# edge values may appear at all. Half the examples are in range throughout, so they reach the
# engine (one edge among ~20 fields would make most of them a 400).
edges_on = st.shared(st.booleans(), key="edges")


def usually(good: st.SearchStrategy, edge: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly values in the field's range, sometimes an edge or out-of-range value."""
    return edges_on.flatmap(lambda on: weighted(good, edge, 1 / 15) if on else good)


unit = usually(st.floats(0, 1), floats)
positive = usually(st.floats(0.01, 3), floats)
counts = usually(st.integers(0, 128), small_ints)


text_prompts = st.one_of(
    st.sampled_from(["hello", "a b c", "é ü 中文 🙂", "\n\n", " ", "x" * 200]), st.text(max_size=40)
)
token_prompts = st.lists(st.one_of(st.integers(0, 459), st.sampled_from([-1, 460, 10**9])), min_size=0, max_size=20)
prompts = st.one_of(
    text_prompts,
    text_prompts,
    token_prompts,
    st.lists(text_prompts, min_size=1, max_size=2),
    st.just(["p"] * 129),  # one prompt over the cap of prompts per request
)
stops = st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=6), max_size=20))
grammars = st.sampled_from(
    ["", 'root ::= [a-z ]+ "."', 'root ::= "yes" | "no"', "root ::= (", "root ::= x", "root ::= [^\\x00]*"]
)
schemas = st.sampled_from(
    [
        None,
        {},
        {"type": "object"},
        {"type": "string", "maxLength": 5},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "bogus"},
        {"$ref": "#/nowhere"},
    ]
)
# repetition counts about the cap (2000 each, 20000 in all) and past it, and a remote $ref
repetitions = st.sampled_from([0, 1, 1999, 2000, 2001, 20_001, 10**9])
schemas = st.one_of(
    schemas,
    repetitions.map(lambda n: {"type": "string", "minLength": n}),
    repetitions.map(lambda n: {"type": "array", "items": {"type": "integer"}, "maxItems": n}),
    repetitions.map(lambda n: {"type": "string", "pattern": f"^a{{{n}}}$"}),
    repetitions.map(
        lambda n: {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": n} for i in range(11)}}
    ),
    st.just({"$ref": "https://example.invalid/schema.json"}),
)
logit_biases = st.one_of(
    st.none(),
    st.lists(st.tuples(st.integers(-3, 470), st.one_of(floats, st.just(False))).map(list), max_size=5),
    st.dictionaries(st.integers(-3, 470).map(str), floats, max_size=5),
    st.dictionaries(st.text(max_size=4), floats, max_size=3),  # texts, each of their tokens biased
)
samplers = st.one_of(
    st.none(),
    st.text(alphabet="dkypsmtxeiz", max_size=6),
    st.lists(
        st.sampled_from(["top_k", "top-p", "temp", "typ", "min_p", "xtc", "dry", "penalties", "top_n_sigma", "bogus"]),
        max_size=6,
    ),
)

SAMPLING = {
    "temperature": usually(st.floats(0, 2), floats),
    "top_k": counts,
    "top_p": unit,
    "min_p": unit,
    "typical_p": unit,
    "top_n_sigma": usually(st.floats(-1, 3), floats),
    "xtc_probability": unit,
    "xtc_threshold": unit,
    "dynatemp_range": usually(st.floats(0, 1), floats),
    "dynatemp_exponent": positive,
    "repeat_penalty": positive,
    "repeat_last_n": usually(st.integers(-1, 128), small_ints),
    "presence_penalty": usually(st.floats(-2, 2), floats),
    "frequency_penalty": usually(st.floats(-2, 2), floats),
    "dry_multiplier": usually(st.floats(0, 3), floats),
    "dry_base": usually(st.floats(0.5, 3), floats),
    "dry_allowed_length": counts,
    "dry_penalty_last_n": usually(st.integers(-1, 128), small_ints),
    "dry_sequence_breakers": usually(
        st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4), st.lists(st.text(max_size=45), max_size=4)
    ),
    "mirostat": usually(st.integers(0, 2), st.integers(-1, 3)),
    "mirostat_tau": positive,
    "mirostat_eta": positive,
    "adaptive_target": usually(st.floats(0, 1), floats),
    "adaptive_decay": usually(st.floats(0, 0.99), floats),
    "min_keep": counts,
    "samplers": samplers,
    "seed": st.one_of(small_ints, st.just(2**32 - 1), st.just(2**32)),
    "logit_bias": logit_biases,
    "grammar": usually(st.just(""), grammars),
    "stop": stops,
    "stream": st.booleans(),
    "n": usually(st.integers(1, 2), st.integers(-1, 6)),
    "cache_prompt": st.booleans(),
    "id_slot": usually(st.just(-1), st.integers(-2, PARALLEL + 1)),
    "ignore_eos": st.booleans(),
    "return_progress": st.booleans(),
    "timings_per_token": st.booleans(),
    "verbose": st.one_of(st.none(), st.booleans()),
    "n_keep": usually(st.integers(-1, 64), small_ints),
    "n_discard": usually(st.integers(0, 64), small_ints),
    "n_cache_reuse": usually(st.integers(0, 32), small_ints),
    # llama-server's streaming knobs (pings only past 30 s: fuzzed streams are short)
    "sse_ping_interval": st.one_of(st.none(), st.sampled_from([-1, 0, 30]), st.just("x")),
    "t_max_predict_ms": usually(st.integers(-1, 50), small_ints),
    "post_sampling_probs": st.booleans(),
    # LoRA: the live server loads one adapter (id 0); other ids, bad scales and shapes are 400s
    "lora": st.one_of(
        st.none(),
        st.just([]),
        st.lists(
            st.fixed_dictionaries(
                {"id": usually(st.just(0), st.integers(-1, 2))}, optional={"scale": usually(st.floats(0, 2), floats)}
            ),
            max_size=2,
        ),
        st.just({"id": 0, "scale": 1.0}),
    ),
    # speculation: the live server does not speculate: the fields are checked and otherwise change nothing
    "speculative.n_max": usually(st.integers(0, 16), small_ints),
    "speculative.n_min": usually(st.integers(0, 4), small_ints),
    "speculative.p_min": usually(st.floats(0, 1), floats),
    # scheduling: any int priority is valid; tags are a string map
    "priority": usually(st.integers(-3, 3), small_ints),
    "tags": st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3), junk),
}
NATIVE = {
    **SAMPLING,
    "prompt": prompts,
    "n_predict": usually(st.integers(0, 24), st.sampled_from([-2, -1, 10**9])),
    "n_probs": usually(st.integers(0, 5), st.integers(-1, 25)),
    "json_schema": schemas,
}
OPENAI = {
    **SAMPLING,
    "max_tokens": usually(st.integers(0, 24), st.sampled_from([None, -1, 10**9])),
    "model": st.text(max_size=5),
    "response_format": st.one_of(
        st.none(),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
            optional={"json_schema": st.one_of(schemas.map(lambda s: {"name": "x", "schema": s}), st.just({}))},
        ),
    ),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "json_schema": schemas,  # llama-server's field, beside response_format
}
COMPLETIONS = {
    **OPENAI,
    "prompt": prompts,
    "logprobs": st.one_of(st.none(), st.integers(-1, 25)),
    "echo": st.booleans(),
}
calls = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.sampled_from(["c1", "c2"]),
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": st.sampled_from(["f", "g"]), "arguments": st.sampled_from(["{}", '{"a": 1}', "{bad", "[1]"])}
            ),
        }
    ),
    max_size=2,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "bogus"]),
            "content": st.one_of(
                text_prompts,
                st.none(),
                st.lists(
                    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": text_prompts}),
                    max_size=2,
                ),
            ),
        },
        optional={
            "tool_calls": calls,
            "tool_call_id": st.sampled_from(["c1", "zz"]),
            "reasoning_content": text_prompts,
        },
    ),
    min_size=0,
    max_size=3,
)
# tool-call and reasoning fields: tools with schemas (some invalid), tool_choice, reasoning options.
tool_defs = st.lists(
    st.fixed_dictionaries(
        {
            "type": usually(st.just("function"), st.sampled_from(["bogus", ""])),
            "function": st.fixed_dictionaries(
                {"name": usually(st.sampled_from(["f", "g", "get_x"]), st.sampled_from(["", "a b"]))},
                optional={"description": st.text(max_size=8), "parameters": schemas},
            ),
        }
    ),
    max_size=3,
)
tool_choices = st.one_of(
    st.none(),
    st.sampled_from(["none", "auto", "required", "bogus"]),
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "nope"])})}
    ),
)
CHAT = {
    **OPENAI,
    "messages": messages,
    "max_completion_tokens": st.one_of(st.none(), st.integers(-1, 40)),
    "logprobs": st.booleans(),
    "top_logprobs": st.one_of(st.none(), st.integers(-1, 25)),
    "n_probs": st.integers(-1, 25),
    "tools": st.one_of(st.none(), tool_defs),
    "tool_choice": tool_choices,
    "parallel_tool_calls": st.one_of(st.none(), st.booleans()),
    "reasoning_format": st.sampled_from(["none", "deepseek", "deepseek-legacy", "auto", "bogus"]),
    "reasoning_effort": st.sampled_from(["none", "low", "high", "bogus"]),
    "chat_template_kwargs": st.one_of(
        st.none(),
        st.dictionaries(
            st.sampled_from(["enable_thinking", "custom", "messages", "not ok"]),
            st.one_of(st.booleans(), st.integers()),
            max_size=2,
        ),
    ),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.one_of(st.none(), st.booleans()),
}


def body(fields: dict[str, st.SearchStrategy], required: tuple[str, ...], *, junky: bool) -> st.SearchStrategy:
    """A request body: the required fields and any subset of the others; ``junky`` bodies may
    carry values of the wrong type anywhere (the well-typed ones reach the engine)."""
    wrap = maybe_junk if junky else (lambda v: v)
    req = {k: wrap(fields[k]) for k in required}
    opt = {k: wrap(v) for k, v in fields.items() if k not in required}
    return st.fixed_dictionaries(req, optional=opt)


ENDPOINTS = (
    ("/completion", NATIVE, ("prompt",)),
    ("/v1/completions", COMPLETIONS, ("prompt",)),
    ("/v1/chat/completions", CHAT, ("messages",)),
)
requests = st.one_of(
    *[st.tuples(st.just(path), body(fields, req, junky=False)) for path, fields, req in ENDPOINTS],
    *[st.tuples(st.just(path), body(fields, req, junky=False)) for path, fields, req in ENDPOINTS],
    *[st.tuples(st.just(path), body(fields, req, junky=True)) for path, fields, req in ENDPOINTS],
)

# ---- the server, in a thread with its own event loop -------------------------------------


class LiveServer:
    """The runtime on ``config`` served over HTTP from a thread of its own (a sync test can call it)."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.url = ""
        self.rt: Runtime | None = None
        self._ready = threading.Event()
        self._stop: anyio.Event | None = None
        self._portal_token: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._stop = anyio.Event()
            self._portal_token = anyio.lowlevel.current_token()
            async with Runtime.open(self.config) as rt, serve_runtime(rt) as url:
                self.rt, self.url = rt, url
                self._ready.set()
                await self._stop.wait()

        try:
            anyio.run(main)
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    def __enter__(self) -> LiveServer:
        self._thread.start()
        assert self._ready.wait(60), "server did not start"
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        anyio.from_thread.run_sync(self._stop.set, token=self._portal_token)
        self._thread.join(30)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from tinylora import write_tiny_lora
    from tinymodel import write_tiny_model

    folder = tmp_path_factory.mktemp("fuzz")
    config = RuntimeConfig(
        model=write_tiny_model(folder / "tiny.gguf"),
        n_ctx=N_CTX,
        parallel=PARALLEL,
        threads=TEST_THREADS,
        n_batch=512,
        n_ubatch=512,
        lora=((str(write_tiny_lora(folder / "lora.gguf")), 1.0),),
        isolate=True,
        endpoint_metrics=True,
    )  # every request field crosses the engine link
    with LiveServer(config) as server:
        yield server


def _check_error_shape(r: httpx.Response) -> None:
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}, err
    assert err["code"] == r.status_code and isinstance(err["message"], str) and err["message"]


def _read_stream(r: httpx.Response, path: str) -> None:
    """Read an SSE stream to its end: every frame JSON (or [DONE]); an error frame must be a 4xx."""
    saw_done = saw_final = False
    for line in r.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            saw_done = True
            continue
        frame = json.loads(data)
        if "error" in frame:
            assert 400 <= frame["error"]["code"] < 500, frame
            return
        if path == "/completion":
            saw_final = saw_final or frame.get("stop", False)
        else:
            saw_final = saw_final or any(c.get("finish_reason") for c in frame.get("choices", []))
    assert saw_done if path != "/completion" else saw_final


class Counter:
    n = 0
    statuses: dict[int, int] = {}  # (threads add to it: a lost count here or there does not matter)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(request=requests)
def test_fuzz_request_surface(live: LiveServer, request: tuple[str, dict[str, Any]]) -> None:
    _send(live, *request)
    assert live.rt is not None and live.rt.engine.counters.restarts == 0, request  # the engine never died


# Well-typed bodies only: they reach the engine, where requests meet in one batch.
well_typed = st.one_of(*[st.tuples(st.just(path), body(fields, req, junky=False)) for path, fields, req in ENDPOINTS])


@settings(
    max_examples=max(EXAMPLES // 4, 10),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(batch=st.lists(well_typed, min_size=2, max_size=PARALLEL + 2))
def test_fuzz_requests_side_by_side(live: LiveServer, batch: list[tuple[str, dict[str, Any]]]) -> None:
    """The same properties with up to PARALLEL + 2 requests at once: their sampling chains,
    grammars, adapters, n children, pinned slots and stop strings meet in the same decode steps
    (a field that only breaks next to another one shows here), and the extra ones queue."""
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        for future in [pool.submit(_send, live, path, payload) for path, payload in batch]:
            future.result()
    assert live.rt is not None and live.rt.engine.counters.restarts == 0, batch


def _send(live: LiveServer, path: str, payload: dict[str, Any]) -> None:
    """One request, its answer checked (and a stream read to its end)."""
    Counter.n += 1
    with httpx.Client(base_url=live.url, timeout=DEADLINE_S) as client:
        try:
            content = json.dumps(payload, allow_nan=True).encode()
        except (ValueError, TypeError):
            return
        with client.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as r:
            Counter.statuses[r.status_code] = Counter.statuses.get(r.status_code, 0) + 1
            if r.status_code != 200:
                r.read()
                assert 400 <= r.status_code < 500, (r.status_code, r.text, payload)
                if os.environ.get("FUZZ_DEBUG"):
                    print(r.text[:150])
                _check_error_shape(r)
            elif r.headers["content-type"].startswith("text/event-stream"):
                _read_stream(r, path)
            else:
                r.read()
                out = r.json()
                results = out if isinstance(out, list) else [out]  # /completion with n > 1: one per choice
                assert results and all("content" in o or "choices" in o for o in results)


def test_fuzz_left_the_server_healthy(live: LiveServer) -> None:
    """After the fuzz run /health is 200, no group restarted (the /metrics
    counter says so), and a plain request succeeds."""
    print(f"\nfuzz: {Counter.n} examples, statuses {dict(sorted(Counter.statuses.items()))}")
    assert Counter.n >= min(EXAMPLES, 50)
    with httpx.Client(base_url=live.url, timeout=DEADLINE_S) as client:
        assert client.get("/health").status_code == 200
        metrics = client.get("/metrics").text
        assert 'llamactor:group_restarts_total{group="0"} 0.0' in metrics
        r = client.post("/completion", json={"prompt": "plain", "n_predict": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
        slots = client.get("/slots").json()
        assert not any(s["is_processing"] for s in slots)


def test_fuzz_strategies_cover_every_sampling_field() -> None:
    """Every field the wire types accept is drawn by the fuzzer (a new field must be fuzzed)."""
    import msgspec

    from llamactor.protocol.wire import ChatCompletionRequest, CompletionRequest, NativeCompletionRequest

    for wire, fields in (
        (NativeCompletionRequest, NATIVE),
        (CompletionRequest, COMPLETIONS),
        (ChatCompletionRequest, CHAT),
    ):
        names = {f.encode_name for f in msgspec.structs.fields(wire)}
        assert names <= set(fields), (wire.__name__, sorted(names - set(fields)))
    assert math.isfinite(DEADLINE_S)
