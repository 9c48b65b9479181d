"""Deterministic tiny vision model for multimodal tests: a text GGUF and a libmtmd projector.

``python tests/tinyvision.py OUTDIR`` writes

* ``OUTDIR/model.gguf``: the tiny LLaMA-architecture text model of ``tests/tinymodel.py``
  (n_embd 64, byte-level BPE, ChatML template), unchanged;
* ``OUTDIR/mmproj.gguf``: a random-weight CLIP vision encoder with a LLaVA MLP projector
  (``clip.projector_type = "mlp"``), about 60 KB, that libmtmd loads next to that model;

then loads both through llama_cpp's ``mtmd_cpp`` bindings and tokenizes and encodes a prompt
with an image (the self-check). The same seed always yields byte-identical files.

Why the LLaVA MLP projector: of libmtmd's projector types it needs the fewest tensors and no
special text tokens. Gemma 3 wraps every image in ``<start_of_image>``/``<end_of_image>`` text
tokens (and decodes it non-causally), Idefics3 needs ``<fake_token_around_image>``,
``<global-img>`` and row/column tokens in the vocabulary, the Qwen types need M-RoPE; "mlp"
is a plain ViT (``tools/mtmd/models/llava.cpp``) whose projected patches are ordinary
embeddings at consecutive positions, so the llama text model of ``tinymodel.py`` serves as is.
libmtmd resizes any image to ``IMAGE_SIZE`` square (fixed-size preprocessing, no slices), so
every image is ``N_IMAGE_TOKENS`` = (32 / 8)^2 = 16 embeddings, each 64 wide like the text model.

The GGUF keys and tensor names are the ones ``tools/mtmd/clip.cpp`` reads
(``clip-impl.h``: ``KEY_*``, ``TN_*``): the LLaVA graph runs the first ``N_LAYER - 1`` encoder
layers (the second-to-last layer is the feature layer) but every layer's tensors must exist.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import struct
import sys
import zlib
from typing import Any

import gguf
import numpy as np
import tinymodel

PROJECTOR_TYPE = "mlp"
N_EMBD = 32  # vision encoder width
N_HEAD = 2
N_FF = 48  # != N_EMBD: clip.cpp guesses swapped up/down tensors from their shapes
N_LAYER = 2
N_MM_HIDDEN = 64  # projector hidden width
PROJECTION_DIM = tinymodel.N_EMBD  # the text model's n_embd; libmtmd refuses a mismatch
IMAGE_SIZE = 32
PATCH_SIZE = 8
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
LAYER_NORM_EPS = 1e-6
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
WEIGHT_STD = 0.2
# The projector's output scale: image embeddings about as large as the text model's token
# embeddings (WEIGHT_STD 0.1 there), so an image changes what the model generates.
OUTPUT_STD = 0.5


def _mmproj_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every tensor of the projector file by GGUF name; matrices are (out, in) in numpy order."""

    def matrix(rows: int, cols: int, std: float = WEIGHT_STD) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * std).astype(np.float16)

    def vector(n: int, std: float = WEIGHT_STD) -> np.ndarray:
        return (rng.standard_normal(n) * std).astype(np.float32)

    n_patches = N_IMAGE_TOKENS
    tensors = {
        # conv2d kernel: ggml ne [PATCH, PATCH, 3, N_EMBD]
        "v.patch_embd.weight": (rng.standard_normal((N_EMBD, 3, PATCH_SIZE, PATCH_SIZE)) * WEIGHT_STD).astype(
            np.float16
        ),
        "v.patch_embd.bias": vector(N_EMBD),
        "v.position_embd.weight": (rng.standard_normal((n_patches, N_EMBD)) * WEIGHT_STD).astype(np.float32),
        "v.pre_ln.weight": np.ones(N_EMBD, dtype=np.float32),
        "v.pre_ln.bias": np.zeros(N_EMBD, dtype=np.float32),
    }
    for il in range(N_LAYER):
        p = f"v.blk.{il}."
        tensors |= {
            p + "ln1.weight": np.ones(N_EMBD, dtype=np.float32),
            p + "ln1.bias": np.zeros(N_EMBD, dtype=np.float32),
            p + "attn_q.weight": matrix(N_EMBD, N_EMBD),
            p + "attn_q.bias": vector(N_EMBD),
            p + "attn_k.weight": matrix(N_EMBD, N_EMBD),
            p + "attn_k.bias": vector(N_EMBD),
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
    tensors |= {
        "mm.0.weight": matrix(N_MM_HIDDEN, N_EMBD),
        "mm.0.bias": vector(N_MM_HIDDEN),
        "mm.2.weight": matrix(PROJECTION_DIM, N_MM_HIDDEN, OUTPUT_STD),
        "mm.2.bias": vector(PROJECTION_DIM),
    }
    return tensors


def write_tiny_mmproj(path: str | os.PathLike, *, seed: int = 0, projection_dim: int = PROJECTION_DIM) -> pathlib.Path:
    """Write the projector GGUF; ``projection_dim`` other than the text model's makes a mismatch."""
    path = pathlib.Path(path)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_name("llamactor-tiny-vision")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_string("clip.projector_type", PROJECTOR_TYPE)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_audio_encoder", False)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", N_EMBD)
    writer.add_uint32("clip.vision.feed_forward_length", N_FF)
    writer.add_uint32("clip.vision.block_count", N_LAYER)
    writer.add_uint32("clip.vision.projection_dim", projection_dim)
    writer.add_uint32("clip.vision.attention.head_count", N_HEAD)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", LAYER_NORM_EPS)
    writer.add_array("clip.vision.image_mean", list(IMAGE_MEAN))
    writer.add_array("clip.vision.image_std", list(IMAGE_STD))
    tensors = _mmproj_tensors(np.random.default_rng(seed))
    if projection_dim != PROJECTION_DIM:
        rng = np.random.default_rng(seed + 1)
        tensors["mm.2.weight"] = (rng.standard_normal((projection_dim, N_MM_HIDDEN)) * OUTPUT_STD).astype(np.float16)
        tensors["mm.2.bias"] = np.zeros(projection_dim, dtype=np.float32)
    return tinymodel.write_out(writer, tensors, path)


def write_tiny_vision(outdir: str | os.PathLike, *, seed: int = 0) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``model.gguf`` and ``mmproj.gguf`` into ``outdir``; returns their paths."""
    outdir = pathlib.Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    model = tinymodel.write_tiny_model(outdir / "model.gguf", seed=seed)
    return model, write_tiny_mmproj(outdir / "mmproj.gguf", seed=seed)


def png_bytes(width: int, height: int, *, seed: int = 0) -> bytes:
    """A deterministic RGB PNG (random pixels, smooth enough to survive resizing), no PIL needed."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    ys = np.arange(height) * 4 // max(height, 1)
    xs = np.arange(width) * 4 // max(width, 1)
    pixels = coarse[ys][:, xs]
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


# Self-check: load both files through libmtmd, tokenize a prompt with an image, encode it.


def _self_check(outdir: pathlib.Path) -> None:
    import llama_cpp as ll
    import llama_cpp.mtmd_cpp as mtmd

    model_path, mmproj_path = write_tiny_vision(outdir)
    again = write_tiny_mmproj(outdir / "mmproj-again.gguf")
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
    assert mtmd.mtmd_support_vision(ctx) and not mtmd.mtmd_support_audio(ctx)

    image = png_bytes(40, 24)
    buf = (ctypes.c_uint8 * len(image)).from_buffer_copy(image)
    bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(image), False)
    assert bitmap, "bitmap from PNG bytes failed"
    marker = mtmd.mtmd_default_marker()
    text = b"<|im_start|>user\nWhat is in " + marker + b"?<|im_end|>\n<|im_start|>assistant\n"
    inp = mtmd.mtmd_input_text(text, len(text), True, True)
    chunks = mtmd.mtmd_input_chunks_init()
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), bitmaps, 1) == 0, "mtmd_tokenize failed"
    kinds = []
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        kinds.append((mtmd.mtmd_input_chunk_get_type(chunk), mtmd.mtmd_input_chunk_get_n_pos(chunk)))
        if kinds[-1][0] == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            assert mtmd.mtmd_input_chunk_get_n_tokens(chunk) == N_IMAGE_TOKENS
            assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0, "mtmd_encode_chunk failed"
            out = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), (N_IMAGE_TOKENS * PROJECTION_DIM,))
            assert np.isfinite(out).all() and out.std() > 0.1, "degenerate image embeddings"
    assert [k for k, _ in kinds] == [0, 1, 0], kinds
    print(f"chunks (type, n_pos): {kinds}")

    eval_and_free(model, ctx, chunks, bitmap, sum(n for _, n in kinds))


def eval_and_free(model: Any, ctx: Any, chunks: Any, bitmap: Any, n_positions: int) -> None:
    """The self-checks' last step: every chunk evaluated into a fresh context (``n_positions`` in
    all), then everything freed."""
    import llama_cpp as ll
    import llama_cpp.mtmd_cpp as mtmd

    cparams = ll.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch = 512, 512
    lctx = ll.llama_init_from_model(model, cparams)
    n_past = ll.llama_pos(0)
    assert mtmd.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0
    assert n_past.value == n_positions
    print(f"evaluated {n_past.value} positions")
    ll.llama_free(lctx)
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    mtmd.mtmd_free(ctx)
    ll.llama_model_free(model)
    print("self-check passed")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/tinyvision.py OUTDIR")
    _self_check(pathlib.Path(sys.argv[1]))
