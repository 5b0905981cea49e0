"""What an image file says about itself before anything is decoded: its format (by its first
bytes), its declared size and its frame count, read from the header with bounded work (a fixed
number of bytes, or a bounded walk over chunks and blocks), so that app/api/images.py refuses an
image over its limits without decoding a pixel. Pillow reads the same headers, but opening a file
with it walks every chunk before the pixels (a PNG of a million tiny chunks) and counts a GIF's
frames by parsing each of them.

`read_header(data)` answers an `ImageHeader`, or raises `HeaderError` with the reason (for the
client's 400). A GIF's or WebP's frames may extend past the declared canvas; the size answered is
then the largest extent (Pillow grows the canvas the same way).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GIF_MAGICS = (b"GIF87a", b"GIF89a")
JPEG_MAGIC = b"\xff\xd8\xff"

# Bounds on the walks: real files stay far below them (a PNG has a dozen chunks before its pixels,
# a JPEG a few dozen segments before its frame header, an encoder fills a GIF's data blocks to 255
# bytes); a file past one is refused rather than walked further.
MAX_CHUNKS = 4096  # PNG chunks before the pixels; WebP chunks
MAX_SEGMENTS = 4096  # JPEG segments before the frame header
MAX_GIF_BLOCKS = 1 << 18  # GIF data sub-blocks (a 20 MB GIF has ~80,000 of 255 bytes)

# JPEG start-of-frame markers (SOF0-SOF15 but DHT, JPG and DAC) hold the frame's size.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset(range(0xD0, 0xDA)) | {0x01}


class HeaderError(ValueError):
    """The bytes are not an image this server reads; the message says why."""


@dataclass(frozen=True)
class ImageHeader:
    format: str  # PNG, JPEG, WEBP or GIF (Pillow's names)
    width: int
    height: int
    frames: int  # 1 for a still image; counted only up to `read_header`'s `max_frames` + 1

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def media_type(self) -> str:
        return f"image/{self.format.lower()}"


def sniff(head: bytes) -> str | None:
    """The format the first bytes announce (PNG, JPEG, WEBP, GIF), or None."""
    if head.startswith(PNG_MAGIC):
        return "PNG"
    if head.startswith(JPEG_MAGIC):
        return "JPEG"
    if head.startswith(GIF_MAGICS):
        return "GIF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    return None


def read_header(data: bytes, max_frames: int) -> ImageHeader:
    """The header of the image in `data`; raises HeaderError. Frames are counted up to
    `max_frames` + 1 (enough to refuse one over the limit)."""
    kind = sniff(data[:16])
    if kind is None:
        raise HeaderError("not a PNG, JPEG, WebP or GIF")
    try:
        return _READERS[kind](data, max_frames)
    except (struct.error, IndexError):
        raise HeaderError(f"a damaged {kind} header (the file ends inside it)") from None


def _png(data: bytes, max_frames: int) -> ImageHeader:
    if data[12:16] != b"IHDR":
        raise HeaderError("a PNG without its IHDR header first")
    width, height = struct.unpack(">II", data[16:24])
    frames, pos = 1, 8
    for _ in range(MAX_CHUNKS):  # an APNG's frame count is in acTL, before the pixels
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"acTL":
            frames = max(1, struct.unpack(">I", data[pos + 8:pos + 12])[0])
            break
        if kind in (b"IDAT", b"IEND"):
            break
        pos += 12 + length
        if pos >= len(data):
            break
    else:
        raise HeaderError(f"a PNG with more than {MAX_CHUNKS} chunks before its pixels")
    return ImageHeader("PNG", width, height, frames)


def _jpeg(data: bytes, max_frames: int) -> ImageHeader:
    pos = 2
    for _ in range(MAX_SEGMENTS):
        if data[pos] != 0xFF:
            raise HeaderError("a damaged JPEG (a segment does not start with a marker)")
        while data[pos + 1] == 0xFF:  # fill bytes
            pos += 1
        marker = data[pos + 1]
        if marker in _SOF:
            height, width = struct.unpack(">HH", data[pos + 5:pos + 9])
            return ImageHeader("JPEG", width, height, 1)
        if marker == 0xD9 or marker == 0xDA:  # the end, or the scan, before any frame header
            break
        if marker in _STANDALONE:
            pos += 2
            continue
        pos += 2 + struct.unpack(">H", data[pos + 2:pos + 4])[0]
    raise HeaderError("a JPEG whose frame header (its size) was not found")


def _skip_blocks(data: bytes, pos: int, budget: list[int]) -> int:
    """The position after a GIF chain of data sub-blocks starting at `pos`."""
    while (size := data[pos]) != 0:
        pos += size + 1
        budget[0] -= 1
        if budget[0] < 0:
            raise HeaderError(f"a GIF with more than {MAX_GIF_BLOCKS} data blocks")
    return pos + 1


def _gif(data: bytes, max_frames: int) -> ImageHeader:
    width, height, flags = struct.unpack("<HHB", data[6:11])
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    frames, budget = 0, [MAX_GIF_BLOCKS]
    while pos < len(data) and frames <= max_frames:
        block = data[pos]
        if block == 0x21:  # an extension: its label, then data blocks
            pos = _skip_blocks(data, pos + 2, budget)
        elif block == 0x2C:  # an image (a frame): its place and size, a local table, its data
            left, top, w, h, local = struct.unpack("<HHHHB", data[pos + 1:pos + 10])
            width, height = max(width, left + w), max(height, top + h)
            frames += 1
            pos += 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0)
            pos = _skip_blocks(data, pos + 1, budget)  # after the LZW code size
        else:  # the trailer, or bytes no GIF has here: what was read is what counts
            break
    if frames == 0:
        raise HeaderError("a GIF without any image in it")
    return ImageHeader("GIF", width, height, frames)


def _webp(data: bytes, max_frames: int) -> ImageHeader:
    kind = data[12:16]
    if kind == b"VP8 ":  # lossy: a key frame's start code, then 14-bit sizes
        if data[23:26] != b"\x9d\x01\x2a":
            raise HeaderError("a damaged WebP (no key frame)")
        width, height = struct.unpack("<HH", data[26:30])
        return ImageHeader("WEBP", width & 0x3FFF, height & 0x3FFF, 1)
    if kind == b"VP8L":  # lossless: a signature byte, then 14-bit sizes minus one
        if data[20] != 0x2F:
            raise HeaderError("a damaged WebP (lossless signature)")
        bits = int.from_bytes(data[21:25], "little")
        return ImageHeader("WEBP", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, 1)
    if kind != b"VP8X":
        raise HeaderError("a WebP of no known kind")
    width = int.from_bytes(data[24:27], "little") + 1
    height = int.from_bytes(data[27:30], "little") + 1
    frames, pos = 0, 30
    if data[20] & 0x02:  # animated: count its ANMF chunks
        for _ in range(MAX_CHUNKS):
            if pos + 8 > len(data) or frames > max_frames:
                break
            chunk, size = data[pos:pos + 4], int.from_bytes(data[pos + 4:pos + 8], "little")
            frames += chunk == b"ANMF"
            pos += 8 + size + (size & 1)
        else:
            raise HeaderError(f"a WebP with more than {MAX_CHUNKS} chunks")
    return ImageHeader("WEBP", width, height, max(frames, 1))


_READERS = {"PNG": _png, "JPEG": _jpeg, "GIF": _gif, "WEBP": _webp}
