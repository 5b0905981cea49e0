"""One server per data folder: an exclusive lock on `server.lock`, which names its holder's pid.

Two servers on one folder would race in the database migrations and write the same prefix-cache
snapshot files. The lock is an advisory `flock`, released by the kernel when its holder exits
however it exits, so a crashed server never leaves a stale lock behind.
"""

import fcntl
import os
from pathlib import Path

LOCK_NAME = "server.lock"


class FolderBusy(Exception):
    """Another process holds the folder's lock."""


class FolderLock:
    def __init__(self, folder: Path):
        self.path = folder / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "FolderLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FolderBusy(f"another mlxchat server (pid {holder}) is using {self.path.parent}; "
                             "stop it first or set MLXCHAT_HOME to another folder") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None
