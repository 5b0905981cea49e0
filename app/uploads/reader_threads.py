"""The threads uploads are read on (app/uploads/reading.py): one queue per size class, so a small
file is never stuck behind large ones. Files up to `SMALL_FILE_BYTES` (a page of notes, a short
PDF, most images) have a thread of their own; larger ones (a 64 MiB log, a 250-page PDF) queue on
another. The chat's own work never waits for either: they are the app's own threads, not the
event loop's default pool."""

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

SMALL_FILE_BYTES = 2 * 1024 * 1024
CLASSES = ("small", "large")  # one thread each


class ReaderThreads:
    """A thread per size class of file."""

    def __init__(self) -> None:
        self.queues = {name: ThreadPoolExecutor(1, thread_name_prefix=f"upload-reader-{name}")
                       for name in CLASSES}

    @staticmethod
    def size_class(size: int) -> str:
        return "small" if size <= SMALL_FILE_BYTES else "large"

    def submit(self, size: int, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run `fn(*args)` on the thread of a file of `size` bytes."""
        return self.queues[self.size_class(size)].submit(fn, *args)

    def shutdown(self, wait: bool = True) -> None:
        for queue in self.queues.values():
            queue.shutdown(wait=wait)
