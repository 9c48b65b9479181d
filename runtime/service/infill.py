"""Fill-in-the-middle prompts, as llama-server's ``format_prompt_infill`` builds them.

The repo-level FIM pattern (https://arxiv.org/pdf/2409.12186), with the GGUF's own tokens::

    [FIM_REP]myproject\\n [FIM_SEP]filename0\\n extra chunk 0 ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix [FIM_SUF]suffix [FIM_MID]prompt

Prefix and suffix are cut to fit one batch (3:1), the extra chunks fill what is left of the
slot context, exactly as llama-server does, so the same request gives the same tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llamactor.protocol.errors import NotSupported, RequestError
from llamactor.runtime.engine.model import Model

# llama-server's chunk separator for models without FIM_SEP ("\n\n--- snippet ---\n\n")
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"
PROJECT_LINE = "myproject\n"  # llama-server's fixed project name (its TODO: an input)
FILE_LINE = "filename\n"  # and its fixed name of the current file


def check_fim(model: Model) -> None:
    """llama-server's 501 ``not_supported_error`` for a model without FIM pre/suf/mid tokens."""
    fim = model.fim_tokens()
    missing = "".join(
        f"{what} token is missing. "
        for what, tok in (("prefix", fim.pre), ("suffix", fim.suf), ("middle", fim.mid))
        if tok < 0
    )
    if missing:
        raise NotSupported(f"Infill is not supported by this model: {missing}")


def _mixed(model: Model, value: str | Sequence[Any], field: str) -> list[int]:
    """llama-server's ``tokenize_mixed``: a string, or a list of strings and token ids."""
    if isinstance(value, str):
        return model.tokenize(value, add_special=False, parse_special=False)
    tokens: list[int] = []
    for part in value:
        if isinstance(part, str):
            tokens += model.tokenize(part, add_special=False, parse_special=False)
        elif isinstance(part, int) and not isinstance(part, bool):
            tokens.append(part)
        else:
            raise RequestError(f"{field} must be a string or a list of strings and token ids")
    model.check_tokens(tokens)
    return tokens


def extra_chunks(raw: Sequence[Any]) -> list[tuple[str, str]]:
    """``input_extra`` as (filename, text) pairs, with llama-server's messages for bad chunks."""
    if not isinstance(raw, (list, tuple)):
        raise RequestError('"input_extra" must be an array of {"filename": string, "text": string}')
    chunks = []
    for chunk in raw:
        if isinstance(chunk, Mapping):
            text, filename = chunk.get("text"), chunk.get("filename", "tmp")
        else:
            text, filename = getattr(chunk, "text", None), getattr(chunk, "filename", "tmp")
        if not isinstance(text, str):
            raise RequestError('input_extra: extra_context chunk must contain a "text" field with a string value')
        if not isinstance(filename, str):
            raise RequestError('input_extra: extra_context chunk\'s "filename" field must be a string')
        chunks.append((filename, text))
    return chunks


def infill_tokens(
    model: Model,
    input_prefix: str | Sequence[Any],
    input_suffix: str | Sequence[Any],
    input_extra: Sequence[Any] = (),
    prompt: str = "",
    *,
    n_batch: int,
    n_predict: int,
    n_ctx: int,
    spm_infill: bool = False,
) -> list[int]:
    """The prompt tokens of one infill request (llama-server's ``format_prompt_infill``)."""
    check_fim(model)
    if not isinstance(prompt, str):
        raise RequestError('"prompt" must be a string')
    fim = model.fim_tokens()

    def tok(text: str) -> list[int]:
        return model.tokenize(text, add_special=False, parse_special=False)

    prefix = _mixed(model, input_prefix, "input_prefix")
    suffix = _mixed(model, input_suffix, "input_suffix")
    prompt_tokens = model.tokenize(prompt, add_special=False, parse_special=True)
    extra: list[int] = []
    if fim.rep >= 0:
        extra += [fim.rep, *tok(PROJECT_LINE)]
    for filename, text in extra_chunks(input_extra):
        extra += [fim.sep, *tok(filename + "\n")] if fim.sep >= 0 else tok(CHUNK_SEPARATOR)
        extra += tok(text)
    if fim.sep >= 0:
        extra += [fim.sep, *tok(FILE_LINE)]

    n_prefix_take = min(len(prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt_tokens))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    prefix = [fim.pre, *prefix[len(prefix) - n_prefix_take :], *prompt_tokens]
    suffix = [fim.suf, *suffix[:n_suffix_take]]
    head, tail = (suffix, prefix) if spm_infill else (prefix, suffix)
    if model.add_bos:
        head = [model.bos, *head]
    return [*extra[len(extra) - n_extra_take :], *head, *tail, fim.mid]
