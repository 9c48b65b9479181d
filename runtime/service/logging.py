"""structlog setup: JSON lines when stderr is not a terminal, readable text when it is.

llama-server's logging flags set the same for every process of a server (the API process, the
engine, the replicas): ``-lv``/``--log-disable`` the level, ``--log-file`` a file each line is
also appended to, ``--log-colors`` colours in text, ``--no-log-timestamps`` and
``--no-log-prefix`` lines without their time or level.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Any, Protocol

import structlog


class _Settings(Protocol):  # RuntimeConfig's logging fields
    @property
    def log_level(self) -> str: ...
    @property
    def log_format(self) -> str: ...
    @property
    def log_file(self) -> str | None: ...
    @property
    def log_colors(self) -> str: ...
    @property
    def log_timestamps(self) -> bool: ...
    @property
    def log_prefix(self) -> bool: ...


class _Tee:
    """stderr and a log file: each line written to both, the file's in one append."""

    def __init__(self, *files: IO[str]) -> None:
        self.files = files

    def write(self, text: str) -> int:
        for f in self.files:
            f.write(text)
        return len(text)

    def flush(self) -> None:
        for f in self.files:
            f.flush()


_open_files: dict[str, IO[str]] = {}


def _log_file(path: str) -> IO[str]:
    if path not in _open_files:  # line-buffered appends: the processes' lines interleave whole
        _open_files[path] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (the process's)
    return _open_files[path]


def _drop(logger: Any, method: str, event: Any) -> Any:
    raise structlog.DropEvent


def configure_logging(
    level: str = "info",
    *,
    json: bool | None = None,
    file: str | None = None,
    colors: str = "off",
    timestamps: bool = True,
    prefix: bool = True,
) -> None:
    """structlog's configuration for this process: events at ``level`` and above ("off": none),
    as JSON lines (``json``; None: when stderr is not a terminal) or text, on stderr and, with
    ``file``, appended to that file too."""
    use_json = not sys.stderr.isatty() if json is None else json
    color = sys.stderr.isatty() and file is None if colors == "auto" else colors == "on"
    renderer: Any = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=color)
    processors: list[Any] = [structlog.contextvars.merge_contextvars]
    if prefix:
        processors.append(structlog.processors.add_log_level)
    if timestamps:
        processors.append(structlog.processors.TimeStamper(fmt="iso", utc=True))
    processors += [structlog.processors.format_exc_info, renderer]
    off = level.lower() == "off"
    if off:  # --log-disable: every event dropped (structlog's filters stop at critical)
        processors = [_drop]
    out: Any = sys.stderr if file is None else _Tee(sys.stderr, _log_file(file))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.CRITICAL if off else logging.getLevelName(level.upper())
        ),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )


def configure_from(cfg: _Settings) -> None:
    """A process of the server logs as its config says (``log_level``, ``log_format``, the file,
    colours, timestamps and prefix)."""
    configure_logging(
        cfg.log_level,
        json={"auto": None, "json": True, "text": False}.get(cfg.log_format),
        file=cfg.log_file,
        colors=cfg.log_colors,
        timestamps=cfg.log_timestamps,
        prefix=cfg.log_prefix,
    )
