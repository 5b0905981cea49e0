"""Prefix-cache snapshot files of a sharded model: every rank keeps its own shard's files.

Each rank writes the files of its shard of a snapshot under its own folder,
`<cache dir>/prompt-cache/<model key>/rank<r>-of-<n>/` (file names and format as on one process,
engine/prefix_cache/snapshot_files.py), and only when rank 0 says so:
- rank 0's prefix cache writes its file, then the same work (write this snapshot's shard as these
  tokens; delete this file) rides along with the next plan, and every follower does it on a
  writer thread of its own, so the model never waits for a disk;
- when rank 0's prefix cache opens (each model load) it proposes the files it found, and every
  rank keeps only the files that every rank holds and that pass the header checks (CHECK);
- a file is read into a cache on every rank at once, and used only if every rank's shard passed
  every check (READ); otherwise rank 0 deletes it and every follower deletes its shard.
A file a rank lost (a killed server, a full disk) therefore costs a recomputation, never a
disagreement between ranks.
"""

import json
import logging
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from ..prefix_cache import snapshot_files as files
from ..prefix_cache.store import default_persist_dir
from ..model_cache import from_layers, snapshot_layers
from ..loading.registry import LoadedModel
from .group import World
from .plan import Op, Plan, agree

log = logging.getLogger(__name__)


def shard_folder(world: World) -> str:
    return f"rank{world.rank}-of-{world.size}"


class SnapshotShards:
    """Rank 0's side, as engine/prefix_cache/store.py asks it (`lm.caches.shards`): the
    scheduler thread calls `agree` and `read`, any thread `written` and `deleted`."""

    def __init__(self, world: World, coordinator: Any, model: Any):
        self.world = world
        self.coordinator = coordinator
        self.model = model  # this rank's shard itself, not the broadcasting wrapper

    def folder(self, base: Path) -> Path:
        """Rank 0's own folder for the model's files under `base`."""
        return base / shard_folder(self.world)

    def agree(self, key: str, names: list[str]) -> tuple[set[str], files.Layout]:
        """The files (of `names`, found under `key`) that every rank holds and trusts, and this
        model's cache layout (every rank probes its own in the same step)."""
        self.coordinator.send(Plan(Op.CHECK, name=json.dumps({"key": key, "files": names})))
        layout = files.cache_layout(self.model)
        ok = agree(self.world.group, [True] * len(names))
        return {n for n, good in zip(names, ok) if good}, layout

    def written(self, cache: Any, tokens: Sequence[int]) -> None:
        """Rank 0 wrote its file of snapshot `cache`: the followers write theirs."""
        self.coordinator.file_work(self, (cache.cache_id, list(tokens)))

    def deleted(self, name: str) -> None:
        self.coordinator.file_work(self, (0, name))

    def read(self, name: str, cache: list[Any], length: int) -> list[Any] | None:
        """`cache`, rank 0's shard of file `name`, made on every rank from its own file; None
        (and nothing made anywhere) when some rank's shard failed its checks."""
        target = self.coordinator.next_id()
        self.coordinator.send(Plan(Op.READ, name=name, target=target, length=length))
        if not agree(self.world.group, [True])[0]:
            return None
        return self.coordinator.adopt(cache, target)


class _Writer:
    """One thread doing file work in the order it was given."""

    def __init__(self) -> None:
        self._jobs: "queue.Queue[Callable[[], Any]]" = queue.Queue()
        threading.Thread(target=self._run, name="mlxchat-shard-files", daemon=True).start()

    def put(self, job: Callable[[], Any]) -> None:
        self._jobs.put(job)

    def drain(self) -> None:
        self._jobs.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - a lost file is caught by the next CHECK or READ
                log.exception("snapshot shard file work failed")
            finally:
                self._jobs.task_done()


class FollowerFiles:
    """A follower's side: its shard's files, touched only as rank 0's plans say."""

    def __init__(self, world: World):
        self.world = world
        self.folder: Path | None = None
        self.identity: dict[str, str] = {}
        self.layout: files.Layout | None = None
        self._writer = _Writer()

    def check(self, plan: Plan, lm: LoadedModel) -> None:
        """CHECK: say which of rank 0's files this rank holds and trusts; keep only those every
        rank does."""
        spec = json.loads(plan.name)
        self._writer.drain()  # the previous model's work, if any, lands first
        self.folder = default_persist_dir() / spec["key"] / shard_folder(self.world)
        self.identity = files.identity(lm)
        self.layout = files.cache_layout(lm.model)
        names = spec["files"]
        ok = agree(self.world.group, [self._trusted(name) for name in names])
        kept = {name for name, good in zip(names, ok) if good}
        self.folder.mkdir(parents=True, exist_ok=True)
        for path in self.folder.iterdir():
            if path.is_file() and path.name not in kept:
                path.unlink(missing_ok=True)

    def _trusted(self, name: str) -> bool:
        assert self.folder is not None
        try:
            files.read_header(self.folder / name, self.identity)
        except (files.BadSnapshot, OSError):
            return False
        return True

    def work(self, plan: Plan, caches: dict[int, list[Any]]) -> None:
        """The file work riding along with `plan`, queued before its drops take any cache."""
        if plan.files and self.folder is None:
            raise RuntimeError("snapshot file work before any CHECK: the ranks diverged")
        folder, identity = self.folder, self.identity
        for cache_id, what in plan.files:
            if cache_id:
                layers, tokens = snapshot_layers(caches[cache_id]), list(what)
                self._writer.put(lambda l=layers, t=tokens: files.write(folder, t, l, identity))
            else:
                self._writer.put(lambda p=folder / str(what): p.unlink(missing_ok=True))

    def read(self, plan: Plan) -> list[Any] | None:
        """READ: this rank's shard of file `plan.name`, if every rank's passed its checks."""
        self._writer.drain()
        cache = None
        try:
            assert self.folder is not None and self.layout is not None
            path = self.folder / plan.name
            header = files.read_header(path, self.identity)
            if len(header.tokens) != plan.length:
                raise files.BadSnapshot(f"holds {len(header.tokens)} tokens, not {plan.length}")
            cache = from_layers(files.load_arrays(path, header, self.layout), plan.length)
        except (files.BadSnapshot, OSError) as exc:
            log.warning("rank %d: snapshot shard %s unusable: %s", self.world.rank, plan.name, exc)
        return cache if agree(self.world.group, [cache is not None])[0] else None

    def close(self) -> None:
        """Finish the queued file work (the server is stopping)."""
        self._writer.drain()
