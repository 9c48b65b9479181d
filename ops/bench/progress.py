"""A one-line progress bar on stderr, drawn only when stderr is a terminal.

``advance`` is called once per finished request, from the event loop; it redraws at most
every ``REDRAW_INTERVAL_S`` so drawing costs nothing measurable during the run.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_INTERVAL_S = 0.2
BAR_WIDTH_CHARS = 30


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self.failed = 0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = self._stream.isatty()
        self._drawn_at = 0.0

    def advance(self, ok: bool = True) -> None:
        self.done += 1
        self.failed += not ok
        now = time.monotonic()
        if self._enabled and (now - self._drawn_at >= REDRAW_INTERVAL_S or self.done >= self.total):
            self._drawn_at = now
            self._draw()

    def _draw(self) -> None:
        filled = BAR_WIDTH_CHARS * min(self.done, self.total) // self.total
        bar = "#" * filled + "." * (BAR_WIDTH_CHARS - filled)
        failed = f" {self.failed} failed" if self.failed else ""
        self._stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total}{failed}")
        self._stream.flush()

    def close(self) -> None:
        if self._enabled:
            self._stream.write("\r\033[K")
            self._stream.flush()


class NoProgress(Progress):
    """Counts but never draws (library calls and tests)."""

    def __init__(self, label: str = "", total: int = 1) -> None:
        super().__init__(label, total)
        self._enabled = False


__all__ = ["NoProgress", "Progress"]
