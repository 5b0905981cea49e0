"""The process group `mlx.launch` describes in the environment, and where its heartbeat runs."""

import json
import logging
import os
from dataclasses import dataclass

import mlx.core as mx

log = logging.getLogger(__name__)

HEARTBEAT_ENV = "MLXCHAT_HEARTBEAT"  # "host:port" rank 0 listens on for heartbeats


@dataclass(frozen=True)
class World:
    """This process's place in the group."""

    group: mx.distributed.Group
    backend: str  # "ring", "nccl", "jaccl" or "mpi"
    heartbeat: tuple[str, int] | None  # rank 0's heartbeat address, None when unknown

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()


def launched() -> bool:
    """Whether `mlx.launch` (or anything setting its variables) started this process."""
    return "MLX_RANK" in os.environ


def _backend() -> str:
    if os.environ.get("MLX_HOSTFILE"):
        return "ring"
    if os.environ.get("NCCL_PORT"):
        return "nccl"
    if os.environ.get("MLX_IBV_DEVICES"):
        return "jaccl"
    return "mpi"


def _heartbeat_address() -> tuple[str, int] | None:
    """MLXCHAT_HEARTBEAT if set; with NCCL or JACCL the port after rank 0's coordinator port;
    with the ring backend, rank 0's first IP and the port after the highest ring port in the
    hostfile (mlx.launch numbers ring ports upwards from one start)."""
    given = os.environ.get(HEARTBEAT_ENV) or os.environ.get("MLX_JACCL_COORDINATOR")
    if given:
        host, _, port = given.rpartition(":")
        return host, int(port) + (0 if os.environ.get(HEARTBEAT_ENV) else 1)
    if os.environ.get("NCCL_HOST_IP") and os.environ.get("NCCL_PORT"):
        return os.environ["NCCL_HOST_IP"], int(os.environ["NCCL_PORT"]) + 1
    hostfile = os.environ.get("MLX_HOSTFILE", "")
    try:
        with open(hostfile) as f:
            hosts = json.load(f)
    except (OSError, ValueError):
        return None
    ports = [int(a.rpartition(":")[2]) for node in hosts for a in node]
    return hosts[0][0].rpartition(":")[0], max(ports) + 1


def join() -> World:
    """Initialise the group `mlx.launch` set up (blocks until every rank has joined)."""
    backend = _backend()
    group = mx.distributed.init(strict=True, backend=backend)
    world = World(group, backend, _heartbeat_address())
    log.info("rank %d of %d (%s backend)", world.rank, world.size, backend)
    return world
