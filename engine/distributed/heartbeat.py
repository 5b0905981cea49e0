"""A side channel that tells rank 0 within seconds when another rank is gone.

A collective with a dead peer often does not return on this MLX (the ring backend logs its
send/recv errors and the call stays blocked; now and then it fails the call instead), so rank 0
cannot count on learning it from the model call. Each follower
keeps a TCP connection to rank 0 and writes a byte every BEAT_S; rank 0's watchdog declares a
rank dead when its connection closes (the process ended) or stays silent for SILENT_S (stalled),
or when it never connects within JOIN_S. A follower whose connection breaks exits: rank 0 is gone.
"""

import logging
import os
import socket
import struct
import threading
import time
from typing import Callable

from .group import World

log = logging.getLogger(__name__)

BEAT_S = 0.5
SILENT_S = 5.0  # 3 s gave false alarms on a busy 2-core machine while a follower loaded
JOIN_S = 120.0


class Watchdog:
    """Rank 0: listens for every follower's heartbeat and calls `on_dead(rank, reason)` once for
    the first rank found gone."""

    def __init__(self, world: World, on_dead: Callable[[int, str], None]):
        if world.heartbeat is None:
            raise RuntimeError("no heartbeat address: set MLXCHAT_HEARTBEAT=host:port")
        self.size = world.size
        self.on_dead = on_dead
        self.seen: dict[int, float] = {}
        self.dead: dict[int, str] = {}
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._server = socket.create_server(world.heartbeat, reuse_port=False)
        threading.Thread(target=self._accept, name="mlxchat-heartbeat", daemon=True).start()
        threading.Thread(target=self._watch, name="mlxchat-watchdog", daemon=True).start()

    def alive(self) -> list[int]:
        """The ranks known to be running, rank 0 included."""
        with self._lock:
            return [0] + sorted(r for r in self.seen if r not in self.dead)

    def _accept(self) -> None:
        while True:
            conn, _ = self._server.accept()
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            head = conn.recv(4)
            if len(head) < 4:
                return
            (rank,) = struct.unpack("!i", head)
            with self._lock:
                self.seen[rank] = time.monotonic()
            while conn.recv(64):
                with self._lock:
                    self.seen[rank] = time.monotonic()
        self._declare(rank, f"rank {rank} is gone (its connection closed)")

    def _watch(self) -> None:
        while not self.dead:
            time.sleep(BEAT_S / 2)
            now = time.monotonic()
            with self._lock:
                seen = dict(self.seen)
            for rank in range(1, self.size):
                if rank not in seen and now - self._started > JOIN_S:
                    self._declare(rank, f"rank {rank} never sent a heartbeat")
                elif rank in seen and now - seen[rank] > SILENT_S:
                    self._declare(rank, f"rank {rank} stopped responding ({SILENT_S:.0f} s "
                                        "without a heartbeat)")

    def _declare(self, rank: int, reason: str) -> None:
        with self._lock:
            if self.dead:
                self.dead.setdefault(rank, reason)
                return
            self.dead[rank] = reason
        log.error("%s", reason)
        self.on_dead(rank, reason)


def beat(world: World) -> None:
    """A follower: connect to rank 0's watchdog and beat until the process ends; if rank 0 goes
    away, end this process (a collective with rank 0 gone would never return)."""
    assert world.heartbeat is not None

    def run() -> None:
        deadline = time.monotonic() + JOIN_S
        while True:
            try:
                conn = socket.create_connection(world.heartbeat, timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    log.error("rank %d: no watchdog at %s", world.rank, world.heartbeat)
                    os._exit(1)
                time.sleep(0.2)
        try:
            conn.sendall(struct.pack("!i", world.rank))
            while True:
                time.sleep(BEAT_S)
                conn.sendall(b".")
        except OSError:
            log.error("rank %d: rank 0 is gone; exiting", world.rank)
            os._exit(1)

    threading.Thread(target=run, name="mlxchat-heartbeat", daemon=True).start()
