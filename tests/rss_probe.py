"""The peak resident memory a block of code adds to this process (a server in a uvicorn thread of
the test process, tests/live_server.py): Linux's high-water mark (VmHWM), reset before the block
(`/proc/self/clear_refs`)."""

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

STATUS = Path("/proc/self/status")


def _status_mb(key: str) -> float:
    for line in STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


class PeakRss:
    """`added_mb`: the block's peak resident memory above what was resident when it began."""

    def __init__(self) -> None:
        self.start_mb = _status_mb("VmRSS")
        self.added_mb = 0.0


@contextmanager
def peak_rss() -> Iterator[PeakRss]:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from now
    probe = PeakRss()
    try:
        yield probe
    finally:
        probe.added_mb = _status_mb("VmHWM") - probe.start_mb
