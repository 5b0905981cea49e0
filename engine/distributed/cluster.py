"""The distributed layer as the app uses it: join the group, then either serve (rank 0) or follow."""

import logging
from typing import Any, Protocol

from .follower import follow
from .group import World, join, launched
from .heartbeat import Watchdog, beat
from .plan import Op, Plan
from .sharded import Coordinator, sharded_loader

log = logging.getLogger(__name__)


class Haltable(Protocol):
    def halt(self, reason: str) -> None: ...


class Cluster:
    """This process's membership in a sharded server (`mlx.launch ... -- mlxchat serve`)."""

    def __init__(self, world: World):
        self.world = world
        self.coordinator = Coordinator(world) if world.rank == 0 else None
        self.watchdog: Watchdog | None = None

    @classmethod
    def join(cls) -> "Cluster | None":
        """The cluster `mlx.launch` started this process in, or None when it did not (or the
        group has one rank): plain single-process serving."""
        if not launched():
            return None
        world = join()
        return cls(world) if world.size > 1 else None

    @property
    def rank(self) -> int:
        return self.world.rank

    def engine_options(self) -> dict[str, Any]:
        """Rank 0's `Engine(...)` options: every rank loads its shard and persists its shard of
        the prefix cache (engine/distributed/snapshots.py); speculation, whose caches the
        followers cannot mirror yet, stays off (engine/distributed/sharded.py)."""
        assert self.coordinator is not None
        return {"load": sharded_loader(self.world, self.coordinator), "prefix_cache": True,
                "persist_prefix_cache": True, "batching": True,
                "speculation": False, "keep_alive": None, "max_loaded": 1}

    def watch(self, engine: Haltable) -> None:
        """Rank 0: halt `engine` (fail its requests, refuse new ones) once a rank is gone."""
        self.watchdog = Watchdog(self.world, lambda rank, reason: engine.halt(
            f"the sharded model lost {reason}; restart the server"))
        assert self.coordinator is not None
        self.coordinator.ring = self.watchdog.ring

    def health(self) -> dict[str, Any]:
        alive = self.watchdog.alive() if self.watchdog else [self.rank]
        dead = self.watchdog.dead if self.watchdog else {}
        return {"world_size": self.world.size, "ranks_alive": alive, "backend": self.world.backend,
                "ranks_gone": {str(r): why for r, why in dead.items()}}

    def stop(self) -> None:
        """Rank 0, after the engine stopped: let every follower leave its loop (skipped when a
        rank is gone; the followers end when rank 0's heartbeat connection closes). When the
        model was refused before any rank loaded it (it cannot be split over this group), the
        followers leave with that reason, each printing the one line rank 0 prints."""
        if self.coordinator is not None and not (self.watchdog and self.watchdog.dead):
            self.coordinator.send(Plan(Op.STOP, name=self.coordinator.refused))

    def follow(self) -> int:
        """Ranks other than 0: run rank 0's plans until it stops; returns how many were run."""
        return follow(self.world, beat(self.world))
