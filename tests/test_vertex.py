"""Vertex AI's prediction protocol (``AIP_MODE=PREDICTION``), as llama-server speaks it: the
predict route runs each instance through the route its ``@requestFormat`` names, at once, and
answers the predictions in order; ``AIP_HEALTH_ROUTE`` is a second /health; ``AIP_HTTP_PORT``
is the port. Off without ``AIP_MODE``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
from conftest import free_port, open_server, wait_healthy

from llamactor.runtime.http.vertex import request_format

LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]


def test_request_formats_are_llama_servers():
    assert request_format("/v1/chat/completions") == "chatCompletions"
    assert request_format("/apply-template") == "applyTemplate"
    assert request_format("/completion") == "completion"
    assert request_format("/slots/{id}") == "slots"


async def test_predict_runs_each_instance_through_its_route(make_config, monkeypatch):
    monkeypatch.setenv("AIP_MODE", "PREDICTION")
    monkeypatch.setenv("AIP_HEALTH_ROUTE", "/isalive")
    async with (
        open_server(make_config(parallel=2, api_key="k")) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=60, headers={"Authorization": "Bearer k"}) as client,
    ):
        chat = {"max_tokens": 4, "messages": [{"role": "user", "content": "Say hello"}], "temperature": 0}
        r = await client.post(
            "/predict",
            json={
                "instances": [
                    {"@requestFormat": "chatCompletions", **chat},
                    {"@requestFormat": "/completion", "prompt": "hi", "n_predict": 3, "stream": True},
                    {"@requestFormat": "tokenize", "content": "hello"},
                    {"@requestFormat": "nothingLikeIt"},
                    {"max_tokens": 2},
                    "not an object",
                ]
            },
        )
        assert r.status_code == 200, r.text
        chat_answer, native, tokens, unknown, no_format, not_object = r.json()["predictions"]
        assert chat_answer["choices"][0]["message"]["role"] == "assistant"
        direct = (await client.post("/v1/chat/completions", json=chat)).json()
        assert chat_answer["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
        assert native["tokens_predicted"] == 3  # stream was turned off: a whole answer
        assert tokens["tokens"]
        assert "no handler registered for @requestFormat: nothingLikeIt" in unknown["error"]["message"]
        assert "@requestFormat" in no_format["error"]["message"]
        assert "JSON object" in not_object["error"]["message"]
        for body, why in (({"instances": {}}, "instances"), ([], "JSON object")):
            bad = await client.post("/predict", json=body)
            assert bad.status_code == 400 and why in bad.json()["error"]["message"]
        too_many = await client.post("/predict", json={"instances": [{}] * 129})
        assert too_many.status_code == 400 and "128" in too_many.text
        assert (await client.get("/isalive")).json() == {"status": "ok"}
        unauthorized = await client.post("/predict", json={"instances": []}, headers={"Authorization": "x"})
        assert unauthorized.status_code == 401


async def test_off_without_aip_mode(make_config, monkeypatch):
    monkeypatch.delenv("AIP_MODE", raising=False)
    async with open_server(make_config(parallel=1)) as (_, url), httpx.AsyncClient(base_url=url) as client:
        assert (await client.post("/predict", json={"instances": []})).status_code == 404


@pytest.mark.slow
def test_aip_http_port_overrides_the_port(tiny_model):
    port, ignored = free_port(), free_port()
    env = {**os.environ, "AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(port)}
    argv = [*LLAMACTOR, "serve", "-m", str(tiny_model), "--port", str(ignored), "-t", "1", "-np", "1", "-c", "256"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", 60)
        instance = {"@requestFormat": "completion", "prompt": "hi", "n_predict": 2}
        r = httpx.post(f"http://127.0.0.1:{port}/predict", json={"instances": [instance] * 2}, timeout=60)
        assert r.status_code == 200 and [p["tokens_predicted"] for p in r.json()["predictions"]] == [2, 2]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
