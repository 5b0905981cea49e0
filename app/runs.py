"""Every generation in flight, whether from the API or the UI.

`/health` counts them, and shutdown cancels them all at once so that each stream ends with a
`cancelled` event and its owner saves what was generated.
"""

from contextlib import contextmanager
from typing import Iterator, Protocol


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Runs:
    def __init__(self) -> None:
        # Keyed by identity: handles need not be hashable.
        self._active: dict[int, Cancellable] = {}

    def __len__(self) -> int:
        return len(self._active)

    @contextmanager
    def track(self, handle: Cancellable) -> Iterator[Cancellable]:
        """Count `handle` while the block runs; leaving the block early cancels it."""
        self._active[id(handle)] = handle
        try:
            yield handle
        finally:
            self._active.pop(id(handle), None)
            handle.cancel()  # a no-op once the generation has finished

    def cancel_all(self) -> None:
        for handle in list(self._active.values()):
            handle.cancel()
