"""What every agent tool reads and raises: the errors a ``/tools`` request is answered with
(400, 404, 403, 500), a tool's ``params`` as llama-server's ``json_value`` and ``at().get<T>()``
read them, llama.cpp's ``glob_match`` (the search tools' ``include`` and ``exclude`` patterns,
and a listing's depth) and lines as ``std::getline`` reads them."""

from __future__ import annotations

from typing import Any


class ToolRequestError(Exception):
    """A request llama-server answers 400 (a missing or mistyped required field)."""


class ToolNotFound(Exception):
    """An unknown tool, or stream asked of a tool that cannot stream: 404."""


class ToolForbidden(Exception):
    """A request that asks for what only the operator decides (403)."""


class ToolFailure(Exception):
    """A request llama-server answers 500 (a bad runtime, a runtime that cannot start)."""


# ---- params, as llama-server's json_value and at().get<T>() read them ------------------------


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def required_str(params: dict[str, Any], key: str) -> str:
    if key not in params:
        raise ToolRequestError(f"key '{key}' not found")
    value = params[key]
    if not isinstance(value, str):
        raise ToolRequestError(f"'{key}': type must be string, but is {_json_type(value)}")
    return value


def opt_value(params: dict[str, Any], key: str, default: Any) -> Any:
    """The value of ``key`` when it has the default's type, else the default (llama-server's
    ``json_value``: a null or mistyped value falls back; a float for an int is truncated)."""
    value = params.get(key)
    if value is None:
        return default
    if isinstance(default, bool):
        return value if isinstance(value, bool) else default
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return default
        return int(value)
    if isinstance(default, str):
        return value if isinstance(value, str) else default
    return value


# ---- glob, as llama.cpp's common glob_match ------------------------------------------------


def _class_match(c: str, pattern: str, start: int, end: int) -> bool:
    i = start
    negated = False
    if i < end and pattern[i] == "!":
        negated = True
        i += 1
    if i < len(pattern) and pattern[i] in "]-":
        if i < end and pattern[i] == c:
            return not negated
        i += 1
    matched = False
    while i < end:
        if i + 2 < end and pattern[i + 1] == "-" and pattern[i + 2] != "]":
            if pattern[i] <= c <= pattern[i + 2]:
                matched = True
                break
            i += 3
        else:
            if pattern[i] == c:
                matched = True
                break
            i += 1
    return not matched if negated else matched


def glob_match(pattern: str, text: str) -> bool:
    """``*`` any run without ``/``, ``**`` any run, ``?`` one character but ``/``, ``[...]`` a class."""

    def match(p: int, s: int) -> bool:
        while True:
            if p == len(pattern):
                return s == len(text)
            ch = pattern[p]
            if pattern.startswith("**", p):
                return any(match(p + 2, k) for k in range(s, len(text) + 1))
            if ch == "*":
                k = s
                while k < len(text) and text[k] != "/":
                    if match(p + 1, k):
                        return True
                    k += 1
                return match(p + 1, k)
            if ch == "?" and s < len(text) and text[s] != "/":
                p, s = p + 1, s + 1
                continue
            if ch == "[":
                end = p + 1
                if end < len(pattern) and pattern[end] in "]-":
                    end += 1
                while end < len(pattern) and pattern[end] != "]":
                    end += 1
                if end < len(pattern):
                    if s == len(text) or not _class_match(text[s], pattern, p + 1, end):
                        return False
                    p, s = end + 1, s + 1
                    continue
                if s < len(text) and text[s] == "[":
                    p, s = p + 1, s + 1
                    continue
                return False
            if s < len(text) and ch == text[s]:
                p, s = p + 1, s + 1
                continue
            return False

    return match(0, 0)


def path_glob_match(pattern: str, rel: str) -> bool:
    """No ``/`` in the pattern: it matches the base name at any depth; else the whole relative
    path, anchored with ``**/`` unless it starts with ``**``/``**/`` or ``/``."""
    if "/" not in pattern:
        return glob_match(pattern, rel.rsplit("/", 1)[-1])
    if pattern == "**" or pattern.startswith(("**/", "/")):
        return glob_match(pattern, rel)
    return glob_match("**/" + pattern, rel)


def _entry_depth(rel: str) -> int:
    return 1 + rel.count("/")


def _lines(content: str) -> list[str]:
    """Lines as std::getline reads them: split at ``\\n``, no empty last line."""
    parts = content.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    return parts
