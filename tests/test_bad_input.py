"""Every bad input gets a clear error and loses nothing else.

Each case posts one bad request, asserts the status and the message, and then checks that
the server still serves a good request and that no slot was leaked.
"""

from __future__ import annotations

import struct

import anyio
import httpx
import pytest
from conftest import open_server

from llamactor.runtime.service.config import MAX_BODY_BYTES

GOOD = {"prompt": "hello", "n_predict": 3, "temperature": 0}
SLOT_CTX = 1024  # TEST_N_CTX 4096 / parallel 4

CASES = [
    # (id, method, path, body (bytes or json), status, message fragment)
    ("malformed-json", "POST", "/completion", b'{"prompt": "x",', 400, "malformed JSON"),
    ("not-an-object", "POST", "/completion", b"[1, 2]", 400, "Expected `object`"),
    ("empty-body", "POST", "/completion", b"", 400, "body is empty"),
    ("wrong-type", "POST", "/completion", {"prompt": "x", "n_predict": "many"}, 400, "n_predict"),
    ("missing-prompt", "POST", "/completion", {"n_predict": 3}, 400, "prompt"),
    ("negative-n-predict", "POST", "/completion", {"prompt": "x", "n_predict": -5}, 400, "got -5"),
    ("empty-prompt", "POST", "/completion", {"prompt": ""}, 400, "prompt is empty"),
    ("empty-token-prompt", "POST", "/completion", {"prompt": []}, 400, "prompt is empty"),
    (
        "prompt-too-long",
        "POST",
        "/completion",
        {"prompt": [5] * 2000},
        400,
        f"request (2000 tokens) exceeds the available context size ({SLOT_CTX} tokens)",
    ),
    ("bad-token-id", "POST", "/completion", {"prompt": [1, 999999]}, 400, "token id 999999"),
    ("negative-token-id", "POST", "/completion", {"prompt": [-1]}, 400, "token id -1"),
    ("float-in-prompt", "POST", "/completion", {"prompt": [1, 2.5]}, 400, "list of token ids"),
    ("bad-grammar", "POST", "/completion", {"prompt": "x", "grammar": "root ::= ("}, 400, "invalid grammar"),
    (
        "too-many-stops",
        "POST",
        "/completion",
        {"prompt": "x", "stop": [str(i) for i in range(40)]},
        400,
        "too many stop strings",
    ),
    ("bad-top-p", "POST", "/completion", {"prompt": "x", "top_p": 3}, 400, "top_p"),
    (
        "bad-logit-bias",
        "POST",
        "/completion",
        {"prompt": "x", "logit_bias": [[999999, 1.0]]},
        400,
        "logit_bias token id 999999",
    ),
    ("unknown-slot-id", "POST", "/completion", {"prompt": "x", "id_slot": 42}, 404, "slot 42 does not exist"),
    ("n-too-large", "POST", "/v1/completions", {"prompt": "x", "n": 99}, 400, "n must be between"),
    ("chat-no-messages", "POST", "/v1/chat/completions", {"messages": []}, 400, "messages must not be empty"),
    (
        "chat-image-part",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "started without --mmproj",
    ),
    (
        "bad-response-format",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
        400,
        "response_format type",
    ),
    ("tokenize-unknown-field", "POST", "/tokenize", {"content": "x", "bogus": 1}, 400, "unknown field"),
    ("detokenize-bad-id", "POST", "/detokenize", {"tokens": [10**9]}, 400, "outside the vocabulary"),
    ("invalid-utf8", "POST", "/completion", b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("slot-unknown", "POST", "/slots/77?action=erase", b"", 404, "slot 77 does not exist"),
    ("slot-bad-action", "POST", "/slots/0?action=explode", b"", 400, "action must be one of"),
    ("unknown-route", "GET", "/nope", None, 404, "no route"),
    ("wrong-method", "GET", "/completion", None, 405, "not allowed"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_bad_input_is_rejected_and_server_keeps_serving(make_config, case):
    """Status, OpenAI error shape and message; the server then serves normally."""
    _, method, path, body, status, fragment = case
    async with open_server(make_config()) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            if isinstance(body, bytes):
                r = await client.request(method, path, content=body, headers={"content-type": "application/json"})
            elif body is None:
                r = await client.request(method, path)
            else:
                r = await client.request(method, path, json=body)
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert fragment in err["message"], err
            assert err["code"] == status and err["type"]
            good = await client.post("/completion", json=GOOD)
            assert good.status_code == 200 and good.json()["tokens_predicted"] == 3
        assert not any(s.busy for s in rt.engine.slot_states())


async def test_oversized_body_is_413(make_config):
    """An oversized body is refused with 413 from its Content-Length, before it is read."""
    async with open_server(make_config()) as (rt, url):
        port = int(url.rsplit(":", 1)[1])
        stream = await anyio.connect_tcp("127.0.0.1", port)
        async with stream:
            head = (
                f"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n"
            )
            await stream.send(head.encode() + b"{" * 1024)
            response = b""
            with anyio.fail_after(10):
                while b"}}" not in response:
                    response += await stream.receive()
        assert response.startswith(b"HTTP/1.1 413")
        assert b"exceeds the limit" in response
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.post("/completion", json=GOOD)).status_code == 200


async def test_slot_save_path_traversal_refused(make_config, tmp_path):
    """Slot files only under --slot-save-path; traversal names are refused."""
    async with open_server(make_config(slot_save_path=str(tmp_path))) as (rt, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for name in ("../evil.bin", "/etc/passwd", "a/b", "..", ""):
                r = await client.post("/slots/0?action=save", json={"filename": name})
                assert r.status_code == 400 and "invalid slot file name" in r.json()["error"]["message"]
            await client.post("/completion", json={**GOOD, "id_slot": 0})
            r = await client.post("/slots/0?action=save", json={"filename": "s0.bin"})
            saved = r.json()["n_saved"]
            assert r.status_code == 200 and saved > 0
            assert (tmp_path / "s0.bin").is_file()
            r = await client.post("/slots/1?action=restore", json={"filename": "s0.bin"})
            assert r.status_code == 200 and r.json()["n_restored"] == saved
            slot1 = next(s for s in (await client.get("/slots")).json() if s["id"] == 1)
            assert slot1["n_cached_tokens"] == saved  # the restored KV is what slot 0 saved
            r = await client.post("/slots/1?action=restore", json={"filename": "missing.bin"})
            assert r.status_code == 404
            # the same slot as llama-server saves it: its packed token layout, the same KV after it
            packed = llama_server_layout((tmp_path / "s0.bin").read_bytes())
            (tmp_path / "ls.bin").write_bytes(packed)
            r = await client.post("/slots/1?action=restore", json={"filename": "ls.bin"})
            assert r.status_code == 200 and r.json()["n_restored"] == saved, r.text
            r = await client.post("/completion", json={**GOOD, "id_slot": 1})
            assert r.status_code == 200 and r.json()["timings"]["cache_n"] > 0  # the prefix is reused
            for bad, words in (("v2.bin", [-1, 2]), ("media.bin", None)):
                data = bytearray(packed)
                if words is None:  # one media chunk counted: this server cannot restore those
                    n = struct.unpack_from("<i", data, 20)[0]
                    struct.pack_into("<i", data, 24 + 4 * n, 1)
                else:
                    struct.pack_into("<2i", data, 12, *words)
                (tmp_path / bad).write_bytes(bytes(data))
                r = await client.post("/slots/1?action=restore", json={"filename": bad})
                assert r.status_code == 400 and "Unable to restore slot" in r.json()["error"]["message"], r.text
                slot1 = next(s for s in (await client.get("/slots")).json() if s["id"] == 1)
                assert slot1["n_cached_tokens"] == 0  # refused: nothing half-restored stays
            r = await client.post("/slots/0?action=erase")
            assert r.status_code == 200 and r.json()["n_erased"] > 0
        assert not list(tmp_path.parent.glob("evil.bin"))


def llama_server_layout(plain: bytes) -> bytes:
    """A slot file of this server's (magic, version, token count, tokens, KV) rewritten as
    llama-server writes its slots: the same call (llama_state_seq_save_file) given its packed
    token words (server_tokens::serialize: LLAMA_TOKEN_NULL, layout version 1, the count, the
    tokens, 0 media chunks)."""
    magic, version, n = struct.unpack_from("<3I", plain)
    tokens = struct.unpack_from(f"<{n}i", plain, 12)
    words = (-1, 1, n, *tokens, 0)
    return struct.pack(f"<3I{len(words)}i", magic, version, len(words), *words) + plain[12 + 4 * n :]
