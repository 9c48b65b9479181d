"""Embeddings and rerank: the OpenAI client, llama-server's native shapes,
``Runtime.embed``/``Runtime.rerank``, bad input, and chat served beside embeddings.

The tiny LLaMA model serves embeddings with ``--pooling mean|last|none``; rerank runs on a tiny
Qwen3 model with a classifier head (tests/tinyreranker.py), since rank pooling needs one.
"""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import anyio
import httpx
import numpy as np
import pytest
from conftest import open_server, wait_until
from openai import AsyncOpenAI
from tinyreranker import write_tiny_reranker

from llamactor.protocol.errors import ConfigError, NotSupported, RequestError
from llamactor.runtime import Runtime
from llamactor.runtime.engine.embedding import EmbeddingContext, gguf_tensor_names, normalize, rerank_tokens
from llamactor.runtime.service.embeddings import MAX_EMBEDDING_INPUTS

N_EMBD = 64
FOX = "The quick brown fox jumps over the lazy dog"
HELLO = "Hello world, this is a tiny model"
QUERY = "What is a panda?"
DOCS = ["hi", "it is a bear", "The giant panda is a bear species endemic to China.", "hi"]
# An input embedded alone and packed with others is the same up to llama.cpp's kernel choice for
# the batch size (flash attention's f16 path on the CPU): measured up to 1e-3 on the tiny model.
PACKED_ATOL = 2e-3


@pytest.fixture(scope="session")
def tiny_reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_reranker(tmp_path_factory.mktemp("reranker") / "reranker.gguf")


@pytest.fixture
def emb_config(make_config):
    def make(**overrides):
        base = {"parallel": 2, "embedding": True, "pooling": "mean"}
        return make_config(**(base | overrides))

    return make


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _vec(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


# ---- OpenAI client -----------------------------------------------------------------------


@pytest.mark.slow
async def test_openai_client_embeddings_shapes_and_values(emb_config):
    """Embeddings with the real openai client: equal inputs equal, different inputs different, unit norm,
    base64 (the client's default) decodes to the floats, token ids equal the text they tokenize to."""
    async with open_server(emb_config()) as (rt, url), _client(url) as client:
        resp = await client.embeddings.create(input=[FOX, FOX, HELLO], model="tiny-embed", encoding_format="float")
        assert resp.object == "list" and resp.model == "tiny-embed"
        assert [d.index for d in resp.data] == [0, 1, 2] and all(d.object == "embedding" for d in resp.data)
        a, b, c = (_vec(d.embedding) for d in resp.data)
        assert a.shape == (N_EMBD,)
        np.testing.assert_allclose(a, b, atol=1e-6)
        assert np.linalg.norm(a - c) > 0.1
        for v in (a, b, c):
            assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-5
        fox_ids = await rt.tokenize(FOX, add_special=True)
        hello_ids = await rt.tokenize(HELLO, add_special=True)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == 2 * len(fox_ids) + len(hello_ids)

        # the same input alone, as floats and as base64 (what the client asks for by default)
        single = await client.embeddings.create(
            input=FOX, model="m", encoding_format="float", dimensions=N_EMBD, user="someone"
        )
        default = await client.embeddings.create(input=FOX, model="m")
        assert len(single.data) == len(default.data) == 1
        assert _vec(default.data[0].embedding).tolist() == _vec(single.data[0].embedding).tolist()
        np.testing.assert_allclose(_vec(single.data[0].embedding), a, atol=PACKED_ATOL)

        # token ids: one list, and a list of lists, equal the text inputs
        by_ids = await client.embeddings.create(input=fox_ids, model="m", encoding_format="float")
        assert _vec(by_ids.data[0].embedding).tolist() == _vec(single.data[0].embedding).tolist()
        both = await client.embeddings.create(input=[fox_ids, hello_ids], model="m", encoding_format="float")
        np.testing.assert_allclose(_vec(both.data[0].embedding), a, atol=PACKED_ATOL)
        np.testing.assert_allclose(_vec(both.data[1].embedding), c, atol=PACKED_ATOL)


async def test_base64_over_http_is_little_endian_float32(emb_config):
    """``encoding_format: base64`` carries the same float32 values as ``float``."""
    async with open_server(emb_config()) as (_rt, url), httpx.AsyncClient(base_url=url) as http:
        floats = (await http.post("/v1/embeddings", json={"input": [FOX, HELLO]})).json()
        b64 = (await http.post("/v1/embeddings", json={"input": [FOX, HELLO], "encoding_format": "base64"})).json()
        for f, b in zip(floats["data"], b64["data"]):
            assert b["encoding_format"] == "base64" and "encoding_format" not in f  # as llama-server marks them
            decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
            assert decoded.tolist() == _vec(f["embedding"]).tolist()
        assert floats["model"] == "tiny.gguf"  # the server's model id when the request names none


# ---- native endpoints ----------------------------------------------------------------------


async def test_native_embedding_endpoints(emb_config):
    """Native embeddings: /embedding and /embeddings answer ``[{index, embedding: [[...]]}]``;
    ``embd_normalize`` -1 (raw), 0 (max-abs int16), 1 (taxicab), 2 (default, euclidean), 3 (p-norm)."""
    async with open_server(emb_config()) as (_rt, url), httpx.AsyncClient(base_url=url) as http:
        one = (await http.post("/embedding", json={"content": FOX})).json()
        assert len(one) == 1 and one[0]["index"] == 0 and len(one[0]["embedding"]) == 1
        unit = _vec(one[0]["embedding"][0])
        assert unit.shape == (N_EMBD,) and abs(float(np.linalg.norm(unit)) - 1) < 1e-5
        many = (await http.post("/embeddings", json={"content": [FOX, HELLO]})).json()
        assert [m["index"] for m in many] == [0, 1]
        np.testing.assert_allclose(_vec(many[0]["embedding"][0]), unit, atol=PACKED_ATOL)

        raw = _vec(
            (await http.post("/embedding", json={"content": FOX, "embd_normalize": -1})).json()[0]["embedding"][0]
        )
        assert abs(float(np.linalg.norm(raw)) - 1) > 1e-3
        np.testing.assert_allclose(raw / np.linalg.norm(raw), unit, atol=1e-5)
        for norm, check in (
            (0, lambda v: np.abs(v).max() - 32760.0),
            (1, lambda v: np.abs(v).sum() - 1.0),
            (3, lambda v: (np.abs(v.astype(np.float64)) ** 3).sum() - 1.0),
        ):
            body = (await http.post("/embeddings", json={"content": FOX, "embd_normalize": norm})).json()
            v = _vec(body[0]["embedding"][0])
            assert abs(float(check(v))) < 1e-2 * (32760 if norm == 0 else 1), norm
            np.testing.assert_allclose(v / np.linalg.norm(v), unit, atol=1e-5)
        # "content" on /v1/embeddings gets the native shape, as llama-server answers it
        native = (await http.post("/v1/embeddings", json={"content": FOX})).json()
        assert isinstance(native, list) and native[0]["index"] == 0


async def test_pooling_none_returns_token_vectors_and_refuses_openai(emb_config):
    """``--pooling none`` gives one unnormalized vector per token on the native API, and
    /v1/embeddings refuses it with llama-server's message."""
    async with open_server(emb_config(pooling="none")) as (rt, url), httpx.AsyncClient(base_url=url) as http:
        ids = await rt.tokenize(FOX, add_special=True)
        body = (await http.post("/embeddings", json={"content": FOX})).json()
        rows = np.asarray(body[0]["embedding"], dtype=np.float32)
        assert rows.shape == (len(ids), N_EMBD)
        assert any(abs(float(np.linalg.norm(r)) - 1) > 1e-3 for r in rows)  # not normalized
        r = await http.post("/v1/embeddings", json={"input": FOX})
        assert r.status_code == 400 and "Pooling type 'none' is not OAI compatible" in r.json()["error"]["message"]
        out = await rt.embed(FOX)
        assert out.pooling == "none" and out.vectors[0].shape == (len(ids), N_EMBD)


# ---- the embedding API -----------------------------------------------------------------------


async def test_runtime_embed(emb_config):
    """Embeddings through the embedding API: ``Runtime.embed`` returns one vector per input, in order;
    pooling ``last`` differs from ``mean``; ``normalize=-1`` gives raw vectors."""
    async with Runtime.open(emb_config(pooling="last")) as rt:
        out = await rt.embed([FOX, HELLO, FOX])
        assert out.pooling == "last" and len(out.vectors) == 3 and out.vectors[0].shape == (N_EMBD,)
        assert out.n_tokens[0] == len(await rt.tokenize(FOX)) and out.prompt_tokens == sum(out.n_tokens)
        np.testing.assert_allclose(out.vectors[0], out.vectors[2], atol=1e-6)
        assert np.linalg.norm(out.vectors[0] - out.vectors[1]) > 0.1
        ids = await rt.tokenize(HELLO)
        np.testing.assert_allclose((await rt.embed(ids)).vectors[0], out.vectors[1], atol=PACKED_ATOL)
        raw = (await rt.embed(FOX, normalize=-1)).vectors[0]
        np.testing.assert_allclose(normalize(raw, 2), out.vectors[0], atol=1e-5)
        last = out.vectors[0]
    async with Runtime.open(emb_config(pooling="mean", embd_normalize=1)) as rt:  # the server's default norm
        mean = (await rt.embed(FOX)).vectors[0]
        assert abs(float(np.abs(mean).sum()) - 1) < 1e-4
        assert np.linalg.norm(normalize(mean, 2) - last) > 0.1


async def test_many_inputs_are_packed_into_shared_decodes(emb_config):
    """Embedding batching: 40 inputs over ``--embedding-parallel 8`` take 5 decodes, and each packed
    vector equals the input embedded alone."""
    async with Runtime.open(emb_config(embedding_parallel=8)) as rt:
        texts = [f"input number {i} {FOX[: i % 30]}" for i in range(40)]
        actor = rt.engine.embedder.actor
        before = actor.statistics().steps
        out = await rt.embed(texts)
        assert actor.statistics().steps - before == 5
        for i in (0, 17, 39):
            np.testing.assert_allclose((await rt.embed(texts[i])).vectors[0], out.vectors[i], atol=PACKED_ATOL)
        assert actor.statistics().inputs_done == 43


# ---- bad input -----------------------------------------------------------------------------


async def test_embeddings_refused_without_embedding_flag(make_config):
    """Embeddings bad input: a server started without --embedding answers 501 not_supported_error (as
    llama-server), for every endpoint and ``Runtime.embed``; chat is unaffected."""
    async with open_server(make_config()) as (rt, url), httpx.AsyncClient(base_url=url) as http:
        for path, body in (
            ("/v1/embeddings", {"input": "x"}),
            ("/embedding", {"content": "x"}),
            ("/embeddings", {"content": "x"}),
            ("/rerank", {"query": "q", "documents": ["d"]}),
        ):
            r = await http.post(path, json=body)
            assert r.status_code == 501, path
            err = r.json()["error"]
            assert err["type"] == "not_supported_error"
            assert ("--reranking" if path == "/rerank" else "--embeddings") in err["message"]
        with pytest.raises(NotSupported, match="--embeddings"):
            await rt.embed("x")
        r = await http.post("/completion", json={"prompt": "hi", "n_predict": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "body", "names"),
    [
        ("/v1/embeddings", {"input": []}, '"input" must not be empty'),
        ("/v1/embeddings", {"input": ""}, "input[0] is an empty string"),
        ("/v1/embeddings", {"input": ["ok", ""]}, "input[1] is an empty string"),
        ("/v1/embeddings", {"input": [[]]}, "input[0] is an empty token list"),
        (
            "/v1/embeddings",
            {"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)},
            f'"input" has {MAX_EMBEDDING_INPUTS + 1} items',
        ),
        ("/v1/embeddings", {"input": "long " * 200}, "input[0] has"),
        ("/v1/embeddings", {"input": [[1, 2], [3, 99999]]}, "input[1]: token id 99999"),
        ("/v1/embeddings", {"input": [-1]}, "input[0]: token id -1"),
        ("/v1/embeddings", {"input": ["a", 5]}, "input[1] must be a string or a list of token ids"),
        ("/v1/embeddings", {"input": 5}, "$.input"),
        ("/v1/embeddings", {"model": "m"}, '"input" or "content" must be provided'),
        ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format must be float or base64"),
        ("/v1/embeddings", {"input": "x", "dimensions": 32}, "dimensions"),
        ("/v1/embeddings", {"input": "x", "embd_normalize": -5}, "embd_normalize"),
        ("/embedding", {"content": "x", "encoding_format": "base64"}, "encoding_format 'base64' is only available"),
        ("/embeddings", {"content": []}, '"content" must not be empty'),
        ("/embedding", {"content": [[1, 500]]}, "content[0]: token id 500"),
        ("/embedding", {}, '"input" or "content" must be provided'),
        ("/rerank", {"query": "q", "documents": ["d"]}, "this server's pooling is 'mean'"),
    ],
)
async def test_bad_embedding_input_is_a_400_naming_the_field(emb_config, path, body, names):
    """Embeddings bad input: each is a 4xx naming the field (and the item), and nothing else is lost:
    the next request is served. Inputs longer than the embedding batch (--ubatch-size) are refused."""
    async with open_server(emb_config(n_batch=128, n_ubatch=128)) as (rt, url), httpx.AsyncClient(base_url=url) as http:
        r = await http.post(path, json=body)
        assert r.status_code == (501 if path == "/rerank" else 400), r.text
        assert names in r.json()["error"]["message"], r.json()
        ok = await http.post("/v1/embeddings", json={"input": ["fine", "also fine"]})
        assert ok.status_code == 200 and len(ok.json()["data"]) == 2
        assert rt.engine.embedder.actor.statistics().jobs == 0


async def test_bad_input_through_the_embedding_api(emb_config):
    """Embeddings bad input via ``Runtime.embed``: RequestError naming the input."""
    async with Runtime.open(emb_config(n_batch=128, n_ubatch=128)) as rt:
        with pytest.raises(RequestError, match=r"input\[0\] has \d+ tokens; one input may have at most 128"):
            await rt.embed(["word " * 200])
        with pytest.raises(RequestError, match="must not be empty"):
            await rt.embed([])
        with pytest.raises(RequestError, match=r"input\[0\]: token id 460"):
            await rt.embed([460])
        assert len((await rt.embed(["x"])).vectors) == 1


async def test_config_refuses_bad_pooling_and_rank_without_a_head(make_config, tiny_model):
    """--pooling rank on a model without a classifier head is refused at startup, naming
    the reason (llama.cpp would score with a hidden unit); unknown poolings are refused too."""
    assert "cls.output.weight" not in gguf_tensor_names(tiny_model)
    with pytest.raises(ConfigError, match="classifier head"):
        async with Runtime.open(make_config(embedding=True, pooling="rank")):
            pass
    for bad, message in (
        ({"pooling": "max"}, "--pooling must be one of"),
        ({"embedding_parallel": 0}, "--embedding-parallel must be between 1 and 256"),
        ({"embd_normalize": -2}, "--embd-normalize must be >= -1"),
    ):
        with pytest.raises(ConfigError, match=message):
            async with Runtime.open(make_config(embedding=True, **bad)):
                pass


# ---- rerank ----------------------------------------------------------------------------------


async def test_rerank_over_http_and_runtime(make_config, tiny_reranker):
    """Rerank on a tiny Qwen3 reranker whose GGUF pooling is rank: every alias answers
    ``results`` best first with ``relevance_score`` in (0, 1), ``top_n``, documents on request,
    the TEI shape for ``texts``; ``Runtime.rerank`` gives the same scores; chat works beside it."""
    cfg = make_config(model=tiny_reranker, parallel=2, embedding=True)
    async with open_server(cfg) as (rt, url), httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS, "top_n": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "rr" and body["object"] == "list"
        results = body["results"]
        assert len(results) == 3 and all("document" not in x for x in results)
        scores = [x["relevance_score"] for x in results]
        assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
        assert len({round(s, 4) for s in scores}) >= 2  # documents are told apart
        n_tokens = sum(len(rerank_tokens(rt.model, QUERY, d)) for d in DOCS)
        assert body["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}  # every document counted

        full = (await http.post("/rerank", json={"query": QUERY, "documents": DOCS, "return_documents": True})).json()
        by_index = {x["index"]: x for x in full["results"]}
        assert sorted(by_index) == [0, 1, 2, 3] and all(by_index[i]["document"]["text"] == DOCS[i] for i in by_index)
        assert abs(by_index[0]["relevance_score"] - by_index[3]["relevance_score"]) < 1e-4  # equal documents
        for alias in ("/reranking", "/v1/reranking"):
            again = (await http.post(alias, json={"query": QUERY, "documents": DOCS})).json()
            assert [x["index"] for x in again["results"]] == [x["index"] for x in full["results"]]
        tei = (await http.post("/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True})).json()
        assert isinstance(tei, list) and {x["text"] for x in tei} == set(DOCS) and "score" in tei[0]

        ranked = await rt.rerank(QUERY, DOCS, top_n=2)
        assert [x.index for x in ranked] == [x["index"] for x in full["results"][:2]]
        np.testing.assert_allclose(
            [x.score for x in ranked], [x["relevance_score"] for x in full["results"][:2]], atol=1e-5
        )

        gen = await http.post("/completion", json={"prompt": "hi", "n_predict": 4, "ignore_eos": True})
        assert gen.status_code == 200 and gen.json()["tokens_predicted"] == 4  # generation from the same weights


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"documents": ["a"]}, '"query" must be provided'),
        ({"query": 5, "documents": ["a"]}, '"query" must be a string'),
        ({"query": "q"}, '"documents" must be a non-empty string array'),
        ({"query": "q", "documents": []}, '"documents" must be a non-empty string array'),
        ({"query": "q", "documents": ["a", 3]}, "documents[1] must be a string"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n must be a positive integer"),
        ({"query": "q", "documents": ["a"], "top_n": "2"}, "$.top_n"),
    ],
)
async def test_bad_rerank_input(make_config, tiny_reranker, body, names):
    """Rerank bad input: a 400 naming the field; the next request is served."""
    cfg = make_config(model=tiny_reranker, parallel=2, embedding=True)
    async with open_server(cfg) as (_rt, url), httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/rerank", json=body)
        assert r.status_code == 400 and names in r.json()["error"]["message"], r.text
        assert (await http.post("/rerank", json={"query": "q", "documents": ["a", "b"]})).status_code == 200


def test_rerank_tokens_without_a_template(tiny_model):
    """Without a ``rerank`` template a pair is [BOS] query document (the tiny vocabulary
    adds no EOS and has no SEP), as llama-server's format_prompt_rerank builds it."""
    from llamactor.runtime.engine.model import Model

    model = Model(tiny_model)
    try:
        q = model.tokenize("query", add_special=False, parse_special=False)
        d = model.tokenize("doc", add_special=False, parse_special=False)
        assert rerank_tokens(model, "query", "doc") == [model.bos, *q, *d]
    finally:
        model.close()


# ---- chat and embeddings at once -----------------------------------------------------------


class _Gate:
    """Holds the embedding context's next decode in its worker thread until opened (test seam)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.open = threading.Event()
        original = EmbeddingContext.decode

        def held(ctx, seqs):
            self.entered.set()
            self.open.wait(30)
            return original(ctx, seqs)

        monkeypatch.setattr(EmbeddingContext, "decode", held)


async def test_chat_keeps_streaming_while_an_embedding_batch_decodes(emb_config, monkeypatch):
    """Embeddings "beyond llama-server": one server serves chat and embeddings from the same weights at
    once. While the embedder is inside a decode (held there), a chat stream runs to the end; then
    the embedding batch finishes with correct vectors, and concurrent requests of both kinds succeed."""
    gate = _Gate(monkeypatch)
    async with open_server(emb_config()) as (rt, url), httpx.AsyncClient(base_url=url, timeout=60) as http:
        texts = [f"{FOX} {i}" for i in range(64)]
        result: dict[str, dict] = {}

        async def embed() -> None:
            result["emb"] = (await http.post("/v1/embeddings", json={"input": texts})).json()

        async with anyio.create_task_group() as tg:
            tg.start_soon(embed)
            await wait_until(gate.entered.is_set)
            tokens = 0
            async with http.stream(
                "POST",
                "/completion",
                json={"prompt": "Hello", "n_predict": 32, "temperature": 0, "ignore_eos": True, "stream": True},
            ) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and not json.loads(line[6:])["stop"]:
                        tokens += 1
            assert tokens == 32 and not gate.open.is_set() and "emb" not in result  # streamed while held
            gate.open.set()
        data = result["emb"]["data"]
        assert len(data) == 64
        alone = (await rt.embed(texts[5])).vectors[0]
        np.testing.assert_allclose(_vec(data[5]["embedding"]), alone, atol=PACKED_ATOL)

        # both kinds at once, several of each: all succeed
        out: list[int] = []

        async def chat(i: int) -> None:
            r = await http.post("/completion", json={"prompt": f"chat {i}", "n_predict": 8, "ignore_eos": True})
            out.append(r.status_code)

        async def emb(i: int) -> None:
            r = await http.post("/v1/embeddings", json={"input": [f"{HELLO} {i}"] * 5})
            out.append(r.status_code)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(chat, i)
                tg.start_soon(emb, i)
        assert out == [200] * 8


async def test_disconnect_drops_the_embedding_job(emb_config, monkeypatch):
    """Client disconnect for embeddings: a client that leaves while its batch waits gets its inputs dropped
    (only the decode already running finishes); the embedder then serves the next request."""
    gate = _Gate(monkeypatch)
    async with open_server(emb_config(embedding_parallel=4)) as (rt, url):
        actor = rt.engine.embedder.actor
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            with anyio.move_on_after(60) as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: http.post("/v1/embeddings", json={"input": [f"x {i}" for i in range(40)]}))
                    await wait_until(gate.entered.is_set)
                    tg.cancel_scope.cancel()  # the client leaves mid-request
            assert not scope.cancelled_caught
        await wait_until(lambda: actor.statistics().callers_gone == 1)  # the server saw the client leave
        gate.open.set()
        await wait_until(lambda: actor.statistics().jobs == 0)
        assert actor.statistics().inputs_done == 4  # only the batch that was already decoding
        assert len((await rt.embed(["after"])).vectors) == 1


@pytest.mark.slow
async def test_embed_bench_script_runs(emb_config):
    """ops/bench/embed_bench.py measures embeddings alone, chat alone and both at once
    (a tiny run here; the figures come from the lead's run on the real model)."""
    import argparse

    from llamactor.ops.bench import embed_bench

    async with open_server(emb_config(parallel=2)) as (_rt, url):
        args = argparse.Namespace(url=url, streams=2, ntg=8, embed_clients=1, embed_batch=4, embed_words=6, seconds=0.3)
        phases = await embed_bench.run(args)
    rows = {p.name: p.summary() for p in phases}
    assert not any(p.errors for p in phases)
    assert rows["embeddings"]["embed_inputs_per_s"] and rows["chat"]["itl_p99_ms"] is not None
    assert rows["chat+embeddings"]["chat_tok_per_s"] and rows["chat"]["embed_inputs_per_s"] is None
    assert "| chat+embeddings |" in embed_bench.render(list(rows.values()))
