"""The values of llama-server's options, parsed: each function takes an option's text (or
argparse's list of them) and returns what the config holds, or raises ValueError /
ArgumentTypeError, which argparse reports as that option's "invalid value". The table of options
that uses them is ``runtime.cliflags``.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llamactor.protocol.errors import ConfigError
from llamactor.protocol.sampling import DEFAULT_SEED, ParamError, sampler_names
from llamactor.runtime.cliargs import Ignored
from llamactor.runtime.engine import placement
from llamactor.runtime.engine.overrides import KvOverride, parse_kv_override
from llamactor.runtime.engine.speculative import SPEC_MOD, SPEC_NONE, SPEC_TYPES
from llamactor.runtime.service.config import ALL_LAYERS, name_set


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def names(values: tuple[str, ...]) -> tuple[str, ...] | None:
    """``--alias``/``--tags a,b`` (repeatable): llama-server adds each comma-separated name to a
    set, so they come out sorted, without repeats; no name at all leaves the field unset."""
    return name_set(name for value in values for name in value.split(",")) or None


def hosts(text: str) -> tuple[str, ...]:
    """``--host a,b``: llama-server reads a CSV row (a quoted address may hold a comma), strips
    each address and drops the empty ones; none left is an error."""
    try:
        row = next(csv.reader([text]), [])
    except csv.Error as exc:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of addresses: {exc}") from None
    hosts = tuple(h.strip() for h in row if h.strip())
    if not hosts:
        raise argparse.ArgumentTypeError("at least one address is required")
    return hosts


def timeout(text: str) -> int:
    """``--timeout N``: whole seconds, at least 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 second, got {n}")
    return n


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in comma_list(text))


def reasoning(value: str) -> str:
    """--reasoning as llama-server reads it: on/enabled/true/1, off/disabled/false/0, auto."""
    if value in ("on", "enabled", "true", "1"):
        return "on"
    if value in ("off", "disabled", "false", "0"):
        return "off"
    if value == "auto":
        return "auto"
    raise argparse.ArgumentTypeError(f"must be on, off or auto, got {value!r}")


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(allowed)}, got {text!r}")
        return text

    return parse


def read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {exc.strerror}") from None


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def schema_grammar(text: str) -> str:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    json_object(text)
    try:
        return str(json_schema_to_gbnf(text))
    except Exception as exc:
        raise argparse.ArgumentTypeError(f"unsupported JSON schema: {exc}") from None


def samplers(text: str) -> tuple[str, ...]:
    try:
        return sampler_names([s for s in text.split(";") if s])
    except ParamError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def sampler_chars(text: str) -> tuple[str, ...]:
    try:
        return sampler_names(text)
    except ParamError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seed(text: str) -> int:
    seed = int(text)
    return DEFAULT_SEED if seed < 0 or seed > DEFAULT_SEED else seed  # llama.cpp's stoul: -1 = random


def logit_bias(text: str) -> tuple[int, float]:
    """``TOKEN_ID(+/-)BIAS`` as llama-server reads it: ``15043+1``, ``15043-inf``."""
    for i, ch in enumerate(text):
        if i and ch in "+-":
            return int(text[:i]), float(text[i:])
    raise argparse.ArgumentTypeError(f"must be TOKEN_ID+BIAS or TOKEN_ID-BIAS, got {text!r}")


def scheduler_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``; a value that reads as an int, a float or true/false becomes one."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE with KEY a Python name, got {text!r}")
    value: Any = raw
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    else:
        for number in (int, float):
            try:
                value = number(raw)
                break
            except ValueError:
                continue
    return key.strip(), value


def itl_pct(text: str) -> float:
    """``p50``, ``p90``, ``p99`` (or a bare percentile in (0, 100)) or ``mean`` (0)."""
    word = text.strip().lower()
    if word == "mean":
        return 0.0
    value = float(word.removeprefix("p"))
    if not 0 < value < 100:
        raise argparse.ArgumentTypeError(
            f"must be p50, p90, p99 (a percentile between 0 and 100) or mean, got {text!r}"
        )
    return value


def layers(text: str) -> int | None:
    if text == "auto":
        return None
    if text == "all":
        return ALL_LAYERS
    n = int(text)
    return None if n == -1 else ALL_LAYERS if n == -2 else n


def auto_int(text: str) -> int | None:
    """-1 (or 0 for threads) means "let llamactor choose", as llama-server's auto."""
    n = int(text)
    return None if n <= 0 else n


def sleep_seconds(text: str) -> int:
    """``--sleep-idle-seconds``: -1 (never) or a positive number of seconds, as llama-server reads it."""
    n = int(text)
    if n == 0 or n < -1:
        raise argparse.ArgumentTypeError("cannot be 0 or less than -1")
    return n


def ctx_size(text: str) -> int:
    n = int(text)
    if n == 0:
        raise argparse.ArgumentTypeError(
            "0 (the model's training context) is not supported: give the total context size for all slots"
        )
    return n


def dry_breakers(values: tuple[str, ...]) -> tuple[str, ...]:
    if "none" in values:
        raise ConfigError("--dry-sequence-breaker none (DRY without breakers) is not supported: give at least one")
    return values


def flatten(values: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    return tuple(k for v in values for k in v)


def lora(text: str) -> tuple[tuple[str, float], ...]:
    """``--lora FNAME[,FNAME...]``: adapters at global scale 1."""
    return tuple((path, 1.0) for path in comma_list(text))


def scaled_files(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, float], ...]:
    """``FNAME:SCALE`` items as llama-server splits them (exactly one ':')."""
    out = []
    for item in items:
        parts = item.split(":")
        if len(parts) != 2:
            raise argparse.ArgumentTypeError(f"must be FNAME:SCALE, got {item!r}")
        try:
            out.append((parts[0], float(parts[1])))
        except ValueError:
            raise argparse.ArgumentTypeError(f"the scale of {parts[0]!r} is not a number: {parts[1]!r}") from None
    return tuple(out)


def lora_scaled(text: str) -> tuple[tuple[str, float], ...]:
    """``--lora-scaled FNAME:SCALE[,...]``."""
    return scaled_files(comma_list(text))


def csv_row(text: str) -> list[str]:
    """llama-server's ``parse_csv_row``: comma-separated fields, a field quoted from its start
    may hold commas (``""`` in it is a quote), a quote anywhere else is a plain character;
    fields are not stripped and an empty one is kept."""
    fields, field, quoted, i = [], "", False, 0
    while i < len(text):
        ch = text[i]
        if ch == '"' and not quoted and not field:
            quoted = True
        elif ch == '"' and quoted:
            if text[i + 1 : i + 2] == '"':
                field += '"'
                i += 1
            else:
                quoted = False
        elif ch == "," and not quoted:
            fields.append(field)
            field = ""
        else:
            field += ch
        i += 1
    fields.append(field)
    return fields


def kv_overrides(text: str) -> tuple[KvOverride, ...]:
    """``--override-kv KEY=TYPE:VALUE[,...]``, each as llama-server's ``string_parse_kv_override``."""
    try:
        return tuple(parse_kv_override(item) for item in csv_row(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def control_vectors(text: str) -> tuple[tuple[str, float], ...]:
    """``--control-vector FNAME[,FNAME...]``: files at scale 1."""
    return tuple((path, 1.0) for path in csv_row(text))


def control_vectors_scaled(text: str) -> tuple[tuple[str, float], ...]:
    """``--control-vector-scaled FNAME:SCALE[,...]`` (fields as llama-server's CSV rows)."""
    return scaled_files(csv_row(text))


def rope_scale(text: str) -> float:
    """``--rope-scale N``: the context expanded N times, llama-server's rope_freq_scale = 1/N."""
    n = float(text)
    if n == 0:
        raise argparse.ArgumentTypeError("must not be 0 (the context is expanded N times)")
    return 1.0 / n


def key_file(path: str) -> tuple[str, ...]:
    return tuple(line for line in read(path).splitlines() if line and not line.startswith("#"))


def tensor_overrides(values: tuple[Any, ...]) -> tuple[tuple[str, str], ...]:
    """-ot, -cmoe, -ncmoe, -ncffn in command-line order: each gives (pattern, buffer type) pairs
    (-cmoe a switch: its pairs when on)."""
    out: list[tuple[str, str]] = []
    for value in values:
        out.extend(placement.cpu_moe(value) if isinstance(value, bool) else value)
    return tuple(out)


def cont_batching(on: bool) -> str | Ignored:
    if on:
        return Ignored("continuous batching is always on (see --scheduler)")
    return "no-cont-batching"  # llama-server's -nocb is a scheduler here


def spec_type(text: str) -> str:
    """llama-server's comma-separated ``--spec-type``; llamactor runs one kind at a time."""
    kinds = [k for k in dict.fromkeys(comma_list(text)) if k != SPEC_NONE]
    unknown = [k for k in kinds if k not in SPEC_TYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)} is not built; one of {', '.join(SPEC_TYPES)}")
    if len(kinds) > 1:
        raise argparse.ArgumentTypeError(f"one kind of speculation at a time, got {text!r}")
    return kinds[0] if kinds else SPEC_NONE


def spec_default(on: bool) -> str | None:
    """``--spec-default``: llama-server's default speculation, ngram-mod; its n_match 24, n_min 48
    and n_max 64 are the --spec-ngram-mod-* defaults (those flags may still change them)."""
    return SPEC_MOD if on else None


def is_one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


def verbosity_level(threshold: int) -> str:
    """llama-server's -lv threshold as a log level (its levels: 1 error, 2 warning, 3 info, 4 debug)."""
    if threshold >= 4:
        return "debug"
    return ("critical", "error", "warning", "info")[max(threshold, 0)]
