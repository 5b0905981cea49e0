"""Documents larger than the context, over real HTTP and the chat socket on tiny random-weight
models: a generated 300-page PDF with one fact on page 217 and decoys elsewhere is uploaded once;
a question retrieves and cites page 217 (BM25 alone, and fused with a tiny embedding model's
vectors); the prompt never exceeds the context whatever room the answer takes; the chunks used are
stored on the turn (a regeneration and a later turn reuse them, so earlier turns stay
byte-identical); citations open the chunk's text, escaped; a 20 MB document indexes with progress
while `/health` keeps answering."""

import html
import json
import re
import time

import pytest

from app.doc_index import answering
from app.uploads.pdf_text import pdf_pages
from app.ui.prompt import prompt_with_documents
from engine import count_tokens
from live_server import engine_serving, new_conversation, turn
from loop_probe import STALL_S, health_probe
from bench.document_corpus import FACT, FACT_PAGE, report_pdf
from tiny_models import tiny_llama, tiny_qwen3_embedding_folder

pytestmark = pytest.mark.fast

CONTEXT = 2048
QUESTION = "What is the vault access code for the Zephyr archive?"


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def report():
    return report_pdf(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory, lm):
    with engine_serving(tmp_path_factory.mktemp("docs"), lm) as s:
        yield s


def upload(http, cid: int, name: str, body: bytes, timeout: float = 120) -> dict:
    up = http.post(f"/c/{cid}/uploads", params={"name": name}, content=body).json()
    deadline = time.monotonic() + timeout
    while up["status"] == "reading" and time.monotonic() < deadline:
        time.sleep(0.1)
        up = http.get(f"/c/{cid}/uploads/{up['id']}").json()
    assert up["status"] == "ready", up
    return up


def ask(server, cid: int, up: dict, question: str) -> None:
    turn(server, cid, action="send", content=question, uploads=[up["id"]])


def pages_used(server, cid: int) -> list[int | None]:
    user = [m for m in server.storage.active_path(cid) if m.role == "user"][-1]
    return [c.page for c in answering.citations(server.storage, user)]


def test_bm25_retrieves_and_cites_page_217_within_the_context(http, server, report):
    cid = new_conversation(http, max_tokens=8)
    up = upload(http, cid, "report.pdf", report)
    assert up["pages"] == 300 and up["tokens"] > CONTEXT  # too large to go in whole
    ask(server, cid, up, QUESTION)
    used = pages_used(server, cid)
    assert used[0] == FACT_PAGE and len(used) > 1  # the fact first, then other chunks that fit
    answer = server.storage.active_path(cid)[-1]
    assert answer.prompt_tokens + 8 <= CONTEXT
    page = http.get(f"/c/{cid}").text
    citation = re.search(r'<li class="citation".*?</li>', page, re.S).group(0)
    assert "report.pdf" in citation and f"p. {FACT_PAGE}" in citation
    assert FACT in html.unescape(citation)  # the citation opens the chunk's text


def test_the_prompt_never_exceeds_the_context(http, server, report):
    """Whatever room the answer takes, the retrieved chunks fill only what is left."""
    cid = new_conversation(http)
    up = upload(http, cid, "report.pdf", report)  # the same bytes as before: indexed once
    ref = server.app.state.uploads.get(up["id"]).reference()
    engine, chosen = server.app.state.engine, []
    for max_tokens in (64, CONTEXT // 2, CONTEXT - 200, CONTEXT - 100):  # the last: no chunk fits
        user = server.storage.add_message(cid, None, "user", QUESTION, attachments=[ref])
        messages = prompt_with_documents(server.app.state, {}, [user], max_tokens)
        assert count_tokens(engine, messages=messages) + max_tokens <= CONTEXT
        chosen.append(len(server.storage.get_message(user.id).retrieved))
    assert chosen == sorted(chosen, reverse=True) and chosen[0] > chosen[-1], chosen  # less room, fewer


def test_chunks_used_are_kept_for_regeneration_and_later_turns(http, server, report):
    cid = new_conversation(http, max_tokens=4)
    up = upload(http, cid, "report.pdf", report)
    ask(server, cid, up, QUESTION)
    first_user, first_answer = server.storage.active_path(cid)
    turn(server, cid, action="regenerate", message_id=first_answer.id)
    again = server.storage.active_path(cid)[-1]
    assert server.storage.get_message(first_user.id).retrieved == first_user.retrieved
    assert again.prompt_tokens == first_answer.prompt_tokens and again.cached_tokens > 0
    turn(server, cid, action="send", content="And when does it change?")
    assert server.storage.get_message(first_user.id).retrieved == first_user.retrieved
    last = server.storage.active_path(cid)[-1]
    assert last.cached_tokens >= again.prompt_tokens - 1  # the first turn came from the cache


def test_citations_show_chunk_text_escaped(http, server):
    cid = new_conversation(http, max_tokens=4)
    hostile = "# Notes\n\n" + "\n\n".join(
        f"Paragraph {i} about gardening and soil and water." for i in range(600))
    hostile += "\n\n## Trap\n\nThe <img src=x onerror=alert(1)> secret password is swordfish."
    up = upload(http, cid, "notes.md", hostile.encode())
    ask(server, cid, up, "What is the secret password?")
    page = http.get(f"/c/{cid}").text
    citations = re.search(r'<ol class="citations".*?</ol>', page, re.S).group(0)
    assert "Trap" in citations and "&lt;img src=x onerror=alert(1)&gt;" in citations
    assert "<img" not in citations


@pytest.mark.slow  # 20 MB to read and index: seconds by design, the second tier
def test_a_20_mb_document_indexes_with_progress_while_health_answers(http, server):
    cid = new_conversation(http)
    body = "".join(f"Paragraph {i}. The committee reviewed the figures for region {i % 97}.\n\n"
                   for i in range(300_000)).encode()
    assert len(body) >= 20_000_000
    seen = []
    with health_probe(server.url) as probe:
        up = http.post(f"/c/{cid}/uploads", params={"name": "big.txt"}, content=body).json()
        deadline = time.monotonic() + 240
        while up["status"] == "reading" and time.monotonic() < deadline:
            seen.append((up["stage"], up["progress"]))
            time.sleep(0.2)
            up = http.get(f"/c/{cid}/uploads/{up['id']}").json()
    assert up["status"] == "ready" and up["summary"].startswith("about ")
    assert any(stage == "indexing" and 0 < fraction < 1 for stage, fraction in seen), seen
    assert len(probe.latencies) > 5 and probe.worst < STALL_S


def test_hybrid_retrieval_with_a_tiny_embedding_model(tmp_path_factory, lm, report):
    embedder = str(tiny_qwen3_embedding_folder())
    with engine_serving(tmp_path_factory.mktemp("hybrid"), lm, document_embeddings=embedder) as s:
        import httpx

        with httpx.Client(base_url=s.url, timeout=60) as http:
            cid = new_conversation(http, max_tokens=4)
            up = upload(http, cid, "report.pdf", report)
            sha = s.app.state.uploads.get(up["id"]).sha256
            assert s.app.state.chunks.has_vectors([sha], embedder)
            ask(s, cid, up, QUESTION)
            assert FACT_PAGE in pages_used(s, cid)


def test_exports_carry_the_documents_as_the_model_read_them_and_import_back(http, server, report):
    cid = new_conversation(http, max_tokens=4)
    up = upload(http, cid, "report.pdf", report)
    ask(server, cid, up, QUESTION)
    data = http.get(f"/c/{cid}/export.json").json()
    user = data["messages"][0]
    assert [a["name"] for a in user["attachments"]] == ["report.pdf"]
    assert FACT in user["attachments"][0]["text"] and "upload" not in user["attachments"][0]
    assert user["sources"][0]["page"] == FACT_PAGE and FACT in user["sources"][0]["text"]
    markdown = http.get(f"/c/{cid}/export.md").text
    assert f"Source: report.pdf, p. {FACT_PAGE}" in markdown and FACT in markdown
    r = http.post("/import", files={"file": ("c.json", json.dumps(data).encode(), "application/json")})
    assert r.status_code == 303, r.text  # to the imported copy
    copy = int(r.headers["location"].rsplit("/", 1)[1])
    imported = server.storage.active_path(copy)[0]
    assert imported.attachments == [{k: user["attachments"][0][k] for k in ("name", "text", "tokens")}]


def test_a_question_nothing_matches_retrieves_nothing_and_still_answers(http, server, report):
    cid = new_conversation(http, max_tokens=4)
    up = upload(http, cid, "report.pdf", report)
    ask(server, cid, up, "Qwxyz plorf?")
    user, answer = server.storage.active_path(cid)
    assert user.retrieved == [] and answer.state == "done"
    assert 'class="citations"' not in http.get(f"/c/{cid}").text


def test_a_pdf_reports_its_pages_as_they_are_read():
    seen = []
    pages = pdf_pages(report_pdf(40), progress=seen.append)
    assert len(pages) == 40 and FACT not in "".join(pages)
    assert seen == sorted(seen) and len(seen) >= 20 and seen[-1] == 1.0
