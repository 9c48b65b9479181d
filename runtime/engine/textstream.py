"""Incremental detokenization and stop strings for one choice.

Bytes of each sampled token go in; text that can safely be shown comes out:
- an incomplete UTF-8 sequence is held until its last byte arrives;
- text that could still be the start of a stop string is held back until it can no longer
  match; when a stop string completes, the text before it is released and the choice ends.
Called in the group's thread once per generated token; O(longest stop string) per call.
"""

from __future__ import annotations

import codecs


class TextStream:
    __slots__ = ("_decoder", "_held", "_max_stop", "_parts", "_stops", "stopped_by")

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._stops = stops
        self._max_stop = max((len(s) for s in stops), default=0)
        self._parts: list[str] = []  # released text
        self._held = ""  # decoded, not yet released (a possible stop-string prefix)
        self.stopped_by = ""

    def push(self, data: bytes) -> str:
        """Feed one token's bytes; return newly released text (maybe empty)."""
        return self.accept(self.decode(data))

    def decode(self, data: bytes) -> str:
        """Incremental UTF-8: the text completed by ``data`` (first half of ``push``)."""
        return self._decoder.decode(data)

    def accept(self, text: str) -> str:
        """Stop-string handling of decoded text (second half of ``push``)."""
        if not self._stops:
            if text:
                self._parts.append(text)
            return text
        window = self._held + text
        for stop in self._stops:
            at = window.find(stop)
            if at >= 0 and (not self.stopped_by or at < window.find(self.stopped_by)):
                self.stopped_by = stop
        if self.stopped_by:
            out = window[: window.find(self.stopped_by)]
            self._held = ""
        else:
            keep = self._partial_len(window)
            out, self._held = window[: len(window) - keep], window[len(window) - keep :]
        if out:
            self._parts.append(out)
        return out

    def flush(self) -> str:
        """At the end of the choice: release what is still held (no stop string matched)."""
        if self.stopped_by:
            return ""
        out = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        if out:
            self._parts.append(out)
        return out

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def _partial_len(self, window: str) -> int:
        """Length of the longest suffix of ``window`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(window)), best, -1):
                if window.endswith(stop[:k]):
                    best = k
                    break
        return best
