"""Model overrides, as llama-server's flags set them: GGUF metadata read instead of the file's
(``--override-kv``) and the RoPE/YaRN settings of a context (``--rope-*``, ``--yarn-*``).

- A ``KvOverride`` is one ``KEY=TYPE:VALUE``, parsed as llama-server's
  ``string_parse_kv_override`` reads it, and goes to llama.cpp in
  ``llama_model_params.kv_overrides`` when a model loads (``Model``): the engine's model, the
  draft model and the API process's vocabulary alike, as llama-server loads its target and
  draft with the same overrides. llama.cpp uses an override where it reads the key (the
  tokenizer's BOS id, the training context, a hyperparameter), never in
  ``llama_model_meta_val_str``.
- ``RopeOptions`` are the RoPE/YaRN fields of ``llama_context_params``, given to every context
  the engine opens over a model (groups, draft, embedding). Their defaults are llama.cpp's and
  llama-server's: 0 or -1 mean the model's own values.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp

KV_OVERRIDE_TYPES = {
    "int": llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT,
    "float": llama_cpp.LLAMA_KV_OVERRIDE_TYPE_FLOAT,
    "bool": llama_cpp.LLAMA_KV_OVERRIDE_TYPE_BOOL,
    "str": llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR,
}
KV_KEY_BYTES = 127  # llama_model_kv_override.key is char[128], NUL included
KV_STR_BYTES = 127  # so is val_str
INT64_RANGE = (-(2**63), 2**63 - 1)

ROPE_SCALING_TYPES = {
    "none": llama_cpp.LLAMA_ROPE_SCALING_TYPE_NONE,
    "linear": llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR,
    "yarn": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN,
}


@dataclass(frozen=True)
class KvOverride:
    """One GGUF metadata value llama.cpp reads instead of the file's (``--override-kv``)."""

    key: str
    kind: str  # int | float | bool | str (KV_OVERRIDE_TYPES)
    value: int | float | bool | str

    def problem(self) -> str | None:
        """What makes this override one llama.cpp cannot take, or None."""
        if not self.key:
            return "the key is empty"
        if len(self.key.encode()) > KV_KEY_BYTES:
            return f"the key is longer than {KV_KEY_BYTES} bytes"
        if self.kind not in KV_OVERRIDE_TYPES:
            return f"the type must be one of {', '.join(KV_OVERRIDE_TYPES)}, got {self.kind!r}"
        value = self.value
        if self.kind == "bool":
            return None if isinstance(value, bool) else f"a bool value must be true or false, got {value!r}"
        if self.kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool) and INT64_RANGE[0] <= value <= INT64_RANGE[1]
            return None if ok else f"an int value must be a 64-bit integer, got {value!r}"
        if self.kind == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            return None if ok else f"a float value must be a number, got {value!r}"
        if not isinstance(value, str):
            return f"a str value must be a string, got {value!r}"
        if len(value.encode()) > KV_STR_BYTES:
            return f"a str value cannot exceed {KV_STR_BYTES} bytes"
        return None


def parse_kv_override(text: str) -> KvOverride:
    """``KEY=TYPE:VALUE`` as llama-server reads it (``string_parse_kv_override``): the key up to
    the first ``=``, a bool ``true`` or ``false``, a str of at most 127 bytes. Stricter than
    llama-server's ``atol``/``atof``, which read ``int:12abc`` as 12 and ``int:abc`` as 0: here
    a number must be one. ValueError saying what is wrong."""
    key, sep, rest = text.partition("=")
    if not sep:
        raise ValueError(f"must be KEY=TYPE:VALUE, got {text!r}")
    kind, colon, raw = rest.partition(":")
    if not colon or kind not in KV_OVERRIDE_TYPES:
        raise ValueError(f"{text!r}: the type must be one of {', '.join(KV_OVERRIDE_TYPES)} (KEY=TYPE:VALUE)")
    value: int | float | bool | str = raw
    try:
        if kind == "int":
            value = int(raw)
        elif kind == "float":
            value = float(raw)
    except ValueError:
        raise ValueError(f"{text!r}: the value {raw!r} is not a number") from None
    if kind == "bool":
        if raw not in ("true", "false"):
            raise ValueError(f"{text!r}: a bool value must be true or false")
        value = raw == "true"
    override = KvOverride(key, kind, value)
    problem = override.problem()
    if problem is not None:
        raise ValueError(f"{text!r}: {problem}")
    return override


def kv_override_array(overrides: Sequence[KvOverride]) -> ctypes.Array[Any]:
    """The NULL-key-terminated ``llama_model_kv_override`` array for ``llama_model_params``
    (llama.cpp reads it while the model loads; the caller keeps it alive with the model)."""
    array = (llama_cpp.llama_model_kv_override * (len(overrides) + 1))()  # zeroed: the last key is ""
    for entry, o in zip(array, overrides):
        entry.key = o.key.encode()
        entry.tag = KV_OVERRIDE_TYPES[o.kind]
        if o.kind == "int":
            entry.value.val_i64 = int(o.value)
        elif o.kind == "float":
            entry.value.val_f64 = float(o.value)
        elif o.kind == "bool":
            entry.value.val_bool = bool(o.value)
        else:
            entry.value.val_str = str(o.value).encode()
    return array


@dataclass(frozen=True)
class RopeOptions:
    """The RoPE/YaRN fields of ``llama_context_params``, as llama-server's flags set them; the
    defaults (llama.cpp's) take each value from the model: 0 for the base, the scale and the
    original context, negative for the YaRN factors, unspecified for the scaling type."""

    scaling_type: int = llama_cpp.LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED  # --rope-scaling
    freq_base: float = 0.0  # --rope-freq-base
    freq_scale: float = 0.0  # --rope-freq-scale, or 1/N from --rope-scale N
    yarn_orig_ctx: int = 0
    yarn_ext_factor: float = -1.0  # negative: the model's, else 1 under YaRN scaling and 0 otherwise
    yarn_attn_factor: float = -1.0
    yarn_beta_slow: float = -1.0
    yarn_beta_fast: float = -1.0

    def settings(self) -> dict[str, Any]:
        """The ``llama_context_params`` fields to set (``open_context``'s settings)."""
        return {
            "rope_scaling_type": self.scaling_type,
            "rope_freq_base": self.freq_base,
            "rope_freq_scale": self.freq_scale,
            "yarn_orig_ctx": self.yarn_orig_ctx,
            "yarn_ext_factor": self.yarn_ext_factor,
            "yarn_attn_factor": self.yarn_attn_factor,
            "yarn_beta_slow": self.yarn_beta_slow,
            "yarn_beta_fast": self.yarn_beta_fast,
        }
