"""Prefix-cache snapshot files: one safetensors file per snapshot, carrying what proves it.

The header's metadata holds:
- `format`: this module's format name;
- `identity`: what produced the arrays (the weights' content digest, the compute path, the weights'
  dtypes, the device, the distributed rank, the mlx and mlx-lm versions, and the KV cache's format
  and int8 activations where not the default), see `identity()`: a snapshot of the full KV cache
  is refused under the 8-bit one and the other way round (engine/kernels/kv8.py), one made with
  exact activations under int8 ones and the other way round (engine/kernels/layout.py);
- `tokens`: the token ids the snapshot holds (the file name is a digest of them);
- `layers`: each layer's cache type and number of array slots;
- `sha256`: of every tensor's bytes, in tensor order.
Tensors are named `<layer>.<slot>`; a name left out is an empty slot.

Files are written by hand (safetensors is an 8-byte header length, a JSON header, then the raw
bytes): the writer reads evaluated arrays through the buffer protocol and calls nothing in MLX, so
it can run on a background thread while the scheduler thread runs the model. A write goes to a
temporary file in the same folder, is flushed to disk, then renamed over the final name.

A file is trusted only after two checks. `read_header` (cheap, no tensor data read) checks the
format, the identity, the tokens and that the tensor table tiles the file exactly with the token
count on every attention layer. `load_arrays` (on a hit, on the thread that runs the model) checks
every tensor's shape and dtype against the model's own cache after one token, then the checksum of
the bytes it read. Any failure raises `BadSnapshot`.
"""

import hashlib
import json
import math
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from ..model_cache import KV_KINDS, Layer, held_layers
from ..kernels import cache_variant
from ..loading.registry import LoadedModel

FORMAT = "mlxchat-snapshot-2"
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
MAX_HEADER_BYTES = 64 * 2**20
KV_TOKEN_AXIS = 2  # KVCache keys/values are (batch, heads, tokens, head dim)

_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.float64: "F64",
           mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.uint8: "U8",
           mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64", mx.bool_: "BOOL"}
_SIZES = {name: dtype.size for dtype, name in _DTYPES.items()}

Layout = list[tuple[str, list[tuple[tuple[int, ...], str] | None]]]  # shapes and dtypes instead


class BadSnapshot(Exception):
    """A snapshot file that must not be used; the message says why."""


@dataclass(frozen=True)
class Header:
    tokens: list[int]
    layers: list[tuple[str, int]]
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape), in file order
    sha256: str


def identity(lm: LoadedModel) -> dict[str, str]:
    """Everything a cache's contents depend on besides the tokens."""
    model: nn.Module = lm.model
    return {
        "weights_sha256": lm.weights_digest,
        "compute": lm.compute,  # as load_model recorded it (engine/kernels/fastest.py)
        "weight_dtypes": ",".join(sorted({str(p.dtype) for _, p in tree_flatten(model.parameters())})),
        "device": str(mx.default_device()),
        "rank": os.environ.get("MLX_RANK", "0"),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        # only where not the default: snapshots written before the 8-bit cache or int8 activations
        # existed stay good
        **cache_variant(model),
    }


def file_name(tokens: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:24] + SUFFIX


def cache_layout(model: nn.Module) -> Layout:
    """Each layer's cache type and its arrays' shapes and dtypes after one token."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    layers = held_layers(cache)
    mx.eval([a for _, arrays in layers for a in arrays if a is not None])
    return [(kind, [None if a is None else (tuple(a.shape), _DTYPES[a.dtype]) for a in arrays])
            for kind, arrays in layers]


# -- writing --------------------------------------------------------------------------------------

def write(folder: Path, tokens: Sequence[int], layers: Sequence[Layer],
          ident: dict[str, str]) -> Path:
    """Write one snapshot atomically; its arrays must be evaluated and contiguous."""
    table: dict[str, Any] = {}
    data: list[mx.array] = []
    digest = hashlib.sha256()
    offset = 0
    for i, (_, arrays) in enumerate(layers):
        for j, a in enumerate(arrays):
            if a is None:
                continue
            table[f"{i}.{j}"] = {"dtype": _DTYPES[a.dtype], "shape": list(a.shape),
                                 "data_offsets": [offset, offset + a.nbytes]}
            offset += a.nbytes
            digest.update(memoryview(a))
            data.append(a)
    table["__metadata__"] = {
        "format": FORMAT,
        "identity": json.dumps(ident, sort_keys=True),
        "tokens": json.dumps(list(tokens)),
        "layers": json.dumps([[kind, len(arrays)] for kind, arrays in layers]),
        "sha256": digest.hexdigest(),
    }
    header = json.dumps(table, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    path = folder / file_name(tokens)
    tmp = folder / f".{path.name}.{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(header)))
            fh.write(header)
            for a in data:
                fh.write(memoryview(a))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(folder)
    return path


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (directories cannot be opened for this on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- checking -------------------------------------------------------------------------------------

def _check(ok: bool, why: str) -> None:
    if not ok:
        raise BadSnapshot(why)


def read_header(path: Path, ident: dict[str, str]) -> Header:
    """The header of a snapshot file, checked against `ident` and against the file itself."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        _check(len(head) == 8, "shorter than a header")
        (n,) = struct.unpack("<Q", head)
        _check(n <= min(size - 8, MAX_HEADER_BYTES), "header length beyond the file")
        try:
            table = json.loads(fh.read(n))
        except (UnicodeDecodeError, ValueError) as exc:
            raise BadSnapshot(f"unreadable header: {exc}") from None
    _check(isinstance(table, dict), "header is not a table")
    meta = table.pop("__metadata__", None)
    _check(isinstance(meta, dict) and meta.get("format") == FORMAT,
           f"not a {FORMAT} file (another format or version)")
    try:
        theirs = json.loads(meta["identity"])
        tokens = json.loads(meta["tokens"])
        layers = [(str(kind), int(slots)) for kind, slots in json.loads(meta["layers"])]
        checksum = str(meta["sha256"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BadSnapshot(f"incomplete metadata: {exc!r}") from None
    _check(isinstance(theirs, dict), "identity is not a table")
    for key in sorted(set(ident) | set(theirs)):
        _check(theirs.get(key) == ident.get(key),
               f"made with {key} {theirs.get(key)!r}, not {ident.get(key)!r}")
    _check(isinstance(tokens, list) and len(tokens) > 0
           and all(type(t) is int and t >= 0 for t in tokens), "no valid token ids")
    _check(path.name == file_name(tokens), "file name does not match its tokens")

    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    entries = sorted(table.items(), key=lambda kv: _offsets(kv)[0])
    for name, entry in entries:
        m = re.fullmatch(r"(\d+)\.(\d+)", name)
        _check(m is not None and int(m[1]) < len(layers) and int(m[2]) < layers[int(m[1])][1],
               f"unexpected tensor {name!r}")
        dtype, shape = entry.get("dtype"), entry.get("shape")
        _check(dtype in _SIZES, f"{name}: unknown dtype {dtype!r}")
        _check(isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape),
               f"{name}: bad shape")
        begin, stop = _offsets((name, entry))
        _check(begin == end and stop - begin == math.prod(shape) * _SIZES[dtype],
               f"{name}: data offsets {begin}..{stop} do not tile the data")
        end = stop
        if layers[int(m[1])][0] in KV_KINDS:
            _check(len(shape) == 4 and shape[KV_TOKEN_AXIS] == len(tokens),
                   f"{name}: shape {shape} does not hold {len(tokens)} tokens")
        tensors[name] = (dtype, tuple(shape))
    _check(8 + n + end == size, f"data is {size - 8 - n} bytes, the header describes {end}")
    return Header(tokens=tokens, layers=layers, tensors=tensors, sha256=checksum)


def _offsets(item: tuple[str, Any]) -> tuple[int, int]:
    name, entry = item
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    _check(isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets),
           f"{name}: no data offsets")
    return offsets[0], offsets[1]


def load_arrays(path: Path, header: Header, layout: Layout) -> list[Layer]:
    """The snapshot's arrays, evaluated, once they match the model's `layout` and checksum."""
    _check([(kind, len(slots)) for kind, slots in layout] == header.layers,
           "layer types differ from the model's")
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i, (kind, slots) in enumerate(layout):
        for j, slot in enumerate(slots):
            if slot is not None:
                shape, dtype = slot
                if kind in KV_KINDS:
                    shape = shape[:KV_TOKEN_AXIS] + (len(header.tokens),) + shape[KV_TOKEN_AXIS + 1:]
                expected[f"{i}.{j}"] = (dtype, shape)
    for name in sorted(set(expected) | set(header.tensors)):
        _check(header.tensors.get(name) == expected.get(name),
               f"tensor {name}: {header.tensors.get(name)} where the model has {expected.get(name)}")
    try:
        loaded = mx.load(str(path), format="safetensors")
        arrays = [loaded[name] for name in header.tensors]
        mx.eval(arrays)
    except Exception as exc:  # noqa: BLE001 - whatever the reader says, the file is unusable
        raise BadSnapshot(f"unreadable data: {exc}") from None
    digest = hashlib.sha256()
    for a in arrays:
        digest.update(memoryview(a))
    _check(digest.hexdigest() == header.sha256, "checksum mismatch: the data is damaged")
    return [(kind, [loaded.get(f"{i}.{j}") for j in range(len(slots))])
            for i, (kind, slots) in enumerate(layout)]
