"""What an uploaded file is, told from its content (not its name or Content-Type), and how each
kind is read once it is stored. Documents (pdf, markdown, text) register themselves in
app/doc_index/indexing.py; another kind (images) registers with `register_kind`.

A kind's `process` runs in a worker thread after the upload is stored: it reads the file, reports
progress through `Processing.progress`, and returns what the chip shows and the prompt needs
(`Processed`), or raises `NotAttachable` with the reason the user sees."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engine import Engine

from .documents import NotAttachable
from .store import UploadStore

if TYPE_CHECKING:  # the index's package registers its kinds here: a type only, no import
    from ..doc_index.store import ChunkStore

__all__ = ["FileKind", "NotAttachable", "Processed", "Processing", "register_kind", "kind_of"]


@dataclass
class Processing:
    """One stored file being read: where it is, what it is called, and how to report progress
    (`progress(stage, fraction)`: stage is a word for the chip, fraction 0..1)."""

    engine: Engine
    path: Path
    sha256: str
    name: str
    kind: str
    progress: Callable[[str, float], None]
    uploads: UploadStore | None = None  # where the file's rows are (a kind may store more there)
    index: "ChunkStore | None" = None  # for kinds that are chunked and searched
    embedding_model: str | None = None  # the model that embeds chunks (None: BM25 only)


@dataclass(frozen=True)
class Processed:
    """What reading a file gave: its token count (as the prompt would count it), its pages, its
    whole text (for the documents kinds), a one-line summary for the chip, and anything else the
    kind keeps (`meta`, JSON)."""

    summary: str
    tokens: int | None = None
    pages: int | None = None
    text: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FileKind:
    """A kind of upload: `sniff(head, name)` says whether the file's first bytes are of this kind;
    `process` reads the stored file (off the event loop)."""

    name: str
    sniff: Callable[[bytes, str], bool]
    process: Callable[[Processing], Processed]


KINDS: list[FileKind] = []
HEAD_BYTES = 8192  # what `sniff` sees of a file


def register_kind(kind: FileKind, *, first: bool = False) -> None:
    """Add a kind of upload (replacing one of the same name). `first`: sniffed before the kinds
    already registered (a binary format should come before the catch-all `text`)."""
    KINDS[:] = [k for k in KINDS if k.name != kind.name]
    KINDS.insert(0, kind) if first else KINDS.append(kind)


def kind_of(head: bytes, name: str) -> FileKind | None:
    """The first registered kind whose `sniff` accepts the file's first bytes, or None."""
    return next((k for k in KINDS if k.sniff(head, name)), None)


def kind_named(name: str) -> FileKind | None:
    return next((k for k in KINDS if k.name == name), None)

