"""Deterministic tiny LLaMA-architecture GGUF for fast llama.cpp tests.

`write_tiny_model` writes a random-weight model (2 layers, n_embd 64, GQA with
4 query / 2 KV heads) of about 270 KB that llama.cpp loads in milliseconds, so
tests can exercise the real runtime without downloading weights. Run this
file directly for a self-check through llama_cpp's low-level API.

What the file contains, and why:

* A real byte-level BPE tokenizer ("gpt2" model, "qwen2" pre-tokenizer): the
  256 GPT-2 byte tokens make any UTF-8 text round-trip exactly, and a few
  hundred merges learned from a fixed English sample give longer tokens.
  "qwen2" is chosen because it disables llama.cpp's `clean_spaces`, which
  would otherwise rewrite " ," into "," when detokenizing.
* CONTROL special tokens <|bos|>, <|eos|>, <|im_start|>, <|im_end|> and a
  ChatML chat template, so chat formatting and end-of-generation handling
  behave like a real chat model (EOS and EOT=<|im_end|> are both EOG tokens).
* A training context of 4096 tokens, so tests may use any n_ctx up to 4096.
* Output rows of the special tokens are scaled down so random greedy decoding
  practically never stops on its own; tests control stopping explicitly.

The same seed always yields a byte-identical file.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import re
from collections import Counter

import gguf
import numpy as np
import pytest

ARCHITECTURE = "llama"
MODEL_NAME = "llamactor-tiny"
N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 128
CONTEXT_LENGTH = 4096
RMS_NORM_EPS = 1e-5
ROPE_FREQ_BASE = 10000.0

WEIGHT_STD = 0.1  # large enough that greedy decoding does not collapse
SPECIAL_TOKEN_OUTPUT_SCALE = 0.1  # keeps special-token logits from winning

N_BYTE_TOKENS = 256
N_MERGES = 200  # 256 bytes + 200 merges + 4 specials = 460 tokens
TOKENIZER_MODEL = "gpt2"
TOKENIZER_PRE = "qwen2"

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
# write_tiny_model(fim=True) only (for /infill): Qwen2.5-Coder's fill-in-the-middle tokens, appended
# after the specials above, with the tokenizer.ggml.fim_*_token_id keys llama.cpp reads.
FIM_TOKENS = {
    "pre": "<|fim_prefix|>",
    "suf": "<|fim_suffix|>",
    "mid": "<|fim_middle|>",
    "pad": "<|fim_pad|>",
    "rep": "<|repo_name|>",
    "sep": "<|file_sep|>",
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MERGE_CORPUS = """
The quick brown fox jumps over the lazy dog. Hello world, this is a tiny model
for testing the serving runtime. It reads the prompt, then it writes tokens one
at a time until the request is done. Many requests may share one model, and
each of them has its own sequence in the batch. The server should stream the
text back to the client as soon as it is ready, and it should stop when the
user asks it to stop. What is the time? Where are you going? I think that we
can do it, and they will see that there are more things to learn when you
start with something small and simple. 0123456789 function return value
"""

# Corpus splitting for merge learning only; it never needs to match llama.cpp.
_WORD_PATTERN = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+")


def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable character table, indexed by byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    unprintable = (byte for byte in range(N_BYTE_TOKENS) if byte not in printable)
    remapped = {byte: chr(N_BYTE_TOKENS + i) for i, byte in enumerate(unprintable)}
    return [remapped.get(byte, chr(byte)) for byte in range(N_BYTE_TOKENS)]


def _merge_pair(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    merged, i = [], 0
    while i < len(word):
        if word[i : i + 2] == pair:
            merged.append(pair[0] + pair[1])
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return tuple(merged)


def _learn_merges(corpus: str, byte_chars: list[str], n_merges: int) -> list[tuple[str, str]]:
    """Classic BPE training; ties break lexicographically so output is stable."""
    words = Counter(tuple(byte_chars[b] for b in piece.encode("utf-8")) for piece in _WORD_PATTERN.findall(corpus))
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            raise ValueError("merge corpus too small for the requested merges")
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        words = Counter({_merge_pair(word, best): n for word, n in words.items()})
    return merges


def _build_vocab(specials: tuple[str, ...] = SPECIAL_TOKENS) -> tuple[list[str], list[int], list[str]]:
    """Token strings, token types and "left right" merge strings."""
    byte_chars = _bytes_to_unicode()
    merges = _learn_merges(MERGE_CORPUS, byte_chars, N_MERGES)
    tokens = [*byte_chars, *(left + right for left, right in merges), *specials]
    assert len(set(tokens)) == len(tokens), "duplicate token in vocabulary"
    n_normal = len(tokens) - len(specials)
    types = [gguf.TokenType.NORMAL] * n_normal + [gguf.TokenType.CONTROL] * len(specials)
    return tokens, types, [f"{left} {right}" for left, right in merges]


def _weights(rng: np.random.Generator, n_vocab: int, n_special: int = len(SPECIAL_TOKENS)) -> dict[str, np.ndarray]:
    """All tensors by GGUF name; matrices are (out_features, in_features)."""

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * WEIGHT_STD).astype(np.float16)

    def norm() -> np.ndarray:
        return np.ones(N_EMBD, dtype=np.float32)

    output = matrix(n_vocab, N_EMBD)  # special tokens are the last rows
    output[-n_special:] *= np.float16(SPECIAL_TOKEN_OUTPUT_SCALE)
    tensors = {"token_embd.weight": matrix(n_vocab, N_EMBD)}
    for layer in range(N_LAYER):
        prefix = f"blk.{layer}."
        tensors |= {
            prefix + "attn_norm.weight": norm(),
            prefix + "attn_q.weight": matrix(N_HEAD * HEAD_DIM, N_EMBD),
            prefix + "attn_k.weight": matrix(N_HEAD_KV * HEAD_DIM, N_EMBD),
            prefix + "attn_v.weight": matrix(N_HEAD_KV * HEAD_DIM, N_EMBD),
            prefix + "attn_output.weight": matrix(N_EMBD, N_HEAD * HEAD_DIM),
            prefix + "ffn_norm.weight": norm(),
            prefix + "ffn_gate.weight": matrix(N_FF, N_EMBD),
            prefix + "ffn_up.weight": matrix(N_FF, N_EMBD),
            prefix + "ffn_down.weight": matrix(N_EMBD, N_FF),
        }
    tensors |= {"output_norm.weight": norm(), "output.weight": output}
    return tensors


def _add_hparams(writer: gguf.GGUFWriter, n_vocab: int) -> None:
    writer.add_name(MODEL_NAME)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(n_vocab)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)


def _add_tokenizer(
    writer: gguf.GGUFWriter, tokens: list[str], types: list[int], merges: list[str], *, chat_template: bool = True
) -> None:
    writer.add_tokenizer_model(TOKENIZER_MODEL)
    writer.add_tokenizer_pre(TOKENIZER_PRE)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index(BOS_TOKEN))
    writer.add_eos_token_id(tokens.index(EOS_TOKEN))
    writer.add_eot_token_id(tokens.index(IM_END_TOKEN))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template:
        writer.add_chat_template(CHAT_TEMPLATE)


def write_tiny_model(
    path: str | os.PathLike, *, seed: int = 0, fim: bool = False, chat_template: bool = True
) -> pathlib.Path:
    """Write the tiny GGUF model to `path` and return it as a Path.

    ``fim=True`` adds the FIM_TOKENS and their metadata keys (for /infill);
    ``chat_template=False`` leaves out ``tokenizer.chat_template`` (a GGUF without one). The
    default model's bytes do not change.
    """
    path = pathlib.Path(path)
    specials = SPECIAL_TOKENS + (tuple(FIM_TOKENS.values()) if fim else ())
    tokens, types, merges = _build_vocab(specials)
    writer = gguf.GGUFWriter(path, ARCHITECTURE)
    _add_hparams(writer, len(tokens))
    _add_tokenizer(writer, tokens, types, merges, chat_template=chat_template)
    if fim:
        for kind, text in FIM_TOKENS.items():
            writer.add_uint32(f"tokenizer.ggml.fim_{kind}_token_id", tokens.index(text))
    return write_out(writer, _weights(np.random.default_rng(seed), len(tokens), len(specials)), path)


def write_out(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray], path: pathlib.Path) -> pathlib.Path:
    """Add ``tensors`` and write the header, metadata and tensors of a test GGUF file."""
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Self-check (`python tests/tinymodel.py`): loads the model with llama_cpp.

SAMPLE_TEXT = 'héllo 世界 🙂 The quick brown fox , said: "ok"\n\tend'
PROMPTS = ("The quick brown fox", "Hello world", "héllo 世界 🙂", "What is the time?")
N_GENERATE = 32
N_SEQ_MAX = 8
MAX_PIECE_BYTES = 64
MIN_DISTINCT_GENERATED = N_GENERATE // 4


def _tokenize(ll, vocab, text: str, *, add_special: bool, parse_special: bool = False) -> list[int]:
    data = text.encode("utf-8")
    buf = (ll.llama_token * (len(data) + 2))()  # at most one token per byte, plus BOS/EOS
    n = ll.llama_tokenize(vocab, data, len(data), buf, len(buf), add_special, parse_special)
    assert n >= 0, f"tokenize failed: {n}"
    return list(buf[:n])


def _detokenize(ll, vocab, tokens: list[int]) -> str:
    buf, pieces = ctypes.create_string_buffer(MAX_PIECE_BYTES), []
    for token in tokens:
        n = ll.llama_token_to_piece(vocab, token, buf, MAX_PIECE_BYTES, 0, False)
        pieces.append(buf.raw[:n])
    return b"".join(pieces).decode("utf-8", errors="replace")


def _greedy(ll, ctx, vocab, prompts: tuple[str, ...], n_new: int) -> list[list[int]]:
    """Greedy-decode each prompt as its own sequence, all sharing each batch."""
    ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
    pending = [list(enumerate(_tokenize(ll, vocab, p, add_special=True))) for p in prompts]
    batch = ll.llama_batch_init(sum(map(len, pending)), 0, len(prompts))
    n_vocab, outputs = ll.llama_vocab_n_tokens(vocab), [[] for _ in prompts]
    for _ in range(n_new):
        batch.n_tokens, logit_rows = 0, []
        for seq, items in enumerate(pending):  # items: (position, token) pairs
            for pos, token in items:
                i = batch.n_tokens
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = token, pos, 1, seq
                batch.logits[i] = pos == items[-1][0]
                batch.n_tokens += 1
            logit_rows.append(batch.n_tokens - 1)
        assert ll.llama_decode(ctx, batch) == 0, "llama_decode failed"
        for seq, row in enumerate(logit_rows):
            token = int(np.argmax(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, row), (n_vocab,))))
            outputs[seq].append(token)
            pending[seq] = [(pending[seq][-1][0] + 1, token)]
    ll.llama_batch_free(batch)
    return outputs


def _check_model(ll, model) -> None:
    vocab = ll.llama_model_get_vocab(model)
    tokens = _tokenize(ll, vocab, SAMPLE_TEXT, add_special=True)
    assert tokens[0] == ll.llama_vocab_bos(vocab), "BOS not added"
    assert _detokenize(ll, vocab, tokens[1:]) == SAMPLE_TEXT, "UTF-8 round trip failed"
    assert IM_START_TOKEN in ll.llama_model_chat_template(model, None).decode()
    im_end = _tokenize(ll, vocab, IM_END_TOKEN, add_special=False, parse_special=True)
    assert len(im_end) == 1 and ll.llama_vocab_is_eog(vocab, im_end[0]), "<|im_end|> not EOG"
    print(f"vocab {ll.llama_vocab_n_tokens(vocab)}, sample text -> {len(tokens)} tokens")

    params = ll.llama_context_default_params()
    params.n_ctx, params.n_seq_max = CONTEXT_LENGTH, N_SEQ_MAX
    ctx = ll.llama_init_from_model(model, params)
    outputs = _greedy(ll, ctx, vocab, PROMPTS, N_GENERATE)
    assert outputs == _greedy(ll, ctx, vocab, PROMPTS, N_GENERATE), "greedy decode not deterministic"
    assert len({tuple(out) for out in outputs}) == len(PROMPTS), "prompts gave identical outputs"
    for prompt, out in zip(PROMPTS, outputs):
        assert len(set(out)) >= MIN_DISTINCT_GENERATED, f"degenerate output for {prompt!r}"
        print(f"{prompt!r} -> {_detokenize(ll, vocab, out)!r}")
    ll.llama_free(ctx)


def _self_check() -> None:
    import tempfile
    import time

    import llama_cpp as ll

    silence = ll.llama_log_callback(lambda level, text, user_data: None)
    ll.llama_log_set(silence, None)
    ll.llama_backend_init()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(pathlib.Path(tmp, "a.gguf"))
        assert path.read_bytes() == write_tiny_model(pathlib.Path(tmp, "b.gguf")).read_bytes()
        start = time.perf_counter()
        model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
        assert model, "model failed to load"
        load_ms = (time.perf_counter() - start) * 1000
        print(f"wrote {path.stat().st_size / 1024:.1f} KB, loaded in {load_ms:.1f} ms")
        _check_model(ll, model)
        ll.llama_model_free(model)
    print("self-check passed")


if __name__ == "__main__":
    _self_check()


def assert_llama_servers(golden: dict, name: str, got: dict, recorder: str) -> None:
    """Compare ``got`` (an answer's text, prompt_tokens and maybe tokens) with llama-server's
    recorded answer ``name`` in ``golden`` (keyed by :func:`cpu_class`).

    The prompt's token count (the chat rendering, the media's positions) is the same on every
    machine and is compared everywhere. The generated text and tokens come from the tiny
    model's nearly flat logits, which ggml's kernels round differently: they are compared only
    on a build of the class they were recorded on, and the test skips after the count
    otherwise (``make conformance`` builds llama-server here and compares token for token)."""
    counts = {answers[name]["prompt_tokens"] for answers in golden.values()}
    assert len(counts) == 1, counts  # recorded on several classes: the count must not depend on one
    assert got["prompt_tokens"] == counts.pop()
    recorded = golden.get(cpu_class())
    if recorded is None:
        pytest.skip(
            f"the prompt's token count is llama-server's; no generated answer was recorded on a "
            f"{cpu_class()} build (run {recorder})"
        )
    want = dict(recorded[name])
    # A choice whose last token ends inside a UTF-8 sequence: llamactor's text ends with U+FFFD
    # for it, llama-server's drops it (the text stream's difference; token ids are compared where
    # recorded).
    got = {**got, "text": got["text"].rstrip("\ufffd")}
    want["text"] = want["text"].rstrip("\ufffd")
    assert got == want


def cpu_class() -> str:
    """The class of CPU kernels this llama.cpp build runs: "avx512", "avx2" or "other".

    The tiny model's logits are nearly flat, so the last-bit rounding that differs between
    ggml's AVX-512 and AVX2 kernels changes seeded samples; recorded token ids are kept per class.
    """
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    features = set(re.findall(r"(\w+) = 1", info))
    if any(f.startswith("AVX512") for f in features):
        return "avx512"
    return "avx2" if "AVX2" in features else "other"
