"""Where a tool's I/O happens, on the host: ``run_subprocess`` (a command with an output cap
and a timeout, its whole process group killed), ``Listing`` and ``ToolsIO`` (paths resolved
against ``x-tool-cwd``, files read and written, commands run, entries listed by ``git ls-files``
or by a walk that skips junk directories), with the limits of a listing. The isolates that do
the same elsewhere (a container, a host over ssh) are ``agent.isolate``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llamactor.runtime.http.agent.params import _entry_depth

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
