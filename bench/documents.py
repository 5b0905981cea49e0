"""Documents larger than the context (issue 30), measured through the app's own code in-process:

- indexing: pages per second for a generated PDF (read in pypdf's child process, counted with the
  model's tokenizer, chunked, stored in SQLite + FTS5): `read_file` as an upload runs it;
- retrieval: milliseconds per question at 1k, 10k and 100k chunks (synthetic text), BM25 alone,
  cosine over the numpy matrix (256-d vectors) alone, and both fused (the query's embedding is not
  included: it is one forward pass of whatever embedding model is used);
- TTFT: a question over the 300-page PDF (retrieval + prompt + prefill to the first token) against
  the same question without documents, on the same engine, each run with its own system prompt so
  that nothing comes from the prefix cache. Median of `--reps`.

    python -m bench.documents [--model bundled|tiny] [--reps 5] [--sizes 1000,10000,100000] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from bench.common import RESULTS_DIR, median, run_meta
from bench.document_corpus import report_pdf

QUESTION = "What is the vault access code for the Zephyr archive?"
DIM = 256


def _app(engine, folder: Path) -> SimpleNamespace:
    """What the app's document code reads of `app.state`, on a fresh database in `folder`."""
    from app.doc_index.store import ChunkStore
    from app.storage import Storage
    from app.uploads.store import UploadStore

    storage = Storage(folder / "db.sqlite")
    return SimpleNamespace(state=SimpleNamespace(
        storage=storage, engine=engine, uploads=UploadStore(storage), chunks=ChunkStore(storage),
        document_embeddings=None))


def _attach(app: SimpleNamespace, cid: int, name: str, raw: bytes):
    from app.uploads.kinds import HEAD_BYTES, kind_of

    store = app.state.uploads
    store.folder.mkdir(parents=True, exist_ok=True)
    sha = hashlib.sha256(raw).hexdigest()
    store.blob(sha).write_bytes(raw)
    return store.add(cid, name, sha, kind_of(raw[:HEAD_BYTES], name).name, len(raw))[0]


def indexing(engine, folder: Path, pages: int, reps: int) -> dict:
    """Pages per second through `read_file` (a fresh database each run)."""
    from app.uploads.reading import read_file

    raw, times = report_pdf(pages), []
    for i in range(reps):
        app = _app(engine, folder / f"index-{pages}-{i}")
        cid = app.state.storage.create_conversation().id
        up = _attach(app, cid, "report.pdf", raw)
        t = time.perf_counter()
        read_file(app.state, up)
        times.append(time.perf_counter() - t)
        assert app.state.uploads.get(up.id).status == "ready"
        app.state.storage.close()
    return {"pages": pages, "seconds": median(times), "pages_per_s": pages / median(times),
            "all_s": times}


SYLLABLES = "ka lo mi nu pe ra si to vu ze ba de fi go hu".split()
VOCABULARY = [a + b + c for a in SYLLABLES for b in SYLLABLES for c in SYLLABLES]  # 3,375 words
ZIPF = [1 / (rank + 1) for rank in range(len(VOCABULARY))]  # word frequencies as in real text


def retrieval(engine, folder: Path, chunks: int, reps: int) -> dict:
    """ms per question over `chunks` synthetic chunks: BM25, cosine, fused."""
    from app.doc_index.answering import fused
    from app.doc_index.chunking import Chunk

    rng = random.Random(chunks)
    app = _app(engine, folder / f"retrieval-{chunks}")
    storage, store = app.state.storage, app.state.chunks
    storage._write("INSERT INTO files (sha256, kind, size, status, created) VALUES ('x', 'text', 0, 'ready', 0)")
    texts = [" ".join(rng.choices(VOCABULARY, ZIPF, k=150)) for _ in range(chunks)]
    t = time.perf_counter()
    ids = store.replace("x", [Chunk(text) for text in texts])
    insert_s = time.perf_counter() - t
    vectors = np.random.default_rng(0).standard_normal((chunks, DIM)).astype(np.float32)
    store.set_vectors(ids, vectors, "bench")
    questions = [" ".join(rng.choices(VOCABULARY[20:], ZIPF[20:], k=6)) + "?" for _ in range(reps * 4)]
    store.nearest(["x"], vectors[0], "bench")  # the matrix is built once, then cached
    bm25, cosine, both = [], [], []
    for q in questions:
        query = np.random.default_rng(len(q)).standard_normal(DIM).astype(np.float32)
        t = time.perf_counter()
        lexical = store.bm25(["x"], q)
        t1 = time.perf_counter()
        nearest = store.nearest(["x"], query, "bench")
        t2 = time.perf_counter()
        fused(lexical, nearest)
        t3 = time.perf_counter()
        bm25.append((t1 - t) * 1e3)
        cosine.append((t2 - t1) * 1e3)
        both.append((t3 - t) * 1e3)
    storage.close()
    return {"chunks": chunks, "bm25_ms": median(bm25), "cosine_ms": median(cosine),
            "fused_ms": median(both), "insert_s": insert_s}


async def _first_token(engine, messages) -> None:
    from app.submission import start

    params = engine.params({"max_tokens": 1, "temperature": 0})
    handle = await start(engine, messages, params, None)
    async for event in handle.stream():
        if event.kind == "done" or event.text:
            break
    handle.cancel()


def ttft(engine, folder: Path, reps: int) -> dict:
    """TTFT of QUESTION over the 300-page PDF against without documents."""
    from app.ui.prompt import engine_messages, prompt_with_documents
    from app.uploads.reading import read_file
    from engine import count_tokens

    app = _app(engine, folder / "ttft")
    storage = app.state.storage
    cid = storage.create_conversation().id
    up = _attach(app, cid, "report.pdf", report_pdf(300))
    read_file(app.state, up)
    ref = app.state.uploads.get(up.id).reference()
    with_docs, without, prompt_tokens = [], [], {}
    for i in range(reps):
        settings = {"system_prompt": f"Run {i} {time.time()}: answer from the documents."}
        for label, out in (("documents", with_docs), ("plain", without)):
            user = storage.add_message(cid, None, "user", QUESTION,
                                       attachments=[ref] if label == "documents" else None)
            t = time.perf_counter()
            messages = prompt_with_documents(app, settings, [user], 64) if label == "documents" \
                else engine_messages(settings, [user])
            asyncio.run(_first_token(engine, messages))
            out.append((time.perf_counter() - t) * 1e3)
            prompt_tokens[label] = count_tokens(engine, messages=messages)
    storage.close()
    return {"with_documents_ms": median(with_docs), "without_ms": median(without),
            "prompt_tokens": prompt_tokens, "all_with": with_docs, "all_without": without}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("bundled", "tiny"), default="bundled")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from engine import Engine

    if args.model == "tiny":
        from bench.shapes import SHAPES, build_folder

        engine = Engine(str(build_folder({**SHAPES["tiny"].config, "vocab_size": 49152}))).start()
    else:
        engine = Engine().start()
    results: dict = {"meta": run_meta(sys.argv), "model": engine.model_name}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            results["indexing"] = [indexing(engine, folder, pages, args.reps) for pages in (300, 1000)]
            for r in results["indexing"]:
                print(f"indexing {r['pages']} pages: {r['seconds']:.2f} s, {r['pages_per_s']:.0f} pages/s")
            results["retrieval"] = []
            for n in (int(s) for s in args.sizes.split(",")):
                r = retrieval(engine, folder, n, args.reps)
                results["retrieval"].append(r)
                print(f"retrieval at {n} chunks: BM25 {r['bm25_ms']:.1f} ms, cosine {r['cosine_ms']:.1f} ms, "
                      f"fused {r['fused_ms']:.1f} ms (indexed in {r['insert_s']:.1f} s)")
            r = results["ttft"] = ttft(engine, folder, args.reps)
            print(f"TTFT over the 300-page PDF: {r['with_documents_ms']:.0f} ms "
                  f"({r['prompt_tokens']['documents']} prompt tokens) vs without documents "
                  f"{r['without_ms']:.0f} ms ({r['prompt_tokens']['plain']} tokens)")
    finally:
        engine.stop()
    out = args.out or RESULTS_DIR / f"documents-cpu-{args.model}-{dt.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
