"""The engine's one memory budget: the bytes its model caches and extra weights may take.

Whatever must stay in memory while it is used reserves its bytes here and releases them when done:
an admitted request reserves the model cache it may grow to (engine/scheduling/service.py), a
dedicated embedding model its weight files while loaded (engine/scheduling/embedding_queue.py). The
prefix cache holds snapshots in what is left (`room`): it is handed `room` as its byte budget and
evicts down to it (engine/prefix_cache/store.py).

One budget is meant to be shared: several model slots (each with its own requests and prefix
cache) reserve from the same instance, so that one machine's memory is counted once; a caller that
needs room another holds (e.g. a model pool evicting an idle model) releases it there and tries
again (`try_reserve`). Thread-safe; its lock is the innermost one (taken under the scheduler's,
never around another).
"""

import threading

from ..errors import Overloaded


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


class MemoryBudget:
    """`total` bytes, of which `reserved` are held by reservations; `room()` is the rest."""

    def __init__(self, total: int):
        self.total = int(total)
        self._reserved = 0
        self._lock = threading.Lock()

    @property
    def reserved(self) -> int:
        """Bytes reserved now."""
        return self._reserved

    def room(self) -> int:
        """Bytes not reserved (what the prefix cache may hold now); never negative."""
        return max(0, self.total - self._reserved)

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` could ever be reserved (an empty budget holds them)."""
        return nbytes <= self.total

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve `nbytes` if they fit beside the reservations held now; False (nothing changed)
        when they do not."""
        with self._lock:
            if self._reserved + nbytes > self.total:
                return False
            self._reserved += nbytes
            return True

    def reserve(self, nbytes: int, what: str, retry_after: float = 2.0) -> None:
        """Reserve `nbytes` for `what` (e.g. "this request"), or raise Overloaded saying how much
        of the budget is held (the client may retry once others release theirs)."""
        if not self.try_reserve(nbytes):
            held = self._reserved
            raise Overloaded(f"server busy: {what} needs {mib(nbytes)} of the {mib(self.total)} "
                             f"memory budget, and {mib(held)} of it are reserved",
                             retry_after=retry_after)

    def release(self, nbytes: int) -> None:
        """Give back `nbytes` reserved earlier."""
        with self._lock:
            self._reserved -= nbytes
