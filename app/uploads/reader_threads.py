"""The threads uploads are read on (app/uploads/reading.py, and files inside API requests:
app/api/documents.py): one queue per size class, so a small file is never stuck behind large ones.
Files up to `SMALL_FILE_BYTES` (a page of notes, a short PDF, most images) have a thread of their
own; larger ones (a 64 MiB log, a 250-page PDF) queue on another. The chat's own work never waits
for either: they are the app's own threads, not the event loop's default pool."""

from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Callable

SMALL_FILE_BYTES = 2 * 1024 * 1024
CLASSES = ("small", "large")  # one thread each


class ReaderThreads(Executor):
    """A thread per size class of file. As an `Executor` (`submit`, `run_in_executor`) it runs
    work of unknown size on the large files' thread; `for_size` picks a file's own."""

    def __init__(self) -> None:
        self.queues = {name: ThreadPoolExecutor(1, thread_name_prefix=f"upload-reader-{name}")
                       for name in CLASSES}

    def for_size(self, size: int) -> ThreadPoolExecutor:
        """The thread of a file of `size` bytes."""
        return self.queues["small" if size <= SMALL_FILE_BYTES else "large"]

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return self.queues["large"].submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for queue in self.queues.values():
            queue.shutdown(wait=wait, cancel_futures=cancel_futures)
