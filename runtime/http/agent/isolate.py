"""Where a tool's I/O happens in an isolate (``--tools-runtime``, ``x-tool-runtime``):
``IsolateIO`` (every operation as a POSIX command), ``ContainerIO`` (``<engine> exec``) and
``SshIO``; ``make_io``, the I/O a request's params name (the host's ``ToolsIO`` without one);
and ``ContainerRuntime``, the container ``--tools-runtime <engine>:<image>`` starts and owns
(the checks of ``--tools-runtime``'s value and program are ``agent.flags``)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from llamactor.runtime.http.agent.hostio import (
    GIT_LS_FILES_MAX_OUTPUT,
    JUNK_DIR_ORDER,
    ExecResult,
    Listing,
    ToolsIO,
    run_subprocess,
)
from llamactor.runtime.http.agent.params import ToolFailure, _entry_depth, opt_value

log = structlog.get_logger("llamactor.tools")

ISOLATE_EXEC_TIMEOUT = 15
ISOLATE_READ_FILE_MAX_SIZE = 64 * 1024 * 1024
CONTAINER_ENGINES = ("docker", "podman")


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
