"""Reasoning: ``<think>`` content split into ``reasoning_content`` (streaming and not),
``--reasoning-format`` / ``reasoning_format``, and ``reasoning_effort`` /
``chat_template_kwargs`` reaching the template; through HTTP and ``rt.chat``.

The tiny model's text is random, so a think block is made by a grammar in the request
(``<think>`` words ``</think>`` words), or by a template that opens the block itself.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from chat_templates import KNOWS_THINK, THINKING, use_template
from conftest import open_server

from llamactor.protocol.errors import RequestError

ASK = [{"role": "user", "content": "Think first."}]
THINK_GRAMMAR = 'root ::= "<think>" [a-z]{2,8} " " [a-z]{2,8} "</think>\\n" [a-z]{2,8}'


async def _chat(url: str, **body) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 60, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        return r.json()


async def _stream(url: str, **body) -> tuple[str, str, str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=60, temperature=0, stream=True, extra_body=body
        )
        reasoning = content = finish = ""
        async for chunk in stream:
            for c in chunk.choices:
                reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
                content += c.delta.content or ""
                finish = c.finish_reason or finish
        return reasoning, content, finish
    finally:
        await client.close()


@pytest.mark.slow
async def test_think_block_split_into_reasoning_content(make_config):
    """With reasoning_format auto (the default) under a template that knows think blocks, and
    deepseek, the leading think block is reasoning_content and the rest the content, streaming
    and not; none keeps the raw text; deepseek-legacy fills both. Under a template that never
    writes <think> (the tiny model's ChatML), auto keeps the raw text, as llama-server."""
    async with open_server(make_config()) as (rt, url):
        raw = (await _chat(url, grammar=THINK_GRAMMAR, reasoning_format="none"))["choices"][0]["message"]
        text = raw["content"]
        assert text.startswith("<think>") and "reasoning_content" not in raw
        assert (await _chat(url, grammar=THINK_GRAMMAR))["choices"][0]["message"] == raw
        assert await _stream(url, grammar=THINK_GRAMMAR) == ("", text, "stop")
        use_template(rt, KNOWS_THINK)
        thoughts, answer = text[len("<think>") :].split("</think>\n")
        for fmt in ("auto", "deepseek", None):
            body = {"grammar": THINK_GRAMMAR, **({"reasoning_format": fmt} if fmt else {})}
            msg = (await _chat(url, **body))["choices"][0]["message"]
            assert (msg["reasoning_content"], msg["content"]) == (thoughts, answer)
            assert await _stream(url, **body) == (thoughts, answer, "stop")
        legacy = (await _chat(url, grammar=THINK_GRAMMAR, reasoning_format="deepseek-legacy"))["choices"][0]["message"]
        assert (legacy["reasoning_content"], legacy["content"]) == (thoughts, text)
        assert await _stream(url, grammar=THINK_GRAMMAR, reasoning_format="deepseek-legacy") == (thoughts, text, "stop")
        result = await rt.chat(ASK, grammar=THINK_GRAMMAR, max_tokens=60, temperature=0)
        assert (result.message.reasoning_content, result.message.content) == (thoughts, answer)


async def test_server_reasoning_format_none(make_config):
    """--reasoning-format none (RuntimeConfig.reasoning_format) is the default of requests."""
    async with open_server(make_config(reasoning_format="none")) as (rt, url):
        msg = (await _chat(url, grammar=THINK_GRAMMAR))["choices"][0]["message"]
        assert msg["content"].startswith("<think>") and "reasoning_content" not in msg
        msg = (await _chat(url, grammar=THINK_GRAMMAR, reasoning_format="deepseek"))["choices"][0]["message"]
        assert msg["reasoning_content"] and "<think>" not in msg["content"]


async def test_template_that_opens_the_think_block(make_config):
    """A template whose generation prompt ends with <think> makes the answer start as
    reasoning; reasoning_effort "none" (enable_thinking false) closes the block in the prompt."""
    async with open_server(make_config()) as (rt, url):
        use_template(rt, THINKING)
        msg = (await _chat(url, max_tokens=12))["choices"][0]["message"]
        assert msg["reasoning_content"] and msg["content"] == ""
        reasoning, content, finish = await _stream(url, max_tokens=12)
        assert (reasoning, content, finish) == (msg["reasoning_content"], "", "length")
        off = (await _chat(url, max_tokens=12, reasoning_effort="none"))["choices"][0]["message"]
        assert off["content"] and "reasoning_content" not in off
        result = await rt.chat(ASK, max_tokens=12, temperature=0)
        assert result.message.reasoning_content == msg["reasoning_content"]


async def test_reasoning_effort_and_chat_template_kwargs_reach_the_template(make_config):
    """reasoning_effort and chat_template_kwargs are template variables (HTTP and rt.chat);
    enable_thinking in chat_template_kwargs switches thinking like reasoning_effort "none"."""
    async with open_server(make_config()) as (rt, url):
        use_template(rt, THINKING)
        async with httpx.AsyncClient(base_url=url) as http:
            body = {"messages": ASK, "reasoning_effort": "high", "chat_template_kwargs": {"custom": {"a": [1, 2]}}}
            prompt = (await http.post("/apply-template", json=body)).json()["prompt"]
            assert prompt.startswith('[effort=high][custom={"a": [1, 2]}]') and prompt.endswith("<think>\n")
            body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
            prompt = (await http.post("/apply-template", json=body)).json()["prompt"]
            assert prompt.endswith("<think>\n\n</think>\n\n")
        turn = rt.prepare_chat(ASK, reasoning_effort="low", chat_template_kwargs={"custom": "x"})
        assert turn.prompt.startswith('[effort=low][custom="x"]') and turn.thinking_open


BAD = [
    ({"reasoning_format": "loud"}, "reasoning_format must be one of none, deepseek, deepseek-legacy, auto"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort must be one of"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages: set by the server"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking must be a boolean"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs: 'not a name'"),
]


@pytest.mark.slow
@pytest.mark.parametrize("extra,message", BAD, ids=[m[:30] for _, m in BAD])
async def test_bad_reasoning_input_is_a_400_naming_the_field(make_config, extra, message):
    """Reasoning bad input: a 400 naming the field (HTTP), a RequestError (rt.chat)."""
    async with open_server(make_config()) as (rt, url):
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **extra})
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        with pytest.raises(RequestError, match=message.split(":")[0]):
            await rt.chat(ASK, max_tokens=2, **extra)


async def test_forced_call_after_thinking(make_config):
    """A forced tool call under a template that opens <think> lets the model think
    first; the call grammar engages at </think> (lazily), and the grammar is valid for llama.cpp."""
    async with open_server(make_config()) as (rt, url):
        use_template(rt, THINKING)
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        turn = rt.prepare_chat(ASK, tools=tools, tool_choice="required")
        assert turn.thinking_open and turn.grammar_lazy and turn.grammar_triggers[0] == "</think>"
        assert 'root ::= "</think>"' in turn.grammar
        result = await rt.chat(ASK, tools=tools, tool_choice="required", max_tokens=5, temperature=0)
        assert result.message.reasoning_content and result.finish_reason == "length"
