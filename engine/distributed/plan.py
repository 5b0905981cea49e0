"""The per-step plan rank 0 broadcasts, as int32 arrays: a fixed header, then its payloads.

MLX's collectives carry arrays only, and `all_sum` is the one every backend has: rank 0 fills
the array, the others contribute zeros, so everyone ends with rank 0's values. The header (read
at once) says what to do and how long the payloads are: a control payload (dropped caches, a
model name, snapshot-file work), read at once when not empty, and for a forward the model's input
tokens, which stay lazy on rank 0 so that broadcasting a sampled token does not wait for it to be
computed. `agree` is the one step where every rank contributes: each says which of rank 0's
proposals (snapshot files) it can honour.
"""

import json
from dataclasses import dataclass, field
from enum import IntEnum

import mlx.core as mx

VERSION = 2
HEADER = 12  # version, op, cache id, rows, columns, drops, name length, offset, target, length,
# values, file-work length

FileWork = tuple[int, list[int] | str]  # (cache id, tokens): write its shard; (0, name): delete


class Op(IntEnum):
    FORWARD = 1  # run the model on `tokens` (rows x columns) with cache `cache_id`
    LOAD = 2  # load model `name` (and shard it); every cache is dropped
    STOP = 3  # leave the follower loop (with `name`: as refused, that reason its error)
    COPY = 4  # cache `target` := a compact copy of cache `cache_id` (a prefix-cache snapshot)
    RESTORE = 5  # cache `target` := the first `length` tokens of snapshot `cache_id`
    MERGE = 6  # cache `target` := mlx-lm's batch cache of one row, cache `cache_id`
    EXTEND = 7  # batch cache `target` gains the rows of batch cache `cache_id`
    EXTRACT = 8  # cache `target` := row `length` of batch cache `cache_id`
    FILTER = 9  # batch cache `cache_id` keeps the rows `values`
    CHECK = 10  # snapshot files: use folder and files `name` (JSON); every rank agrees on them
    READ = 11  # cache `target` := snapshot file `name` (`length` tokens); every rank agrees


@dataclass
class Plan:
    op: Op
    cache_id: int = 0
    shape: tuple[int, int] = (0, 0)  # of the tokens of a forward
    offset: int = 0  # tokens the cache holds before a forward (checked by every rank)
    drops: list[int] = field(default_factory=list)  # caches rank 0 let go of since the last plan
    name: str = ""
    target: int = 0  # the new cache of a COPY or RESTORE
    length: int = 0  # tokens a RESTORE keeps, the row an EXTRACT takes
    values: list[int] = field(default_factory=list)  # the rows a FILTER keeps
    files: list[FileWork] = field(default_factory=list)  # snapshot files rank 0 wrote or deleted
    tokens: mx.array | None = None  # int32 (rows, columns), lazy


def _bcast(group: mx.distributed.Group, mine: mx.array | None, shape: tuple[int, ...]) -> mx.array:
    x = mine if mine is not None else mx.zeros(shape, dtype=mx.int32)
    return mx.distributed.all_sum(x, group=group, stream=mx.cpu)


def broadcast(group: mx.distributed.Group, plan: Plan | None) -> Plan:
    """Rank 0 passes its plan, the others None; every rank returns rank 0's plan."""
    header = control = tokens = None
    if plan is not None:
        name = list(plan.name.encode())
        work = list(json.dumps(plan.files).encode()) if plan.files else []
        header = mx.array([VERSION, int(plan.op), plan.cache_id, *plan.shape, len(plan.drops),
                           len(name), plan.offset, plan.target, plan.length, len(plan.values),
                           len(work)], dtype=mx.int32)
        control = mx.array(plan.drops + name + plan.values + work, dtype=mx.int32)
        if plan.tokens is not None:
            tokens = plan.tokens.astype(mx.int32)
    version, op, cache_id, rows, cols, ndrops, nname, offset, target, length, nvalues, nwork = \
        _bcast(group, header, (HEADER,)).tolist()
    if version != VERSION:
        raise RuntimeError(f"plan version {version}, expected {VERSION}: ranks run different code")
    values: list[int] = []
    if ndrops + nname + nvalues + nwork:
        values = _bcast(group, control, (ndrops + nname + nvalues + nwork,)).tolist()
    at = ndrops + nname + nvalues
    work = bytes(values[at:]).decode()
    out = Plan(Op(op), cache_id, (rows, cols), offset, values[:ndrops],
               bytes(values[ndrops:ndrops + nname]).decode(), target, length,
               values[ndrops + nname:at], [tuple(w) for w in json.loads(work)] if work else [])
    if op == Op.FORWARD:
        out.tokens = _bcast(group, tokens, (rows, cols))
    return out


def agree(group: mx.distributed.Group, ok: list[bool]) -> list[bool]:
    """Every rank says which of the same proposals it can honour; all agree on which every rank
    can (the same answer everywhere, so no rank acts on one another cannot)."""
    if not ok:
        return []
    counts = mx.distributed.all_sum(mx.array([int(x) for x in ok], dtype=mx.int32), group=group,
                                    stream=mx.cpu).tolist()
    return [c == group.size() for c in counts]
