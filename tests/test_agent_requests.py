"""What coding agents send, against a real server on 127.0.0.1 with a tiny random llama: Claude
Code's per-request billing line never splits the prefix cache (every later round of a session
read from it), documents (PDF, text) and images wherever the clients put them, the error each
client compacts on when a prompt outgrows the context, the context length in the model lists."""

import base64
import hashlib
import io
import json
import random
import re
import time

import httpx
import pytest

from app.api import documents as api_documents
from app.api.prompt_noise import without_noise, without_noise_blocks
from bench.document_corpus import FACT, FILLER, pdf_of_pages
from event_loop import run
from live_server import anthropic_client, openai_client, tiny_serving
from tiny_models import tiny_llama

pytestmark = pytest.mark.fast

CONTEXT = 4096
TOOLS = [{"name": "Read", "description": "Read a file from the disk.",
          "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                           "required": ["file_path"]}},
         {"name": "Bash", "description": "Run a shell command.",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]}}]
SYSTEM = ("You are a coding agent working in the user's repository. Read before you edit, keep "
          "changes small, run the tests, and report what you did in a few lines. ") * 30


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    lm = tiny_llama(max_position_embeddings=CONTEXT)
    with tiny_serving(tmp_path_factory.mktemp("agents"), lm) as s:
        yield s


def billing(entrypoint: str = "cli") -> str:
    """Claude Code's billing line, its `cch` new on every request (interactive mode)."""
    return (f"x-anthropic-billing-header: cc_version=2.1.332.f0c; cc_entrypoint={entrypoint}; "
            f"cch={random.randrange(16 ** 5):05x};")


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def pdf(*lines: str) -> bytes:
    return pdf_of_pages([list(lines)])


def session_rounds(system_of) -> list[dict]:
    """Four rounds of a Claude Code-like session: each request is the one before plus the tool
    call it answered and the tool's result (the third a PDF, as Claude Code's Read gives one)."""
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>Today's date is 2026-12-06.</system-reminder>"},
        {"type": "text", "text": "Summarise this project and its notes."}]}]
    results = [[{"type": "text", "text": "1\t# tides\n2\tPredicts tide heights."}],
               "tides/model.py\ntides/cli.py",
               [{"type": "text", "text": "PDF file read: notes.pdf"},
                {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                                "data": b64(pdf("The gauge was recalibrated."))}}]]
    calls = [("Read", {"file_path": "README.md"}), ("Bash", {"command": "ls tides"}),
             ("Read", {"file_path": "notes.pdf"})]
    rounds = []
    for k in range(4):
        rounds.append({"model": "claude-opus-5-5", "max_tokens": 4, "tools": TOOLS,
                       "system": system_of(), "messages": [dict(m) for m in messages],
                       "temperature": 0, "metadata": {"user_id": f"session-{k}"}})
        if k < 3:
            name, args = calls[k]
            messages.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": f"toolu_{k}", "name": name, "input": args}]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{k}", "content": results[k]}]})
    return rounds


def cached_fractions(server, rounds: list[dict]) -> list[float]:
    out = []
    for body in rounds:
        r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=120)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        out.append(usage["cache_read_input_tokens"] /
                   (usage["input_tokens"] + usage["cache_read_input_tokens"]))
    return out


@pytest.mark.slow  # four rounds of a session, twice: seconds of prefill, the second tier
@pytest.mark.parametrize("form", ["blocks", "string"])
def test_a_changing_billing_line_leaves_every_later_round_cached(server, form):
    def system():
        if form == "blocks":  # as Claude Code sends it: the line is a text block of its own
            return [{"type": "text", "text": billing()},
                    {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
        return f"{billing()}\n{SYSTEM}"

    fractions = cached_fractions(server, session_rounds(system))
    assert all(f >= 0.9 for f in fractions[1:]), fractions


@pytest.mark.slow  # four cold rounds by design
def test_per_request_noise_it_does_not_know_makes_rounds_cold(server):
    """The control: a value that changes per request at the front, under another name, is kept
    (it might mean something), and every round is cold: the test above can fail."""
    def system():
        return [{"type": "text", "text": billing().replace("x-anthropic-billing", "x-other")},
                {"type": "text", "text": SYSTEM}]

    fractions = cached_fractions(server, session_rounds(system))
    assert all(f < 0.2 for f in fractions[1:]), fractions


def test_the_responses_instructions_drop_the_billing_line(server):
    body = {"model": "gpt-5", "max_output_tokens": 4, "temperature": 0, "store": False,
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "List the files."}]}]}
    usages = []
    for _ in range(2):
        r = httpx.post(f"{server.url}/v1/responses", timeout=120,
                       json={**body, "instructions": f"{billing()}\n{SYSTEM}"})
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    second = usages[1]
    assert second["input_tokens_details"]["cached_tokens"] >= 0.9 * second["input_tokens"]


def test_noise_lines_and_blocks():
    line = billing()
    assert without_noise(f"{line}\nYou are Claude.") == "You are Claude."
    assert without_noise(f"  {line.upper()}\nA\n") == "A\n"
    text = "Explain x-anthropic-billing-header: in the docs."  # not at a line's start: kept
    assert without_noise(text) is text
    blocks = [{"type": "text", "text": line}, {"type": "text", "text": f"{line}\nKeep me"},
              {"type": "image"}]
    assert without_noise_blocks(blocks) == [{"type": "text", "text": "Keep me"}, {"type": "image"}]


@pytest.mark.slow  # a whole round of the session, cold: the second tier
def test_count_tokens_counts_as_the_request_renders(server):
    """With the billing line and a PDF: count_tokens equals what the request itself reports."""
    client = anthropic_client(server)
    body = session_rounds(lambda: [{"type": "text", "text": billing()},
                                   {"type": "text", "text": SYSTEM}])[3]
    counted = client.messages.count_tokens(model=body["model"], system=body["system"],
                                           messages=body["messages"], tools=body["tools"])
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=120).json()["usage"]
    assert counted.input_tokens == r["input_tokens"] + r["cache_read_input_tokens"]


def _count(server, content, system: str = "Be brief.") -> int:
    r = httpx.post(f"{server.url}/v1/messages/count_tokens", timeout=120, json={
        "model": "m", "system": system, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_a_pdf_document_block_reads_as_its_text_in_a_document_tag(server):
    raw = pdf("Tide tables for Harbor Point.", "High water at 06:12.")
    block = {"type": "document", "title": "tides.pdf",
             "source": {"type": "base64", "media_type": "application/pdf", "data": b64(raw)}}
    question = {"type": "text", "text": "When is high water?"}
    text = api_documents.with_documents(
        "", [{"name": "tides.pdf", "text": "Tide tables for Harbor Point.\nHigh water at 06:12."}])
    assert _count(server, [block, question]) == _count(server, text + "When is high water?")
    msg = anthropic_client(server).messages.create(
        model="m", max_tokens=3, messages=[{"role": "user", "content": [block, question]}])
    assert msg.stop_reason in ("max_tokens", "end_turn")
    # text and content sources read the same way
    for source in ({"type": "text", "media_type": "text/plain", "data": "Low water at noon."},
                   {"type": "content", "content": [{"type": "text", "text": "Low water at noon."}]}):
        plain = api_documents.with_documents("", [{"name": "t", "text": "Low water at noon."}])
        assert _count(server, [{"type": "document", "title": "t", "source": source}]) == \
            _count(server, plain)


def test_a_pdf_inside_a_tool_result_is_read_once(server, monkeypatch):
    from app.doc_index import indexing

    reads = []
    real = indexing.pdf_pages
    monkeypatch.setattr(indexing, "pdf_pages", lambda *a, **k: reads.append(1) or real(*a, **k))
    raw = pdf("Station notes: read", f"gauge {random.random()}")  # a file never sent before
    body = {"model": "m", "max_tokens": 3, "tools": TOOLS, "messages": [
        {"role": "user", "content": "Read notes.pdf"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read",
                                           "input": {"file_path": "notes.pdf"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "PDF file read"},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                            "data": b64(raw)}}]}]}]}
    for _ in range(2):
        r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=120)
        assert r.status_code == 200, r.text
    assert reads == [1]  # the second round found it read, by its sha256
    row = server.storage._query("SELECT status, meta FROM files WHERE sha256 = ?",
                                (hashlib.sha256(raw).hexdigest(),))[0]
    assert row["status"] == "ready" and json.loads(row["meta"])["source"] == "api"


def test_openai_chat_file_and_responses_input_file(server):
    url = "data:application/pdf;base64," + b64(pdf("Harbor Point tide tables."))
    chat = openai_client(server).chat.completions.create(model=server.model, max_tokens=3,
                                                         messages=[{"role": "user", "content": [
        {"type": "file", "file": {"filename": "tides.pdf", "file_data": url}},
        {"type": "text", "text": "Summarise."}]}])
    assert chat.choices[0].finish_reason in ("length", "stop")
    plain = _count(server, api_documents.with_documents(
        "", [{"name": "tides.pdf", "text": "Harbor Point tide tables."}]) + "Summarise.", "")
    response = openai_client(server).responses.create(model="gpt-5", max_output_tokens=3,
                                                      input=[{"role": "user", "content": [
        {"type": "input_file", "filename": "tides.pdf", "file_data": url},
        {"type": "input_text", "text": "Summarise."}]}])
    assert response.status == "incomplete" and response.usage.input_tokens > 10
    # a function call's output may carry a file too
    r = httpx.post(f"{server.url}/v1/responses", timeout=120, json={
        "model": "gpt-5", "max_output_tokens": 3, "input": [
            {"role": "user", "content": "Read it"},
            {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [
                {"type": "input_file", "filename": "tides.pdf", "file_data": url}]}]})
    assert r.status_code == 200, r.text
    assert plain > 10


def test_a_document_larger_than_half_the_context_is_given_by_retrieval(server):
    """An API request has no conversation: the file is indexed by its sha256, the question is the
    request's last user text, and the excerpts that answer it go where the file was."""
    pages = [[f"Report section {n}.", FILLER] for n in range(1, 61)]
    pages[40].append(FACT)  # one page of sixty holds the answer
    raw = pdf_of_pages(pages)
    messages = [{"role": "user", "content": [
        api_documents.from_base64(b64(raw), "application/pdf", "report.pdf", "messages[0]"),
        {"type": "text", "text": "What is the vault access code for the Zephyr archive?"}]}]
    state = server.app.state
    out = run(api_documents.read_documents(state, messages))
    text = out[0]["content"]
    whole = state.uploads.text(hashlib.sha256(raw).hexdigest())
    assert isinstance(text, str) and FACT in text and "[page 41]" in text
    assert len(whole) > 2 * CONTEXT and len(text) < len(whole) / 2  # excerpts, not the report
    again = run(api_documents.read_documents(state, messages))
    assert again == out  # the same prompt every round: the prefix cache holds


def test_bad_documents_are_clear_4xx(server, monkeypatch):
    def ask(block):
        return httpx.post(f"{server.url}/v1/messages", timeout=60, json={
            "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [block]}]})

    def doc(source):
        return {"type": "document", "source": source}

    cases = [(doc({"type": "url", "url": "https://example.com/a.pdf"}), "URL"),
             (doc({"type": "base64", "media_type": "application/zip", "data": "UEsDBA=="}),
              "application/zip"),
             (doc({"type": "base64", "media_type": "application/pdf",
                   "data": b64(b"%PDF-1.4 not really a pdf")}), "cannot be read"),
             (doc({"type": "base64", "media_type": "application/pdf", "data": ""}), "empty"),
             (doc({"type": "file", "file_id": "file_1"}), "file id")]
    for block, words in cases:
        r = ask(block)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    monkeypatch.setattr(api_documents, "MAX_DOCUMENT_BYTES", 100)
    r = ask(doc({"type": "text", "media_type": "text/plain", "data": "x" * 200}))
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    many = [doc({"type": "text", "media_type": "text/plain", "data": f"d{i}"}) for i in range(9)]
    r = httpx.post(f"{server.url}/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": many}]})
    assert r.status_code == 400 and "limit is 8" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={"messages": [
        {"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "document_url_not_allowed"


def test_an_image_in_a_tool_result_on_a_text_model_names_the_vision_models(server):
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 24), (30, 90, 160)).save(out, format="PNG")
    r = httpx.post(f"{server.url}/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": 2, "tools": TOOLS, "messages": [
            {"role": "user", "content": "Look at the diagram"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read",
                                               "input": {"file_path": "d.png"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": b64(out.getvalue())}}]}]}]})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "cannot see images" in r.json()["error"]["message"]


def test_a_prompt_over_the_context_gets_the_error_each_client_compacts_on(server):
    long = "word " * (CONTEXT + 500)
    start = time.monotonic()
    r = httpx.post(f"{server.url}/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": 32000, "stream": True,
        "messages": [{"role": "user", "content": long}]})
    took = time.monotonic() - start
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    message = r.json()["error"]["message"]
    n, m = (int(x) for x in re.fullmatch(
        r"prompt is too long: (\d+) tokens > (\d+) maximum", message).groups())
    assert n > m == CONTEXT
    assert took < 5, took  # refused at once, never a stall (the ≤ 1 s goal: bench.agents)
    from anthropic import BadRequestError

    with pytest.raises(BadRequestError, match="prompt is too long"):
        anthropic_client(server).messages.create(model="m", max_tokens=10,
                                                  messages=[{"role": "user", "content": long}])
    for path, body in (("/v1/responses", {"model": "gpt-5", "input": long, "stream": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}],
                                                 "stream": True})):
        r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_the_model_lists_report_the_context_length(server):
    listed = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert next(m for m in listed if m["id"] == server.model)["context_length"] == CONTEXT
    one = httpx.get(f"{server.url}/v1/models/{server.model}").json()
    assert one["context_length"] == CONTEXT
    shown = httpx.post(f"{server.url}/api/show", json={"model": server.model}).json()
    assert shown["model_info"]["llama.context_length"] == CONTEXT
