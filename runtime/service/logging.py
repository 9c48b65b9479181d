"""structlog setup: JSON lines when stderr is not a terminal, readable text when it is."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """structlog's configuration for this process: events at ``level`` and above, as JSON lines
    (``json``; None: when stderr is not a terminal) or text, on stderr."""
    use_json = not sys.stderr.isatty() if json is None else json
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def configure_from(level: str, log_format: str) -> None:
    """A process the runtime started logs as its config says (``log_level``, ``log_format``)."""
    configure_logging(level, json={"auto": None, "json": True, "text": False}.get(log_format))
