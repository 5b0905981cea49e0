"""A background thread that runs its owner's flush soon after being poked.

Pokes during the delay or during a flush are coalesced into one more flush. The thread holds its
owner only weakly, so an owner dropped without `close()` (a model switch) is collected and the
thread ends; `close()` ends it at once, after the flush in progress.
"""

import logging
import threading
import weakref
from typing import Any, Callable

log = logging.getLogger(__name__)


def _stop(closed: threading.Event, poked: threading.Event) -> None:
    closed.set()
    poked.set()


class WriteBehind:
    def __init__(self, flush: Callable[[], Any], delay: float, name: str = "mlxchat-write-behind"):
        """`flush` must be a bound method; its object is referenced weakly."""
        self.delay = delay
        self._flush = weakref.WeakMethod(flush)
        self._poked = threading.Event()
        self._closed = threading.Event()
        weakref.finalize(flush.__self__, _stop, self._closed, self._poked)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._poked.set()

    def close(self, timeout: float | None = None) -> None:
        _stop(self._closed, self._poked)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._poked.wait()
            if self._closed.wait(self.delay):
                return
            self._poked.clear()
            flush = self._flush()
            if flush is None:
                return
            try:
                flush()
            except Exception:  # noqa: BLE001 - a failed write must not end write-behind
                log.exception("write-behind flush failed")
            del flush
