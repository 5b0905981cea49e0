"""Reading a stored upload (its kind's `process`: a PDF's text, the document index, an image's
checks) on the app's own reader threads (a queue per size class: app/uploads/reader_threads.py),
and recording what it gave or why it failed."""

import asyncio
import logging

from ..state import AppState
from .documents import NotAttachable
from .kinds import Processing, kind_named
from .store import Upload

log = logging.getLogger(__name__)

def start_reading(state: AppState, up: Upload) -> None:
    """Read the stored file (its kind's `process`) on the app's own reader thread of its size
    class, keeping the task: uploads queue there, never taking the threads chat turns prepare
    their prompts on, and a small file never waits behind large ones."""
    task = asyncio.wrap_future(state.readers.for_size(up.size).submit(read_file, state, up))
    state.reading.add(task)
    task.add_done_callback(state.reading.discard)


def read_file(state: AppState, up: Upload) -> None:
    """Run the kind's `process` on the stored file; record what it gave, or why it failed."""
    store = state.uploads
    kind = kind_named(up.kind)
    job = Processing(engine=state.engine, path=store.blob(up.sha256), sha256=up.sha256,
                     name=up.name, kind=up.kind,
                     progress=lambda stage, fraction: store.progress(up.sha256, stage, fraction),
                     uploads=store, index=state.chunks, embedding_model=state.document_embeddings)
    try:
        if kind is None:
            raise NotAttachable(f"no reader for {up.kind} files")
        done = kind.process(job)
    except NotAttachable as exc:
        store.refused(up.sha256, str(exc))
    except Exception as exc:  # noqa: BLE001 - a reader's bug: the chip says so, the server lives
        log.exception("reading an upload failed")
        store.refused(up.sha256, f"it could not be read ({type(exc).__name__})")
    else:
        store.ready(up.sha256, summary=done.summary, tokens=done.tokens, pages=done.pages,
                    text=done.text, meta=done.meta)
