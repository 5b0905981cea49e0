"""Issue 54 M5: a 64 MiB text upload without blank lines was still "reading" after 30 minutes (the
chunker was quadratic on one long paragraph: 8 MB took 10 s), two such files blocked every later
upload, and the part files of uploads a killed server was receiving stayed an hour. The chunker
on its own (real text), the reader threads (real threads), and a real app's start-up sweep."""

import threading
import time

import pytest

from app.doc_index.chunking import CHUNK_CHARS, markdown_chunks, text_chunks
from app.uploads.reader_threads import SMALL_FILE_BYTES, ReaderThreads
from app.uploads.store import PART_PREFIX

pytestmark = pytest.mark.fast


def finishes_within(seconds: float, work) -> object:
    """`work()`'s result, or a failure when it took more than `seconds` (a hang detector: the
    quadratic chunker took 28-62 s on these inputs, the linear one a fraction of a second)."""
    start = time.monotonic()
    result = work()
    assert time.monotonic() - start < seconds, f"took {time.monotonic() - start:.0f} s"
    return result


@pytest.mark.parametrize("text", [
    "x" * 16_000_000,  # one 16 MB word: cut every CHUNK_CHARS
    "word " * 3_200_000,  # one 16 MB paragraph: cut at spaces
], ids=["no spaces", "one paragraph"])
def test_one_long_paragraph_is_cut_in_linear_time(text):
    chunks = finishes_within(10, lambda: text_chunks(text))
    assert all(len(c.text) <= CHUNK_CHARS for c in chunks)
    assert sum(len(c.text) for c in chunks) >= len(text.replace(" ", "")) * 0.99
    assert len(chunks) >= len(text) // CHUNK_CHARS


def test_a_heading_line_of_millions_of_characters_is_read_in_linear_time():
    """The heading pattern backtracked over a long line of `#`s (quadratic)."""
    text = "# a" + "#" * 40_000 + "b\n\nbody text\n\n## Closed ##\n\nmore"  # before: 36 s
    chunks = finishes_within(10, lambda: markdown_chunks(text))
    assert chunks[-1].heading == "Closed" and chunks[-1].text.endswith("more")
    assert markdown_chunks("# C#\n\nx")[0].heading == "C#"  # a '#' that closes nothing stays


def test_a_small_file_is_read_while_large_ones_are_still_reading():
    readers = ReaderThreads()
    release = threading.Event()
    try:
        large = [readers.for_size(SMALL_FILE_BYTES * 30).submit(release.wait, 30)
                 for _ in range(2)]
        small = readers.for_size(1000).submit(time.monotonic)
        assert small.result(timeout=10)  # not behind the two large ones
        assert not any(f.done() for f in large)
    finally:
        release.set()
        readers.shutdown()


def test_parts_of_uploads_a_stopped_server_was_receiving_are_removed_at_start(tmp_path):
    """A part file minutes old used to stay an hour (it might still be arriving); at start-up
    nothing can be arriving, so every part goes."""
    from engine import Engine
    from app.server import create_app
    from app.uploads.store import UPLOADS_DIR

    folder = tmp_path / UPLOADS_DIR
    folder.mkdir()
    part = folder / f"{PART_PREFIX}0123abcd"
    part.write_bytes(b"half a file")
    create_app(Engine(model="never-loaded"), tmp_path / "db.sqlite")
    assert not part.exists()
