"""Tool calls end to end: the real openai client against the bundled server on the tiny
model, the embedding API (``rt.chat``), each template family, lazy grammars, bad input.

The tiny model's weights are random, so a valid call can only come from the grammar: every
call asserted here is one the server constrained (``tool_choice`` required or named), and its
arguments are validated against the tool's JSON Schema with ``jsonschema``.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import msgspec
import openai
import pytest
from chat_templates import HERMES, LLAMA3, MISTRAL, use_template
from conftest import TEST_THREADS, open_server
from hypothesis import given, settings
from hypothesis import strategies as st

from llamactor.protocol.errors import RequestError
from llamactor.protocol.sampling import ParamError, SamplingParams, check_sampling
from llamactor.runtime import GenerationRequest, RequestHandle, Runtime, RuntimeConfig
from llamactor.runtime.service.chat import ChatTemplate
from llamactor.runtime.service.chatparse import MessageParser
from llamactor.runtime.service.chatprepare import prepare_chat
from llamactor.runtime.service.config import default_model_path
from llamactor.runtime.service.toolcalls import (
    SYNTAX,
    ToolChoice,
    ToolFormat,
    call_grammar,
    detect_format,
    parse_tools,
    trigger_words,
)

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "unit"],
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS},
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME_PARAMS}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TOKENS = 300  # the tiny model writes a call a byte or two per token


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


@pytest.mark.slow
async def test_required_tool_call_openai_client_streaming_and_not(make_config):
    """tool_choice "required" yields a valid call with the real openai client, streaming
    and not: finish_reason "tool_calls", arguments valid against the schema, and the stream's
    tool_calls deltas reassemble to the same call as the non-streaming answer."""
    async with open_server(make_config()) as (rt, url):
        client = _client(url)
        try:
            kwargs = dict(
                model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=CALL_TOKENS, temperature=0
            )
            full = await client.chat.completions.create(**kwargs)
            choice = full.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None and len(choice.message.tool_calls) == 1
            call = choice.message.tool_calls[0]
            assert call.type == "function" and call.id and call.function.name in SCHEMAS
            _valid(call.function.name, call.function.arguments)

            stream = await client.chat.completions.create(**kwargs, stream=True)
            calls: dict[int, dict] = {}
            finish, content = None, ""
            async for chunk in stream:
                for c in chunk.choices:
                    finish = c.finish_reason or finish
                    content += c.delta.content or ""
                    for d in c.delta.tool_calls or []:
                        entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                        entry["id"] = d.id or entry["id"]
                        if d.function is not None:
                            entry["name"] += d.function.name or ""
                            entry["arguments"] += d.function.arguments or ""
            assert finish == "tool_calls" and content == ""
            assert list(calls) == [0] and calls[0]["id"]
            assert (calls[0]["name"], calls[0]["arguments"]) == (call.function.name, call.function.arguments)
        finally:
            await client.close()


@pytest.mark.slow
async def test_smollm2_required_call_is_valid_and_on_topic():
    """Tool calls on SmolLM2 (its template has no tool support: the GENERIC family): a required call
    through the openai client is valid, and the model fills it from the question (Paris)."""
    config = RuntimeConfig(model=default_model_path(), n_ctx=2048, parallel=1, threads=TEST_THREADS)
    async with open_server(config) as (rt, url):
        client = _client(url)
        try:
            r = await client.chat.completions.create(
                model="smol", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0
            )
            call = r.choices[0].message.tool_calls[0]
            assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
            assert _valid("get_weather", call.function.arguments)["city"] == "Paris"
        finally:
            await client.close()
        result = await rt.chat(ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
        assert result.message.tool_calls[0].arguments == call.function.arguments


async def test_named_tool_choice_and_tool_results_sent_back(make_config):
    """A named function is the one called (HTTP and rt.chat), and the assistant's
    tool_calls plus a role "tool" answer are accepted back in the history and rendered."""
    async with open_server(make_config()) as (rt, url):
        client = _client(url)
        try:
            named = {"type": "function", "function": {"name": "get_time"}}
            r = await client.chat.completions.create(
                model="tiny",
                messages=ASK,
                tools=TOOLS,
                tool_choice=named,
                max_tokens=CALL_TOKENS,
                temperature=0.7,
                seed=5,
            )
            call = r.choices[0].message.tool_calls[0]
            assert call.function.name == "get_time"
            assert _valid("get_time", call.function.arguments)["zone"] in ("UTC", "CET")

            history = [
                *ASK,
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "12:00 UTC"},
            ]
            follow = await client.chat.completions.create(
                model="tiny", messages=history, tools=TOOLS, max_tokens=5, temperature=0
            )
            assert follow.choices[0].finish_reason in ("stop", "length")
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/apply-template", json={"messages": history, "tools": TOOLS})
                prompt = r.json()["prompt"]
            assert f'"name": "get_time", "arguments": {call.function.arguments}' in prompt
            assert "<tool_response>\n12:00 UTC\n</tool_response>" in prompt
        finally:
            await client.close()
        result = await rt.chat(ASK, tools=TOOLS, tool_choice=named, max_tokens=CALL_TOKENS, temperature=0)
        assert result.finish_reason == "tool_calls"
        assert [c.name for c in result.message.tool_calls] == ["get_time"]
        assert result.message.tool_calls[0].args == json.loads(result.message.tool_calls[0].arguments)


async def test_tool_choice_none_and_auto_answer_in_text(make_config):
    """tool_choice "none" gives no call and no grammar; "auto" on a model that does not call gives
    its plain answer, unconstrained (the lazy grammar never engaged: the same tokens as the
    same prompt run with no grammar at all)."""
    async with open_server(make_config()) as (rt, url):
        client = _client(url)
        try:
            r = await client.chat.completions.create(
                model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
            )
            assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
            assert r.choices[0].message.content
        finally:
            await client.close()
        turn = rt.prepare_chat(ASK, tools=TOOLS, tool_choice="auto")
        assert turn.grammar_lazy and "<tool_call>" in turn.grammar_triggers and turn.grammar
        plain = await rt.complete(turn.prompt, max_tokens=40, temperature=0)
        result = await rt.chat(ASK, tools=TOOLS, max_tokens=40, temperature=0)  # under the lazy grammar
        assert result.completion.choices[0].tokens == plain.choices[0].tokens
        assert result.message.content == plain.text and not result.message.tool_calls


async def test_lazy_grammar_engages_at_its_trigger_word(make_config):
    """A lazy grammar leaves the text free until the trigger word, then constrains it
    (greedy text of the tiny model repeats "et"; after it the grammar forces "XYZ")."""
    async with Runtime.open(make_config()) as rt:
        free = await rt.complete("hello", max_tokens=30, temperature=0)
        assert "et" in free.text
        admitted = await rt.admission.admit(GenerationRequest(prompt="hello", max_tokens=30, temperature=0))
        lazy_params = msgspec.structs.replace(
            admitted.task.params, grammar='root ::= "et" "XYZ"', grammar_lazy=True, grammar_triggers=("et",)
        )
        rt.engine.submit(msgspec.structs.replace(admitted.task, params=lazy_params))
        lazy = await RequestHandle(admitted.task, admitted.events, rt.engine.cancel).result()
        cut = free.text.index("et")
        assert lazy.text == free.text[:cut] + "etXYZ" and lazy.finish_reason == "stop"
        for bad in (
            dict(grammar_lazy=True),
            dict(grammar='root ::= "a"', grammar_triggers=("a",)),
            dict(grammar='root ::= "a"', grammar_lazy=True, grammar_triggers=("",)),
        ):
            with pytest.raises(ParamError, match="grammar"):
                check_sampling(SamplingParams(**bad), n_vocab=100)


@pytest.mark.slow
@pytest.mark.serial  # compares two timings: alone on the machine
async def test_lazy_grammar_does_not_slow_plain_answers(make_config):
    """A plain answer under a lazy tool grammar that never engages costs about what it
    costs without one (the trigger check is one end-anchored regex per token)."""
    async with Runtime.open(make_config(parallel=1)) as rt:
        turn = rt.prepare_chat(ASK, tools=TOOLS)
        timings: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(3):
            for lazy in (False, True):
                t = time.perf_counter()
                admitted = await rt.admission.admit(
                    GenerationRequest(prompt=turn.prompt, max_tokens=600, ignore_eos=True, temperature=0)
                )
                task = admitted.task
                if lazy:
                    task = msgspec.structs.replace(task, params=turn.sampling(task.params))
                rt.engine.submit(task)
                c = await RequestHandle(task, admitted.events, rt.engine.cancel).result()
                timings[lazy].append(time.perf_counter() - t)
                assert c.n_predicted == 600
        plain, lazy_s = min(timings[False]), min(timings[True])
        print(f"\n600 tokens: no grammar {plain * 1e3:.0f} ms, lazy tool grammar {lazy_s * 1e3:.0f} ms")
        assert lazy_s < plain * 1.5 + 0.05


@pytest.mark.slow
@pytest.mark.parametrize(
    "source,fmt,opener",
    [
        (HERMES, ToolFormat.HERMES, "<tool_call>"),
        (LLAMA3, ToolFormat.LLAMA3, '{"name": '),
        (MISTRAL, ToolFormat.MISTRAL, "[TOOL_CALLS]["),
    ],
)
async def test_native_template_families(make_config, source, fmt, opener):
    """Each native family gets the tools through its template, writes calls in its own
    syntax under the grammar, and they parse back into the same call (HTTP, streaming, rt.chat)."""
    async with open_server(make_config()) as (rt, url):
        use_template(rt, source)
        assert detect_format(source) is fmt
        turn = rt.prepare_chat(ASK, tools=TOOLS, tool_choice="required")
        assert '"get_weather"' in turn.prompt and "Weather in a city" in turn.prompt  # rendered by the template
        assert "You have access to the following functions" not in turn.prompt
        result = await rt.chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=CALL_TOKENS, temperature=0)
        raw = result.completion.text
        assert raw.startswith(opener), raw
        call = result.message.tool_calls[0]
        assert result.finish_reason == "tool_calls" and not result.message.content
        _valid(call.name, call.arguments)
        if fmt is ToolFormat.MISTRAL:
            assert len(call.id) == 9 and call.id.isalnum() and f'"id": "{call.id}"' in raw
        client = _client(url)
        try:
            stream = await client.chat.completions.create(
                model="tiny",
                messages=ASK,
                tools=TOOLS,
                tool_choice="required",
                max_tokens=CALL_TOKENS,
                temperature=0,
                stream=True,
            )
            name = args = ""
            async for chunk in stream:
                for c in chunk.choices:
                    for d in c.delta.tool_calls or []:
                        name += d.function.name or ""
                        args += d.function.arguments or ""
            assert (name, args) == (call.name, call.arguments)
            history = [*ASK, result.message.to_openai(), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
            follow = await client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=3)
            assert follow.choices[0].finish_reason in ("stop", "length")
        finally:
            await client.close()
        prompt = rt.prepare_chat(history, tools=TOOLS).prompt
        assert "sunny" in prompt and call.name in prompt


async def test_parallel_tool_calls(make_config):
    """parallel_tool_calls lets the grammar take several calls; each parsed call is valid."""
    async with Runtime.open(make_config()) as rt:
        result = await rt.chat(
            ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=True, max_tokens=600, temperature=0.8, seed=2
        )
        assert result.message.tool_calls
        for call in result.message.tool_calls:
            _valid(call.name, call.arguments)
        assert len({c.id for c in result.message.tool_calls}) == len(result.message.tool_calls)
        grammar = rt.prepare_chat(ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=True).grammar
        assert 'root ::= call ( "\\n"? call )*' in grammar


BAD = [
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name: unknown function 'nope'",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be 'none', 'auto', 'required'"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
        "tools[0].function.parameters.type is not valid JSON Schema",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "string", "maxLength": -1}}},
                    },
                }
            ]
        },
        "tools[0].function.parameters.properties.a.maxLength is not valid JSON Schema",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}]},
        "tools[0].function.parameters.required is not valid JSON Schema",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools[0].function.parameters must describe an object",
    ),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name: 'get_weather' is offered twice"),
    ({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice: 'required' needs a non-empty tools list"),
    (
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "zzz", "content": "x"}]},
        "messages[1].tool_call_id: no earlier assistant tool call has id 'zzz'",
    ),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id is required"),
    (
        {
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}
                    ],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    ({"tools": TOOLS, "grammar": 'root ::= "x"'}, "cannot be combined with tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "cannot be combined with tools"),
    ({"tools": [{"type": "function", "function": {"name": 3}}]}, "$.tools[0].function.name"),
]


@pytest.mark.slow
@pytest.mark.parametrize("extra,message", BAD, ids=[m[:40] for _, m in BAD])
async def test_bad_tool_input_is_a_400_naming_the_field(make_config, extra, message):
    """Tool-call bad input: each is a 400 whose message names the field; the server keeps serving,
    and the embedding API raises the same RequestError."""
    async with open_server(make_config()) as (rt, url):
        body = {"messages": ASK, "max_tokens": 2, **extra}
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            assert message in r.json()["error"]["message"]
            ok = await http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
            assert ok.status_code == 200
        if "$." in message or "response_format" in extra:
            return  # wire types and response_format belong to HTTP only
        kwargs = {k: v for k, v in body.items() if k not in ("messages", "max_tokens")}
        with pytest.raises(RequestError, match=re.escape(message)):
            await rt.chat(body["messages"], max_tokens=2, **kwargs)


async def test_apply_template_and_input_tokens_match_the_chat_prompt(make_config):
    """/apply-template returns the prompt the chat request runs, and
    /v1/chat/completions/input_tokens its length, equal to the chat answer's prompt_tokens."""
    async with open_server(make_config()) as (rt, url):
        body = {"messages": ASK, "tools": TOOLS}
        async with httpx.AsyncClient(base_url=url) as http:
            prompt = (await http.post("/apply-template", json=body)).json()
            assert prompt == {"prompt": rt.prepare_chat(ASK, tools=TOOLS).prompt}
            counted = (await http.post("/v1/chat/completions/input_tokens", json=body)).json()
            n_tokens = len(await rt.tokenize(prompt["prompt"]))
            assert counted == {"object": "response.input_tokens", "input_tokens": n_tokens}
            ran = (await http.post("/v1/chat/completions", json={**body, "max_tokens": 1})).json()
            assert ran["usage"]["prompt_tokens"] == counted["input_tokens"]
            bad = await http.post("/apply-template", json={"messages": []})
            assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]


# ---- grammar and parser, without a model ----------------------------------------------------

FAMILY_TEXT = {
    ToolFormat.HERMES: 'Let me check.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
    ToolFormat.GENERIC: '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>',
    ToolFormat.LLAMA3: '{"name": "get_time", "parameters": {"zone": "UTC"}}',
    ToolFormat.MISTRAL: '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}, "id": "abcDEF123"}]',
}


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(fmt=st.sampled_from(list(FAMILY_TEXT)), think=st.booleans(), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_parser_result_does_not_depend_on_how_the_text_streams(fmt, think, cuts):
    """The parse of a streamed answer equals the parse of the whole text, for every
    family and with a reasoning block, however the text is cut into pieces."""
    text = ("<think>\nplan </thi the call</think>\n\n" if think else "") + FAMILY_TEXT[fmt]
    whole = MessageParser(SYNTAX[fmt], reasoning_format="deepseek", new_id=lambda: "id")
    whole.feed(text)
    whole.finish()
    parts = MessageParser(SYNTAX[fmt], reasoning_format="deepseek", new_id=lambda: "id")
    reasoning = content = ""
    calls = []
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for a, b in zip(points, points[1:]):
        d = parts.feed(text[a:b])
        reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.calls
    d = parts.finish()
    reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.calls
    assert parts.message == whole.message
    assert (reasoning, content, [c for _, c in calls]) == (
        whole.message.reasoning_content,
        whole.message.content,
        whole.message.tool_calls,
    )
    assert whole.message.tool_calls and all(c.name in SCHEMAS for c in whole.message.tool_calls)
    assert whole.message.reasoning_content == ("\nplan </thi the call" if think else "")


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "\n",
    "{",
    "}",
    "[",
    "]",
    '"',
    "[TOOL_CALLS]",
    '[{"name"',
    '{"name"',
    '{"name": "f", "arguments": {}}',
    "<think>",
    "</think>",
    " ",
    "x",
    "<",
    "\\",
]


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    fmt=st.sampled_from(list(SYNTAX)),
    pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=30),
    cuts=st.lists(st.integers(0, 300), max_size=8),
    think=st.booleans(),
)
def test_parser_never_fails_and_keeps_every_character(fmt, pieces, cuts, think):
    """Whatever the model writes, the parser ends, loses no text (content + reasoning + calls
    account for it) and gives the same result however the text streams."""
    text = "".join(pieces)
    fmt_name = "deepseek" if think else "none"
    whole = MessageParser(SYNTAX[fmt], reasoning_format=fmt_name, new_id=lambda: "id")
    whole.feed(text)
    whole.finish()
    streamed = MessageParser(SYNTAX[fmt], reasoning_format=fmt_name, new_id=lambda: "id")
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for a, b in zip(points, points[1:]):
        streamed.feed(text[a:b])
    streamed.finish()
    assert streamed.message == whole.message
    if not whole.message.tool_calls and not think:
        assert whole.message.content == text


def test_mistral_call_without_its_control_token():
    """[TOOL_CALLS] is a control token in Mistral's vocabularies, rendered empty in the text: the
    bare call array is recognised too."""
    p = MessageParser(SYNTAX[ToolFormat.MISTRAL], new_id=lambda: "id")
    for piece in ('[{"na', 'me": "get_time", "arguments": {"zone": "UTC"}, "id": "abcDEF123"}]'):
        p.feed(piece)
    p.finish()
    assert p.message.content == "" and [(c.name, c.id) for c in p.message.tool_calls] == [("get_time", "abcDEF123")]


def test_parser_keeps_what_is_not_a_call_as_content():
    """A malformed or unfinished call stays in the content as text."""
    for text in (
        '<tool_call>{"name": 3}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a"',
        "[TOOL_CALLS] not json",
        "x <tool_cal",
    ):
        fmt = ToolFormat.MISTRAL if "TOOL_CALLS" in text else ToolFormat.HERMES
        p = MessageParser(SYNTAX[fmt])
        p.feed(text)
        p.finish()
        assert p.message.content == text and not p.message.tool_calls


def test_trigger_words_are_prefixes_the_grammar_accepts():
    """Every lazy trigger word is a prefix of a call the grammar writes (the engine feeds the
    grammar exactly the word, so any other text there would abort llama.cpp)."""
    for fmt, syntax in SYNTAX.items():
        example = {
            ToolFormat.LLAMA3: '{"name": "get_time"',
            ToolFormat.MISTRAL: '[TOOL_CALLS][{"name": "get_time"',
        }.get(fmt, '<tool_call>\n{"name": "get_time"')
        compact = example.replace("<tool_call>\n", "<tool_call>")
        for word in trigger_words(syntax):
            assert example.startswith(word) or compact.startswith(word), (fmt, word)
        grammar = call_grammar(syntax, parse_tools(TOOLS), ToolChoice("auto"), False)
        assert "root ::=" in grammar and "tool1-call" in grammar


def test_templates_are_detected_by_their_markers():
    assert detect_format(ChatTemplate(None).source) is ToolFormat.GENERIC
    assert detect_format("<tool_call><function=x><parameter=y>") is ToolFormat.GENERIC  # Qwen3-Coder XML
    with pytest.raises(RequestError, match="reasoning_format"):
        prepare_chat(ChatTemplate(None), ASK, reasoning_format="loud")
