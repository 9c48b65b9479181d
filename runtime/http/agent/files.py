"""The file tools but ``edit_file`` (``agent.edit``): ``read_file``, ``file_glob_search``,
``grep_search`` and ``write_file``, as llama-server's, with its limits on what they read and
return."""

from __future__ import annotations

import base64
import os
import re
from typing import Any

from llamactor.runtime.http.agent.isolate import make_io
from llamactor.runtime.http.agent.params import _lines, opt_value, path_glob_match, required_str
from llamactor.runtime.http.agent.tools import Stream, Tool, _fn, _prop

READ_FILE_MAX_SIZE = 16 * 1024
READ_FILE_MAX_SIZE_BASE64 = 32 * 1024 * 1024
FILE_SEARCH_MAX_RESULTS = 100
GREP_SEARCH_MAX_RESULTS = 100


class ReadFile(Tool):
    name, display_name = "read_file", "Read file"

    def definition(self) -> dict[str, Any]:
        return _fn(
            self.name,
            "Read the contents of a file. Optionally specify a 1-based line range. "
            'If append_loc is true, each line is prefixed with its line number (e.g. "1\u2192...").',
            {
                "path": _prop("string", "Path to the file"),
                "start_line": _prop("integer", "First line to read, 1-based (default: 1)"),
                "end_line": _prop("integer", "Last line to read, 1-based inclusive (default: end of file)"),
                "append_loc": _prop("boolean", "Prefix each line with its line number"),
            },
            ["path"],
        )

    def invoke(self, params: dict[str, Any], stream: Stream | None = None) -> Any:
        path = required_str(params, "path")
        start_line = opt_value(params, "start_line", 1)
        end_line = opt_value(params, "end_line", -1)
        append_loc = opt_value(params, "append_loc", False)
        as_base64 = opt_value(params, "resp_type", "") == "base64"  # the x-resp-type header's
        io = make_io(params)
        size = io.file_size(path)
        if size is None:
            return {"error": f"cannot stat file: {path}"}
        if as_base64:
            if size > READ_FILE_MAX_SIZE_BASE64:
                return {"error": f"file too large ({size} bytes, max {READ_FILE_MAX_SIZE_BASE64})"}
            data = io.read_file(path)
            if data is None:
                return {"error": f"failed to open file: {path}"}
            return {"base64": base64.b64encode(data).decode("ascii"), "size_bytes": len(data)}
        if size > READ_FILE_MAX_SIZE and end_line == -1:
            return {
                "error": f"file too large ({size} bytes, max {READ_FILE_MAX_SIZE}). "
                "Use start_line/end_line to read a portion."
            }
        data = io.read_file(path)
        if data is None:
            return {"error": f"failed to open file: {path}"}
        result = bytearray()
        for lineno, line in enumerate(_lines(data.decode("latin-1")), start=1):
            if lineno < start_line:
                continue
            if end_line != -1 and lineno > end_line:
                break
            raw = line.encode("latin-1")
            out_line = (str(lineno).encode() + "\u2192".encode() if append_loc else b"") + raw + b"\n"
            if len(result) + len(out_line) > READ_FILE_MAX_SIZE:
                result += b"[output truncated]"
                break
            result += out_line
        return {"plain_text_response": result.decode("utf-8", "replace")}


class FileGlobSearch(Tool):
    name, display_name = "file_glob_search", "File search"

    def definition(self) -> dict[str, Any]:
        n = FILE_SEARCH_MAX_RESULTS
        return _fn(
            self.name,
            "Recursively search for files matching a glob pattern under a directory. "
            "Automatically skips files ignored by .gitignore (when the directory is inside a git repo) "
            "and common junk directories (.git, node_modules, build, dist, etc.) otherwise. "
            "A pattern with no '/' (e.g. \"*.cpp\") matches the file's basename at any depth. "
            "A pattern containing '/' matches the full relative path; unless already anchored with "
            '"**/" or a leading \'/\', it is automatically prefixed with "**/". '
            'Use type="dir" or "all" to also list directories; '
            "directory entries are suffixed with '/' in the output. "
            "Note: directory listings do not apply .gitignore filtering.",
            {
                "path": _prop("string", "Base directory to search in"),
                "include": _prop(
                    "string", 'Glob pattern for files to include (e.g. "*.cpp" or "src/**/*.cpp"). Default: **'
                ),
                "exclude": _prop("string", "Glob pattern for files to exclude"),
                "type": _prop("string", 'Entry type to return: "file" (default), "dir" or "all"'),
                "max_depth": _prop(
                    "integer",
                    "Maximum depth to descend into subdirectories (default: 0 = unlimited; 1 = direct children only)",
                ),
                "limit": _prop("integer", f"Maximum number of results to return, capped at {n} (default {n})"),
            },
            ["path"],
        )

    def invoke(self, params: dict[str, Any], stream: Stream | None = None) -> Any:
        io = make_io(params)
        path = required_str(params, "path")
        base = io.resolve(path)
        include = opt_value(params, "include", "**")
        exclude = opt_value(params, "exclude", "")
        kind = opt_value(params, "type", "file")
        max_depth = max(0, opt_value(params, "max_depth", 0))
        limit = opt_value(params, "limit", FILE_SEARCH_MAX_RESULTS)
        if limit < 1:
            return {"error": f"invalid limit: {limit} (expected 1 or more)"}
        limit = min(limit, FILE_SEARCH_MAX_RESULTS)
        if kind not in ("file", "dir", "all"):
            return {"error": f'invalid type: {kind} (expected "file", "dir" or "all")'}
        listing = io.list_entries(base, max_depth, kind)
        if listing.err:
            return {"error": f"{listing.err}: {path}"}
        matches = [
            (rel, is_dir)
            for rel, is_dir in listing.entries
            if path_glob_match(include, rel) and not (exclude and path_glob_match(exclude, rel))
        ]
        shown = matches[:limit]
        text = "".join(f"{rel}{'/' if is_dir else ''}\n" for rel, is_dir in shown)
        text += f"\n---\nTotal matches: {len(matches)}\n"
        if len(matches) > len(shown):
            text += (
                f"[{len(shown)} results limit reached ({len(matches)} total matches). "
                "Refine the glob pattern to narrow the search.]\n"
            )
        if listing.truncated:
            text += "[results truncated: time budget or unreadable directory]\n"
        entries = [{"path": rel, "type": "dir" if is_dir else "file"} for rel, is_dir in shown]
        return {"plain_text_response": text, "entries": entries, "base": base}


class GrepSearch(Tool):
    name, display_name = "grep_search", "Grep search"

    def definition(self) -> dict[str, Any]:
        return _fn(
            self.name,
            "Search for a pattern in files under a path. Returns matching lines with file paths "
            "(and, unless searching a single file, paths relative to the given directory). "
            "Automatically skips files ignored by .gitignore (when the directory is inside a git repo) "
            "and common junk directories (.git, node_modules, build, dist, etc.) otherwise. "
            "include/exclude: a pattern with no '/' matches the basename at any depth; a pattern "
            "containing '/' matches the full relative path (auto-anchored with \"**/\" unless already anchored).",
            {
                "path": _prop("string", "File or directory to search in"),
                "pattern": _prop("string", "Pattern to search for (regular expression unless literal is true)"),
                "include": _prop("string", "Glob pattern to filter files (default: **)"),
                "exclude": _prop("string", "Glob pattern to exclude files"),
                "return_line_numbers": _prop("boolean", "If true, include line numbers in results"),
                "literal": _prop(
                    "boolean", "Treat pattern as a literal string instead of a regular expression (default: false)"
                ),
                "ignore_case": _prop("boolean", "Case-insensitive search (default: false)"),
                "context_lines": _prop(
                    "integer", "Number of lines of context to show before and after each match (default: 0)"
                ),
            },
            ["path", "pattern"],
        )

    def invoke(self, params: dict[str, Any], stream: Stream | None = None) -> Any:
        path = required_str(params, "path")
        pattern_text = required_str(params, "pattern")
        include = opt_value(params, "include", "**")
        exclude = opt_value(params, "exclude", "")
        show_lineno = opt_value(params, "return_line_numbers", False)
        literal = opt_value(params, "literal", False)
        ignore_case = opt_value(params, "ignore_case", False)
        ctx_lines = max(0, opt_value(params, "context_lines", 0))
        if literal:
            pattern_text = "".join("\\" + c if c in "\\^$.|?*+()[]{}" else c for c in pattern_text)
        try:
            pattern = re.compile(pattern_text, re.IGNORECASE if ignore_case else 0)
        except re.error as exc:
            return {"error": f"invalid regex: {exc}"}
        io = make_io(params)
        abs_path = io.resolve(path)
        files: list[tuple[str, str]] = []
        if io.is_regular_file(abs_path):
            files.append((abs_path, path))
        elif io.is_directory(abs_path):
            listing = io.list_entries(abs_path, 0, "file")
            if listing.err:
                return {"error": f"{listing.err}: {path}"}
            for rel, _ in listing.entries:
                if path_glob_match(include, rel) and not (exclude and path_glob_match(exclude, rel)):
                    files.append((os.path.join(abs_path, rel) if abs_path != "/" else "/" + rel, rel))
        else:
            return {"error": f"path does not exist: {path}"}
        out: list[str] = []
        total, limit_reached = 0, False
        show_num = show_lineno or ctx_lines > 0
        for fpath, display in files:
            if limit_reached:
                break
            data = io.read_file(fpath)
            if data is None:
                continue
            lines = _lines(data.decode("utf-8", "replace"))
            for i, line in enumerate(lines):
                if total >= GREP_SEARCH_MAX_RESULTS:
                    limit_reached = True
                    break
                if not pattern.search(line):
                    continue
                lo = max(0, i - ctx_lines) if ctx_lines else i
                hi = min(len(lines) - 1, i + ctx_lines) if ctx_lines else i
                for j in range(lo, hi + 1):
                    mark = ":" if j == i else "-"
                    out.append(f"{display}{mark}{f'{j + 1}{mark}' if show_num else ''}{lines[j]}\n")
                if ctx_lines > 0:
                    out.append("--\n")
                total += 1
        text = "".join(out) + f"\n---\nTotal matches: {total}\n"
        if limit_reached:
            text += f"[{GREP_SEARCH_MAX_RESULTS} matches limit reached. Narrow the path/pattern/include to see more.]\n"
        return {"plain_text_response": text}


class WriteFile(Tool):
    name, display_name = "write_file", "Write file"
    permission_write = True

    def definition(self) -> dict[str, Any]:
        return _fn(
            self.name,
            "Write content to a file, creating it (including parent directories) if it does not exist. "
            "May use with edit_file for more complex edits.",
            {"path": _prop("string", "Path of the file to write"), "content": _prop("string", "Content to write")},
            ["path", "content"],
        )

    def invoke(self, params: dict[str, Any], stream: Stream | None = None) -> Any:
        path = required_str(params, "path")
        content = required_str(params, "content").encode("utf-8", "surrogatepass")
        if not make_io(params).write_file(path, content):
            return {"error": f"failed to write file: {path}"}
        return {"result": "file written successfully", "path": path, "bytes": len(content)}
