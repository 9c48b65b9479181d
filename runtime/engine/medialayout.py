"""A prompt's media layout and the stand-in tokens its media chunks take: ``Vision.tokenize``'s second half.

``Vision.layout`` (libmtmd's work: decode the files, tokenize the text around them) gives the
prompt as text runs and ``MediaSpan``s; ``place`` turns that into the prompt's token ids, each
media chunk's positions holding the stand-in ``MediaKeys`` gives it. Plain Python, no libmtmd:
the isolated engine's API process places what its decoder process laid out
(``runtime.service.mediaproc``).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

import msgspec

from llamactor.protocol.errors import RequestError
from llamactor.protocol.media import NO_TOKEN, MediaChunk

KEYS_REMEMBERED = 65536  # distinct files whose stand-in is remembered (a file seen again after: a new one)


class MediaKeys:
    """The stand-in token of each distinct image chunk (file SHA-256 and chunk number).

    Values count down from -2 and are never given twice: an image forgotten (past
    ``KEYS_REMEMBERED`` others) and seen again gets a new one, which only costs a cache miss.
    """

    def __init__(self, remembered: int = KEYS_REMEMBERED) -> None:
        self.remembered = remembered
        self._keys: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._next = NO_TOKEN - 1
        self._lock = threading.Lock()

    def standin(self, digest: str, part: int) -> int:
        key = (digest, part)
        with self._lock:
            value = self._keys.get(key)
            if value is None:
                value = self._keys[key] = self._next
                self._next -= 1
                while len(self._keys) > self.remembered:
                    self._keys.popitem(last=False)
            else:
                self._keys.move_to_end(key)
            return value


class MediaSpan(msgspec.Struct, frozen=True, kw_only=True):
    """One media chunk of a prompt as libmtmd tokenized it: the ``part``-th chunk of file
    ``index``, taking ``n_pos`` positions and decoding ``n_tokens`` embeddings."""

    index: int
    part: int
    n_pos: int
    n_tokens: int
    audio: bool = False
    non_causal: bool = False  # decoded at once (non-causal attention): must fit one physical batch


def place(
    spans: Sequence[list[int] | MediaSpan], files: Sequence[bytes], keys: MediaKeys, n_ubatch: int = 0
) -> tuple[list[int], tuple[MediaChunk, ...]]:
    """A prompt's tokens and media chunks from its layout: each chunk's positions hold the
    stand-in ``keys`` gives its file and part. RequestError for a chunk over the physical batch
    ``n_ubatch`` that must be decoded at once, and for a prompt that ends with media."""
    tokens: list[int] = []
    media: list[MediaChunk] = []
    digests: dict[int, str] = {}
    for span in spans:
        if not isinstance(span, MediaSpan):
            tokens.extend(span)
            continue
        noun = "audio" if span.audio else "image"
        if not 0 <= span.index < len(files):
            raise RequestError(f"the media decoder named file {span.index + 1} of {len(files)}")
        if 0 < n_ubatch < span.n_tokens and span.non_causal:
            raise RequestError(
                f"{noun} {span.index + 1} makes {span.n_tokens} embeddings, decoded at once (non-causal attention): "
                f"more than the physical batch, --ubatch-size {n_ubatch}"
            )
        if span.index not in digests:
            digests[span.index] = hashlib.sha256(files[span.index]).hexdigest()
        media.append(
            MediaChunk(
                pos=len(tokens), n_pos=span.n_pos, n_tokens=span.n_tokens, data=files[span.index], part=span.part
            )
        )
        tokens.extend([keys.standin(digests[span.index], span.part)] * span.n_pos)
    if media and media[-1].end == len(tokens):
        last = "audio" if [s for s in spans if isinstance(s, MediaSpan)][-1].audio else "an image"
        raise RequestError(
            f"the prompt ends with {last}: put text after it (a chat template's turn end does), the first token is "
            "sampled after the last prompt token"
        )
    return tokens, tuple(media)


__all__ = ["KEYS_REMEMBERED", "MediaKeys", "MediaSpan", "place"]
