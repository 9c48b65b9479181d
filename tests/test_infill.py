"""POST /infill and ``Runtime.infill``: llama-server's FIM prompt from the GGUF's FIM
tokens, the native /completion response shape, and its errors (501 for a model without FIM
tokens, 400 naming the field for bad input).

The default tiny model has no FIM tokens; ``write_tiny_model(fim=True)`` adds Qwen2.5-Coder's.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from conftest import open_server
from tinymodel import FIM_TOKENS, write_tiny_model

from llamactor.protocol.errors import NotSupported, RequestError
from llamactor.runtime import InfillChunk, InfillParts, Runtime
from llamactor.runtime.engine.model import Model
from llamactor.runtime.service.infill import infill_tokens

PREFIX = "def hello(name):\n    "
SUFFIX = "\n    return greeting\n"
EXTRA = [{"filename": "util.py", "text": "def greet(x):\n    return x\n"}]
N_PREDICT = 8
GREEDY = {"temperature": 0, "n_predict": N_PREDICT, "ignore_eos": True}


@pytest.fixture(scope="session")
def fim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fim") / "tiny-fim.gguf", fim=True)


def expected_prompt(model: Model, prompt: str = "") -> list[int]:
    """The repo-level FIM layout llama-server's format_prompt_infill builds, written out by hand."""
    fim = model.fim_tokens()

    def tok(text: str) -> list[int]:
        return model.tokenize(text, add_special=False, parse_special=False)

    return [
        fim.rep,
        *tok("myproject\n"),
        fim.sep,
        *tok("util.py\n"),
        *tok(EXTRA[0]["text"]),
        fim.sep,
        *tok("filename\n"),
        model.bos,
        fim.pre,
        *tok(PREFIX),
        *tok(prompt),
        fim.suf,
        *tok(SUFFIX),
        fim.mid,
    ]


def test_fim_tokens_from_gguf(fim_model: Path, tiny_model: Path) -> None:
    """The accessors read tokenizer.ggml.fim_*_token_id; the default model has none."""
    model = Model(fim_model)
    try:
        fim = model.fim_tokens()
        got = {kind: model.token_text(getattr(fim, kind)) for kind in FIM_TOKENS}
        assert got == FIM_TOKENS
    finally:
        model.close()
    plain = Model(tiny_model)
    try:
        assert set(vars(plain.fim_tokens()).values()) == {-1}
    finally:
        plain.close()


def test_prompt_layout_and_budget(fim_model: Path) -> None:
    """The layout, and llama-server's cuts: prefix keeps its last 3/4 of a batch, suffix
    its first quarter less the prompt, extra chunks only what the context leaves."""
    model = Model(fim_model)
    try:
        tokens = infill_tokens(model, PREFIX, SUFFIX, EXTRA, "x = ", n_batch=512, n_predict=-1, n_ctx=4096)
        assert tokens == expected_prompt(model, "x = ")
        fim = model.fim_tokens()
        long_prefix = "word " * 400
        cut = infill_tokens(model, long_prefix, SUFFIX * 40, EXTRA, n_batch=64, n_predict=16, n_ctx=64 + 32 + 5)
        extra_taken = cut[: cut.index(model.bos)]
        assert len(extra_taken) == 5  # n_ctx - n_batch - 2 * n_predict
        pre, suf = cut.index(fim.pre), cut.index(fim.suf)
        assert suf - pre - 1 == 48  # 3 * (64 // 4)
        assert cut[pre + 1 : suf] == model.tokenize(long_prefix, add_special=False)[-48:]
        assert len(cut) - 1 - suf - 1 == 16 - 2  # 64 // 4 - (2 + len(prompt))
        spm = infill_tokens(model, PREFIX, SUFFIX, (), n_batch=512, n_predict=-1, n_ctx=4096, spm_infill=True)
        assert spm[spm.index(model.bos) + 1] == fim.suf and spm.index(fim.pre) > spm.index(fim.suf)
    finally:
        model.close()


async def test_infill_over_http_and_runtime(make_config, fim_model: Path) -> None:
    """/infill answers in the /completion shape, with the FIM prompt llama-server builds;
    the same request through Runtime.infill and as token ids through /completion agree."""
    async with open_server(make_config(model=fim_model)) as (rt, url):
        assert rt.model is not None
        want = expected_prompt(rt.model, "x = ")
        body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "x = ", **GREEDY}
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            r = await client.post("/infill", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["tokens_evaluated"] == len(want)
            assert out["tokens_predicted"] == N_PREDICT and len(out["tokens"]) == N_PREDICT
            assert out["stop"] is True and isinstance(out["content"], str) and out["content"]
            assert "generation_settings" in out and "timings" in out
            same = await client.post("/completion", json={"prompt": want, **GREEDY})
            assert same.json()["tokens"] == out["tokens"]

            async with client.stream("POST", "/infill", json={**body, "stream": True}) as s:
                assert s.status_code == 200
                chunks = [json.loads(line[6:]) async for line in s.aiter_lines() if line.startswith("data: ")]
            assert "".join(c["content"] for c in chunks) == out["content"]
            assert chunks[-1]["stop"] is True

            # return_progress: the prompt's progress chunks first, as /completion sends them
            progressed = {**body, "stream": True, "return_progress": True}
            async with client.stream("POST", "/infill", json=progressed) as s:
                assert s.status_code == 200
                chunks = [json.loads(line[6:]) async for line in s.aiter_lines() if line.startswith("data: ")]
            progress = [c for c in chunks if "prompt_progress" in c]
            assert progress and all(c["content"] == "" for c in progress)
            assert "".join(c["content"] for c in chunks) == out["content"]

            props = (await client.get("/props")).json()
            assert props["infill"] is True

        parts = InfillParts(input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=[InfillChunk(**c) for c in EXTRA])
        result = await rt.infill(parts, prompt="x = ", max_tokens=N_PREDICT, temperature=0, ignore_eos=True)
        assert result.n_prompt == len(want)
        assert list(result.choices[0].tokens) == out["tokens"]
        assert result.text == out["content"]


async def test_infill_bad_input(make_config, fim_model: Path) -> None:
    """Infill bad input: llama-server's messages, each a 400 naming the field."""
    async with open_server(make_config(model=fim_model, parallel=1)) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            cases = [
                ({"input_suffix": SUFFIX}, "input_prefix"),
                ({"input_prefix": PREFIX}, "input_suffix"),
                ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": 3}, "prompt"),
                ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": {"text": "a"}}, "input_extra"),
                ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [{"filename": "a"}]}, "text"),
                (
                    {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [{"text": "a", "filename": 1}]},
                    "filename",
                ),
                ({"input_prefix": [PREFIX, 99999], "input_suffix": SUFFIX}, "99999"),
            ]
            for body, field in cases:
                r = await client.post("/infill", json={**body, "n_predict": 1})
                assert r.status_code == 400, (body, r.text)
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error" and field in err["message"], (body, err)
            ok = await client.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, **GREEDY})
            assert ok.status_code == 200  # nothing else lost
        with pytest.raises(RequestError, match="input_extra"):
            await rt.infill(InfillParts(input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=[{"filename": "a"}]))


async def test_infill_without_fim_tokens(make_config) -> None:
    """A model without FIM tokens gets llama-server's 501 not_supported_error."""
    async with open_server(replace(make_config(), parallel=1)) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            r = await client.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX})
            assert r.status_code == 501
            err = r.json()["error"]
            assert err["type"] == "not_supported_error"
            assert err["message"] == (
                "Infill is not supported by this model: prefix token is missing. "
                "suffix token is missing. middle token is missing. "
            )
            assert (await client.get("/props")).json()["infill"] is False
        with pytest.raises(NotSupported, match="Infill is not supported"):
            await rt.infill(InfillParts(input_prefix=PREFIX, input_suffix=SUFFIX))
        assert isinstance(rt, Runtime)
