"""Record llama-server's greedy answers to audio requests on the tiny audio model.

Usage::

    .venv/bin/python tests/record_audio_golden.py [/path/to/llama-server]

The default server is ``/tmp/llama-server-build/bin/llama-server``: llama-server of the llama.cpp
that llama-cpp-python 0.3.36 vendors, built with its libmtmd (``--mmproj``). The script writes the
tiny model and audio projector of ``tests/tinyaudio.py`` (seed 0) to a temporary folder, starts
llama-server on loopback with ``-m model.gguf --mmproj mmproj.gguf -t 1 -np 1 -c 2048`` and
``LLAMA_MEDIA_MARKER=<__media__>`` (llama-server makes up a random media marker otherwise;
llamactor's is libmtmd's default, ``<__media__>``), sends each of ``REQUESTS`` once and stores
what it answered (the generated text, the prompt's token count, and on /completion the token
ids) in ``tests/golden/llama_server_audio.json``; then the same with the projector that has both
encoders (``tinyaudio.write_tiny_omni_mmproj``) for ``OMNI_REQUESTS``, images and audio in one
prompt. The answers are kept under this machine's CPU class
(``tinymodel.cpu_class``: ggml's AVX-512 and AVX2 kernels round the tiny model's nearly flat
logits differently). ``tests/test_audio.py`` sends the same requests to llamactor and compares;
it skips on a CPU class nothing was recorded for. Run it again after changing the tiny model,
the projector, the audio or a request.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

import tinyaudio
import tinyvision
from tinymodel import cpu_class

OUT = pathlib.Path(__file__).resolve().parent / "golden" / "llama_server_audio.json"
DEFAULT_SERVER = "/tmp/llama-server-build/bin/llama-server"
N = 16  # tokens generated per request

AUDIO = tinyaudio.wav_bytes(1.0, seed=0)  # 16 kHz mono: libmtmd's rate
OTHER_AUDIO = tinyaudio.wav_bytes(2.5, seed=5, rate=22050, channels=2)  # resampled and mixed down by libmtmd
# over 30 s: libmtmd cuts it into two 30 s chunks, two encodes of N_AUDIO_TOKENS embeddings each
LONG_AUDIO = tinyaudio.wav_bytes(31.0, seed=7, rate=8000)
IMAGE = tinyvision.png_bytes(40, 24, seed=0)  # for the projector with both encoders


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def audio_part(data: bytes) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": "wav"}}


# name -> (path, body); greedy, so the slot count and the cache cannot change the answer
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "You transcribe speech."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is said here?"},
                        audio_part(AUDIO),
                        {"type": "text", "text": "Be brief."},
                    ],
                },
            ],
            "max_tokens": N,
            "temperature": 0,
        },
    ),
    "completion": (
        "/completion",
        {
            "prompt": {
                "prompt_string": "First <__media__> then <__media__> so the two differ by",
                "multimodal_data": [b64(AUDIO), b64(OTHER_AUDIO)],
            },
            "n_predict": N,
            "temperature": 0,
            "return_tokens": True,
        },
    ),
    "completion_swapped": (
        "/completion",
        {
            "prompt": {
                "prompt_string": "First <__media__> then <__media__> so the two differ by",
                "multimodal_data": [b64(OTHER_AUDIO), b64(AUDIO)],
            },
            "n_predict": N,
            "temperature": 0,
            "return_tokens": True,
        },
    ),
    "long_audio": (
        "/completion",
        {
            "prompt": {"prompt_string": "Long: <__media__> and then", "multimodal_data": [b64(LONG_AUDIO)]},
            "n_predict": N,
            "temperature": 0,
            "return_tokens": True,
        },
    ),
}


# to the projector with both encoders (tinyaudio.write_tiny_omni_mmproj): images and audio in one prompt
OMNI_REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "omni_chat": (
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Does the sound match the picture?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(IMAGE)}},
                        audio_part(AUDIO),
                        {"type": "text", "text": "Say."},
                    ],
                },
            ],
            "max_tokens": N,
            "temperature": 0,
        },
    ),
    "omni_completion": (
        "/completion",
        {
            "prompt": {
                "prompt_string": "Hear <__media__> see <__media__> hear <__media__> and",
                "multimodal_data": [b64(OTHER_AUDIO), b64(IMAGE), b64(AUDIO)],
            },
            "n_predict": N,
            "temperature": 0,
            "return_tokens": True,
        },
    ),
}

# POST /v1/audio/transcriptions: a multipart form, the audio in its "file" part
TRANSCRIPTION_PATH = "/v1/audio/transcriptions"
TRANSCRIPTION_FIELDS = {"language": "en", "max_tokens": str(N), "temperature": "0"}


def form_body(fields: dict[str, str], files: dict[str, bytes]) -> tuple[bytes, str]:
    """A multipart/form-data body and its Content-Type (each file named ``<field>.wav``)."""
    boundary = "llamactor-form-boundary-7c1f"
    out = b""
    for name, value in fields.items():
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
    for name, data in files.items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}.wav"\r\n'
        out += (head + "Content-Type: audio/wav\r\n\r\n").encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def answer(name: str, body: dict[str, Any]) -> dict[str, Any]:
    """What a response says, in the form the golden keeps (the same for both servers)."""
    if name == "transcription":
        return {"text": body["text"], "prompt_tokens": body["usage"]["input_tokens"]}
    if name in ("chat", "omni_chat"):
        return {"text": body["choices"][0]["message"]["content"], "prompt_tokens": body["usage"]["prompt_tokens"]}
    return {"text": body["content"], "prompt_tokens": body["tokens_evaluated"], "tokens": body["tokens"]}


def post(url: str, body: dict[str, Any] | tuple[bytes, str]) -> dict[str, Any]:
    """POST a JSON body, or a (form body, Content-Type) pair."""
    data, kind = body if isinstance(body, tuple) else (json.dumps(body).encode(), "application/json")
    req = urllib.request.Request(url, data, {"Content-Type": kind})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def record(server: str, projector: str, requests: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    """Start llama-server on the tiny model with the projector ``projector`` names
    ("audio" or "omni") and send it ``requests`` (a JSON body, or a form as ``form_body``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        model, mmproj = tinyaudio.write_tiny_audio(tmp)
        if projector == "omni":
            mmproj = tinyaudio.write_tiny_omni_mmproj(pathlib.Path(tmp) / "omni.gguf")
        argv = [server, "-m", str(model), "--mmproj", str(mmproj), "-t", "1", "-np", "1", "-c", "2048"]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "LLAMA_MEDIA_MARKER": "<__media__>"}
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"llama-server did not start ({' '.join(argv)})")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    time.sleep(0.1)
            props = json.loads(urllib.request.urlopen(url + "/props", timeout=5).read())
            assert props["modalities"]["audio"], props["modalities"]
            assert props["modalities"]["vision"] == (projector == "omni"), props["modalities"]
            return {name: answer(name, post(url + path, body)) for name, (path, body) in requests.items()}
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def main(server: str) -> None:
    transcription = {"transcription": (TRANSCRIPTION_PATH, form_body(TRANSCRIPTION_FIELDS, {"file": AUDIO}))}
    recorded = record(server, "audio", {**REQUESTS, **transcription}) | record(server, "omni", OMNI_REQUESTS)
    assert recorded["completion"]["tokens"] != recorded["completion_swapped"]["tokens"], "the audio changes nothing"
    golden = json.loads(OUT.read_text()) if OUT.exists() else {}
    golden[cpu_class()] = recorded
    OUT.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    print(f"recorded {', '.join(recorded)} for {cpu_class()} in {OUT}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_SERVER)
