"""llama-server's built-in agent tools (``--tools``) and the ``/tools`` endpoints.

The same seven tools as llama-server's ``server-tools.cpp``, with its names, JSON schemas,
results, errors and limits: ``read_file``, ``file_glob_search``, ``grep_search``,
``exec_shell_command``, ``write_file``, ``edit_file``, ``get_info``. ``GET /tools`` lists the
enabled tools (and the MCP servers' tools, ``runtime.http.mcp``); ``POST /tools`` with
``{"tool", "params", "stream"}`` runs one. A tool's own failure is a 200 with ``{"error": ...}``
(what the model reads), as in llama-server; a body that is not a JSON object or lacks a required
field is a 400, an unknown tool a 404, a bad runtime a 500.

Headers, as llama-server reads them: ``x-tool-cwd`` is the directory relative paths resolve
against and commands run in; ``x-tool-runtime`` runs the tool's I/O in an isolate
(``docker-container:<id>``, ``podman-container:<id>``, ``ssh:<target>``) when the operator gave
no ``--tools-runtime`` (with one, a request naming another is a 403: no header overrides an
operator's flag); ``x-resp-type: base64`` makes ``read_file`` answer the raw bytes. The
same keys in ``params`` are dropped: the model cannot choose them.

Every tool runs in a worker thread (file and process I/O block). ``exec_shell_command`` with
``"stream": true`` answers SSE frames ``{"chunk"}`` as the output comes and ``{"done": true}``
last; a client that leaves stops the command.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llamactor.protocol.errors import ConfigError
from llamactor.runtime.http.body import read_body
from llamactor.runtime.http.errors import BodyTooLarge

if TYPE_CHECKING:
    from llamactor.runtime.http.mcp import McpManager
    from llamactor.runtime.service.config import RuntimeConfig

log = structlog.get_logger("llamactor.tools")

TOOL_NAMES = (
    "read_file",
    "file_glob_search",
    "grep_search",
    "exec_shell_command",
    "write_file",
    "edit_file",
    "get_info",
)

GIT_LS_FILES_MAX_OUTPUT = 8 * 1024 * 1024
LIST_ENTRIES_TIMEOUT = 15  # seconds, one listing (git or the walker)
JUNK_DIR_NAMES = frozenset(
    {".git", ".svn", ".hg", "node_modules", "__pycache__", ".venv", "venv", "dist", "build", "target", ".cache"}
    | {".idea", ".vscode"}
)
JUNK_DIR_ORDER = (
    ".git",
    ".svn",
    ".hg",
    "node_modules",
    "__pycache__",
    ".venv",
    "venv",
    "dist",
    "build",
    "target",
    ".cache",
    ".idea",
    ".vscode",
)
ISOLATE_EXEC_TIMEOUT = 15
ISOLATE_READ_FILE_MAX_SIZE = 64 * 1024 * 1024
READ_FILE_MAX_SIZE = 16 * 1024
READ_FILE_MAX_SIZE_BASE64 = 32 * 1024 * 1024
FILE_SEARCH_MAX_RESULTS = 100
GREP_SEARCH_MAX_RESULTS = 100
EXEC_MAX_OUTPUT_SIZE = 16 * 1024
EXEC_MAX_TIMEOUT = 60
GET_INFO_MAX_OUTPUT = 4096
GET_INFO_TIMEOUT = 5
CONTAINER_ENGINES = ("docker", "podman")
JSON_TYPE = "application/json; charset=utf-8"


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


# ---- processes -------------------------------------------------------------------------------


@dataclass
class ExecResult:
    output: str = ""
    exit_code: int = -1
    timed_out: bool = False


def run_subprocess(
    args: list[str],
    max_output: int,
    timeout_s: float,
    on_chunk: Callable[[str], bool] | None = None,
    *,
    combine_stderr: bool = True,
    cwd: str = "",
    stdin_data: bytes | None = None,
    raw: bool = False,
) -> ExecResult:
    """Run ``args`` (stdin closed after ``stdin_data``), reading at most ``max_output`` bytes
    of output (the rest drained, ``[output truncated]`` appended); killed (its whole process
    group) after ``timeout_s``. ``on_chunk`` sees each piece as it comes; False stops the run.
    A process killed by a signal reports exit code 1, as llama-server's."""
    res = ExecResult()
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if combine_stderr else subprocess.DEVNULL,
            cwd=cwd or None,
            start_new_session=True,
        )
    except (OSError, ValueError):
        res.output = "failed to spawn process"
        return res
    timed_out = threading.Event()

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def expire() -> None:
        timed_out.set()
        kill()

    timer = threading.Timer(max(timeout_s, 0), expire)
    timer.daemon = True
    timer.start()
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if stdin_data:
            with contextlib.suppress(OSError):
                proc.stdin.write(stdin_data)
        with contextlib.suppress(OSError):
            proc.stdin.close()
        out = bytearray()
        truncated = False
        fd = proc.stdout.fileno()
        while True:
            try:
                data = os.read(fd, 4096)
            except OSError:
                break
            if not data:
                break
            if truncated:
                continue
            if len(out) + len(data) <= max_output:
                out += data
                if on_chunk is not None and not on_chunk(data.decode("utf-8", "replace")):
                    kill()
                    break
            else:
                remaining = max(max_output - len(out), 0)
                out += data[:remaining]
                if on_chunk is not None and remaining > 0:
                    on_chunk(data[:remaining].decode("utf-8", "replace"))
                truncated = True
        code = proc.wait()
    finally:
        timer.cancel()
        proc.stdout.close()
    res.exit_code = code if code >= 0 else 1
    res.timed_out = timed_out.is_set()
    res.output = out.decode("latin-1") if raw else out.decode("utf-8", "replace")
    if truncated:
        res.output += "\n[output truncated]"
    return res


# ---- where a tool's I/O happens: the host, or an isolate --------------------------------------


@dataclass
class Listing:
    entries: list[tuple[str, bool]] = field(default_factory=list)  # (relative path with '/', is a directory)
    err: str = ""
    truncated: bool = False


class ToolsIO:
    """The host: paths resolve against ``cwd`` (else the server's working directory)."""

    def __init__(self, cwd: str = "") -> None:
        self.cwd = cwd

    def resolve(self, path: str) -> str:
        p = os.path.expanduser(path) if path.startswith("~") and (len(path) == 1 or path[1] == "/") else path
        if not os.path.isabs(p):
            base = self.cwd or os.getcwd()
            p = os.path.join(base, p)
        p = os.path.normpath(p)
        return p[1:] if p.startswith("//") else p

    def is_directory(self, path: str) -> bool:
        return os.path.isdir(self.resolve(path))

    def is_regular_file(self, path: str) -> bool:
        return os.path.isfile(self.resolve(path))

    def file_size(self, path: str) -> int | None:
        try:
            return os.stat(self.resolve(path)).st_size if self.is_regular_file(path) else None
        except OSError:
            return None

    def read_file(self, path: str) -> bytes | None:
        try:
            return Path(self.resolve(path)).read_bytes()
        except OSError:
            return None

    def write_file(self, path: str, content: bytes) -> bool:
        full = Path(self.resolve(path))
        try:
            full.parent.mkdir(parents=True, exist_ok=True)
            full.write_bytes(content)
        except OSError:
            return False
        return True

    def run(
        self, args: list[str], max_output: int, timeout_s: float, on_chunk: Callable[[str], bool] | None = None
    ) -> ExecResult:
        return run_subprocess(args, max_output, timeout_s, on_chunk, cwd=self.cwd)

    def list_entries(self, base: str, max_depth: int, kind: str) -> Listing:
        """Entries under ``base`` (absolute): files from ``git ls-files`` where it works (its
        ignore rules apply), else a walk that never descends into links or junk directories."""
        out = Listing()
        if not os.path.isdir(base):
            out.err = "path does not exist or is not a directory"
            return out
        deadline = time.monotonic() + LIST_ENTRIES_TIMEOUT
        if kind == "file":
            res = self.run(
                ["git", "-C", base, "ls-files", "--cached", "--others", "--exclude-standard"],
                GIT_LS_FILES_MAX_OUTPUT,
                LIST_ENTRIES_TIMEOUT,
            )
            if res.exit_code == 0 and not res.timed_out:
                for line in res.output.split("\n"):
                    line = line.rstrip("\r").replace("\\", "/")
                    if not line or (max_depth > 0 and _entry_depth(line) > max_depth):
                        continue
                    if os.path.isfile(os.path.join(base, line)):
                        out.entries.append((line, False))
                return out
        stack: list[tuple[str, str, int]] = [(base, "", 0)]
        while stack:
            if time.monotonic() >= deadline:
                out.truncated = True
                return out
            directory, rel_dir, depth = stack.pop()
            try:
                it = os.scandir(directory)
            except OSError:
                out.truncated = True
                continue
            with it:
                for entry in it:
                    rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                    try:
                        is_dir = entry.is_dir()
                    except OSError:
                        continue
                    if is_dir:
                        if kind in ("dir", "all"):
                            out.entries.append((rel, True))
                        if entry.name in JUNK_DIR_NAMES:
                            continue
                        if not entry.is_symlink() and (max_depth == 0 or depth + 1 < max_depth):
                            stack.append((entry.path, rel, depth + 1))
                    elif entry.is_file() and kind in ("file", "all"):
                        out.entries.append((rel, False))
        return out


def shell_quote_join(argv: list[str]) -> str:
    return " ".join("'" + arg.replace("'", "'\\''") + "'" for arg in argv)


class IsolateIO(ToolsIO):
    """Every operation as a POSIX command in an isolate (a container, a host over ssh): it
    must have sh, cat, wc, mkdir, dirname, find and timeout."""

    def build_argv(self, inner: list[str], needs_stdin: bool) -> list[str]:
        raise NotImplementedError

    def resolve(self, path: str) -> str:
        if not self.cwd or path.startswith("/"):
            return path
        return f"{self.cwd}/{path}"

    def _exec(self, inner: list[str], max_output: int, combine_stderr: bool = True, raw: bool = False) -> ExecResult:
        return run_subprocess(
            self.build_argv(inner, False), max_output, ISOLATE_EXEC_TIMEOUT, combine_stderr=combine_stderr, raw=raw
        )

    def _test(self, flag: str, path: str) -> bool:
        res = self._exec(["sh", "-c", f'[ {flag} "$1" ]', "_", path], 4096)
        return res.exit_code == 0 and not res.timed_out

    def is_directory(self, path: str) -> bool:
        return self._test("-d", self.resolve(path))

    def is_regular_file(self, path: str) -> bool:
        return self._test("-f", self.resolve(path))

    def file_size(self, path: str) -> int | None:
        res = self._exec(["sh", "-c", 'wc -c < "$1"', "_", self.resolve(path)], 64)
        if res.exit_code != 0 or res.timed_out:
            return None
        try:
            return int(res.output.strip())
        except ValueError:
            return None

    def read_file(self, path: str) -> bytes | None:
        res = self._exec(["cat", "--", self.resolve(path)], ISOLATE_READ_FILE_MAX_SIZE, combine_stderr=False, raw=True)
        if res.exit_code != 0 or res.timed_out:
            return None
        return res.output.encode("latin-1")

    def write_file(self, path: str, content: bytes) -> bool:
        inner = ["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "_", self.resolve(path)]
        res = run_subprocess(self.build_argv(inner, True), 4096, ISOLATE_EXEC_TIMEOUT, stdin_data=content)
        return res.exit_code == 0 and not res.timed_out

    def run(
        self, args: list[str], max_output: int, timeout_s: float, on_chunk: Callable[[str], bool] | None = None
    ) -> ExecResult:
        inner = ["timeout", f"{int(timeout_s)}s", *args]
        if self.cwd:  # 127: what a shell reports for a command it could not run
            inner = ["sh", "-c", 'cd "$1" || exit 127; shift; exec "$@"', "_", self.cwd, *inner]
        return run_subprocess(self.build_argv(inner, True), max_output, timeout_s + 5, on_chunk)

    @staticmethod
    def _split(text: str, strip_dot_slash: bool) -> list[str]:
        out = []
        for line in text.split("\n"):
            line = line.rstrip("\r")
            if not line:
                continue
            if strip_dot_slash and line.startswith("./"):
                line = line[2:]
            out.append(line.replace("\\", "/"))
        return out

    def _find(self, base: str, max_depth: int, dirs: bool, out: Listing) -> list[str]:
        prune = " -o ".join(f"-name {n}" for n in JUNK_DIR_ORDER)
        cmd = 'cd "$1" && find . -mindepth 1'
        if max_depth > 0:
            cmd += f" -maxdepth {max_depth}"
        cmd += f" \\( {prune} \\) -prune"
        cmd += " -print -o -type d -print" if dirs else " -o -type f -print"
        res = self._exec(["sh", "-c", cmd, "_", base], GIT_LS_FILES_MAX_OUTPUT)
        out.truncated = out.truncated or res.timed_out
        return self._split(res.output, True)

    def list_entries(self, base: str, max_depth: int, kind: str) -> Listing:
        out = Listing()
        base = self.resolve(base)
        if not self.is_directory(base):
            out.err = "path does not exist or is not a directory"
            return out
        if kind == "file":
            cmd = 'cd "$1" && git ls-files --cached --others --exclude-standard'
            res = self._exec(["sh", "-c", cmd, "_", base], GIT_LS_FILES_MAX_OUTPUT)
            if res.exit_code == 0 and not res.timed_out:
                for rel in self._split(res.output, False):
                    if max_depth <= 0 or _entry_depth(rel) <= max_depth:
                        out.entries.append((rel, False))
                return out
        if kind in ("dir", "all"):
            out.entries += [(rel, True) for rel in self._find(base, max_depth, True, out)]
        if kind in ("file", "all"):
            out.entries += [(rel, False) for rel in self._find(base, max_depth, False, out)]
        return out


class ContainerIO(IsolateIO):
    """A running container, through ``<engine> exec``."""

    def __init__(self, engine: str, container_id: str, cwd: str = "") -> None:
        super().__init__(cwd)
        self.engine, self.container_id = engine, container_id

    def build_argv(self, inner: list[str], needs_stdin: bool) -> list[str]:
        return [self.engine, "exec", *(["-i"] if needs_stdin else []), self.container_id, *inner]


class SshIO(IsolateIO):
    """A remote POSIX host over ssh (key-based, trusted host key: no prompt can be answered)."""

    def __init__(self, target: str, cwd: str = "") -> None:
        super().__init__(cwd)
        self.target = target

    def build_argv(self, inner: list[str], needs_stdin: bool) -> list[str]:
        argv = ["ssh", "-o", "BatchMode=yes", "-o", "PasswordAuthentication=no"]
        argv += ["-o", "KbdInteractiveAuthentication=no", "-o", "StrictHostKeyChecking=yes"]
        if not needs_stdin:
            argv.append("-n")
        return [*argv, self.target, shell_quote_join(inner)]


_SSH_TARGET = re.compile(r"[A-Za-z0-9._@-]+")
_CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def container_spec(spec: str) -> tuple[str, str, bool] | None:
    """``<engine>-container:<id>`` (attach: True) or ``<engine>:<image>`` (spawn), else None."""
    for engine in CONTAINER_ENGINES:
        if spec.startswith(engine + "-container:"):
            return engine, spec[len(engine) + len("-container:") :], True
        if spec.startswith(engine + ":"):
            return engine, spec[len(engine) + 1 :], False
    return None


def make_io(params: dict[str, Any]) -> ToolsIO:
    cwd, runtime = opt_value(params, "cwd", ""), opt_value(params, "runtime", "")
    if not runtime:
        return ToolsIO(cwd)
    container = container_spec(runtime)
    if container is not None:
        engine, arg, attach = container
        if not attach:
            raise ToolFailure(f"tool runtime must name a running container: {runtime}")
        if not _CONTAINER_ID.fullmatch(arg):
            raise ToolFailure(f"invalid container id: {arg}")
        return ContainerIO(engine, arg, cwd)
    if runtime.startswith("ssh:"):
        target = runtime[4:]
        if not target or target.startswith("-") or not _SSH_TARGET.fullmatch(target):
            raise ToolFailure(f"invalid ssh target: {target}")
        return SshIO(target, cwd)
    raise ToolFailure(f"unknown tool runtime: {runtime}")  # never the host: an isolate was asked for


def check_tools_runtime(spec: str) -> None:
    """``--tools-runtime``'s form (ValueError naming what is wrong)."""
    container = container_spec(spec)
    if container is not None and not container[2]:
        if not container[1]:
            raise ValueError(f"{container[0]}:<image> requires an image name")
        return
    try:
        make_io({"runtime": spec})
    except ToolFailure as exc:
        raise ValueError(str(exc)) from None


def tools_runtime_program(spec: str) -> str:
    """``--tools-runtime``'s program (docker, podman or ssh) must be on PATH: ConfigError if not."""
    container = container_spec(spec)
    program = container[0] if container is not None else "ssh"
    if shutil.which(program) is None:
        raise ConfigError(f"--tools-runtime {spec}: {program} is not installed on this machine (not found on PATH)")
    return spec


class ContainerRuntime:
    """The container ``--tools-runtime <engine>:<image>`` starts and owns: ``<engine> run --rm -i
    <image> sh`` kept alive by its open stdin, respawned if it dies, stopped (stdin closed,
    ``--rm`` removes it) when the server exits."""

    def __init__(self, engine: str, image: str) -> None:
        self.engine, self.image = engine, image
        self.proc: subprocess.Popen[bytes] | None = None
        self.container_id = ""
        self.lock = threading.Lock()

    def spawn(self) -> None:
        self.stop()
        fd, cidfile = tempfile.mkstemp(prefix="llamactor-tools-runtime-cid-", suffix=".tmp")
        os.close(fd)
        os.unlink(cidfile)  # the engine refuses a cidfile that exists
        try:
            self.proc = subprocess.Popen(
                [self.engine, "run", "--rm", "-i", "--cidfile", cidfile, self.image, "sh"],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except OSError as exc:
            raise ToolFailure(
                f"failed to spawn {self.engine} container for tools runtime (image: {self.image}): {exc}"
            ) from None
        cid = ""
        for _ in range(100):
            with contextlib.suppress(OSError):
                cid = Path(cidfile).read_text().strip()
            if cid or self.proc.poll() is not None:
                break
            time.sleep(0.1)
        with contextlib.suppress(OSError):
            os.unlink(cidfile)
        if not cid:
            code = self.proc.poll()
            self.stop()
            if code is not None:
                raise ToolFailure(
                    f"failed to start a {self.engine} container for the tools runtime (image: {self.image}): "
                    f"'{self.engine} run' exited with code {code}"
                )
            raise ToolFailure(f"timed out waiting for {self.engine} container to start (image: {self.image})")
        self.container_id = cid

    def spec(self) -> str:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                if self.proc is not None:
                    log.warning("tools_runtime_respawn", engine=self.engine, container=self.container_id)
                self.spawn()
            return f"{self.engine}-container:{self.container_id}"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the tools -----------------------------------------------------------------------------------


class Stream:
    """Where a streaming tool's output goes: ``push`` from the worker thread; ``alive`` False
    once the client has left."""

    def __init__(self, push: Callable[[str], None], alive: Callable[[], bool]) -> None:
        self.push, self.alive = push, alive


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str] | None) -> dict[str, Any]:
    params: dict[str, Any] = {"type": "object", "properties": properties}
    if required is not None:
        params["required"] = required
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def _prop(type_: str, description: str) -> dict[str, Any]:
    return {"type": type_, "description": description}


class Tool:
    name = ""
    display_name = ""
    permission_write = False
    support_stream = False
    uses_cwd = True
    kind = "server"

    def definition(self) -> dict[str, Any]:
        raise NotImplementedError

    def invoke(self, params: dict[str, Any], stream: Stream | None = None) -> Any:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        return {
            "display_name": self.display_name,
            "tool": self.name,
            "type": self.kind,
            "permissions": {"write": self.permission_write},
            "uses_cwd": self.uses_cwd,
            "definition": self.definition(),
        }


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


class ExecShellCommand(Tool):
    name, display_name = "exec_shell_command", "Execute shell command"
    permission_write = True
    support_stream = True

    def definition(self) -> dict[str, Any]:
        return _fn(
            self.name,
            "Execute a shell command and return its output (stdout and stderr combined).",
            {
                "command": _prop("string", "Shell command to execute"),
                "timeout": _prop("integer", f"Timeout in seconds (default 10, max {EXEC_MAX_TIMEOUT})"),
                "max_output_size": _prop("integer", f"Maximum output size in bytes (default {EXEC_MAX_OUTPUT_SIZE})"),
            },
            ["command"],
        )

    def invoke(self, params: dict[str, Any], stream: Stream | None = None) -> Any:
        command = required_str(params, "command")
        timeout = min(opt_value(params, "timeout", 10), EXEC_MAX_TIMEOUT)
        max_output = opt_value(params, "max_output_size", EXEC_MAX_OUTPUT_SIZE)
        max_output = EXEC_MAX_OUTPUT_SIZE if max_output < 0 else min(max_output, EXEC_MAX_OUTPUT_SIZE)
        io = make_io(params)
        args = ["sh", "-c", command]
        if stream is not None:

            def on_chunk(chunk: str) -> bool:
                stream.push(chunk)
                return stream.alive()

            res = io.run(args, max_output, timeout, on_chunk)
            if not stream.alive():
                return None
            tail = f"\n[exit code: {res.exit_code}]" + (" [exit due to timed out]" if res.timed_out else "")
            stream.push(tail)
            return None
        res = io.run(args, max_output, timeout)
        text = res.output + f"\n[exit code: {res.exit_code}]"
        if res.timed_out:
            text += " [exit due to timed out]"
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


class GetInfo(Tool):
    name, display_name = "get_info", "Get Runtime Info"

    def definition(self) -> dict[str, Any]:
        return _fn(self.name, "Returns runtime info: the OS name/version and the current working directory", {}, None)

    def invoke(self, params: dict[str, Any], stream: Stream | None = None) -> Any:
        io = make_io(params)
        res = io.run(["uname", "-a"], GET_INFO_MAX_OUTPUT, GET_INFO_TIMEOUT)
        os_info = res.output.strip() if res.exit_code == 0 and not res.timed_out else "unknown"
        cwd = opt_value(params, "cwd", "")
        if not cwd:
            if not opt_value(params, "runtime", ""):
                cwd = os.getcwd()
            else:
                pwd = io.run(["pwd"], GET_INFO_MAX_OUTPUT, GET_INFO_TIMEOUT)
                cwd = pwd.output.strip() if pwd.exit_code == 0 and not pwd.timed_out else "unknown"
        return {"os": os_info, "cwd": cwd}


BUILTIN_TOOLS: tuple[type[Tool], ...] = (ReadFile, FileGlobSearch, GrepSearch, ExecShellCommand, WriteFile, EditFile)
BUILTIN_TOOLS += (GetInfo,)


class McpTool(Tool):
    """One tool of an MCP server, named ``<server>_<tool>``."""

    kind = "mcp"
    uses_cwd = False

    def __init__(self, manager: McpManager, server: str, tool: str, description: str, schema: Any) -> None:
        self.manager, self.server, self.tool = manager, server, tool
        self.name = self.display_name = f"{server}_{tool}"
        self.description, self.schema = description, schema if isinstance(schema, dict) else {}

    def definition(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.schema}
        return {"type": "function", "function": fn}


# ---- command-line values ---------------------------------------------------------------------


def parse_tool_names(text: str) -> tuple[str, ...]:
    """``--tools a,b`` (or ``all``), as llama-server reads a CSV row; an unknown name is an error."""
    row = next(csv.reader([text]), [])
    names = tuple(name.strip() for name in row if name.strip())
    for name in names:
        if name != "all" and name not in TOOL_NAMES:
            raise ValueError(f'unknown tool "{name}". available tools: {", ".join(TOOL_NAMES)}')
    return names


def agent_enabled(config: RuntimeConfig) -> bool:
    """Whether ``/tools`` is on: built-in tools or MCP servers configured."""
    return bool(config.server_tools or config.mcp_servers_config or config.mcp_servers_json)


# ---- the endpoints ----------------------------------------------------------------------------


def feature_disabled(request: Request) -> Response:
    """llama-server's answer on /tools and /cors-proxy when the feature is off."""
    body = {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}
    return Response(_dumps(body), status_code=403, media_type=JSON_TYPE)


def _error(message: str, status: int, kind: str) -> Response:
    """llama-server's /tools errors: ``{"code", "message", "type"}`` with no ``error`` around it
    (its handler writes the body itself), but for the 404 (its HTTP layer's 404 shape)."""
    body: dict[str, Any] = {"code": status, "message": message, "type": kind}
    if status == 404:
        body = {"error": body}
    return Response(_dumps(body), status_code=status, media_type=JSON_TYPE)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class AgentTools:
    """The tools of one server: the built-in ones ``--tools`` enables, then the MCP servers'
    (a name already taken is skipped, with a warning). ``start`` (before serving) starts a
    ``--tools-runtime`` container and lists the MCP servers' tools; ``close`` stops them."""

    def __init__(self, config: RuntimeConfig, stopping: Callable[[], bool] = lambda: False) -> None:
        from llamactor.runtime.http.mcp import McpManager

        enabled = set(config.server_tools)
        self.tools: list[Tool] = [cls() for cls in BUILTIN_TOOLS if cls.name in enabled or "all" in enabled]
        self.mcp = McpManager.from_config(config.mcp_servers_config, config.mcp_servers_json, stopping)
        self.runtime_spec = config.tools_runtime
        self.container: ContainerRuntime | None = None

    async def start(self) -> None:
        spec = self.runtime_spec
        container = container_spec(spec) if spec else None
        if container is not None and not container[2]:
            self.container = ContainerRuntime(container[0], container[1])
            await asyncio.to_thread(self.container.spawn)
        await self.mcp.start()
        seen = {t.name for t in self.tools}
        added = 0
        for server, tool, description, schema in self.mcp.registry:
            name = f"{server}_{tool}"
            if name in seen:
                log.warning("mcp_tool_skipped", tool=name, server=server, reason="collides with an existing tool")
                continue
            seen.add(name)
            self.tools.append(McpTool(self.mcp, server, tool, description, schema))
            added += 1
        if added:
            log.info("mcp_tools_added", count=added)

    async def close(self) -> None:
        await self.mcp.close()
        if self.container is not None:
            await asyncio.to_thread(self.container.stop)

    async def get(self, request: Request) -> Response:
        return Response(_dumps([t.to_json() for t in self.tools]), media_type=JSON_TYPE)

    def _params(self, request: Request, body: Any) -> tuple[Tool, dict[str, Any], bool]:
        if not isinstance(body, dict):
            raise ToolRequestError(f"the request body must be a JSON object, got {_json_type(body)}")
        if "tool" not in body:
            raise ToolRequestError("key 'tool' not found")
        name = body["tool"]
        if not isinstance(name, str):
            raise ToolRequestError(f"'tool': type must be string, but is {_json_type(name)}")
        params = body.get("params", {})
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ToolRequestError(f"'params': type must be object, but is {_json_type(params)}")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ToolRequestError(f"'stream': type must be boolean, but is {_json_type(stream)}")
        params = {k: v for k, v in params.items() if k not in ("cwd", "runtime", "resp_type")}
        if cwd := request.headers.get("x-tool-cwd", ""):
            params["cwd"] = cwd
        runtime = request.headers.get("x-tool-runtime", "")
        if self.runtime_spec:  # the operator's --tools-runtime: no request picks another
            if runtime and runtime not in (self.runtime_spec, self.container.spec() if self.container else ""):
                raise ToolForbidden(
                    f"x-tool-runtime: the tools run in --tools-runtime {self.runtime_spec}; "
                    "a request cannot pick another"
                )
            params["runtime"] = self.container.spec() if self.container is not None else self.runtime_spec
        elif runtime:
            params["runtime"] = runtime
        if resp_type := request.headers.get("x-resp-type", ""):
            params["resp_type"] = resp_type
        tool = next((t for t in self.tools if t.name == name), None)
        if tool is None:
            raise ToolNotFound(f'unknown tool "{name}"')
        if stream and not tool.support_stream:
            raise ToolNotFound(f'tool "{name}" does not support stream = true')
        return tool, params, stream

    async def post(self, request: Request) -> Response:
        try:
            try:
                raw = await read_body(request)
            except BodyTooLarge as exc:
                return _error(str(exc), 413, "invalid_request_error")
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise ToolRequestError(f"malformed JSON: {exc}") from None
            tool, params, stream = await asyncio.to_thread(self._params, request, body)
            if stream:
                return self._stream(request, tool, params)
            if isinstance(tool, McpTool):
                result = await tool.manager.call_tool(tool.server, tool.tool, params)
            else:
                result = await asyncio.to_thread(tool.invoke, params, None)
            return Response(_dumps(result), media_type=JSON_TYPE)
        except ToolRequestError as exc:
            return _error(str(exc), 400, "invalid_request_error")
        except ToolNotFound as exc:
            return _error(str(exc), 404, "not_found_error")
        except ToolForbidden as exc:
            return _error(str(exc), 403, "permission_error")
        except ToolFailure as exc:
            return _error(str(exc), 500, "server_error")

    def _stream(self, request: Request, tool: Tool, params: dict[str, Any]) -> Response:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        gone = threading.Event()

        def push(chunk: str) -> None:
            if chunk:
                loop.call_soon_threadsafe(queue.put_nowait, {"chunk": chunk})

        def work() -> None:
            done: dict[str, Any] = {"done": True}
            try:
                tool.invoke(params, Stream(push, lambda: not gone.is_set()))
            except (ToolRequestError, ToolFailure) as exc:
                done["error"] = str(exc)
            except Exception as exc:
                log.exception("tool_failed", tool=tool.name)
                done["error"] = str(exc) or "An unknown error occurred"
            with contextlib.suppress(RuntimeError):  # the loop may be closing
                loop.call_soon_threadsafe(queue.put_nowait, done)

        async def frames() -> AsyncIterator[bytes]:
            worker = loop.run_in_executor(None, work)
            try:
                while True:
                    item = await queue.get()
                    yield f"data: {_dumps(item)}\n\n".encode()
                    if item.get("done"):
                        break
            finally:
                gone.set()
                await asyncio.shield(worker)

        return StreamingResponse(frames(), media_type="text/event-stream", headers={"X-Accel-Buffering": "no"})


# ---- argparse value parsers (runtime.cliflags) --------------------------------------------------


def tools_flag(text: str) -> tuple[str, ...]:
    try:
        return parse_tool_names(text)
    except (ValueError, csv.Error) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def tools_runtime_flag(text: str) -> str:
    try:
        check_tools_runtime(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def mcp_config_file_check(path: str) -> str:
    """``--mcp-servers-config``: the file is read and parsed at startup (ConfigError if it cannot be)."""
    from llamactor.runtime.http.mcp import parse_config, read_config_file

    try:
        parse_config(read_config_file(path), warn=False)
    except ValueError as exc:
        raise ConfigError(f"--mcp-servers-config: {exc}") from None
    return path


def mcp_config_json_flag(text: str) -> str:
    from llamactor.runtime.http.mcp import parse_config

    try:
        parse_config(text, warn=False)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def localhost_cors(fields: dict[str, Any]) -> None:
    """llama-server's rule, widened to the proxy: with tools, MCP servers or the CORS proxy on and
    no --cors-origins given, CORS allows localhost origins only (``fields``: the command line's
    config fields, changed here)."""
    on = any(fields.get(name) for name, _ in _EXPOSING)
    if on and "cors_origins" not in fields:
        fields["cors_origins"] = "localhost"


# the config fields that run something or reach a network for whoever calls the server, and
# the flag that sets each
_EXPOSING = (
    ("server_tools", "--tools"),
    ("mcp_servers_config", "--mcp-servers-config"),
    ("mcp_servers_json", "--mcp-servers-json"),
    ("ui_mcp_proxy", "--ui-mcp-proxy"),
)


def require_api_key(fields: dict[str, Any], spelled: dict[str, str] | None = None) -> None:
    """Tools run commands and read and write files, MCP servers and the CORS proxy reach what
    the server's machine reaches: for any client that reaches the server, unless an API key
    stands in front. So with any of them on and no ``--api-key``, the server refuses to start,
    unless ``--insecure-tools`` says the operator means it (``fields``: the command line's
    config fields; ``spelled``: how each was given, for the message)."""
    spelled = spelled or {}
    on = sorted({spelled.get(name, flag) for name, flag in _EXPOSING if fields.get(name)})
    if on and not (fields.get("api_key") or fields.get("api_keys")) and not fields.get("insecure_tools"):
        raise ConfigError(
            f"{', '.join(on)} without --api-key: every client that reaches the server could run tools or "
            "reach this machine's network through it; give --api-key (or --api-key-file), or "
            "--insecure-tools to allow it without one"
        )
