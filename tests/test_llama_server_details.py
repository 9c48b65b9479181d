"""Request details llama.cpp's own server tests exercise, each through a real request:
``logit_bias`` given as texts (each of the text's tokens biased) in the list and the OpenAI map
forms, beside token ids, on /completion and /v1/completions, and through the embedding API."""

from __future__ import annotations

import httpx
from conftest import open_server, wait_until

from llamactor.runtime import Runtime

PROMPT = "What is the best book"


async def test_logit_bias_by_text(make_config):
    """Banning the texts of the greedy answer's tokens changes the answer and none of them comes
    out again; the same ban given as token ids (from /tokenize) answers the same; a token id as a
    number-like string is a token id; a bias entry that is neither a number nor a text is a 400."""
    async with (
        open_server(make_config(parallel=1)) as (rt, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True}
        plain = (await client.post("/completion", json=body)).json()
        pieces = [(await client.post("/detokenize", json={"tokens": [t]})).json()["content"] for t in plain["tokens"]]
        texts = sorted({p for p in pieces if p.strip()})
        assert texts
        banned_ids = set()
        for text in texts:
            banned_ids.update((await client.post("/tokenize", json={"content": text})).json()["tokens"])
        by_text = (await client.post("/completion", json={**body, "logit_bias": [[t, -100] for t in texts]})).json()
        by_map = (await client.post("/completion", json={**body, "logit_bias": dict.fromkeys(texts, -100)})).json()
        by_ids = (
            await client.post("/completion", json={**body, "logit_bias": [[t, False] for t in banned_ids]})
        ).json()
        assert by_text["tokens"] != plain["tokens"]
        assert not banned_ids & set(by_text["tokens"])
        by_id_map = (
            await client.post("/completion", json={**body, "logit_bias": {str(t): -100 for t in banned_ids}})
        ).json()
        assert by_text["tokens"] == by_map["tokens"] == by_ids["tokens"] == by_id_map["tokens"]
        oai = await client.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logit_bias": dict.fromkeys(texts, -100)},
        )
        assert oai.status_code == 200 and oai.json()["choices"][0]["text"] == by_text["content"]
        for digits in ("¹", "٣"):  # digits to str.isdigit, not a token id: a text (this was a 500)
            r = await client.post("/completion", json={**body, "logit_bias": {digits: 0.0}})
            assert r.status_code == 200, r.text
        bad = await client.post("/completion", json={**body, "logit_bias": [[True, 1.0]]})
        assert bad.status_code == 400 and "logit_bias" in bad.json()["error"]["message"]
        bias = [(t, -100.0) for t in texts]
        out = await rt.complete(PROMPT, max_tokens=8, temperature=0, ignore_eos=True, logit_bias=bias)
        assert list(out.choices[0].tokens) == by_text["tokens"]


async def test_embedding_inputs_as_content_parts(make_config):
    """An embedding input given as ``{"content": [text parts]}`` embeds its texts joined, the same
    vector as the plain string; media parts, a bare string content and unknown parts are 400s."""
    async with (
        open_server(make_config(parallel=1, embedding=True, pooling="last")) as (rt, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        parts = {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}
        r = await client.post("/v1/embeddings", json={"input": ["hello world", parts]})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert data[0]["embedding"] == data[1]["embedding"]
        for bad, why in (
            ({"content": "string"}, "content parts"),
            ({"content": [{"type": "unknown"}]}, "text"),
            ({"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}, "image_url"),
            ({"content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}, "input_audio"),
        ):
            r = await client.post("/v1/embeddings", json={"input": [bad]})
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        same = await rt.embed(["hello world", parts])  # the embedding API takes the same shapes
        assert list(same.vectors[0]) == list(same.vectors[1])


async def test_template_details_as_llama_cpp(make_config):
    """What llama.cpp gives a Jinja chat template: today as ``date_string`` and ``datetime``, an
    undefined variable added to a string is the string; /apply-template's
    ``add_generation_prompt``; ``--reasoning off`` sets ``enable_thinking`` false unless a
    request's ``chat_template_kwargs`` says otherwise."""
    import datetime

    template = (
        "{{ date_string }}|{{ datetime }}|{{ 'x' + nothing_defined }}|"
        "{% if enable_thinking %}think{% else %}nothink{% endif %}|"
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}|gen{% endif %}"
    )
    now = datetime.datetime.now()
    today = f"{now.strftime('%d %b %Y')}|{now.strftime('%b %d %Y')}"
    messages = [{"role": "user", "content": "hi"}]
    for reasoning, kwargs, thinking in (("auto", None, "think"), ("off", None, "nothink"), ("off", True, "think")):
        config = make_config(parallel=1, chat_template=template, reasoning=reasoning)
        async with open_server(config) as (_, url), httpx.AsyncClient(base_url=url, timeout=60) as client:
            body: dict = {"messages": messages}
            if kwargs is not None:
                body["chat_template_kwargs"] = {"enable_thinking": kwargs}
            prompt = (await client.post("/apply-template", json=body)).json()["prompt"]
            assert prompt == f"{today}|x|{thinking}|hi|gen"
            bare = (await client.post("/apply-template", json={**body, "add_generation_prompt": False})).json()
            assert bare["prompt"] == f"{today}|x|{thinking}|hi"


def test_reasoning_flag_reads_llama_servers_values():
    import pytest
    from serveargs import parse_serve

    assert [parse_serve(["--reasoning", v]).config.reasoning for v in ("on", "1", "off", "false", "auto")] == [
        "on",
        "on",
        "off",
        "off",
        "auto",
    ]
    with pytest.raises(SystemExit):
        parse_serve(["--reasoning", "maybe"])


async def test_several_prompts_and_mixed_prompts(make_config):
    """/completion as llama-server reads its prompt: several prompts (token ids, texts, objects)
    answered as an array in order with each answer's index; one prompt of token ids with texts
    among them tokenized in place (the same answer as its tokens); a stream of several prompts and
    a bad one among them are 400s."""
    async with (
        open_server(make_config(parallel=2)) as (rt, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        text = "I believe the meaning of life is"
        tokens = (await client.post("/tokenize", json={"content": text, "add_special": True})).json()["tokens"]
        body = {"n_predict": 4, "temperature": 0, "ignore_eos": True}
        single = (await client.post("/completion", json={**body, "prompt": tokens})).json()
        for prompts in ([tokens, tokens], [tokens, text], [tokens, {"prompt_string": text}]):
            r = await client.post("/completion", json={**body, "prompt": prompts})
            assert r.status_code == 200, r.text
            answers = r.json()
            assert [a["index"] for a in answers] == [0, 1]
            assert [a["content"] for a in answers] == [single["content"]] * 2
        plain = (await client.post("/tokenize", json={"content": " life", "add_special": False})).json()["tokens"]
        mixed = await client.post("/completion", json={**body, "prompt": [*tokens[:3], " life", tokens[3]]})
        by_ids = await client.post("/completion", json={**body, "prompt": [*tokens[:3], *plain, tokens[3]]})
        assert mixed.status_code == 200 and mixed.json()["tokens"] == by_ids.json()["tokens"]
        assert mixed.json()["tokens_evaluated"] == 4 + len(plain)
        streamed = await client.post("/completion", json={**body, "prompt": [text, text], "stream": True})
        assert streamed.status_code == 400 and "several prompts" in streamed.text
        bad = await client.post("/completion", json={**body, "prompt": [text, [1, 10**6]]})
        assert bad.status_code == 400 and "outside the vocabulary" in bad.text
        out = await rt.complete([*tokens[:3], " life", tokens[3]], max_tokens=4, temperature=0, ignore_eos=True)
        assert list(out.choices[0].tokens) == mixed.json()["tokens"]


async def test_generation_settings_logit_bias_as_llama_server(make_config):
    """generation_settings.logit_bias as llama-server writes it: {"bias", "token"} objects, null
    for a ban; with ignore_eos every end-of-generation token is listed banned, without it none."""
    async with (
        open_server(make_config(parallel=1)) as (rt, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        body = {"prompt": "Once upon a time", "n_predict": 2, "temperature": 0, "logit_bias": [[7, 1.5], [8, False]]}
        settings = (await client.post("/completion", json=body)).json()["generation_settings"]
        assert settings["logit_bias"] == [{"bias": 1.5, "token": 7}, {"bias": None, "token": 8}]
        ignoring = (await client.post("/completion", json={**body, "ignore_eos": True})).json()["generation_settings"]
        eog = [e for e in ignoring["logit_bias"] if e["token"] not in (7, 8)]
        assert eog and all(e["bias"] is None for e in eog)
        assert [e["token"] for e in eog] == list(rt.model.eog_tokens)


async def test_assistant_prefill_and_continue_final_message(make_config):
    """A chat that ends with the assistant's message continues it, as llama-server's prefill: the
    prompt ends with that text after the assistant's opening, and the answer carries on from it;
    continue_final_message true (with add_generation_prompt false) does the same; both true, two
    assistant messages at the end, or continuing a non-assistant message are 400s; with
    continue_final_message false (or --no-prefill-assistant) the chat is answered as before."""
    user = {"role": "user", "content": "What is the best book"}
    prefill = {"role": "assistant", "content": "Whill"}
    async with (
        open_server(make_config(parallel=1)) as (rt, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        opening = (await client.post("/apply-template", json={"messages": [user]})).json()["prompt"]
        prompt = (await client.post("/apply-template", json={"messages": [user, prefill]})).json()["prompt"]
        assert prompt == opening + "Whill"
        explicit = {"messages": [user, prefill], "continue_final_message": True, "add_generation_prompt": False}
        assert (await client.post("/apply-template", json=explicit)).json()["prompt"] == prompt
        answered = (
            await client.post("/apply-template", json={"messages": [user, prefill], "continue_final_message": False})
        ).json()["prompt"]
        assert answered.startswith(opening + "Whill") and answered != prompt
        chat = {"messages": [user, prefill], "max_tokens": 4, "temperature": 0}
        continued = (await client.post("/v1/chat/completions", json=chat)).json()
        native = (await client.post("/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0})).json()
        assert continued["choices"][0]["message"]["content"] == native["content"]
        for body, why in (
            ({**explicit, "add_generation_prompt": True}, "both add_generation_prompt and continue_final_message"),
            ({"messages": [user, prefill, prefill]}, "2 or more assistant messages"),
            (
                {"messages": [user], "continue_final_message": True, "add_generation_prompt": False},
                "must be the assistant",
            ),
        ):
            r = await client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    async with Runtime.open(make_config(parallel=1, prefill_assistant=False)) as rt:
        assert rt.apply_chat_template([user, prefill]) == answered


async def test_verbose_answers(make_config):
    """verbose: an OpenAI answer (chat or completions) carries llama-server's ``__verbose``: the
    native answer with the prompt's text; off by default, on by default with -v, and a request's
    ``verbose: false`` turns it off again."""
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    chat = {"messages": messages, "max_tokens": 2, "temperature": 0}
    for server_verbose in (False, True):
        async with (
            open_server(make_config(parallel=1, verbose=server_verbose)) as (_, url),
            httpx.AsyncClient(base_url=url, timeout=60) as client,
        ):
            on = (await client.post("/v1/chat/completions", json={**chat, "verbose": True})).json()
            assert "Book" in on["__verbose"]["prompt"] and on["__verbose"]["tokens_predicted"] == 2
            assert on["__verbose"]["content"] == on["choices"][0]["message"]["content"]
            off = (await client.post("/v1/chat/completions", json={**chat, "verbose": False})).json()
            assert "__verbose" not in off
            default = (await client.post("/v1/chat/completions", json=chat)).json()
            assert ("__verbose" in default) is server_verbose
            text = {"prompt": "hello there", "max_tokens": 2, "verbose": True}
            completion = (await client.post("/v1/completions", json=text)).json()
            assert completion["__verbose"]["prompt"].endswith("hello there")


async def test_chat_json_schema_field_and_prefill_parts(make_config):
    """llama-server's top-level json_schema on OpenAI chat and completions (beside
    response_format) constrains the answer; an assistant prefill given as text parts is continued
    from its texts joined by a blank line, as llama.cpp renders them."""
    user = {"role": "user", "content": "Write an example"}
    async with (
        open_server(make_config(parallel=1)) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        body = {"messages": [user], "max_tokens": 6, "json_schema": {"const": "42"}}
        chat = (await client.post("/v1/chat/completions", json=body)).json()
        assert chat["choices"][0]["message"]["content"] == '"42"'
        text = (
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 6, "json_schema": {"const": "42"}})
        ).json()
        assert text["choices"][0]["text"] == '"42"'
        parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
        prompt = (
            await client.post("/apply-template", json={"messages": [user, {"role": "assistant", "content": parts}]})
        ).json()["prompt"]
        assert prompt.endswith("Wh\n\nill")


async def test_slots_fail_on_no_slot_is_a_503_while_every_slot_is_busy(make_config):
    """``GET /slots?fail_on_no_slot=1``, llama-server's readiness probe: 503 "no slot available"
    while every slot serves a request, 200 with the slots otherwise (and without the parameter)."""
    import threading

    import anyio
    from faults import Faults

    faults = Faults()
    faults.hold = threading.Event()  # the request's decode steps wait: its slot stays busy
    async with open_server(make_config(parallel=1), hooks=faults) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            first = await client.get("/slots?fail_on_no_slot=1")
            assert first.status_code == 200 and "id_task" not in first.json()[0]  # no request yet
            body = {"prompt": "busy", "n_predict": 4, "temperature": 0.5, "top_k": 7, "repeat_penalty": 1.1}
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: client.post("/completion", json=body))
                try:
                    await wait_until(lambda: bool(faults.holding), timeout_s=30)
                    busy = await client.get("/slots?fail_on_no_slot=1")
                    assert busy.status_code == 503, busy.text
                    error = busy.json()["error"]
                    assert error == {"code": 503, "message": "no slot available", "type": "unavailable_error"}
                    plain = await client.get("/slots")
                    assert plain.status_code == 200 and plain.json()[0]["is_processing"] is True
                    slot = plain.json()[0]
                    assert slot["params"]["top_k"] == 7 and slot["params"]["repeat_penalty"] == 1.1
                    assert slot["next_token"][0]["has_next_token"] is True
                finally:
                    faults.hold.set()
            await wait_until(lambda: rt.in_flight() == 0, timeout_s=30)
            idle = await client.get("/slots?fail_on_no_slot=1")
            assert idle.status_code == 200
            # an idle slot shows the request it served last, as llama-server's (its task_prev)
            slot = idle.json()[0]
            assert slot["is_processing"] is False and slot["id_task"] >= 0
            assert slot["n_prompt_tokens"] > 0
            assert slot["n_prompt_tokens_processed"] + slot["n_prompt_tokens_cache"] == slot["n_prompt_tokens"]
            assert slot["next_token"][0] == {
                "has_next_token": False,
                "has_new_line": False,
                "n_remain": 0,
                "n_decoded": 4,
            }
            assert slot["params"]["temperature"] == 0.5 and slot["params"]["n_predict"] == 4
            assert slot["params"]["samplers"] and slot["params"]["lora"] == []


async def test_reasoning_budget_zero_turns_thinking_off(make_config):
    """--reasoning-budget 0 renders chats with enable_thinking false, as llama-server; a positive
    budget is not applied, and the startup log says so (it used to be stored and ignored quietly)."""
    from serveargs import parse_serve

    source = "{{ 'think:' ~ (enable_thinking if enable_thinking is defined else 'unset') }}"
    messages = [{"role": "user", "content": "hi"}]
    async with Runtime.open(make_config(chat_template=source, reasoning_budget=0)) as rt:
        assert rt.apply_chat_template(messages) == "think:False"
        assert rt.apply_chat_template(messages, chat_template_kwargs={"enable_thinking": True}) == "think:True"
    async with Runtime.open(make_config(chat_template=source)) as rt:
        assert rt.apply_chat_template(messages) == "think:True"  # the default, as llama-server's
    ignored = dict(parse_serve(["--reasoning-budget", "256"]).ignored)
    assert "not cut at a token count" in ignored["--reasoning-budget"]
    assert "--reasoning-budget" not in dict(parse_serve(["--reasoning-budget", "0"]).ignored)


async def test_model_meta_and_template_caps(make_config):
    """GET /v1/models' ``meta`` and /props' ``model_ftype`` and ``chat_template_caps``, as
    llama-server answers them: the model's sizes come from the file (the API process loads its
    vocabulary only), the caps from rendering probe chats with the template."""
    async with (
        open_server(make_config(parallel=2)) as (rt, url),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        meta = (await client.get("/v1/models")).json()["data"][0]["meta"]
        props = (await client.get("/props")).json()
    assert meta["n_ctx"] == props["n_ctx"] and meta["n_vocab"] == rt.model.n_vocab
    assert meta["n_params"] > 0 and meta["size"] > 0 and meta["n_ctx_train"] > 0 and meta["n_embd"] > 0
    assert meta["ftype"] == props["model_ftype"] != "all F32"  # the file's type, not a guess from no weights
    caps = props["chat_template_caps"]
    assert caps["supports_system_role"] and caps["supports_string_content"] and not caps["supports_tools"]


def test_template_caps_by_rendering_probe_chats():
    """Tools, tool calls, object arguments and parallel calls of a Hermes template; a template
    that drops the system message lacks the system role; a reasoning template's effort."""
    from chat_templates import HERMES, MISTRAL, THINKING

    from llamactor.runtime.service.chat import ChatTemplate
    from llamactor.runtime.service.templatecaps import template_caps

    hermes = template_caps(ChatTemplate(HERMES))
    assert hermes["supports_tools"] and hermes["supports_tool_calls"] and hermes["supports_system_role"]
    assert hermes["supports_object_arguments"] and hermes["supports_parallel_tool_calls"]
    assert not hermes["supports_typed_content"] and not hermes["supports_reasoning_effort"]
    assert not template_caps(ChatTemplate(MISTRAL))["supports_system_role"]
    assert template_caps(ChatTemplate(THINKING))["supports_reasoning_effort"]
    assert template_caps(ChatTemplate("chatml", builtin=True))["supports_tools"] is False
