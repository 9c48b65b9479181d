"""Deterministic tiny audio model for multimodal tests: a text GGUF and a libmtmd audio projector.

``python tests/tinyaudio.py OUTDIR`` writes

* ``OUTDIR/model.gguf``: the tiny LLaMA-architecture text model of ``tests/tinymodel.py``
  (n_embd 64, byte-level BPE, ChatML template), unchanged;
* ``OUTDIR/mmproj.gguf``: a random-weight Whisper-style audio encoder with an Ultravox
  projector (``clip.projector_type = "ultravox"``), about 400 KB, that libmtmd loads next to
  that model (audio only: ``clip.has_vision_encoder`` false);

then loads both through llama_cpp's ``mtmd_cpp`` bindings, tokenizes and encodes a prompt with
a WAV file (the self-check). The same seed always yields byte-identical files.

Why Ultravox: of libmtmd's Whisper-encoder projectors (``tools/mtmd/models/whisper-enc.cpp``)
it adds no framing text around the audio (Qwen2-Audio wraps it in ``<|audio_bos|>`` ...
``<|audio_eos|>``, Voxtral starts it with ``[BEGIN_AUDIO]``) and it stacks frames, so a clip
is few embeddings. libmtmd turns any audio into 16 kHz mono, an 80-bin log-mel spectrogram
cut into 30 s chunks (3000 frames; a clip under 30 s is one chunk, padded with silence); the
encoder's second convolution halves the frames (1500 positions, hence the 1500-row position
embedding), and the projector stacks ``STACK_FACTOR`` of them: ``N_AUDIO_TOKENS`` = 1500 / 20
= 75 embeddings per chunk, each 64 wide like the text model's.

The GGUF keys and tensor names are the ones ``tools/mtmd/clip.cpp`` reads (``clip-impl.h``:
``KEY_*``, ``TN_*``, the ``a.`` prefix of audio encoders); the encoder's key projection has no
bias, as Whisper's.
"""

from __future__ import annotations

import ctypes
import io
import os
import pathlib
import sys
import wave

import gguf
import numpy as np
import tinymodel

PROJECTOR_TYPE = "ultravox"
N_EMBD = 32  # audio encoder width
N_HEAD = 2
N_FF = 48
N_LAYER = 2
N_MEL_BINS = 80
STACK_FACTOR = 20  # divides the 1500 encoder positions: no padding frame
N_MM_HIDDEN = 32  # projector hidden width (after SwiGLU)
PROJECTION_DIM = tinymodel.N_EMBD  # the text model's n_embd; libmtmd refuses a mismatch
N_POSITIONS = 1500  # encoder positions of one 30 s chunk
N_AUDIO_TOKENS = N_POSITIONS // STACK_FACTOR
SAMPLE_RATE = 16000  # what libmtmd resamples every clip to
LAYER_NORM_EPS = 1e-5
WEIGHT_STD = 0.2
OUTPUT_STD = 0.1  # audio embeddings (std about 0.6) large enough that audio changes the answer


def _mmproj_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every tensor of the projector file by GGUF name; matrices are (out, in) in numpy order."""

    def matrix(rows: int, cols: int, std: float = WEIGHT_STD) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * std).astype(np.float16)

    def vector(n: int, std: float = WEIGHT_STD) -> np.ndarray:
        return (rng.standard_normal(n) * std).astype(np.float32)

    def conv(out_ch: int, in_ch: int) -> np.ndarray:  # ggml ne [3, in, out]
        return (rng.standard_normal((out_ch, in_ch, 3)) * WEIGHT_STD / np.sqrt(in_ch / 8)).astype(np.float16)

    tensors = {
        "a.conv1d.1.weight": conv(N_EMBD, N_MEL_BINS),
        "a.conv1d.1.bias": vector(N_EMBD).reshape(N_EMBD, 1),  # ggml ne [1, out]: broadcast over frames
        "a.conv1d.2.weight": conv(N_EMBD, N_EMBD),
        "a.conv1d.2.bias": vector(N_EMBD).reshape(N_EMBD, 1),
        "a.position_embd.weight": (rng.standard_normal((N_POSITIONS, N_EMBD)) * WEIGHT_STD).astype(np.float32),
    }
    for il in range(N_LAYER):
        p = f"a.blk.{il}."
        tensors |= {
            p + "ln1.weight": np.ones(N_EMBD, dtype=np.float32),
            p + "ln1.bias": np.zeros(N_EMBD, dtype=np.float32),
            p + "attn_q.weight": matrix(N_EMBD, N_EMBD),
            p + "attn_q.bias": vector(N_EMBD),
            p + "attn_k.weight": matrix(N_EMBD, N_EMBD),  # no bias (Whisper's)
            p + "attn_v.weight": matrix(N_EMBD, N_EMBD),
            p + "attn_v.bias": vector(N_EMBD),
            p + "attn_out.weight": matrix(N_EMBD, N_EMBD),
            p + "attn_out.bias": vector(N_EMBD),
            p + "ln2.weight": np.ones(N_EMBD, dtype=np.float32),
            p + "ln2.bias": np.zeros(N_EMBD, dtype=np.float32),
            p + "ffn_up.weight": matrix(N_FF, N_EMBD),
            p + "ffn_up.bias": vector(N_FF),
            p + "ffn_down.weight": matrix(N_EMBD, N_FF),
            p + "ffn_down.bias": vector(N_EMBD),
        }
    stacked = N_EMBD * STACK_FACTOR
    tensors |= {
        "a.post_ln.weight": np.ones(N_EMBD, dtype=np.float32),
        "a.post_ln.bias": np.zeros(N_EMBD, dtype=np.float32),
        "mm.a.norm_pre.weight": np.ones(stacked, dtype=np.float32),
        "mm.a.mlp.1.weight": matrix(2 * N_MM_HIDDEN, stacked, WEIGHT_STD / 2),  # SwiGLU: two halves
        "mm.a.norm_mid.weight": np.ones(N_MM_HIDDEN, dtype=np.float32),
        "mm.a.mlp.2.weight": matrix(PROJECTION_DIM, N_MM_HIDDEN, OUTPUT_STD),
    }
    return tensors


def write_tiny_audio_mmproj(
    path: str | os.PathLike, *, seed: int = 0, projection_dim: int = PROJECTION_DIM
) -> pathlib.Path:
    """Write the audio projector GGUF; ``projection_dim`` other than the text model's makes a mismatch."""
    path = pathlib.Path(path)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_name("llamactor-tiny-audio")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_string("clip.projector_type", PROJECTOR_TYPE)
    writer.add_bool("clip.has_vision_encoder", False)
    writer.add_bool("clip.has_audio_encoder", True)
    writer.add_uint32("clip.audio.embedding_length", N_EMBD)
    writer.add_uint32("clip.audio.feed_forward_length", N_FF)
    writer.add_uint32("clip.audio.block_count", N_LAYER)
    writer.add_uint32("clip.audio.projection_dim", projection_dim)
    writer.add_uint32("clip.audio.attention.head_count", N_HEAD)
    writer.add_float32("clip.audio.attention.layer_norm_epsilon", LAYER_NORM_EPS)
    writer.add_uint32("clip.audio.num_mel_bins", N_MEL_BINS)
    writer.add_uint32("clip.audio.projector.stack_factor", STACK_FACTOR)
    tensors = _mmproj_tensors(np.random.default_rng(seed))
    if projection_dim != PROJECTION_DIM:
        rng = np.random.default_rng(seed + 1)
        tensors["mm.a.mlp.2.weight"] = (rng.standard_normal((projection_dim, N_MM_HIDDEN)) * OUTPUT_STD).astype(
            np.float16
        )
    return tinymodel.write_out(writer, tensors, path)


def write_tiny_omni_mmproj(path: str | os.PathLike, *, seed: int = 0) -> pathlib.Path:
    """Write a projector with both encoders in one GGUF (as Qwen2.5-Omni's and Gemma 3n's are):
    ``tinyvision``'s image encoder and this audio encoder, each with the same weights as in its
    own file, told apart by ``clip.vision.projector_type`` and ``clip.audio.projector_type``."""
    import tinyvision

    path = pathlib.Path(path)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_name("llamactor-tiny-omni")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_string("clip.vision.projector_type", tinyvision.PROJECTOR_TYPE)
    writer.add_string("clip.audio.projector_type", PROJECTOR_TYPE)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_audio_encoder", True)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", tinyvision.IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", tinyvision.PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", tinyvision.N_EMBD)
    writer.add_uint32("clip.vision.feed_forward_length", tinyvision.N_FF)
    writer.add_uint32("clip.vision.block_count", tinyvision.N_LAYER)
    writer.add_uint32("clip.vision.projection_dim", tinyvision.PROJECTION_DIM)
    writer.add_uint32("clip.vision.attention.head_count", tinyvision.N_HEAD)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", tinyvision.LAYER_NORM_EPS)
    writer.add_array("clip.vision.image_mean", list(tinyvision.IMAGE_MEAN))
    writer.add_array("clip.vision.image_std", list(tinyvision.IMAGE_STD))
    writer.add_uint32("clip.audio.embedding_length", N_EMBD)
    writer.add_uint32("clip.audio.feed_forward_length", N_FF)
    writer.add_uint32("clip.audio.block_count", N_LAYER)
    writer.add_uint32("clip.audio.projection_dim", PROJECTION_DIM)
    writer.add_uint32("clip.audio.attention.head_count", N_HEAD)
    writer.add_float32("clip.audio.attention.layer_norm_epsilon", LAYER_NORM_EPS)
    writer.add_uint32("clip.audio.num_mel_bins", N_MEL_BINS)
    writer.add_uint32("clip.audio.projector.stack_factor", STACK_FACTOR)
    tensors = tinyvision._mmproj_tensors(np.random.default_rng(seed)) | _mmproj_tensors(np.random.default_rng(seed))
    return tinymodel.write_out(writer, tensors, path)


def write_tiny_audio(outdir: str | os.PathLike, *, seed: int = 0) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``model.gguf`` and ``mmproj.gguf`` (the audio projector) into ``outdir``; returns their paths."""
    outdir = pathlib.Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    model = tinymodel.write_tiny_model(outdir / "model.gguf", seed=seed)
    return model, write_tiny_audio_mmproj(outdir / "mmproj.gguf", seed=seed)


def wav_bytes(seconds: float = 1.0, *, seed: int = 0, rate: int = SAMPLE_RATE, channels: int = 1) -> bytes:
    """A deterministic 16-bit PCM WAV file: a few tones with random pitches and amplitudes, no
    libraries needed. Another ``rate`` or ``channels`` than libmtmd's 16 kHz mono is resampled
    and mixed down by it."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    freqs = rng.uniform(100, 3000, size=4)
    amps = rng.uniform(0.05, 0.25, size=4)
    signal = sum(a * np.sin(2 * np.pi * f * t + rng.uniform(0, np.pi)) for f, a in zip(freqs, amps))
    pcm = (np.clip(signal, -1, 1) * 32767).astype("<i2")
    frames = np.repeat(pcm[:, None], channels, axis=1).tobytes()
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    return out.getvalue()


# Self-check: load both files through libmtmd, tokenize a prompt with a WAV file, encode it.


def _self_check(outdir: pathlib.Path) -> None:
    import llama_cpp as ll
    import llama_cpp.mtmd_cpp as mtmd

    model_path, mmproj_path = write_tiny_audio(outdir)
    again = write_tiny_audio_mmproj(outdir / "mmproj-again.gguf")
    assert again.read_bytes() == mmproj_path.read_bytes(), "mmproj not deterministic"
    again.unlink()
    print(f"wrote {model_path} ({model_path.stat().st_size} B), {mmproj_path} ({mmproj_path.stat().st_size} B)")

    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(str(model_path).encode(), ll.llama_model_default_params())
    assert model, "text model failed to load"
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = 1
    params.print_timings = False
    ctx = mtmd.mtmd_init_from_file(str(mmproj_path).encode(), model, params)
    assert ctx, "mtmd_init_from_file failed"
    assert mtmd.mtmd_support_audio(ctx) and not mtmd.mtmd_support_vision(ctx)

    audio = wav_bytes(1.5, rate=22050, channels=2)
    buf = (ctypes.c_uint8 * len(audio)).from_buffer_copy(audio)
    bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(audio), False)
    assert bitmap, "bitmap from WAV bytes failed"
    assert mtmd.mtmd_bitmap_is_audio(bitmap)
    marker = mtmd.mtmd_default_marker()
    text = b"<|im_start|>user\nWhat is said in " + marker + b"?<|im_end|>\n<|im_start|>assistant\n"
    inp = mtmd.mtmd_input_text(text, len(text), True, True)
    chunks = mtmd.mtmd_input_chunks_init()
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), bitmaps, 1) == 0, "mtmd_tokenize failed"
    kinds = []
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        kinds.append((mtmd.mtmd_input_chunk_get_type(chunk), mtmd.mtmd_input_chunk_get_n_pos(chunk)))
        if kinds[-1][0] == mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO:
            assert mtmd.mtmd_input_chunk_get_n_tokens(chunk) == N_AUDIO_TOKENS
            assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0, "mtmd_encode_chunk failed"
            out = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), (N_AUDIO_TOKENS * PROJECTION_DIM,))
            rows = out.reshape(N_AUDIO_TOKENS, PROJECTION_DIM)
            assert np.isfinite(out).all() and out.std() > 0.1, f"degenerate audio embeddings (std {out.std()})"
            assert np.abs(rows[0] - rows[1]).max() > 1e-3, "every audio position the same embedding"
            print(f"audio embeddings: std {out.std():.3f}")
    assert [k for k, _ in kinds] == [0, 2, 0], kinds
    print(f"chunks (type, n_pos): {kinds}")

    import tinyvision

    tinyvision.eval_and_free(model, ctx, chunks, bitmap, sum(n for _, n in kinds))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/tinyaudio.py OUTDIR")
    _self_check(pathlib.Path(sys.argv[1]))
