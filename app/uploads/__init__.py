"""The files a conversation holds: received into the data folder (receiving.py), stored once by
content (store.py), told apart by their content (kinds.py) and read on reader threads
(reading.py) as documents (documents.py; a PDF's text in a child process, pdf_text.py and
pdf_worker.py) or as images (image_uploads.py). The composer's upload endpoint is app/ui/uploads.py."""
