"""Documents larger than the context: uploaded documents cut into chunks and indexed in SQLite
(FTS5 BM25, and embeddings when a model for them is chosen), and the chunks that answer a question
put into the current user turn, with citations. Importing it registers the documents kinds of
upload (app/doc_index/indexing.py); app/server.py imports it through `doc_index.store`."""

from .indexing import DOCUMENT_KIND_NAMES  # importing it registers the pdf, markdown, text kinds

__all__ = ["DOCUMENT_KIND_NAMES"]
