"""Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``) with the real
``anthropic`` client against the bundled server on the tiny model: text, system prompts,
streaming, tools (tool_use / tool_result), thinking blocks, stop sequences, bad input."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from chat_templates import THINKING, use_template
from conftest import open_server

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": PARAMS},
    {"name": "get_time", "description": "The time", "input_schema": TIME},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TOKENS = 300


def _client(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.slow
async def test_messages_text_streaming_and_not(make_config):
    """A text answer as a message of one text block, and as Anthropic's stream whose
    text deltas reassemble to the same text; usage matches count_tokens."""
    async with open_server(make_config()) as (rt, url):
        client = _client(url)
        try:
            kwargs = dict(
                model="tiny",
                max_tokens=12,
                messages=ASK,
                system=[{"type": "text", "text": "Be brief."}],
                extra_body={"temperature": 0},
            )
            msg = await client.messages.create(**kwargs)
            assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "max_tokens"
            assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
            assert msg.usage.output_tokens == 12
            counted = await client.messages.count_tokens(model="tiny", messages=ASK, system="Be brief.")
            assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == counted.input_tokens
            async with client.messages.stream(**kwargs) as stream:
                texts = [t async for t in stream.text_stream]
                final = await stream.get_final_message()
            assert "".join(texts) == msg.content[0].text == final.content[0].text
            assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
        finally:
            await client.close()


async def test_stream_event_sequence(make_config):
    """The raw stream is message_start, content_block_start/delta/stop, message_delta,
    message_stop, each an ``event:`` line with its ``data:``. message_start's usage splits the
    prompt as llama-server does: the same request again reads all but its last token from the
    cache (``cache_read_input_tokens``) and counts one as input."""
    body = {"max_tokens": 5, "messages": ASK, "stream": True, "temperature": 0}
    async with open_server(make_config(parallel=1)) as (rt, url):
        async with httpx.AsyncClient(base_url=url) as http:
            first = await http.post("/v1/messages", json=body)
            r = await http.post("/v1/messages", json=body)
            counted = (await http.post("/v1/messages/count_tokens", json={"messages": ASK})).json()
            frames = [f for f in r.text.split("\n\n") if f]
        started = json.loads(first.text.split("\n")[1].removeprefix("data: "))["message"]["usage"]
        assert started == {"input_tokens": counted["input_tokens"], "cache_read_input_tokens": 0, "output_tokens": 0}
        again = json.loads(frames[0].split("\n")[1].removeprefix("data: "))["message"]["usage"]
        assert again["input_tokens"] == 1 and again["cache_read_input_tokens"] == counted["input_tokens"] - 1
        names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
        datas = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
        assert names[:2] == ["message_start", "content_block_start"]
        assert set(names[2:-3]) == {"content_block_delta"}
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert all(d["type"] == n for n, d in zip(names, datas))
        assert datas[-2]["delta"]["stop_reason"] == "max_tokens" and datas[-2]["usage"]["output_tokens"] == 5


@pytest.mark.slow
async def test_tools_tool_use_and_tool_result(make_config):
    """Tool calls: tool_choice any/tool gives a tool_use block whose input validates
    against input_schema (stop_reason tool_use), the same streaming and not; the tool_result
    is accepted back."""
    async with open_server(make_config()) as (rt, url):
        client = _client(url)
        try:
            kwargs = dict(
                model="tiny",
                max_tokens=CALL_TOKENS,
                messages=ASK,
                tools=TOOLS,
                tool_choice={"type": "any"},
                extra_body={"temperature": 0},
            )
            msg = await client.messages.create(**kwargs)
            assert msg.stop_reason == "tool_use"
            use = msg.content[-1]
            assert use.type == "tool_use" and use.id and use.name in ("get_weather", "get_time")
            jsonschema.validate(use.input, PARAMS if use.name == "get_weather" else TIME)
            async with client.messages.stream(**kwargs) as stream:
                final = await stream.get_final_message()
            streamed = final.content[-1]
            assert (streamed.type, streamed.name, streamed.input) == ("tool_use", use.name, use.input)
            assert final.stop_reason == "tool_use"

            named = await client.messages.create(**{**kwargs, "tool_choice": {"type": "tool", "name": "get_time"}})
            assert named.content[-1].name == "get_time" and named.content[-1].input["zone"] in ("UTC", "CET")

            history = [
                *ASK,
                {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "sunny"}]}
                    ],
                },
            ]
            follow = await client.messages.create(
                model="tiny", max_tokens=3, messages=history, tools=TOOLS, thinking={"type": "disabled"}
            )
            assert follow.stop_reason in ("max_tokens", "end_turn")
        finally:
            await client.close()
        assert (
            "<tool_response>\nsunny\n</tool_response>"
            in rt.prepare_chat(
                [
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": use.id, "function": {"name": use.name, "arguments": "{}"}}],
                    },
                    {"role": "tool", "tool_call_id": use.id, "content": "sunny"},
                ]
            ).prompt
        )


async def test_stop_sequence_and_thinking_blocks(make_config):
    """A stop sequence ends with stop_reason stop_sequence; a template that opens
    <think> gives a thinking block (with its signature_delta when streamed)."""
    async with open_server(make_config()) as (rt, url):
        client = _client(url)
        try:
            greedy = {"model": "tiny", "messages": ASK, "extra_body": {"temperature": 0}}
            free = await client.messages.create(max_tokens=30, **greedy)
            word = free.content[0].text[5:7]
            stopped = await client.messages.create(max_tokens=30, stop_sequences=[word], **greedy)
            assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
            use_template(rt, THINKING)
            msg = await client.messages.create(max_tokens=8, **greedy)
            assert [b.type for b in msg.content] == ["thinking"] and msg.content[0].thinking
            async with client.messages.stream(max_tokens=8, **greedy) as stream:
                kinds = [e.type async for e in stream]
                final = await stream.get_final_message()
            assert final.content[0].thinking == msg.content[0].thinking
            assert "thinking" in kinds and "signature" in kinds
        finally:
            await client.close()


BAD = [
    (
        {
            "messages": [
                *ASK,
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "zz", "content": "x"}]},
            ]
        },
        "messages[1].content[0].tool_use_id: no earlier tool_use block has id 'zz'",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
        "messages[0].content[0]: image input is not supported by this server",  # without --mmproj
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}]},
        "messages[0].content[0]: unsupported content block 'document'",
    ),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be 'user' or 'assistant'"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "unknown function 'nope'"),
    ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice must be"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    (
        {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": []}}]},
        "tools[0].function.parameters.properties is not valid JSON Schema",
    ),
    ({"messages": []}, "messages must be a non-empty array"),
    # found by tests/test_fuzz_endpoints.py (were a 500 and a str() of an object)
    ({"thinking": {"type": "disabled"}, "chat_template_kwargs": [1]}, "chat_template_kwargs must be an object"),
    (
        {"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": {"a": 1}}]}, *ASK]},
        "messages[0].content[0].thinking must be a string",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("extra,message", BAD, ids=[m[:30] for _, m in BAD])
async def test_bad_messages_input_is_a_400_naming_the_field(make_config, extra, message):
    """Anthropic Messages bad input: a 400 naming the field, on both endpoints; the server keeps serving."""
    async with open_server(make_config()) as (rt, url), httpx.AsyncClient(base_url=url) as http:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = await http.post(path, json={"model": "tiny", "max_tokens": 2, "messages": ASK, **extra})
            assert r.status_code == 400 and message in r.json()["error"]["message"], (path, r.text)
        ok = await http.post("/v1/messages", json={"max_tokens": 2, "messages": ASK})
        assert ok.status_code == 200 and ok.json()["type"] == "message"
