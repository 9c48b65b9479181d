"""What a JSON schema may ask of the grammar converter, checked before it converts anything.

llama-cpp-python's converter (``json_schema_to_gbnf``, ``SchemaConverter``: what turns a
request's ``json_schema``, ``response_format`` or a tool's ``parameters`` into a grammar) writes
every repetition out in full: ``{"type": "string", "minLength": N}`` becomes N copies of a rule,
about 5 bytes and 60 ns each, so a 100-byte body with N = 10^9 would ask for gigabytes and a
minute of CPU. llama.cpp's own grammar parser refuses repetitions above ``MAX_REPETITION``
(2,000). So before a schema is converted, ``check_limits`` walks it and refuses (a 400 naming
the field) any count over ``MAX_REPETITION`` (``minLength``, ``maxLength``, ``minItems``,
``maxItems``, ``minProperties``, ``maxProperties``, ``minContains``, ``maxContains``, a
pattern's ``{m,n}``), counts that add up to more than ``MAX_REPETITION_TOTAL`` over the whole
schema, a schema nested deeper than ``MAX_DEPTH`` or with more than ``MAX_NODES`` parts, and a
``$ref`` that is not local (``#...``: the converter would fetch any other, and only an
``assert`` stops it there). The walk is iterative and linear in the schema's size.
"""

from __future__ import annotations

import re
from typing import Any

from llamactor.protocol.errors import RequestError

MAX_REPETITION = 2000  # llama.cpp's grammar parser: MAX_REPETITION_THRESHOLD
MAX_REPETITION_TOTAL = 20_000  # all the counts of one schema: a grammar of ~100 KB at most
MAX_DEPTH = 64
MAX_NODES = 10_000

COUNT_KEYS = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _path(base: str, keys: tuple[str | int, ...]) -> str:
    out = base
    for key in keys:
        out += f"[{key}]" if isinstance(key, int) else f".{key}"
    return out


def check_limits(schema: Any, field: str) -> None:
    """Raise RequestError naming ``field`` and the place in ``schema`` that is over a limit."""
    total = 0
    nodes = 0
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(schema, ())]
    while stack:
        node, where = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise RequestError(f"{field}: the schema has more than {MAX_NODES} parts")
        if len(where) > MAX_DEPTH:
            raise RequestError(f"{_path(field, where)}: the schema is nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, list):  # scalars (an enum's values) are not parts: they cost what they weigh
            stack.extend((item, (*where, i)) for i, item in enumerate(node) if isinstance(item, (dict, list)))
            continue
        if not isinstance(node, dict):
            continue
        for key in COUNT_KEYS:
            value = node.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if value > MAX_REPETITION:
                    raise RequestError(
                        f"{_path(field, (*where, key))}: {value} is over {MAX_REPETITION}, the most repetitions "
                        "a grammar takes"
                    )
                total += max(int(value), 0)
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            for match in _QUANTIFIER.finditer(pattern):
                for count in match.groups():
                    if count:
                        n = int(count)
                        if n > MAX_REPETITION:
                            raise RequestError(
                                f"{_path(field, (*where, 'pattern'))}: the repetition {match.group(0)} is over "
                                f"{MAX_REPETITION}, the most repetitions a grammar takes"
                            )
                        total += n
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise RequestError(
                f"{_path(field, (*where, '$ref'))}: only references inside the schema (#...) are followed, "
                f"not {ref[:200]!r}"
            )
        if total > MAX_REPETITION_TOTAL:
            raise RequestError(
                f"{field}: the schema's repetitions add up to more than {MAX_REPETITION_TOTAL} (the most one schema's "
                "grammar may hold)"
            )
        stack.extend((value, (*where, key)) for key, value in node.items() if isinstance(value, (dict, list)))


__all__ = ["MAX_REPETITION", "MAX_REPETITION_TOTAL", "check_limits"]
