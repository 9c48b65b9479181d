"""Audio input (``--mmproj`` with an audio encoder) on a real server, against llama-server's answers.

A ``llamactor serve`` process (its engine in a child process, one thread) serves the tiny model
and audio projector of ``tinyaudio.py`` (Whisper-style encoder, Ultravox projector). Greedy
answers to a chat with an ``input_audio`` part and to native /completion prompts with audio in
``multimodal_data`` (two clips in either order; a clip over 30 s, two chunks) must equal
llama-server's for the same files and requests: ``tests/golden/llama_server_audio.json``, recorded by
``tests/record_audio_golden.py`` from ``/tmp/llama-server-build/bin/llama-server``: the
prompt's token count on any machine, the generated tokens on a build of the CPU class they were
recorded on (they hang on the kernels' rounding of the tiny model's flat logits). The same
audio sent again is served from the cached prefix. Bad input (audio for a projector without an
audio encoder, an image for one without a vision encoder, bytes that are not audio, markers
without files) is a 400 naming it, and the server goes on.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import tinyaudio
import tinyvision
from conftest import TEST_THREADS, free_port, wait_healthy
from record_audio_golden import (
    AUDIO,
    LONG_AUDIO,
    OMNI_REQUESTS,
    OTHER_AUDIO,
    REQUESTS,
    TRANSCRIPTION_FIELDS,
    TRANSCRIPTION_PATH,
    answer,
    audio_part,
    b64,
    form_body,
)
from tinymodel import assert_llama_servers

from llamactor.protocol.errors import RequestError
from llamactor.runtime import Runtime, RuntimeConfig
from llamactor.runtime.http import transcriptions

LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]
GOLDEN = json.loads((Path(__file__).parent / "golden" / "llama_server_audio.json").read_text())
RECORDER = "tests/record_audio_golden.py"
STARTUP_TIMEOUT_S = 60
N_AUDIO = tinyaudio.N_AUDIO_TOKENS
PNG = tinyvision.png_bytes(40, 24, seed=0)
NOT_AUDIO = b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00 but then nothing a decoder can use"


def _serve(model: Path, mmproj: Path, slots: int) -> Iterator[str]:
    port = free_port()
    argv = [*LLAMACTOR, "serve", "-m", str(model), "--mmproj", str(mmproj), "-t", str(TEST_THREADS)]
    argv += ["-np", str(slots), "-c", str(2048 * slots), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url + "/health", STARTUP_TIMEOUT_S)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def audio_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tinyaudio.write_tiny_audio(tmp_path_factory.mktemp("audio"))


@pytest.fixture(scope="module")
def server(audio_files: tuple[Path, Path]) -> Iterator[str]:
    yield from _serve(*audio_files, slots=2)


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(*tinyvision.write_tiny_vision(tmp_path_factory.mktemp("vision")), slots=1)


@pytest.fixture(scope="module")
def omni_server(audio_files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The projector with both encoders (images and audio)."""
    mmproj = tinyaudio.write_tiny_omni_mmproj(tmp_path_factory.mktemp("omni") / "omni.gguf")
    yield from _serve(audio_files[0], mmproj, slots=1)


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _chat(url: str, content: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **fields}
    return _post(url, "/v1/chat/completions", body)


def _complete(url: str, prompt: str, files: list[bytes], **fields: Any) -> httpx.Response:
    body = {"prompt": {"prompt_string": prompt, "multimodal_data": [b64(f) for f in files]}, "n_predict": 2, **fields}
    return _post(url, "/completion", body)


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


# ---- what llama-server answers ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(REQUESTS))
def test_greedy_answers_are_llama_servers(server: str, name: str):
    """Chat (input_audio part) and /completion (prompt_string + multimodal_data: two clips, in
    either order, and one over 30 s): the same text and prompt token count as llama-server, and
    the same token ids on /completion."""
    path, body = REQUESTS[name]
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    assert_llama_servers(GOLDEN, name, answer(name, r.json()), RECORDER)


@pytest.mark.parametrize("name", list(OMNI_REQUESTS))
def test_images_and_audio_in_one_prompt_are_llama_servers(omni_server: str, name: str):
    """A projector with both encoders: a chat with an image_url and an input_audio part, and a
    /completion with audio, an image and audio, answered as llama-server answers them."""
    path, body = OMNI_REQUESTS[name]
    r = _post(omni_server, path, body)
    assert r.status_code == 200, r.text
    got = answer(name, r.json())
    if name == "omni_completion":
        assert got["prompt_tokens"] > 2 * N_AUDIO + tinyvision.N_IMAGE_TOKENS  # and the text around them
    assert_llama_servers(GOLDEN, name, got, RECORDER)


def test_bad_media_for_both_encoders(omni_server: str):
    """With both encoders, what is neither is named so; audio that does not decode is named audio."""
    props = httpx.get(omni_server + "/props").json()
    assert props["modalities"] == {"vision": True, "video": False, "audio": True}
    _refused(
        _complete(omni_server, "A <__media__> B <__media__> C", [PNG, b"neither a picture nor a sound"]),
        "file 2 of 2 is neither an image (png, jpeg, bmp, gif, ...) nor audio (wav, mp3, flac) libmtmd can read",
    )
    _refused(_complete(omni_server, "A <__media__> B", [NOT_AUDIO]), "file 1 of 1 is not audio libmtmd can decode")
    _refused(
        _complete(omni_server, "A <__media__> B <__media__> C", [PNG]),
        "the prompt has 2 media markers ('<__media__>') but 1 media file was given",
    )
    ok = _complete(omni_server, "A <__media__> B <__media__> C", [AUDIO, PNG])
    assert ok.status_code == 200, ok.text


def _transcribe(url: str, fields: dict[str, str], files: dict[str, bytes]) -> httpx.Response:
    body, kind = form_body(fields, files)
    return httpx.post(url + TRANSCRIPTION_PATH, content=body, headers={"Content-Type": kind}, timeout=60)


def test_transcription_is_llama_servers(server: str):
    """POST /v1/audio/transcriptions (a multipart form): the chat llama-server makes of it
    ("Transcribe audio to text (language: en)" and the audio) answered as llama-server does."""
    r = _transcribe(server, TRANSCRIPTION_FIELDS, {"file": AUDIO})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["type"] == "transcript.text.done" and body["usage"]["type"] == "tokens"
    usage = body["usage"]
    assert usage["output_tokens"] == int(TRANSCRIPTION_FIELDS["max_tokens"])
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    # streamed: a delta frame per token, then the done frame (the audio now cached) and [DONE];
    # httpx's own multipart encoding, the form's fields as strings
    with httpx.stream(
        "POST",
        server + "/audio/transcriptions",
        data={**TRANSCRIPTION_FIELDS, "stream": "true", "top_k": "1"},
        files={"file": ("clip.wav", AUDIO, "audio/wav")},
        timeout=60,
    ) as streamed:
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        lines = [line.removeprefix("data: ") for line in streamed.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    frames = [json.loads(line) for line in lines[:-1]]
    done = frames[-1]
    assert done["type"] == "transcript.text.done" and done["text"] == body["text"]
    assert {f["type"] for f in frames[:-1]} == {"transcript.text.delta"}
    assert "".join(f["delta"] for f in frames[:-1]) == body["text"]
    assert done["usage"]["input_tokens_details"]["cached_tokens"] == usage["input_tokens"] - 1
    assert_llama_servers(GOLDEN, "transcription", answer("transcription", body), RECORDER)  # last: it may skip


def test_bad_transcription_requests_are_refused(server: str, vision_server: str):
    wav = {"file": AUDIO}
    cases = [
        (httpx.post(server + TRANSCRIPTION_PATH, json={"max_tokens": 2}), 400, "No input file found for transcription"),
        (_transcribe(server, {"max_tokens": "2"}, {}), 400, "No input file found for transcription"),
        (_transcribe(server, {}, {}), 400, "No input file found for transcription"),
        (_transcribe(server, {"max_tokens": "2"}, {"file": b""}), 400, "the form's 'file' part is empty"),
        (_transcribe(server, {"response_format": "text"}, wav), 400, "Only 'json' response_format is supported"),
        (_transcribe(server, {"max_tokens": "many"}, wav), 400, "max_tokens"),
        (_transcribe(server, {"max_tokens": "2"}, {"file": b"not audio, not anything"}), 400, "is not audio"),
        (_transcribe(server, {"max_tokens": "2"}, {"file": PNG}), 400, "is an image: image input is not supported"),
        (_transcribe(vision_server, {"max_tokens": "2"}, wav), 501, "The current model does not support audio input."),
    ]
    for response, status, says in cases:
        assert response.status_code == status, response.text
        assert says in response.json()["error"]["message"], response.text
    ok = _transcribe(server, {"max_tokens": "2", "prompt": "Words:"}, wav)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["output_tokens"] == 2


def test_transcription_in_router_mode(audio_files: tuple[Path, Path], tmp_path: Path):
    """In router mode the form's ``model`` field names the model (llama-server's router reads
    the form as its body); a model named by ``?model=`` instead works too."""
    model, mmproj = audio_files
    preset = tmp_path / "models.ini"
    preset.write_text(f"version = 1\n[heard]\nmodel = {model}\nmmproj = {mmproj}\nctx-size = 2048\n")
    port = free_port()
    argv = [*LLAMACTOR, "serve", "--models-preset", str(preset), "-t", str(TEST_THREADS)]
    proc = subprocess.Popen(
        [*argv, "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url + "/health", STARTUP_TIMEOUT_S)
        named = _transcribe(url, {"model": "heard", "max_tokens": "3", "temperature": "0"}, {"file": AUDIO})
        assert named.status_code == 200, named.text
        assert named.json()["usage"]["output_tokens"] == 3
        body, kind = form_body({"max_tokens": "3", "temperature": "0"}, {"file": AUDIO})
        queried = httpx.post(
            url + TRANSCRIPTION_PATH + "?model=heard", content=body, headers={"Content-Type": kind}, timeout=60
        )
        assert queried.status_code == 200, queried.text
        assert queried.json()["text"] == named.json()["text"]
        unnamed = _transcribe(url, {"max_tokens": "3"}, {"file": AUDIO})
        assert unnamed.status_code == 400 and "model name is missing" in unnamed.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_transcription_chat_is_llama_servers():
    """The chat a form becomes (llama-server's convert_transcriptions_to_chatcmpl): the ASR
    prompt and the language, then the audio; an LFM2 template's system prompt instead."""
    clip = {"type": "input_audio", "input_audio": {"data": b64(b"RIFF")}}
    req = transcriptions.to_chat({"language": "fr", "max_tokens": "5", "stream": "1"}, {"file": b"RIFF"}, None)
    assert [msgspec.to_builtins(m) for m in req.messages] == [
        {"role": "user", "content": [{"type": "text", "text": "Transcribe audio to text (language: fr)"}, clip]}
    ]
    assert req.max_tokens == 5 and req.stream is False  # "true" only, as llama-server reads it
    lfm2 = "{{ '<|tool_list_start|>' }}{{ tools }}{{ '<|tool_list_end|>' }}"
    req = transcriptions.to_chat({"stream": "true", "top_k": "7"}, {"file": b"RIFF"}, lfm2)
    assert [msgspec.to_builtins(m) for m in req.messages] == [
        {"role": "system", "content": "Perform ASR."},
        {"role": "user", "content": [clip]},
    ]
    assert req.stream is True and req.top_k == 7


def test_props_say_audio(server: str, vision_server: str):
    props = httpx.get(server + "/props").json()
    assert props["modalities"] == {"vision": False, "video": False, "audio": True}
    assert props["media_marker"] == "<__media__>"
    assert httpx.get(vision_server + "/props").json()["modalities"] == {"vision": True, "video": False, "audio": False}


def test_an_audio_clip_takes_its_positions(server: str):
    """A clip under 30 s is one chunk of N_AUDIO positions, one over 30 s two; the chat token
    counter counts them as a request does; a data:audio/ URL, or base64 under ``url`` instead of
    ``data``, is the same file as bare base64."""
    one = _complete(server, "x <__media__> y", [AUDIO]).json()["tokens_evaluated"]
    two = _complete(server, "x <__media__> y", [LONG_AUDIO]).json()["tokens_evaluated"]
    assert two - one == N_AUDIO
    content = [_text("Count:"), audio_part(OTHER_AUDIO), _text("ok?")]
    n = _post(server, "/v1/chat/completions/input_tokens", {"messages": [{"role": "user", "content": content}]})
    assert n.status_code == 200, n.text
    used = _chat(server, content).json()["usage"]["prompt_tokens"]
    assert n.json()["input_tokens"] == used
    as_url = {"type": "input_audio", "input_audio": {"data": "data:audio/wav;base64," + b64(OTHER_AUDIO)}}
    again = _chat(server, [content[0], as_url, content[2]]).json()
    assert again["usage"]["prompt_tokens"] == used
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == used - 1  # the same file
    by_url_key = {"type": "input_audio", "input_audio": {"url": b64(OTHER_AUDIO), "format": "mp3"}}  # as llama-server
    third = _chat(server, [content[0], by_url_key, content[2]]).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == used - 1  # format is not read: the bytes are


# ---- the prompt cache --------------------------------------------------------------------------


def test_the_same_audio_again_reuses_the_cached_prefix(server: str):
    """Sent again, the prompt with its audio is served from the slot's KV (only the last token
    is decoded again, and the chat reports the rest as cached); another clip at the same place
    is decoded, and what comes after it too, never taken for the cached one."""
    clip = tinyaudio.wav_bytes(1.2, seed=21)
    other = tinyaudio.wav_bytes(1.2, seed=22)
    content = [_text("Cache me:"), audio_part(clip), _text("ok?")]
    first = _chat(server, content)
    assert first.status_code == 200, first.text
    n_prompt = first.json()["usage"]["prompt_tokens"]
    again = _chat(server, content).json()
    assert again["usage"]["prompt_tokens"] == n_prompt
    assert again["timings"]["prompt_n"] == 1  # everything but the last token came from the cache
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1
    assert again["choices"][0]["message"] == first.json()["choices"][0]["message"]
    swapped = _chat(server, [content[0], audio_part(other), content[2]]).json()
    assert swapped["usage"]["prompt_tokens"] == n_prompt
    assert swapped["timings"]["prompt_n"] >= N_AUDIO + 1  # from the audio on: decoded
    # the native API: the same clip twice in one prompt and again later, both reused; and a
    # clip of two chunks
    for files in ([clip, clip], [LONG_AUDIO, clip]):
        one = _complete(server, "A <__media__> B <__media__> C", files, temperature=0).json()
        two = _complete(server, "A <__media__> B <__media__> C", files, temperature=0).json()
        assert one["tokens_evaluated"] == two["tokens_evaluated"] >= 2 * N_AUDIO
        assert two["timings"]["prompt_n"] == 1 and two["tokens"] == one["tokens"]
        assert two["tokens_cached"] == two["tokens_evaluated"] + len(two["tokens"]) - 1


# ---- bad input -----------------------------------------------------------------------------------


def _refused(response: httpx.Response, says: str) -> None:
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"], response.text


def test_bad_audio_input_is_a_400_and_the_server_goes_on(server: str):
    cases = [
        # an image for a projector with no vision encoder
        (
            _chat(server, [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(PNG)}}]),
            "messages[0].content[0]: image input is not supported: the multimodal projector (--mmproj) has no "
            "vision encoder, it takes audio only",
        ),
        (_complete(server, "See <__media__>?", [PNG]), "audio file 1 of 1 is an image: image input is not supported"),
        # bytes that are not audio
        (
            _chat(server, [_text("Hear"), audio_part(b"this is not audio at all"), _text("?")]),
            "audio file 1 of 1 (messages[0].content[1].input_audio) is not audio libmtmd can decode (wav, mp3, flac): "
            "24 bytes starting",
        ),
        (
            _chat(server, [_text("Hear"), audio_part(NOT_AUDIO), _text("?")]),
            "audio file 1 of 1 (messages[0].content[1].input_audio) is not audio libmtmd can decode (wav, mp3, flac)",
        ),
        (_complete(server, "A <__media__> B <__media__> C", [AUDIO, NOT_AUDIO]), "audio file 2 of 2 is not audio"),
        # markers and files that do not pair up
        (
            _complete(server, "<__media__> and <__media__>?", [AUDIO]),
            "the prompt has 2 media markers ('<__media__>') but 1 audio file was given",
        ),
        (_complete(server, "none here", [AUDIO]), "0 media markers"),
        (_complete(server, "ends with <__media__>", [AUDIO]), "the prompt ends with audio"),
        # the part itself
        (_chat(server, [{"type": "input_audio", "input_audio": "AAAA"}]), "content[0].input_audio must be an object"),
        (
            _chat(server, [{"type": "input_audio", "input_audio": {"format": "wav"}}]),
            "content[0].input_audio.data is required",
        ),
        (
            _chat(server, [{"type": "input_audio", "input_audio": {"data": "@@@", "format": "wav"}}]),
            "content[0].input_audio.data: not valid base64",
        ),
        (
            _chat(server, [{"type": "input_audio", "input_audio": {"data": "data:image/png;base64," + b64(PNG)}}]),
            "expected base64 or a data:audio/<type>;base64, URL",
        ),
        (
            _chat(server, [{"type": "input_audio", "input_audio": {"data": "file://a.wav"}}]),
            "file:// URLs are not allowed unless --media-path is specified",
        ),
        (_chat(server, [{"type": "input_video", "input_video": {}}]), "'input_video' parts are not supported"),
    ]
    for response, says in cases:
        _refused(response, says)
    ok = _chat(server, [_text("Still there?"), audio_part(OTHER_AUDIO), _text(".")])
    assert ok.status_code == 200, ok.text
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_audio_for_a_vision_only_projector_is_a_400(vision_server: str):
    _refused(
        _chat(vision_server, [_text("Hear"), audio_part(AUDIO), _text("?")]),
        "messages[0].content[1]: audio input is not supported: the multimodal projector (--mmproj) has no "
        "audio encoder, it takes images only",
    )
    _refused(
        _complete(vision_server, "Hear <__media__>?", [AUDIO]),
        "image 1 of 1 is audio (wav, mp3, flac): audio input is not supported by this multimodal projector",
    )
    _refused(_complete(vision_server, "See <__media__>?", [b"not an image"]), "image 1 of 1 is not an image")
    ok = _complete(vision_server, "See <__media__>?", [PNG])
    assert ok.status_code == 200, ok.text
    assert httpx.get(vision_server + "/health").json()["status"] == "ok"


async def test_audio_in_process(audio_files: tuple[Path, Path]):
    """The embedding API with the engine beside it: audio bytes in multimodal_data and an
    input_audio chat part; the same prompt again comes from the cache."""
    model, mmproj = audio_files
    config = RuntimeConfig(model=model, mmproj=mmproj, n_ctx=2048, parallel=1, threads=TEST_THREADS, isolate=False)
    async with Runtime.open(config) as rt:
        assert rt.vision is not None and rt.vision.modalities == ("audio",)
        first = await rt.complete("x <__media__> y", multimodal_data=[AUDIO], max_tokens=3, temperature=0)
        again = await rt.complete("x <__media__> y", multimodal_data=[AUDIO], max_tokens=3, temperature=0)
        assert first.n_prompt > N_AUDIO and again.n_cached == first.n_prompt - 1
        assert again.choices[0].tokens == first.choices[0].tokens
        chat = await rt.chat([{"role": "user", "content": [_text("Hear"), audio_part(AUDIO)]}], max_tokens=2)
        assert chat.completion.n_prompt > N_AUDIO and chat.completion.n_predicted == 2


async def test_audio_without_a_projector_is_refused(make_config):
    async with Runtime.open(make_config()) as rt:
        with pytest.raises(RequestError, match=r"content\[0\]: audio input is not supported by this server.*--mmproj"):
            await rt.chat([{"role": "user", "content": [audio_part(AUDIO)]}], max_tokens=2)
        with pytest.raises(RequestError, match="--mmproj"):
            await rt.complete("Hear: <__media__>.", multimodal_data=[AUDIO], max_tokens=2)
        assert (await rt.complete("Hi", max_tokens=2)).n_predicted == 2
