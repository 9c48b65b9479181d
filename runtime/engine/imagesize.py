"""An image's size read from its header, before anything decodes it: the pixel cap.

A few kilobytes of PNG can declare a 60,000 x 60,000 image (its zeros compress a
thousandfold), which stb_image, libmtmd's decoder, would allocate whole (10 GB at 3 bytes a
pixel): it caps each side at 2^24 and nothing else. ``check_pixels`` refuses an image whose
header declares more than ``MAX_IMAGE_PIXELS`` before it is decoded. The limit is Pillow's
default decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``, about 89.5 million pixels, a
quarter of a gigabyte at 3 bytes a pixel), far above what any projector takes in: they
resize to a few hundred pixels a side, or to a grid of such tiles.

The headers read are those of the formats stb_image decodes and people send: PNG, JPEG, GIF
and BMP. Other formats (TGA, PSD, HDR, PNM, PIC) go to the decoder unread; in an isolated
server the decoder runs in a process of its own under a memory limit
(``runtime.service.mediaproc``), so a bomb in one of those fails that request alone.
"""

from __future__ import annotations

import struct

from llamactor.protocol.errors import RequestError

MAX_IMAGE_PIXELS = 89_478_485  # Pillow's Image.MAX_IMAGE_PIXELS: (1024 * 1024 * 1024 // 4 // 3)
# JPEG start-of-frame markers (every SOFn but the DHT, JPG and DAC markers among C0..CF)
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset(range(0xD0, 0xDA)) | {0x01}  # RSTn, SOI, EOI, TEM: no length


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) as the header of a PNG, JPEG, GIF or BMP declares it; None for other
    formats and for a header too short or broken to say (the decoder then refuses it)."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24 and data[12:16] == b"IHDR":
        w, h = struct.unpack(">II", data[16:24])
        return w, h
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        w, h = struct.unpack("<HH", data[6:10])
        return w, h
    if data[:2] == b"BM" and len(data) >= 26:
        w, h = struct.unpack("<ii", data[18:26])
        return abs(w), abs(h)
    if data[:2] == b"\xff\xd8":
        return _jpeg_size(data)
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill bytes before a marker
            i += 1
            continue
        if marker in _JPEG_STANDALONE:
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if marker in _SOF:
            if i + 9 > len(data):
                return None
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return w, h
        if marker == 0xDA:  # start of scan without a frame header: not an image stb reads
            return None
        i += 2 + length
    return None


def check_pixels(data: bytes, which: str) -> None:
    """RequestError when ``data``'s header declares an image over ``MAX_IMAGE_PIXELS``."""
    size = image_size(data)
    if size is not None and size[0] * size[1] > MAX_IMAGE_PIXELS:
        w, h = size
        raise RequestError(
            f"{which} is {w} x {h} pixels ({w * h:,}): more than the {MAX_IMAGE_PIXELS:,} an image may have "
            "(it is not decoded)"
        )
