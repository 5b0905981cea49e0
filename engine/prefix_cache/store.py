"""Prefix cache: snapshots of a model's cache at conversation checkpoints, found by token equality.

`Generation` saves snapshots where engine/decoding/snapshots.py says (the prompt's end, the answer's
end and, for non-trimmable caches, chosen message ends and branch points); a new request fetches the longest reusable prefix of its tokens. Lookup
walks a radix trie over token ids, never message ids: a chat template may render earlier turns
differently once later turns exist, and only truly equal tokens may be reused.

Two kinds of model cache:
- trimmable (every layer a `KVCache`, dense models): a snapshot serves any shorter prefix, so a
  request reuses its whole common prefix with anything cached (sliced back to that length);
- not trimmable (`ArraysCache` linear-attention state in qwen3_5 / qwen3_next): the state is valid
  only at the exact token count where it was taken, so a request reuses the deepest snapshot at or
  before its common prefix, and the checkpoints are what keep that close to the edit.

A snapshot owns compact copies of its arrays (mlx-lm's `KVCache` writes new keys into its buffer by
slice assignment, which rebinds the very array objects it holds), and a fetch hands out fresh cache
objects, so a request can never change a snapshot. Sizes are the copies' exact `nbytes`, kept under
a byte budget by evicting least-recently-used snapshots. On dense models a snapshot makes the shorter
ones on its path redundant (trimming it gives them back), so `save` drops those at once and a
conversation holds one snapshot, not one per message.

With a persist folder, snapshots are written to disk, one file per snapshot under
`<cache dir>/prompt-cache/<model key>/` (format and checks in snapshot_files.py): in the background
soon after they are made (write-behind), so a killed process loses only the last moments, and all
at once by `persist()` at shutdown. Files are kept under a disk byte budget, least recently used
deleted first. A restart indexes the files by their tokens and loads one on its first hit; the
memory copy, when there is one, is always used first. A file that fails any check is deleted with
one warning and the request recomputes what it would have reused.

A sharded model's caches (engine/distributed/sharded.py) carry `shards`: then each rank keeps its own
shard's files in a folder of its own, and the prefix cache tells it what it wrote and deleted,
keeps only the files every rank holds, and uses a file only once every rank's shard loaded.
"""

import hashlib
import logging
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from mlx_lm.models.cache import make_prompt_cache

from ..device import memory_budget
from ..model_cache import CacheOps, cache_length, from_layers, snapshot_layers
from ..kernels import cache_variant
from ..paths import cache_dir
from ..loading.registry import LoadedModel
from . import snapshot_files as files
from .writebehind import WriteBehind

log = logging.getLogger(__name__)

DISK_BUDGET_BYTES = 512 * 2**20  # snapshot files kept on disk per model
WRITE_DELAY_S = 1.0  # write-behind: how long after a snapshot is made it is written


# -- snapshots ------------------------------------------------------------------------------------

def model_key(lm: LoadedModel) -> str:
    """Identity of a model's weights for cache purposes: its name and resolved folder, and its KV
    cache's format and int8 activations where not the default (engine/kernels: cache_variant):
    each variant keeps its own snapshot folder, so switching `--kv-bits` or int8 activations
    neither reads nor deletes the other's files."""
    variant = "".join(f"|{v}" for v in cache_variant(lm.model).values())
    ident = f"{lm.name}|{Path(lm.path).resolve()}{variant}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


# -- the trie -------------------------------------------------------------------------------------

@dataclass(eq=False)
class Snapshot:
    length: int
    cache: list[Any] | None  # None while it lives only on disk
    nbytes: int = 0
    last_used: int = 0
    file: Path | None = None
    file_bytes: int = 0


@dataclass(eq=False)
class _Node:
    """A radix-trie node; `edge` is the token run from the parent to this node."""

    edge: tuple[int, ...] = ()
    parent: "_Node | None" = None
    children: dict[int, "_Node"] = field(default_factory=dict)
    snapshot: Snapshot | None = None


def _walk(root: _Node, tokens: Sequence[int]) -> tuple[list[tuple[int, _Node]], int]:
    """Follow `tokens` down the trie. Returns the (depth, node) pairs of complete nodes passed and
    the number of tokens matched (possibly ending inside the last node's edge)."""
    path, depth, node = [(0, root)], 0, root
    while depth < len(tokens):
        child = node.children.get(tokens[depth])
        if child is None:
            break
        n = 0
        edge = child.edge
        while n < len(edge) and depth + n < len(tokens) and edge[n] == tokens[depth + n]:
            n += 1
        if n < len(edge):
            return path + [(depth + len(edge), child)], depth + n
        depth += n
        node = child
        path.append((depth, node))
    return path, depth


def _subtree(node: _Node) -> Iterator[_Node]:
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def _insert(root: _Node, tokens: Sequence[int]) -> _Node:
    """The node for exactly `tokens`, splitting an edge or adding a leaf as needed."""
    node, depth = root, 0
    while depth < len(tokens):
        child = node.children.get(tokens[depth])
        if child is None:
            leaf = _Node(edge=tuple(tokens[depth:]), parent=node)
            node.children[tokens[depth]] = leaf
            return leaf
        edge, n = child.edge, 0
        while n < len(edge) and depth + n < len(tokens) and edge[n] == tokens[depth + n]:
            n += 1
        if n < len(edge):  # split the edge at n
            mid = _Node(edge=edge[:n], parent=node)
            node.children[edge[0]] = mid
            child.edge, child.parent = edge[n:], mid
            mid.children[edge[n]] = child
            child = mid
        node, depth = child, depth + n
    return node


def _prune(node: _Node) -> None:
    """Remove empty leaves upward and merge a snapshot-less node into its only child."""
    while node.parent is not None and node.snapshot is None and len(node.children) <= 1:
        parent = node.parent
        if node.children:
            (child,) = node.children.values()
            child.edge, child.parent = node.edge + child.edge, parent
            parent.children[node.edge[0]] = child
        else:
            del parent.children[node.edge[0]]
        node = parent


def _tokens_of(node: _Node) -> list[int]:
    runs = []
    while node.parent is not None:
        runs.append(node.edge)
        node = node.parent
    return [t for run in reversed(runs) for t in run]


# -- the cache ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CacheStats:
    entries: int  # snapshots in memory
    bytes: int  # their exact total size
    budget_bytes: int
    hits: int  # fetches that reused at least one token
    misses: int
    evictions: int
    reused_tokens: int  # summed over all hits
    disk_entries: int  # snapshots known on disk and not loaded
    saves: int = 0  # snapshots taken into memory
    file_reads: int = 0  # snapshot files loaded
    file_writes: int = 0  # snapshot files written

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class PrefixCache:
    """The prefix cache of one model (implements `engine.decoding.generate.PrefixStore`). Thread-safe."""

    def __init__(self, lm: LoadedModel, budget_bytes: int | Callable[[], int] | None = None,
                 persist_dir: Path | None = None, disk_budget_bytes: int = DISK_BUDGET_BYTES,
                 write_delay: float | None = WRITE_DELAY_S, caches: CacheOps | None = None):
        """`budget_bytes` (a number, or a function giving the bytes currently allowed, as the
        engine's one memory budget shares them) defaults to the device's memory budget
        (engine/device.py). With `persist_dir` (e.g. `default_persist_dir()`), snapshots are
        written there `write_delay` seconds after they are made (None: only by `persist()`), kept
        within `disk_budget_bytes`, and found again by the next PrefixCache of the same model.
        `caches`: how to copy and restore the model's caches (default: the model's own,
        `lm.caches`)."""
        self.lm = lm
        self.caches = caches if caches is not None else lm.caches
        self.key = model_key(lm)
        self._budget = memory_budget() if budget_bytes is None else budget_bytes
        template = make_prompt_cache(lm.model)
        self.enabled = self.caches.supported(template)
        self.trimmable = self.enabled and self.caches.trimmable(template)
        self.layer_types = [type(c).__name__ for c in template]
        if not self.enabled:
            log.info("prefix cache off for %s: unsupported cache types %s", lm.name, self.layer_types)
        self.dir = persist_dir / self.key if persist_dir is not None and self.enabled else None
        # a sharded model's ranks each keep their shard's files (engine/distributed/snapshots.py)
        self._shards = self.caches.shards if self.dir is not None else None
        if self._shards is not None:
            self.dir = self._shards.folder(self.dir)
        self.disk_budget = int(disk_budget_bytes)
        self._root = _Node()
        self._lock = threading.RLock()
        self._write_lock = threading.Lock()  # one writer of files at a time
        self._clock = 0
        self._bytes = 0
        self._hits = self._misses = self._evictions = self._reused = 0
        self._saves = self._file_reads = self._file_writes = 0
        self._identity: dict[str, str] = {}
        self._layout: files.Layout | None = None  # the model's cache shapes, probed on first load
        self._writer: WriteBehind | None = None
        if self.dir is not None:
            self._identity = files.identity(lm)
            self._scan_disk()
            if write_delay is not None:
                self._writer = WriteBehind(self.write_pending, write_delay)

    @property
    def budget(self) -> int:
        return max(0, int(self._budget() if callable(self._budget) else self._budget))

    # -- PrefixStore ---------------------------------------------------------------------------
    def fetch(self, tokens: Sequence[int]) -> tuple[list[Any], int]:
        """A private cache holding the longest reusable prefix of `tokens` (at most all but the
        last token, whose logits the request needs) and its length."""
        limit = len(tokens) - 1
        with self._lock:
            while self.enabled and limit > 0:
                found = self._lookup(tokens[:limit])
                if found is None:
                    break
                node, reuse = found
                snapshot = node.snapshot
                if snapshot.cache is None and not self._load(node):
                    continue  # a bad file: it is gone from the trie now, look again
                self._touch(snapshot)
                self._hits += 1
                self._reused += reuse
                return self.caches.restore(snapshot.cache, reuse), reuse
            self._misses += 1
        return make_prompt_cache(self.lm.model), 0

    def save(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Snapshot `cache`, which holds exactly `tokens` (copied; later mutation is harmless)."""
        n = len(tokens)
        if not self.enabled or n == 0:
            return
        held = cache_length(cache)
        if held is not None and held != n:
            log.warning("prefix cache: not saving a cache of %d tokens as %d tokens", held, n)
            return
        with self._lock:
            path, matched = _walk(self._root, tokens)
            if self._served(path[-1], matched, n):
                return
            copy = self.caches.copy(cache)
            size = self.caches.nbytes(copy)
            if size > self.budget:
                log.debug("prefix cache: a %d-byte snapshot exceeds the budget", size)
                return
            node = _insert(self._root, tokens)
            if node.snapshot is None:
                node.snapshot = Snapshot(length=n, cache=None)
            snapshot = node.snapshot
            if snapshot.file is not None:  # an unread file: the fresh copy replaces it
                self._unlink(snapshot.file)
                snapshot.file, snapshot.file_bytes = None, 0
            snapshot.cache, snapshot.nbytes = copy, size
            self._bytes += size
            self._saves += 1
            self._touch(snapshot)
            if self.trimmable:  # shorter snapshots on this path are this one trimmed: drop them
                self._drop_shorter(path, matched, n)
            self._evict(keep=snapshot)
        if self._writer is not None:
            self._writer.poke()

    def _served(self, end: tuple[int, _Node], matched: int, n: int) -> bool:
        """Under the lock: whether a snapshot in memory already serves these `n` tokens (`end`
        and `matched`: where `_walk` ended), touching the snapshot that does."""
        depth, node = end
        if matched == n and depth == n and node.snapshot is not None:
            self._touch(node.snapshot)  # already cached
            return node.snapshot.cache is not None
        if matched == n and self.trimmable:
            self._touch(self._covering(node).snapshot)  # a longer one serves these tokens
            return True
        return False

    def _drop_shorter(self, path: list[tuple[int, _Node]], matched: int, n: int) -> None:
        """Drop the snapshots in memory on `path` that a new one of `n` tokens covers."""
        for depth, ancestor in path:
            if depth <= matched and depth < n and ancestor.snapshot is not None \
                    and ancestor.snapshot.cache is not None:
                self._drop(ancestor)

    def branch_point(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the cached snapshots' token runs share: where this
        prompt leaves what is cached (a snapshot there serves the next prompt that branches off
        at the same place; engine/decoding/snapshots.py)."""
        with self._lock:
            return _walk(self._root, tokens)[1] if self.enabled else 0

    # -- queries -------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        with self._lock:
            snaps = [n.snapshot for n in _subtree(self._root) if n.snapshot is not None]
            return CacheStats(
                entries=sum(s.cache is not None for s in snaps), bytes=self._bytes,
                budget_bytes=self.budget, hits=self._hits, misses=self._misses,
                evictions=self._evictions, reused_tokens=self._reused,
                disk_entries=sum(s.cache is None for s in snaps), saves=self._saves,
                file_reads=self._file_reads, file_writes=self._file_writes,
            )

    def snapshots(self) -> list[tuple[list[int], Snapshot]]:
        """Every snapshot with its tokens, shortest first (for inspection and tests)."""
        with self._lock:
            found = [(_tokens_of(n), n.snapshot) for n in _subtree(self._root) if n.snapshot]
        return sorted(found, key=lambda item: item[1].length)

    # -- internals -----------------------------------------------------------------------------
    def _touch(self, snapshot: Snapshot) -> None:
        self._clock += 1
        snapshot.last_used = self._clock

    def _lookup(self, tokens: Sequence[int]) -> tuple[_Node, int] | None:
        """The snapshot's node to start from for a prefix of `tokens`, and how many tokens of it
        to reuse."""
        path, matched = _walk(self._root, tokens)
        if self.trimmable and matched > 0:
            return self._covering(path[-1][1]), matched
        for depth, node in reversed(path):
            if depth <= matched and node.snapshot is not None:
                return node, depth
        return None

    def _covering(self, node: _Node) -> _Node:
        """The node of the shortest snapshot at or below `node` (every leaf holds one), one in
        memory if any."""
        nodes = [n for n in _subtree(node) if n.snapshot is not None]
        return min(nodes, key=lambda n: (n.snapshot.cache is None, n.snapshot.length))

    def _evict(self, keep: Snapshot) -> None:
        """Drop the least recently used snapshots until within budget. (On dense models no
        snapshot is covered by a longer one: `save` drops those at once.)"""
        if self._bytes <= self.budget:
            return
        nodes = [n for n in _subtree(self._root)
                 if n.snapshot is not None and n.snapshot.cache is not None and n.snapshot is not keep]
        nodes.sort(key=lambda n: n.snapshot.last_used)
        for node in nodes:
            if self._bytes <= self.budget:
                break
            self._drop(node)
            self._evictions += 1

    def _drop(self, node: _Node) -> None:
        snapshot = node.snapshot
        self._bytes -= snapshot.nbytes if snapshot.cache is not None else 0
        snapshot.cache, snapshot.nbytes = None, 0
        if snapshot.file is None:  # nothing left of it
            node.snapshot = None
            _prune(node)

    # -- persistence ---------------------------------------------------------------------------
    def write_pending(self, limit: int | None = None) -> None:
        """Write every snapshot held only in memory (most recent first), then delete the least
        recently used files beyond `limit` bytes (default: the disk budget). The write-behind
        thread calls this; the scheduler keeps running meanwhile."""
        if self.dir is None:
            return
        limit = self.disk_budget if limit is None else limit
        with self._write_lock:
            with self._lock:
                todo = [(n.snapshot, _tokens_of(n)) for n in _subtree(self._root)
                        if n.snapshot is not None and n.snapshot.cache is not None
                        and n.snapshot.file is None and n.snapshot.nbytes <= limit]
            todo.sort(key=lambda item: -item[0].last_used)
            self.dir.mkdir(parents=True, exist_ok=True)
            written = []
            for snapshot, tokens in todo:
                cache = snapshot.cache  # read once: eviction may drop it meanwhile
                if cache is not None:
                    written.append((snapshot, tokens,
                                    files.write(self.dir, tokens, snapshot_layers(cache), self._identity)))
                    if self._shards is not None:  # while `cache` is held: the other ranks' twin
                        self._shards.written(cache, tokens)
            with self._lock:
                self._file_writes += len(written)
                for snapshot, tokens, path in written:
                    self._adopt(snapshot, tokens, path)
                self._trim_disk(limit)

    def persist(self, max_bytes: int | None = None) -> list[Path]:
        """Write what is not on disk yet and keep the most recently used files within `max_bytes`
        (default: the disk budget); delete every other file in the folder. Returns the files kept,
        most recently used first."""
        if self.dir is None:
            return []
        self.write_pending(max_bytes)
        with self._write_lock, self._lock:
            nodes = [n for n in _subtree(self._root) if n.snapshot is not None
                     and n.snapshot.file is not None]
            nodes.sort(key=lambda n: -n.snapshot.last_used)
            kept = [n.snapshot.file for n in nodes]
            for path in self.dir.iterdir():
                if path not in kept and (path.suffix == files.SUFFIX
                                         or path.name.endswith(files.TMP_SUFFIX)):
                    self._unlink(path)
        return kept

    def close(self) -> None:
        """End write-behind (after the write in progress); `persist()` still works."""
        if self._writer is not None:
            self._writer.close()

    def _adopt(self, snapshot: Snapshot, tokens: list[int], path: Path) -> None:
        """Record a file just written for `snapshot`, unless the snapshot left the trie meanwhile."""
        walked, matched = _walk(self._root, tokens)
        depth, node = walked[-1]
        if not (matched == depth == len(tokens) and node.snapshot is snapshot):
            self._unlink(path)
            return
        snapshot.file, snapshot.file_bytes = path, path.stat().st_size
        if self.trimmable:  # shorter files on its path are this one trimmed: delete them
            for _, ancestor in walked[:-1]:
                shorter = ancestor.snapshot
                if shorter is not None and shorter.cache is None and shorter.file is not None:
                    self._forget_file(ancestor)

    def _trim_disk(self, limit: int) -> None:
        nodes = [n for n in _subtree(self._root) if n.snapshot is not None
                 and n.snapshot.file is not None]
        total = sum(n.snapshot.file_bytes for n in nodes)
        for node in sorted(nodes, key=lambda n: n.snapshot.last_used):
            if total <= limit:
                break
            total -= node.snapshot.file_bytes
            self._forget_file(node)

    def _forget_file(self, node: _Node) -> None:
        snapshot = node.snapshot
        self._unlink(snapshot.file)
        snapshot.file, snapshot.file_bytes = None, 0
        if snapshot.cache is None:
            node.snapshot = None
            _prune(node)

    def _reject(self, path: Path, why: Exception) -> None:
        log.warning("prefix cache: skipping and deleting %s: %s", path, why)
        self._unlink(path)

    def _unlink(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        if self._shards is not None and path.suffix == files.SUFFIX:
            self._shards.deleted(path.name)

    def _scan_disk(self) -> None:
        """Index the files' snapshots by their tokens from the headers alone (arrays stay on disk
        until a hit); delete files that fail the header checks and temporary files left by a
        writer that is gone."""
        for path in sorted(self.dir.iterdir()) if self.dir.exists() else []:
            if path.name.endswith(files.TMP_SUFFIX):
                if not _writer_alive(path.name):
                    path.unlink(missing_ok=True)
                continue
            if path.suffix != files.SUFFIX:
                continue
            try:
                header = files.read_header(path, self._identity)
            except (files.BadSnapshot, OSError) as exc:
                self._reject(path, exc)
                continue
            node = _insert(self._root, header.tokens)
            if node.snapshot is None:
                node.snapshot = Snapshot(length=len(header.tokens), cache=None)
            node.snapshot.file, node.snapshot.file_bytes = path, path.stat().st_size
        if self._shards is not None:
            self._agree_with_shards()

    def _agree_with_shards(self) -> None:
        """Keep only the files every rank of a sharded model holds and trusts (each checked its
        own shard); the model's cache layout comes with the answer."""
        nodes = {n.snapshot.file.name: n for n in _subtree(self._root)
                 if n.snapshot is not None and n.snapshot.file is not None}
        kept, self._layout = self._shards.agree(self.key, sorted(nodes))
        for name, node in nodes.items():
            if name not in kept:
                self._forget_file(node)

    def _load(self, node: _Node) -> bool:
        """Bring a persisted snapshot into memory once every check passes; else delete the file
        and forget the snapshot."""
        snapshot = node.snapshot
        try:
            header = files.read_header(snapshot.file, self._identity)
            if header.tokens != _tokens_of(node):
                raise files.BadSnapshot("its tokens changed since it was indexed")
            if self._layout is None:
                self._layout = files.cache_layout(self.lm.model)
            cache = from_layers(files.load_arrays(snapshot.file, header, self._layout),
                                snapshot.length)
            if self._shards is not None:
                cache = self._shards.read(snapshot.file.name, cache, snapshot.length)
                if cache is None:
                    raise files.BadSnapshot("another rank's shard of it failed its checks")
        except (files.BadSnapshot, OSError) as exc:
            self._reject(snapshot.file, exc)
            snapshot.file, snapshot.file_bytes = None, 0
            node.snapshot = None
            _prune(node)
            return False
        snapshot.cache, snapshot.nbytes = cache, self.caches.nbytes(cache)
        self._bytes += snapshot.nbytes
        self._file_reads += 1
        self._touch(snapshot)
        self._evict(keep=snapshot)
        return True


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process named in a temporary file's name (`.<name>.<pid>-<thread>.tmp`) runs."""
    try:
        os.kill(int(tmp_name.rsplit(".", 2)[-2].split("-")[0]), 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def default_persist_dir() -> Path:
    return cache_dir() / "prompt-cache"
