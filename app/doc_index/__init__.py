"""Documents larger than the context: uploaded documents cut into chunks and indexed in SQLite
(FTS5 BM25, and embeddings when a model for them is chosen), and the chunks that answer a question
put into the current user turn, with citations. Importing it registers the documents kinds of
upload (app/doc_index/indexing.py)."""

from . import indexing  # noqa: F401 - registers the pdf, markdown and text kinds
