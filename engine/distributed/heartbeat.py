"""A side channel between rank 0 and each follower: heartbeats one way, a doorbell the other.

A collective with a dead peer often does not return on this MLX (the ring backend logs its
send/recv errors and the call stays blocked; now and then it fails the call instead), so rank 0
cannot count on learning it from the model call. Each follower
keeps a TCP connection to rank 0 and writes a byte every BEAT_S; rank 0's watchdog declares a
rank dead when its connection closes (the process ended) or stays silent for SILENT_S (stalled),
or when it never connects within JOIN_S. A follower whose connection breaks exits: rank 0 is gone.

The doorbell: a follower waiting for rank 0's next plan inside the collective spins a core (the
ring backend polls its sockets), for as long as the server is idle. So rank 0 rings before each
plan, sending the plan's number down every registered connection, and a follower waits for that
number on the socket (asleep) before it enters the collective. On registering a connection rank
0 first sends the number of the last plan it rang; every later plan is rung to that follower, so
it waits only for plans past that number (the plans before, or a follower whose connection is not
registered yet, go straight into the collective as before).
"""

import logging
import os
import select
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
        self._bells: dict[int, socket.socket] = {}  # the doorbell's connections, by rank
        self._rung = 0  # the number of the last plan rung
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
                self._send(rank, conn, self._rung)  # every plan after this one is rung to it
            try:
                while conn.recv(64):
                    with self._lock:
                        self.seen[rank] = time.monotonic()
            except OSError:  # reset: the doorbell wrote to a connection the peer's end had closed
                pass
        self._declare(rank, f"rank {rank} is gone (its connection closed)")

    def ring(self, plan: int) -> None:
        """Before rank 0 broadcasts plan number `plan`: tell every registered follower."""
        with self._lock:
            self._rung = plan
            for rank, conn in list(self._bells.items()):
                self._send(rank, conn, plan)

    def _send(self, rank: int, conn: socket.socket, plan: int) -> None:
        """One number down `conn` (the lock held); a broken connection leaves the doorbell (its
        reader declares the rank gone)."""
        try:
            conn.sendall(struct.pack("!i", plan))
            self._bells[rank] = conn
        except OSError:
            self._bells.pop(rank, None)

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


class Doorbell:
    """A follower's end of the doorbell (see the module's docstring)."""

    def __init__(self) -> None:
        self.conn: socket.socket | None = None  # set once connected to rank 0
        self.registered: int | None = None  # rank 0's last plan rung when it registered us
        self.rung = 0  # the highest plan number heard
        self._buffer = b""

    def wait_for(self, plan: int) -> None:
        """Sleep until rank 0 rings plan number `plan` (returns at once for a plan it may not
        ring: before this follower is registered, or up to the number it registered with)."""
        while self.conn is not None and (self.registered is None or plan > self.registered):
            if self.registered is not None and self.rung >= plan:
                return
            if self.registered is None and not select.select([self.conn], [], [], 0)[0]:
                return  # not registered yet: rank 0 does not ring us; the collective waits
            try:
                data = self.conn.recv(4096)
            except OSError:
                return
            if not data:  # rank 0 is gone (the heartbeat thread ends the process)
                self.conn = None
                return
            self._buffer += data
            while len(self._buffer) >= 4:
                (number,) = struct.unpack("!i", self._buffer[:4])
                self._buffer = self._buffer[4:]
                if self.registered is None:
                    self.registered = number
                self.rung = max(self.rung, number)


def beat(world: World) -> Doorbell:
    """A follower: connect to rank 0's watchdog and beat until the process ends; if rank 0 goes
    away, end this process (a collective with rank 0 gone would never return). Returns the
    follower's doorbell on the same connection."""
    assert world.heartbeat is not None
    bell = Doorbell()

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
            conn.settimeout(None)
            conn.sendall(struct.pack("!i", world.rank))
            bell.conn = conn
            while True:
                time.sleep(BEAT_S)
                conn.sendall(b".")
        except OSError:
            log.error("rank %d: rank 0 is gone; exiting", world.rank)
            os._exit(1)

    threading.Thread(target=run, name="mlxchat-heartbeat", daemon=True).start()
    return bell
