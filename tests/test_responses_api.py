"""OpenAI Responses API (``/v1/responses``, ``/v1/responses/input_tokens``) with the real
``openai`` client against the bundled server on the tiny model: text, streaming events,
function calls and their outputs sent back, reasoning items, instructions, bad input."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
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
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": PARAMS},
    {"type": "web_search"},
]  # a built-in tool: skipped, as llama-server does
CALL_TOKENS = 300


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.slow
async def test_responses_text_streaming_and_not(make_config):
    """A text answer is one message item (output_text), streamed as response.created,
    output_item/content_part/output_text events and response.completed with the same text."""
    async with open_server(make_config()) as (rt, url):
        client = _client(url)
        try:
            kwargs = dict(model="tiny", input="Say hi", instructions="Be brief.", max_output_tokens=10, temperature=0)
            resp = await client.responses.create(**kwargs)
            assert resp.object == "response" and resp.status == "incomplete"
            assert resp.incomplete_details.reason == "max_output_tokens"
            assert [item.type for item in resp.output] == ["message"] and resp.output_text
            assert resp.usage.output_tokens == 10 and resp.usage.input_tokens > 0
            async with client.responses.stream(**kwargs) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_response()
            assert final.output_text == resp.output_text and final.id != resp.id
            assert kinds[:4] == [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
            ]
            assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
            async with httpx.AsyncClient(base_url=url) as http:
                counted = (
                    await http.post("/v1/responses/input_tokens", json={"input": "Say hi", "instructions": "Be brief."})
                ).json()
            assert counted == {"object": "response.input_tokens", "input_tokens": resp.usage.input_tokens}
        finally:
            await client.close()


@pytest.mark.slow
async def test_responses_function_calls_and_outputs(make_config):
    """Tool calls: tool_choice required gives a function_call item with arguments valid
    against the schema, streaming and not; the call and its function_call_output go back in."""
    async with open_server(make_config()) as (rt, url):
        client = _client(url)
        try:
            kwargs = dict(
                model="tiny",
                input="Weather in Oslo?",
                tools=TOOLS,
                tool_choice="required",
                max_output_tokens=CALL_TOKENS,
                temperature=0,
            )
            resp = await client.responses.create(**kwargs)
            call = resp.output[-1]
            assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
            assert call.call_id.startswith("call_") and call.id.startswith("fc_")
            jsonschema.validate(json.loads(call.arguments), PARAMS)
            async with client.responses.stream(**kwargs) as stream:
                deltas = [e.delta async for e in stream if e.type == "response.function_call_arguments.delta"]
                final = await stream.get_final_response()
            streamed = final.output[-1]
            assert (streamed.name, streamed.arguments) == (call.name, call.arguments) == (call.name, "".join(deltas))
            named = await client.responses.create(
                **{**kwargs, "tool_choice": {"type": "function", "name": "get_weather"}}
            )
            assert named.output[-1].name == "get_weather"

            history = [
                {"role": "user", "content": "Weather in Oslo?"},
                {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
            ]
            follow = await client.responses.create(model="tiny", input=history, tools=TOOLS, max_output_tokens=3)
            assert follow.output and follow.output[0].type == "message"
        finally:
            await client.close()


async def test_responses_reasoning_item(make_config):
    """Reasoning comes back as a reasoning item (streamed as reasoning_text
    deltas); reasoning.effort reaches the template."""
    async with open_server(make_config()) as (rt, url):
        use_template(rt, THINKING)
        client = _client(url)
        try:
            kwargs = dict(model="tiny", input="Think.", max_output_tokens=8, temperature=0)
            resp = await client.responses.create(**kwargs, reasoning={"effort": "low"})
            assert [item.type for item in resp.output] == ["reasoning"]
            text = resp.output[0].content[0].text
            async with client.responses.stream(**kwargs, reasoning={"effort": "low"}) as stream:
                deltas = [e.delta async for e in stream if e.type == "response.reasoning_text.delta"]
                final = await stream.get_final_response()
            assert "".join(deltas) == text == final.output[0].content[0].text
            off = await client.responses.create(**kwargs, reasoning={"effort": "none"})
            assert [item.type for item in off.output] == ["message"]
        finally:
            await client.close()
        turn = rt.prepare_chat([{"role": "user", "content": "x"}], reasoning_effort="low")
        assert turn.prompt.startswith("[effort=low]")


BAD = [
    ({"previous_response_id": "resp_1"}, "previous_response_id is not supported"),
    ({"input": 3}, "input must be a string or an array of items"),
    ({"input": [{"type": "mystery"}]}, "input[0]: cannot tell what this item is"),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": 5, "arguments": "{}"}]},
        "input[0].name must be a string",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "image input is not supported by this server: it was started without --mmproj",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        "input[0].content[0]: only input_text, text and input_image parts are supported, got 'input_file'",
    ),
    (
        {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
        "no earlier assistant tool call has id 'nope'",
    ),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "unknown function 'nope'"),
    # found by tests/test_fuzz_endpoints.py (were 500s)
    ({"input": [{"type": "reasoning", "content": True}]}, "input[0].content must be an array of content parts"),
    (
        {"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]}]},
        "input[0].content[0] must be an object whose text is a string",
    ),
    ({"text": {"format": {"type": "json_schema", "schema": 5}}}, "needs a 'json_schema.schema' object"),
]
COUNTED_ANYWAY = "json_schema.schema"  # input_tokens counts the prompt and builds no grammar


@pytest.mark.slow
@pytest.mark.parametrize("extra,message", BAD, ids=[m[:30] for _, m in BAD])
async def test_bad_responses_input_is_a_400_naming_the_field(make_config, extra, message):
    """Responses API bad input: a 400 naming the field on /v1/responses and its input_tokens twin."""
    async with open_server(make_config()) as (rt, url), httpx.AsyncClient(base_url=url) as http:
        for path in ("/v1/responses", *(("/v1/responses/input_tokens",) if COUNTED_ANYWAY not in message else ())):
            r = await http.post(path, json={"input": "hi", "max_output_tokens": 2, **extra})
            assert r.status_code == 400 and message in r.json()["error"]["message"], (path, r.text)
        ok = await http.post("/responses", json={"input": "hi", "max_output_tokens": 2})
        assert ok.status_code == 200 and ok.json()["object"] == "response"
