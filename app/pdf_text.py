"""The text of an attached PDF, read in a child process (`app/pdf_worker.py`) with a time budget,
a memory cap, and limits on pages and text: pypdf is pure Python and hostile PDFs (a shared content
stream re-parsed per page, a flate bomb, a page tree thousands deep) can keep it busy for minutes or
take gigabytes. In the server's own process that froze the event loop; in a child it costs only the
child, which is killed at the budget. Call `pdf_text` off the event loop: it waits for the child."""

import json
import subprocess
import sys
from pathlib import Path

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


def pdf_pages(source: bytes | Path, time_budget_s: float = TIME_BUDGET_S) -> list[str]:
    """The text of each page of the PDF `source` (its bytes, or a file the child reads itself);
    PdfUnreadable on any failure."""
    command = [sys.executable, "-I", str(_WORKER), str(MEMORY_BYTES), str(MAX_PAGES), str(MAX_CHARS)]
    try:
        if isinstance(source, Path):
            with open(source, "rb") as stdin:
                done = subprocess.run(command, stdin=stdin, capture_output=True, timeout=time_budget_s)
        else:
            done = subprocess.run(command, input=source, capture_output=True, timeout=time_budget_s)
    except subprocess.TimeoutExpired:
        raise PdfUnreadable(f"this PDF took more than {time_budget_s:g} s to read") from None
    try:
        result = json.loads(done.stdout)
    except ValueError:
        raise PdfUnreadable("this PDF cannot be read (its reader stopped)") from None
    if "error" in result:
        raise PdfUnreadable(result["error"])
    return result["pages"]
