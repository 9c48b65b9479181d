"""Every field of ``GenerationRequest`` is reachable: from the embedding API, and from each HTTP
API that llama-server exposes it on (native /completion, /infill, OpenAI completions and chat,
Responses, Anthropic Messages). Each field is sent in a real request to a running runtime (the
tiny model with FIM tokens), and the request admission receives must carry it.

A new field fails this test until the table below says where it comes from.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from conftest import TEST_THREADS
from tinymodel import write_tiny_model

from llamactor.protocol.request import GenerationRequest, InfillParts
from llamactor.runtime import Runtime, RuntimeConfig

NATIVE, INFILL, COMPLETIONS, CHAT, RESPONSES, ANTHROPIC = (
    "native",
    "infill",
    "completions",
    "chat",
    "responses",
    "anthropic",
)
USER = [{"role": "user", "content": "Hi"}]
BASE: dict[str, tuple[str, dict[str, Any]]] = {
    NATIVE: ("/completion", {"prompt": "Hi", "n_predict": 2}),
    INFILL: ("/infill", {"input_prefix": "a", "input_suffix": "b", "n_predict": 2}),
    COMPLETIONS: ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    CHAT: ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
    RESPONSES: ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
    ANTHROPIC: ("/v1/messages", {"messages": USER, "max_tokens": 2}),
}
COMPLETION_APIS = (NATIVE, INFILL, COMPLETIONS, CHAT, RESPONSES)  # llama-server reads these fields on all
NATIVE_LIKE = (NATIVE, INFILL, COMPLETIONS, CHAT)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}

# field: (the value the embedding API passes, {api: the body fragment that asks for it},
#         the value admission must see, if it differs from the first)
Row = tuple[Any, dict[str, dict[str, Any]]] | tuple[Any, dict[str, dict[str, Any]], Any]


def _same(value: Any, apis: tuple[str, ...], key: str | None = None, json_value: Any = None) -> tuple[Any, dict]:
    """A field every one of ``apis`` carries under ``key`` (default: its own name)."""
    return value, {api: {key or "": value if json_value is None else json_value} for api in apis}


FIELDS: dict[str, Row] = {
    "prompt": (
        "Hello there",
        {NATIVE: {"prompt": "Hello there"}, COMPLETIONS: {"prompt": "Hello there"}, INFILL: {"prompt": "Hello there"}},
    ),
    "messages": (USER, {CHAT: {"messages": USER}, RESPONSES: {"input": "Hi"}, ANTHROPIC: {"messages": USER}}),
    "infill": (InfillParts(input_prefix="a", input_suffix="b"), {INFILL: {"input_prefix": "a", "input_suffix": "b"}}),
    "add_special": (False, {}),  # the embedding API's own (llama-server exposes it on no API)
    # llama-server's multimodal prompt object (without --mmproj admission refuses it, after seeing it)
    "multimodal_data": (
        [b"\x89PNG"],
        {
            api: {"prompt": {"prompt_string": "Hi <__media__> there", "multimodal_data": ["iVBORw=="]}}
            for api in (NATIVE, COMPLETIONS)
        },
    ),
    "tools": (
        TOOLS,
        {
            CHAT: {"tools": TOOLS},
            RESPONSES: {"tools": [{"type": "function", "name": "f"}]},
            ANTHROPIC: {"tools": [{"name": "f", "input_schema": {"type": "object"}}]},
        },
    ),
    "tool_choice": (
        "required",
        {
            CHAT: {"tool_choice": "required", "tools": TOOLS},
            RESPONSES: {"tool_choice": "required", "tools": [{"type": "function", "name": "f"}]},
            ANTHROPIC: {"tool_choice": {"type": "any"}, "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
        },
    ),
    "parallel_tool_calls": (True, {CHAT: {"parallel_tool_calls": True}, RESPONSES: {"parallel_tool_calls": True}}),
    "reasoning_format": ("none", {CHAT: {"reasoning_format": "none"}}),
    "reasoning_effort": ("low", {CHAT: {"reasoning_effort": "low"}, RESPONSES: {"reasoning": {"effort": "low"}}}),
    "chat_template_kwargs": (
        {"x": 1},
        {api: {"chat_template_kwargs": {"x": 1}} for api in (CHAT, RESPONSES, ANTHROPIC)},
    ),
    "add_generation_prompt": (False, {api: {"add_generation_prompt": False} for api in (CHAT, RESPONSES)}),
    "continue_final_message": (False, {api: {"continue_final_message": False} for api in (CHAT, RESPONSES)}),
    "max_tokens": (
        3,
        {
            NATIVE: {"n_predict": 3},
            INFILL: {"n_predict": 3},
            COMPLETIONS: {"max_tokens": 3},
            CHAT: {"max_completion_tokens": 3},
            RESPONSES: {"max_output_tokens": 3},
            ANTHROPIC: {"max_tokens": 3},
        },
    ),
    "n": (2, {api: {"n": 2} for api in (NATIVE, COMPLETIONS, CHAT)}),
    "stop": (["zz"], {**{api: {"stop": ["zz"]} for api in COMPLETION_APIS}, ANTHROPIC: {"stop_sequences": ["zz"]}}),
    "seed": (42, {api: {"seed": 42} for api in COMPLETION_APIS}),
    "logit_bias": ({5: 1.5}, {api: {"logit_bias": {"5": 1.5}} for api in COMPLETION_APIS}, [(5, 1.5)]),
    "grammar": ('root ::= "a"', {api: {"grammar": 'root ::= "a"'} for api in COMPLETION_APIS}),
    "json_schema": (
        SCHEMA,
        {
            NATIVE: {"json_schema": SCHEMA},
            INFILL: {"json_schema": SCHEMA},
            COMPLETIONS: {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            CHAT: {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            RESPONSES: {"text": {"format": {"type": "json_schema", "schema": SCHEMA}}},
        },
    ),
    "n_probs": (
        2,
        {
            NATIVE: {"n_probs": 2},
            INFILL: {"n_probs": 2},
            COMPLETIONS: {"logprobs": 2},
            CHAT: {"logprobs": True, "top_logprobs": 2},
        },
    ),
    "speculative_n_max": (4, {api: {"speculative.n_max": 4} for api in COMPLETION_APIS}),
    "speculative_n_min": (1, {api: {"speculative.n_min": 1} for api in COMPLETION_APIS}),
    "speculative_p_min": (0.5, {api: {"speculative.p_min": 0.5} for api in COMPLETION_APIS}),
    "temperature": (0.5, {api: {"temperature": 0.5} for api in (*COMPLETION_APIS, ANTHROPIC)}),
    "top_k": (7, {api: {"top_k": 7} for api in (*COMPLETION_APIS, ANTHROPIC)}),
    "top_p": (0.9, {api: {"top_p": 0.9} for api in (*COMPLETION_APIS, ANTHROPIC)}),
    "return_progress": (True, {api: {"return_progress": True, "stream": True} for api in (NATIVE, COMPLETIONS, CHAT)}),
    "timings_per_token": (
        True,
        {api: {"timings_per_token": True, "stream": True} for api in (NATIVE, COMPLETIONS, CHAT, RESPONSES)},
    ),
    "lora": ([{"id": 0, "scale": 0.5}], {api: {"lora": [{"id": 0, "scale": 0.5}]} for api in NATIVE_LIKE}),
    "priority": (3, {api: {"priority": 3} for api in NATIVE_LIKE}),  # vLLM's field, on the APIs that build requests
    "tags": ({"tenant": "a"}, {api: {"tags": {"tenant": "a"}} for api in NATIVE_LIKE}),
}
# The rest: same name, same JSON value, on every API that takes llama-server's completion fields.
SIMPLE = {
    "dynatemp_range": 0.1,
    "dynatemp_exponent": 1.5,
    "min_p": 0.1,
    "typical_p": 0.9,
    "top_n_sigma": 1.0,
    "xtc_probability": 0.1,
    "xtc_threshold": 0.2,
    "repeat_penalty": 1.1,
    "repeat_last_n": 32,
    "presence_penalty": 0.1,
    "frequency_penalty": 0.1,
    "dry_multiplier": 0.5,
    "dry_base": 2.0,
    "dry_allowed_length": 3,
    "dry_penalty_last_n": 16,
    "dry_sequence_breakers": ["\n", "x"],
    "mirostat": 2,
    "mirostat_tau": 4.0,
    "mirostat_eta": 0.2,
    "adaptive_target": 0.5,
    "adaptive_decay": 0.5,
    "min_keep": 1,
    "samplers": ["top_k", "temperature"],
    "post_sampling_probs": True,
    "t_max_predict_ms": 1000,
    "ignore_eos": True,
    "cache_prompt": False,
    "id_slot": 1,
    "n_keep": 5,
    "n_discard": 2,
    "n_cache_reuse": 16,
}
for _name, _value in SIMPLE.items():
    FIELDS[_name] = (_value, {api: {_name: _value} for api in COMPLETION_APIS})
FIELDS["id_slot"] = (1, {api: {"id_slot": 1} for api in NATIVE_LIKE})
FIELDS["n_keep"] = (5, {api: {"n_keep": 5} for api in NATIVE_LIKE})
FIELDS["n_discard"] = (2, {api: {"n_discard": 2} for api in NATIVE_LIKE})
FIELDS["n_cache_reuse"] = (16, {api: {"n_cache_reuse": 16} for api in NATIVE_LIKE})


def test_the_table_names_every_field():
    """A field added to GenerationRequest must say where it comes from (and nothing else may be listed)."""
    assert set(FIELDS) == set(GenerationRequest.__struct_fields__)


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fields") / "tiny-fim.gguf", fim=True)


class Spy:
    """Records the request admission receives, then lets it go on (it may still be refused)."""

    def __init__(self, rt: Runtime) -> None:
        self.seen: list[GenerationRequest] = []
        assert rt.admission is not None
        admit = rt.admission.admit

        async def spy(request: GenerationRequest) -> Any:
            self.seen.append(request)
            return await admit(request)

        rt.admission.admit = spy  # type: ignore[method-assign]

    def last(self) -> GenerationRequest:
        assert self.seen, "the request never reached admission"
        return self.seen[-1]


def _plain(value: Any) -> Any:
    """JSON-like, tuples as lists: the value as the request carries it, whatever its sequence type."""
    return msgspec.json.decode(msgspec.json.encode(value)) if value is not None else None


def _expected(field: str) -> Any:
    row = FIELDS[field]
    return _plain(row[2] if len(row) == 3 else row[0])


@asynccontextmanager
async def served(fim_model: Path) -> AsyncIterator[tuple[Runtime, Spy, httpx.AsyncClient]]:
    config = RuntimeConfig(model=fim_model, n_ctx=4096, parallel=4, threads=TEST_THREADS, n_batch=512, isolate=False)
    async with Runtime.open(config) as rt:
        spy = Spy(rt)
        transport = httpx.ASGITransport(app=rt.asgi_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
            yield rt, spy, client


@pytest.mark.parametrize("api", sorted(BASE))
async def test_each_field_reaches_admission_from_an_http_api(fim_model, api):
    """One real request per field the API carries; the request admission sees has the value."""
    wrong = []
    async with served(fim_model) as (rt, spy, client):
        for field, row in FIELDS.items():
            if api not in row[1]:
                continue
            path, base = BASE[api]
            spy.seen.clear()
            r = await client.post(path, json={**base, **row[1][api]})
            assert r.status_code < 500, (field, r.text)
            got = getattr(spy.last(), field)
            if field in ("messages", "tools", "infill", "tool_choice"):  # converted from each API's own shape
                ok = got is not None
            else:
                ok = _plain(got) == _expected(field)
            if not ok:
                wrong.append((field, got))
    assert not wrong


async def test_each_field_reaches_admission_from_the_embedding_api(fim_model):
    """``rt.complete(prompt, field=value)`` (``rt.chat(messages, ...)`` for the chat fields,
    ``rt.infill(parts, ...)`` for the infill parts)."""
    chat_fields = (
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "reasoning_format",
        "reasoning_effort",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
    )
    wrong = []
    async with served(fim_model) as (rt, spy, _):
        for field, row in FIELDS.items():
            value = row[0]
            spy.seen.clear()
            try:
                if field in chat_fields:
                    kw = {k: v for k, v in {field: value}.items() if k != "messages"}
                    if field == "tool_choice":
                        kw["tools"] = TOOLS
                    await rt.chat(USER, max_tokens=2, **kw)
                elif field == "prompt":
                    await rt.complete(value, max_tokens=2)
                elif field == "infill":
                    await rt.infill(value, max_tokens=2)
                else:
                    await rt.complete("Hi", **{"max_tokens": 2, field: value})
            except Exception as exc:
                assert type(exc).__name__ in ("RequestError", "NotFound"), (field, exc)
            if _plain(getattr(spy.last(), field)) != _plain(value):
                wrong.append((field, getattr(spy.last(), field)))
    assert not wrong
