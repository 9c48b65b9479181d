"""``edit_file``: exact text replacements, each ``old_text`` unique in the file and matched
against the original content, not incrementally; when one is not there as given, a fuzzy match
(trailing blanks dropped, typographic quotes, dashes and spaces as ASCII) that keeps the lines
no edit touches as they were."""

from __future__ import annotations

from typing import Any

from llamactor.runtime.http.agent.isolate import make_io
from llamactor.runtime.http.agent.params import ToolRequestError, _json_type, required_str
from llamactor.runtime.http.agent.tools import Stream, Tool, _fn, _prop

# edit_file's fuzzy match: trailing blanks dropped, typographic quotes, dashes and spaces as ASCII
_FUZZY = str.maketrans(
    {
        **dict.fromkeys("\u2018\u2019\u201a\u201b", "'"),
        **dict.fromkeys("\u201c\u201d\u201e\u201f", '"'),
        **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-"),
        **dict.fromkeys("\u00a0\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000", " "),
    }
)


def _fuzzy(content: str) -> str:
    return "\n".join(line.rstrip(" \t\r").translate(_FUZZY) for line in content.split("\n"))


def _count(content: str, needle: str) -> int:
    return content.count(needle) if needle else 0


def _line_spans(content: str) -> list[tuple[int, int]]:
    spans, offset = [], 0
    for line in _lines_with_endings(content):
        spans.append((offset, offset + len(line)))
        offset += len(line)
    return spans


def _lines_with_endings(content: str) -> list[str]:
    out, start = [], 0
    while start < len(content):
        nl = content.find("\n", start)
        if nl < 0:
            out.append(content[start:])
            break
        out.append(content[start : nl + 1])
        start = nl + 1
    return out


def _apply(content: str, reps: list[tuple[int, int, int, str]], offset: int) -> str:
    for _, index, length, new_text in reversed(reps):
        local = index - offset
        content = content[:local] + new_text + content[local + length :]
    return content


def _apply_preserving(original: str, base: str, reps: list[tuple[int, int, int, str]]) -> str:
    """As ``_apply`` on the fuzzy-normalized text, but lines no edit touches come from the original."""
    original_lines = _lines_with_endings(original)
    spans = _line_spans(base)
    groups: list[tuple[int, int, list[tuple[int, int, int, str]]]] = []
    for rep in reps:
        start, end = rep[1], rep[1] + rep[2]
        first = next((i for i, (a, b) in enumerate(spans) if a <= start < b), 0)
        last = first
        while last < len(spans) and spans[last][1] < end:
            last += 1
        last = min(last, len(spans) - 1) + 1
        if groups and first < groups[-1][1]:
            g0, g1, greps = groups[-1]
            groups[-1] = (g0, max(g1, last), [*greps, rep])
        else:
            groups.append((first, last, [rep]))
    result, at = [], 0
    for first, last, greps in groups:
        result += original_lines[at:first]
        lo, hi = spans[first][0], spans[last - 1][1]
        result.append(_apply(base[lo:hi], greps, lo))
        at = last
    result += original_lines[at:]
    return "".join(result)


class EditFile(Tool):
    name, display_name = "edit_file", "Edit file"
    permission_write = True

    def definition(self) -> dict[str, Any]:
        item = {
            "type": "object",
            "properties": {
                "old_text": _prop(
                    "string",
                    "Exact text to find; must be unique in the file and must not overlap with other edits",
                ),
                "new_text": _prop("string", "Text to replace old_text with"),
            },
            "required": ["old_text", "new_text"],
        }
        return _fn(
            self.name,
            "Edit a file using exact text replacement. Each edits[].old_text must be unique in the file "
            "and is matched against the original content, not incrementally. Merge nearby changes into "
            "one edit instead of overlapping edits. Use write_file to replace the whole file.",
            {
                "path": _prop("string", "Path to the file to edit"),
                "edits": {
                    "type": "array",
                    "description": "One or more exact text replacements to apply",
                    "items": item,
                },
            },
            ["path", "edits"],
        )

    def invoke(self, params: dict[str, Any], stream: Stream | None = None) -> Any:
        path = required_str(params, "path")
        if "edits" not in params:
            raise ToolRequestError("key 'edits' not found")
        edits_json = params["edits"]
        if not isinstance(edits_json, list) or not edits_json:
            return {"error": '"edits" must be a non-empty array'}
        edits: list[tuple[str, str]] = []
        for e in edits_json:
            if not isinstance(e, dict):
                raise ToolRequestError(f"edits[{len(edits)}]: type must be object, but is {_json_type(e)}")
            old_text, new_text = required_str(e, "old_text"), required_str(e, "new_text")
            if not old_text:
                return {"error": f"edits[{len(edits)}].old_text must not be empty"}
            edits.append((old_text, new_text))
        io = make_io(params)
        data = io.read_file(path)
        if data is None:
            return {"error": f"failed to open file: {path}"}
        original = data.decode("utf-8", "surrogateescape")
        fuzzy_original = _fuzzy(original)
        any_fuzzy = False
        for i, (old_text, _) in enumerate(edits):
            if old_text in original:
                continue
            if _fuzzy(old_text) not in fuzzy_original:
                return {
                    "error": f"could not find edits[{i}].old_text in {path}, "
                    "it must match the file's current content exactly"
                }
            any_fuzzy = True
        base = fuzzy_original if any_fuzzy else original
        matched: list[tuple[int, int, int, str]] = []
        for i, (old_text, new_text) in enumerate(edits):
            needle = _fuzzy(old_text) if any_fuzzy else old_text
            occurrences = _count(fuzzy_original, _fuzzy(old_text))
            if occurrences > 1:
                return {"error": f"found {occurrences} occurrences of edits[{i}].old_text in {path}, it must be unique"}
            matched.append((i, base.find(needle), len(needle), new_text))
        matched.sort(key=lambda m: m[1])
        for a, b in zip(matched, matched[1:], strict=False):
            if a[1] + a[2] > b[1]:
                return {
                    "error": f"edits[{a[0]}] and edits[{b[0]}] overlap in {path}; "
                    "merge them into one edit or target disjoint regions"
                }
        new_content = _apply_preserving(original, base, matched) if any_fuzzy else _apply(base, matched, 0)
        if new_content == original:
            return {"error": "no changes made: the replacement(s) produced identical content"}
        if not io.write_file(path, new_content.encode("utf-8", "surrogateescape")):
            return {"error": f"failed to write file: {path}"}
        return {"result": "file edited successfully", "path": path, "edits_applied": len(matched)}
