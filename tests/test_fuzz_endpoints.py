"""Bad input (a clear error, nothing else lost) on the endpoints beside the three completion APIs
(tests/test_fuzz_requests.py):
property-based fuzzing of the Responses API, Anthropic Messages (and count_tokens), /apply-template,
the input-token counters, /tokenize, /detokenize, /infill, POST /slots/{id}, POST /lora-adapters,
POST /props, /v1/embeddings, /embedding(s) and /rerank, each against a real server.

Bodies are drawn from the endpoint's own shapes (items, content blocks, tools, tool choices,
documents), edge values and values of the wrong type at any depth. Properties, as for the
completion APIs: every answer is 200 or a 4xx with an OpenAI-shaped error (501 only where
llama-server answers it), streams are read to their end with every ``data:`` frame JSON, and
the engine never restarts; afterwards both servers are healthy and answer a plain request.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import TEST_THREADS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_requests import LiveServer, text_prompts

from llamactor.runtime import RuntimeConfig

pytestmark = pytest.mark.slow  # hypothesis fuzzing against live servers

EXAMPLES = int(os.environ.get("LLAMACTOR_FUZZ_EXAMPLES", "150"))
DEADLINE_S = 30.0
ANY_STATUS_501 = {"/props"}  # llama-server: POST /props is 501 without --props

# ---- shapes ---------------------------------------------------------------------------------

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
json_any = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6,
)
# A value of another type, non-empty (``x or default`` does not hide it), or null.
wrong = st.one_of(
    st.integers(1, 10**12),
    st.just(True),
    st.floats(0.5, 1e6),
    st.text(min_size=1, max_size=6),
    st.lists(json_leaf, min_size=1, max_size=2),
    st.none(),
    st.dictionaries(st.text(max_size=3), json_leaf, min_size=1, max_size=2),
)


def shapes(p_wrong: float) -> dict[str, st.SearchStrategy]:
    """The generation and the embedding servers' requests (and the Responses and Messages
    bodies alone); a field holds a value of the wrong
    type with probability ``p_wrong`` (0: every request is well-typed, so most reach the engine)."""

    def sometimes_wrong(valid: st.SearchStrategy, p: float = p_wrong) -> st.SearchStrategy:
        """``valid`` mostly, else a value of another type at this depth."""
        return st.integers(0, 999).flatmap(lambda u: wrong if u < p * 1000 else valid) if p else valid

    def obj(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
        wrap = {k: sometimes_wrong(v) for k, v in required.items()}
        return sometimes_wrong(
            st.fixed_dictionaries(wrap, optional={k: sometimes_wrong(v) for k, v in optional.items()}), p_wrong / 2
        )

    texts = sometimes_wrong(text_prompts)
    small = st.one_of(st.integers(0, 16), st.sampled_from([-1, -2, 10**9]))
    schemas = st.sampled_from(
        [
            {},
            {"type": "object"},
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "bogus"},
            {"$ref": "#/x"},
        ]
    )
    common = {
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1),
        "stream": st.booleans(),
        "model": st.text(max_size=4),
    }

    # Responses API items
    part = obj(
        {
            "type": st.sampled_from(["input_text", "output_text", "text", "input_image", "refusal", "bogus"]),
            "text": texts,
        },
        {},
    )
    content = st.one_of(texts, st.lists(part, max_size=3))
    item = st.one_of(
        obj(
            {
                "role": st.sampled_from(["user", "system", "developer", "assistant", "tool", "bogus"]),
                "content": content,
            },
            {"type": st.sampled_from(["message", "bogus"])},
        ),
        obj(
            {
                "type": st.just("function_call"),
                "call_id": st.sampled_from(["c1", "c2"]),
                "name": st.sampled_from(["f", "g"]),
                "arguments": st.sampled_from(["{}", '{"a": 1}', "{bad"]),
            },
            {"id": st.text(max_size=4)},
        ),
        obj({"type": st.just("function_call_output"), "call_id": st.sampled_from(["c1", "zz"]), "output": content}, {}),
        obj({"type": st.just("reasoning")}, {"content": st.lists(part, max_size=2), "summary": json_any}),
    )
    responses_body = obj(
        {"input": st.one_of(texts, st.lists(item, max_size=4))},
        {
            **common,
            "instructions": texts,
            "max_output_tokens": small,
            "tools": st.lists(
                obj(
                    {
                        "type": st.sampled_from(["function", "web_search", "bogus"]),
                        "name": st.sampled_from(["f", "g", ""]),
                    },
                    {"parameters": schemas, "description": texts, "strict": st.booleans()},
                ),
                max_size=3,
            ),
            "tool_choice": st.one_of(
                st.sampled_from(["auto", "none", "required", "bogus"]),
                obj({"type": st.just("function"), "name": st.sampled_from(["f", "nope"])}, {}),
            ),
            "reasoning": obj({}, {"effort": st.sampled_from(["low", "high", "none", "bogus"]), "summary": json_any}),
            "text": obj(
                {},
                {
                    "format": obj(
                        {"type": st.sampled_from(["text", "json_object", "json_schema", "bogus"])},
                        {"schema": schemas, "name": st.text(max_size=3)},
                    )
                },
            ),
            "previous_response_id": st.sampled_from(["", "resp_1"]),
            "store": st.booleans(),
            "metadata": json_any,
            "parallel_tool_calls": st.booleans(),
            "truncation": st.sampled_from(["auto", "disabled"]),
        },
    )

    # Anthropic Messages content blocks
    block = st.one_of(
        obj({"type": st.just("text"), "text": texts}, {"cache_control": json_any}),
        obj({"type": st.just("thinking"), "thinking": texts}, {"signature": st.text(max_size=3)}),
        obj({"type": st.just("redacted_thinking")}, {"data": st.text(max_size=3)}),
        obj(
            {
                "type": st.just("tool_use"),
                "id": st.sampled_from(["t1", "t2", ""]),
                "name": st.sampled_from(["f", "g"]),
                "input": st.dictionaries(st.text(max_size=3), json_leaf, max_size=2),
            },
            {},
        ),
        obj(
            {"type": st.just("tool_result"), "tool_use_id": st.sampled_from(["t1", "zz"])},
            {
                "content": st.one_of(
                    texts, st.lists(obj({"type": st.sampled_from(["text", "image"]), "text": texts}, {}), max_size=2)
                ),
                "is_error": st.booleans(),
            },
        ),
        obj({"type": st.sampled_from(["image", "document", "bogus"])}, {"source": json_any}),
    )
    anthropic_message = obj(
        {
            "role": st.sampled_from(["user", "assistant", "system", "bogus"]),
            "content": st.one_of(texts, st.lists(block, max_size=3)),
        },
        {},
    )
    messages_body = obj(
        {"messages": st.lists(anthropic_message, max_size=4)},
        {
            **common,
            "max_tokens": small,
            "top_k": small,
            "system": st.one_of(
                texts, st.lists(obj({"type": st.sampled_from(["text", "bogus"]), "text": texts}, {}), max_size=2)
            ),
            "stop_sequences": st.lists(st.text(max_size=4), max_size=3),
            "tools": st.lists(
                obj(
                    {"name": st.sampled_from(["f", "g", ""])},
                    {
                        "description": texts,
                        "input_schema": schemas,
                        "type": st.sampled_from(["custom", "bash_20250124"]),
                    },
                ),
                max_size=3,
            ),
            "tool_choice": obj(
                {"type": st.sampled_from(["auto", "any", "tool", "none", "bogus"])},
                {"name": st.sampled_from(["f", "nope"]), "disable_parallel_tool_use": st.booleans()},
            ),
            "thinking": obj({"type": st.sampled_from(["enabled", "disabled", "bogus"])}, {"budget_tokens": small}),
            "metadata": json_any,
            "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), json_leaf, max_size=2),
        },
    )

    # OpenAI chat messages (for /apply-template and the chat token counter)
    chat_message = obj(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "bogus"]),
            "content": st.one_of(texts, st.none(), st.lists(part, max_size=2)),
        },
        {
            "tool_call_id": st.sampled_from(["c1", "zz"]),
            "reasoning_content": texts,
            "tool_calls": st.lists(
                obj(
                    {
                        "id": st.just("c1"),
                        "type": st.just("function"),
                        "function": obj({"name": st.just("f"), "arguments": st.just("{}")}, {}),
                    },
                    {},
                ),
                max_size=2,
            ),
        },
    )
    chat_body = obj(
        {"messages": st.lists(chat_message, max_size=3)},
        {
            "tools": st.lists(
                obj(
                    {
                        "type": st.just("function"),
                        "function": obj({"name": st.sampled_from(["f", "a b"])}, {"parameters": schemas}),
                    },
                    {},
                ),
                max_size=2,
            ),
            "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), json_leaf, max_size=2),
            "add_generation_prompt": st.booleans(),
            "reasoning_format": st.sampled_from(["none", "auto", "bogus"]),
        },
    )

    tokens = st.lists(st.one_of(st.integers(0, 459), st.sampled_from([-1, 460, 2**31, 10**12])), max_size=12)
    tokenize_body = obj(
        {"content": texts},
        {
            "add_special": st.booleans(),
            "parse_special": st.booleans(),
            "with_pieces": st.booleans(),
            "bogus": st.booleans(),
        },
    )
    detokenize_body = obj({"tokens": tokens}, {"bogus": st.booleans()})
    infill_body = obj(
        {"input_prefix": st.one_of(texts, tokens), "input_suffix": st.one_of(texts, tokens)},
        {
            "prompt": texts,
            "n_predict": small,
            "stream": st.booleans(),
            "temperature": st.floats(0, 2),
            "input_extra": st.lists(obj({"text": texts}, {"filename": st.text(max_size=6)}), max_size=2),
            "id_slot": st.integers(-2, 3),
            "cache_prompt": st.booleans(),
        },
    )
    slot_body = obj(
        {
            "filename": st.one_of(
                st.sampled_from(["s0.bin", "a-b_c.bin", "../x", "/etc/x", "", ".", "a b"]), st.text(max_size=6)
            )
        },
        {},
    )
    lora_body = st.lists(
        obj({"id": st.integers(-1, 2)}, {"scale": st.one_of(st.floats(-2, 2), st.just(1e30))}), max_size=2
    )

    GENERATION = st.one_of(
        st.tuples(st.sampled_from(["/v1/responses", "/responses"]), responses_body),
        st.tuples(st.just("/v1/responses/input_tokens"), responses_body),
        st.tuples(st.just("/v1/messages"), messages_body),
        st.tuples(st.just("/v1/messages/count_tokens"), messages_body),
        st.tuples(st.just("/apply-template"), chat_body),
        st.tuples(st.just("/v1/chat/completions/input_tokens"), chat_body),
        st.tuples(st.just("/tokenize"), tokenize_body),
        st.tuples(st.just("/detokenize"), detokenize_body),
        st.tuples(st.just("/infill"), infill_body),
        st.tuples(
            st.builds(
                lambda i, a: f"/slots/{i}?action={a}",
                st.sampled_from(["0", "1", "-1", "9", "x"]),
                st.sampled_from(["save", "restore", "erase", "bogus"]),
            ),
            slot_body,
        ),
        st.tuples(st.just("/lora-adapters"), lora_body),
        st.tuples(st.just("/props"), json_any),
        *(
            [st.tuples(st.sampled_from(["/tokenize", "/v1/messages", "/v1/responses", "/infill"]), json_any)]
            if p_wrong
            else []
        ),  # any JSON at all
    )

    embed_input = st.one_of(texts, st.lists(st.one_of(texts, tokens), max_size=3), tokens)
    EMBEDDING = st.one_of(
        st.tuples(
            st.just("/v1/embeddings"),
            obj(
                {"input": embed_input},
                {
                    "model": st.text(max_size=3),
                    "encoding_format": st.sampled_from(["float", "base64", "bogus"]),
                    "dimensions": st.one_of(st.integers(-1, 64), st.none()),
                    "user": st.text(max_size=3),
                },
            ),
        ),
        st.tuples(
            st.sampled_from(["/embedding", "/embeddings"]),
            obj({"content": embed_input}, {"embd_normalize": st.integers(-2, 4)}),
        ),
        st.tuples(
            st.sampled_from(["/rerank", "/v1/rerank", "/reranking"]),
            obj(
                {"query": texts},
                {
                    "documents": st.lists(st.one_of(texts, obj({"text": texts}, {})), max_size=3),
                    "texts": st.lists(texts, max_size=2),
                    "top_n": st.integers(-1, 4),
                    "return_text": st.booleans(),
                    "return_documents": st.booleans(),
                },
            ),
        ),
    )

    return {"generation": GENERATION, "embedding": EMBEDDING, "responses": responses_body, "messages": messages_body}


_clean, _junky = shapes(0.0), shapes(1 / 10)
GENERATION = st.one_of(_clean["generation"], _junky["generation"])
EMBEDDING = st.one_of(_clean["embedding"], _junky["embedding"])
_mostly_wrong = shapes(1 / 4)
CONVERTED = st.one_of(
    st.tuples(st.just("responses"), st.one_of(_junky["responses"], _mostly_wrong["responses"])),
    st.tuples(st.just("messages"), st.one_of(_junky["messages"], _mostly_wrong["messages"])),
)


# ---- the servers --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, LiveServer]]:
    from tinylora import write_tiny_lora
    from tinymodel import write_tiny_model
    from tinyreranker import write_tiny_reranker

    folder = tmp_path_factory.mktemp("fuzz_endpoints")
    (folder / "slots").mkdir()
    gen = RuntimeConfig(
        model=write_tiny_model(folder / "fim.gguf", fim=True),
        n_ctx=2048,
        parallel=4,
        threads=TEST_THREADS,
        n_batch=512,
        n_ubatch=512,
        lora=((str(write_tiny_lora(folder / "lora.gguf")), 1.0),),
        slot_save_path=str(folder / "slots"),
        isolate=True,
    )
    emb = RuntimeConfig(
        model=write_tiny_reranker(folder / "rerank.gguf"),
        n_ctx=1024,
        parallel=2,
        threads=TEST_THREADS,
        n_batch=512,
        n_ubatch=512,
        embedding=True,
        isolate=True,
    )
    with LiveServer(gen) as a, LiveServer(emb) as b:
        yield a, b


STATUSES: dict[tuple[str, int], int] = {}
ANTHROPIC_4XX = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large"}


def _check(client: httpx.Client, path: str, body: Any) -> None:
    try:
        content = json.dumps(body, allow_nan=True).encode()
    except (ValueError, TypeError):
        return
    with client.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as r:
        key = (path.split("?")[0], r.status_code)
        STATUSES[key] = STATUSES.get(key, 0) + 1
        if r.status_code != 200:
            r.read()
            ok = 400 <= r.status_code < 500 or (r.status_code == 501 and path in ANY_STATUS_501)
            assert ok, (r.status_code, r.text, path, body)
            body_json = r.json()
            err = body_json["error"]
            if os.environ.get("FUZZ_DEBUG"):
                print("FUZZ", path.split("?")[0], err["message"][:90].replace("\n", " "))
            assert isinstance(err["message"], str) and err["message"], err
            if path.startswith("/v1/messages"):  # Anthropic's error shape
                assert body_json["type"] == "error" and err["type"] == ANTHROPIC_4XX[r.status_code], body_json
            else:
                assert err["code"] == r.status_code, err
            return
        if not r.headers["content-type"].startswith("text/event-stream"):
            r.read()
            r.json()
            return
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frame = json.loads(line[6:])
                error = frame.get("error") if isinstance(frame, dict) else None
                if isinstance(error, dict) and "code" in error:
                    assert 400 <= error["code"] < 500, (frame, path, body)
            else:
                assert not line or line.startswith(("event: ", ":")), (line, path)


SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


def _one(live: LiveServer, request: tuple[str, Any]) -> None:
    """One request to ``live``, its answer checked; the engine must not have restarted."""
    with httpx.Client(base_url=live.url, timeout=DEADLINE_S) as client:
        _check(client, *request)
    assert live.rt is not None and live.rt.engine.counters.restarts == 0, request


@SETTINGS
@given(request=GENERATION)
def test_fuzz_generation_endpoints(servers: tuple[LiveServer, LiveServer], request: tuple[str, Any]) -> None:
    _one(servers[0], request)


@settings(
    max_examples=max(EXAMPLES // 4, 10),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(batch=st.lists(_clean["generation"], min_size=2, max_size=6))
def test_fuzz_generation_endpoints_side_by_side(
    servers: tuple[LiveServer, LiveServer], batch: list[tuple[str, Any]]
) -> None:
    """Well-typed requests to those endpoints at once: Responses and Messages turns with tools,
    infill, slot save / restore / erase and adapter changes meet running requests."""
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        for future in [pool.submit(_one, servers[0], request) for request in batch]:
            future.result()


@SETTINGS
@given(request=EMBEDDING)
def test_fuzz_embedding_endpoints(servers: tuple[LiveServer, LiveServer], request: tuple[str, Any]) -> None:
    _one(servers[1], request)


@settings(
    max_examples=EXAMPLES * 10,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=CONVERTED)
def test_fuzz_responses_and_messages_conversion(request: tuple[str, Any]) -> None:
    """The Responses and Messages converters alone, ten times as many bodies, wrong types more
    often: each body becomes a chat request or a RequestError / a msgspec ValidationError (both
    a 400 with the field named); any other exception would be a 500."""
    import msgspec

    from llamactor.protocol.errors import RequestError
    from llamactor.runtime.http import anthropic, responses_request

    api, body = request
    try:
        (responses_request if api == "responses" else anthropic).to_chat(body)
    except (RequestError, msgspec.ValidationError):
        pass


def test_fuzz_left_both_servers_healthy(servers: tuple[LiveServer, LiveServer]) -> None:
    print("\nfuzz endpoints:", dict(sorted(STATUSES.items())))
    assert sum(STATUSES.values()) >= min(2 * EXAMPLES, 100)
    gen, emb = servers
    with httpx.Client(base_url=gen.url, timeout=DEADLINE_S) as client:
        assert client.get("/health").status_code == 200
        client.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}]).raise_for_status()
        r = client.post(
            "/v1/messages", json={"max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "plain"}]}
        )
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] >= 1
        assert not any(s["is_processing"] for s in client.get("/slots").json())
    with httpx.Client(base_url=emb.url, timeout=DEADLINE_S) as client:
        assert client.get("/health").status_code == 200
        r = client.post("/rerank", json={"query": "a", "documents": ["a b", "c"]})
        assert r.status_code == 200 and len(r.json()["results"]) == 2
    for live in servers:
        assert live.rt is not None and live.rt.engine.counters.restarts == 0
