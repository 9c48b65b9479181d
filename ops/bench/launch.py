"""Servers the bench starts itself (``--serve NAME=COMMAND``): start, wait until ready, stop.

A command is a template with ``{port}``, ``{np}`` and ``{ctx}`` placeholders, split like a shell
line (``shlex``; ``$VAR`` expanded from the environment), run without a shell, in a session of
its own, with its output going to a log file. ``start`` waits for ``GET /health`` to answer 200;
a server that exits first, or takes longer than the timeout, raises ``ServerStartError`` with the
server's name and the last lines of its log.

``stop`` never leaves a process behind. Every server runs with an environment variable of
its own (``TAG_ENV``, a fresh token), which its children inherit; ``stop`` finds the server's
processes by their parent links *and* by that token (llamactor's engine child runs in a process
group of its own, so a group signal alone would miss it, and a child orphaned by a server that
died early has no parent link left). The server gets SIGTERM and ``grace_s`` to exit, whatever
of its processes outlives it gets SIGTERM too, and SIGKILL ends what is left (each process
checked by its start time, so a reused pid is never hit).
A last-resort ``atexit`` hook SIGKILLs the processes of servers still running when the
interpreter exits. Processes are read from /proc (Linux); elsewhere only the process group is
signalled.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import signal
import socket
import string
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx

PLACEHOLDERS = ("port", "np", "ctx")
TAG_ENV = "LLAMACTOR_BENCH_SERVER"  # set to a fresh token in each started server's environment
HOST = "127.0.0.1"
DEFAULT_START_TIMEOUT_S = 300.0  # loading a model and allocating its KV cache
DEFAULT_GRACE_S = 15.0  # after SIGTERM, before SIGKILL
ORPHAN_GRACE_S = 3.0  # the same for processes that outlived their server
HEALTH_POLL_S = 0.2
EXIT_POLL_S = 0.05
LOG_TAIL_LINES = 20
HTTP_OK = 200


class ServerStartError(RuntimeError):
    """A server did not become ready; the message names it and quotes its log."""


@dataclass(frozen=True)
class ServerCommand:
    """``NAME=COMMAND`` from the command line."""

    name: str
    template: str

    @classmethod
    def parse(cls, text: str) -> ServerCommand:
        name, sep, template = text.partition("=")
        name = name.strip()
        if not sep or not name or not template.strip():
            raise ValueError(f"--serve takes NAME=COMMAND, got {text!r}")
        cmd = cls(name, template.strip())
        cmd.argv(port=1, np=1, ctx=1)  # a bad template fails now, not after the first seed
        if "{port}" not in template:
            raise ValueError(f"--serve {name}: the command needs a {{port}} placeholder (the bench picks the port)")
        return cmd

    @property
    def sized(self) -> bool:
        """The command takes the drawn ``-np`` and ``-c`` (else the server's sizes are its own)."""
        return "{np}" in self.template and "{ctx}" in self.template

    def argv(self, *, port: int, np: int, ctx: int) -> list[str]:
        """The command line for one start; a ValueError naming the server for a bad template."""
        try:
            words = shlex.split(self.template)
        except ValueError as exc:
            raise ValueError(f"--serve {self.name}: cannot split the command ({exc})") from None
        if not words:
            raise ValueError(f"--serve {self.name}: empty command")
        values = {"port": port, "np": np, "ctx": ctx}
        out = []
        for word in words:
            for _, name, _, _ in string.Formatter().parse(word):
                if name is not None and name not in PLACEHOLDERS:
                    raise ValueError(
                        f"--serve {self.name}: unknown placeholder {{{name}}}; known: "
                        + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS)
                    )
            out.append(os.path.expandvars(word.format(**values)))
        return out

    def key(self, np: int, ctx: int) -> str:
        """The server's configuration without its port (calibrations are cached by it)."""
        return f"{self.name}={shlex.join(self.argv(port=0, np=np, ctx=ctx))}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# ---- process trees ---------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of ``pid`` from /proc, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields_ = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid ...
    return int(fields_[1]), int(fields_[19])


def _tree(root: int) -> dict[int, int]:
    """``root`` and its descendants as pid -> start time (empty where /proc is unavailable)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        st = _stat(pid)
        if st is not None:
            children.setdefault(st[0], []).append(pid)
            starts[pid] = st[1]
    out: dict[int, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in starts and pid not in out:
            out[pid] = starts[pid]
            todo += children.get(pid, [])
    return out


def _tagged(tag: str) -> dict[int, int]:
    """Processes whose environment holds ``TAG_ENV=tag``, as pid -> start time."""
    needle = f"{TAG_ENV}={tag}\0".encode()
    out: dict[int, int] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue  # gone, or another user's
        st = _stat(pid) if needle in environ else None
        if st is not None:
            out[pid] = st[1]
    return out


def _alive(tree: dict[int, int]) -> dict[int, int]:
    """The processes of ``tree`` still running as the same process (not a reused pid)."""
    out = {}
    for pid, start in tree.items():
        st = _stat(pid)
        if st is not None and st[1] == start and not _zombie(pid):
            out[pid] = start
    return out


def _zombie(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rindex(")") + 2 :].startswith("Z")


def _signal_tree(tree: dict[int, int], sig: signal.Signals) -> None:
    for pid in _alive(tree):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


# ---- one server ------------------------------------------------------------------------------


@dataclass(eq=False)  # compared and hashed by identity: one object per started process
class Server:
    """A started server. ``url`` is its loopback base URL."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] = field(repr=False)
    tag: str = ""  # the value of TAG_ENV in its environment and its children's
    tree: dict[int, int] = field(default_factory=dict, repr=False)  # pid -> start time of all seen

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def note_tree(self) -> None:
        """Remember its processes now (merged: a process seen once is always stopped)."""
        self.tree.update(_tree(self.proc.pid))
        if self.tag:
            self.tree.update(_tagged(self.tag))


_RUNNING: set[Server] = set()


def _kill_leftovers() -> None:
    """``atexit``: SIGKILL every server tree still running (the bench was interrupted)."""
    for server in list(_RUNNING):
        server.note_tree()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.proc.pid, signal.SIGKILL)
        _signal_tree(server.tree, signal.SIGKILL)


atexit.register(_kill_leftovers)


async def start(
    cmd: ServerCommand, *, np: int, ctx: int, log_dir: Path, timeout_s: float = DEFAULT_START_TIMEOUT_S
) -> Server:
    """Start ``cmd`` on a free loopback port and wait until ``/health`` answers 200."""
    port = free_port()
    argv = cmd.argv(port=port, np=np, ctx=ctx)
    tag = uuid.uuid4().hex
    log_path = log_dir / f"{''.join(c if c.isalnum() or c in '-_.' else '_' for c in cmd.name)}-{port}.log"
    with open(log_path, "wb") as log:
        log.write(f"$ {shlex.join(argv)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, TAG_ENV: tag},
            )
        except OSError as exc:
            raise ServerStartError(f"server {cmd.name}: cannot run {argv[0]!r}: {exc}") from None
    server = Server(cmd.name, argv, port, log_path, proc, tag)
    _RUNNING.add(server)
    try:
        await _wait_ready(server, timeout_s)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stop(server)
        raise
    server.note_tree()
    return server


async def _wait_ready(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as client:
        while True:
            rc = server.proc.poll()
            if rc is not None:
                raise ServerStartError(
                    f"server {server.name} exited with status {rc} before it was ready "
                    f"({shlex.join(server.argv)}); last lines of its log:\n{server.log_tail()}"
                )
            try:
                if (await client.get(server.url + "/health")).status_code == HTTP_OK:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"server {server.name} did not answer /health with 200 within {timeout_s:g} s "
                    f"({shlex.join(server.argv)}); last lines of its log:\n{server.log_tail()}"
                )
            server.note_tree()
            await anyio.sleep(HEALTH_POLL_S)


async def _wait(server: Server, timeout_s: float, *, all_: bool) -> bool:
    """Wait until the server's process (``all_``: and every process noted of it) has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        server.proc.poll()  # reaps the server itself once it has exited
        if server.proc.returncode is not None:
            if not all_:
                return True
            server.note_tree()  # orphans keep their tag
            if not _alive(server.tree):
                return True
        if time.monotonic() > deadline:
            return False
        await anyio.sleep(EXIT_POLL_S)


def _kill(server: Server) -> None:
    server.note_tree()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    _signal_tree(server.tree, signal.SIGKILL)


async def stop(server: Server, grace_s: float = DEFAULT_GRACE_S) -> None:
    """Stop the server and every process it started; returns once all of them have exited.

    SIGTERM goes to the server alone (once: a second SIGTERM makes llama-server quit at once),
    so it shuts its children down its own way; SIGKILL after ``grace_s``. Processes of it that
    outlive it (orphans) then get SIGTERM, and SIGKILL after ``ORPHAN_GRACE_S``.
    """
    server.note_tree()
    if server.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(server.proc.pid, signal.SIGTERM)
        if not await _wait(server, grace_s, all_=False):
            _kill(server)
    if not await _wait(server, 0.0, all_=True):
        _signal_tree(server.tree, signal.SIGTERM)
        if not await _wait(server, min(grace_s, ORPHAN_GRACE_S), all_=True):
            _kill(server)
            await _wait(server, grace_s, all_=True)
    server.proc.wait()
    _RUNNING.discard(server)


@contextlib.asynccontextmanager
async def serving(
    cmds: Sequence[ServerCommand],
    *,
    np: int,
    ctx: int,
    log_dir: Path,
    timeout_s: float = DEFAULT_START_TIMEOUT_S,
    grace_s: float = DEFAULT_GRACE_S,
) -> AsyncIterator[list[Server]]:
    """Start every command, one after another, and stop them all on the way out (whatever
    happened, cancellation included)."""
    started: list[Server] = []
    try:
        for cmd in cmds:
            started.append(await start(cmd, np=np, ctx=ctx, log_dir=log_dir, timeout_s=timeout_s))
        yield started
    finally:
        with anyio.CancelScope(shield=True):
            for server in reversed(started):
                await stop(server, grace_s)


__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_START_TIMEOUT_S",
    "Server",
    "ServerCommand",
    "ServerStartError",
    "free_port",
    "serving",
    "start",
    "stop",
]
