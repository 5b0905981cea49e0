"""The text of an attached PDF, read in a child process (`app/uploads/pdf_worker.py`) with a time budget,
a memory cap, and limits on pages and text: pypdf is pure Python and hostile PDFs (a shared content
stream re-parsed per page, a flate bomb, a page tree thousands deep) can keep it busy for minutes or
take gigabytes. In the server's own process that froze the event loop; in a child it costs only the
child, which is killed at the budget. Call `pdf_text` off the event loop: it waits for the child."""

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

TIME_BUDGET_S = 20.0
MEMORY_BYTES = 1 << 30  # the child's address space
MAX_PAGES = 1000
MAX_CHARS = 4_000_000

_WORKER = Path(__file__).with_name("pdf_worker.py")


class PdfUnreadable(ValueError):
    """Why a PDF's text could not be read, for the user."""


def pdf_text(raw: bytes) -> str:
    """The text of the PDF `raw`, pages separated by blank lines; PdfUnreadable on any failure."""
    return "\n\n".join(pdf_pages(raw))


def pdf_pages(source: bytes | Path, time_budget_s: float | None = None,
              progress: Callable[[float], None] = lambda fraction: None) -> list[str]:
    """The text of each page of the PDF `source` (its bytes, or a file the child reads itself);
    `progress` hears the fraction of pages read. PdfUnreadable on any failure. The time budget is
    TIME_BUDGET_S unless given (read when called: a test may shorten it)."""
    time_budget_s = TIME_BUDGET_S if time_budget_s is None else time_budget_s
    command = [sys.executable, "-I", str(_WORKER), str(MEMORY_BYTES), str(MAX_PAGES), str(MAX_CHARS)]
    try:
        stdout = _run(command, source, time_budget_s, progress)
    except subprocess.TimeoutExpired:
        raise PdfUnreadable(f"this PDF took more than {time_budget_s:g} s to read") from None
    try:
        result = json.loads(stdout)
    except ValueError:
        raise PdfUnreadable("this PDF cannot be read (its reader stopped)") from None
    if "error" in result:
        raise PdfUnreadable(result["error"])
    return result["pages"]


def _run(command: list[str], source: bytes | Path, time_budget_s: float,
         progress: Callable[[float], None]) -> bytes:
    """The child's stdout; its stderr's `page <n> <pages>` lines go to `progress` as they come.
    Raises TimeoutExpired (the child killed) past `time_budget_s`."""
    stdin = open(source, "rb") if isinstance(source, Path) else subprocess.PIPE
    try:
        with subprocess.Popen(command, stdin=stdin, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) as child:
            out: list[bytes] = []
            work = [lambda: out.append(child.stdout.read()), lambda: _pages(child.stderr, progress)]
            if stdin is subprocess.PIPE:
                work.append(lambda: _feed(child.stdin, source))
            threads = [threading.Thread(target=w, daemon=True) for w in work]
            for t in threads:
                t.start()
            try:
                child.wait(timeout=time_budget_s)
            except subprocess.TimeoutExpired:
                child.kill()
                raise
            finally:
                for t in threads:
                    t.join()
            return out[0] if out else b""
    finally:
        if stdin is not subprocess.PIPE:
            stdin.close()


def _feed(pipe: Any, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError):  # the child stopped reading (it failed or was killed)
        pass


def _pages(pipe: Any, progress: Callable[[float], None]) -> None:
    """Each percent of pages read, to `progress` (other lines, such as warnings, are skipped)."""
    told = -1
    for line in pipe:
        parts = line.split()
        if len(parts) == 3 and parts[0] == b"page" and parts[1].isdigit() and parts[2].isdigit():
            fraction = int(parts[1]) / max(1, int(parts[2]))
            if int(fraction * 100) > told:
                told = int(fraction * 100)
                progress(fraction)
