"""A GGUF file's scalar metadata (numbers, booleans, strings), read from its header alone.

`gguf.GGUFReader` builds a numpy view for every element of every array it meets: the vocabulary
and merges of a 49,152-token tokenizer took ~4 s of a 2-core CPU for each reader, and a model's
load asked twice (its sampling keys, its FIM token ids). The keys asked at load are scalars, so
this reader steps over arrays (a string array by its lengths alone) and keeps the rest. Read once
per version of the file (path, size, modification time).
"""

from __future__ import annotations

import functools
import mmap
import struct
from pathlib import Path
from typing import Any

# GGUF's value types (gguf.GGUFValueType): struct format of each fixed-size scalar.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def scalar_metadata(path: Path | str) -> dict[str, Any]:
    """The header's keys with a scalar value; arrays are left out. {} for a file that is not a
    readable GGUF (version 2 or later)."""
    stat = Path(path).stat()
    return dict(_read(str(path), stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _read(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _header(buf)
    except (OSError, ValueError, struct.error, KeyError, UnicodeDecodeError):
        return {}


def _header(buf: mmap.mmap) -> dict[str, Any]:
    magic, version, _tensors, count = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version < 2:
        return {}
    offset, found = 24, {}
    for _ in range(count):
        key, offset = _string(buf, offset)
        (kind,), offset = struct.unpack_from("<I", buf, offset), offset + 4
        if kind == _ARRAY:
            offset = _skip_array(buf, offset)
        elif kind == _STRING:
            found[key], offset = _string(buf, offset)
        else:
            fmt = _SCALARS[kind]
            (found[key],), offset = struct.unpack_from(fmt, buf, offset), offset + struct.calcsize(fmt)
    return found


def _string(buf: mmap.mmap, offset: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, offset)
    start = offset + 8
    if start + n > len(buf):
        raise ValueError("a string runs past the end of the file")
    return bytes(buf[start:start + n]).decode("utf-8"), start + n


def _skip_array(buf: mmap.mmap, offset: int) -> int:
    kind, n = struct.unpack_from("<IQ", buf, offset)
    offset += 12
    if kind == _STRING:
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(n):
            offset += 8 + unpack(buf, offset)[0]
    elif kind == _ARRAY:
        for _ in range(n):
            offset = _skip_array(buf, offset)
    else:
        offset += n * struct.calcsize(_SCALARS[kind])
    if offset > len(buf):
        raise ValueError("an array runs past the end of the file")
    return offset
