"""Attachments and conversations longer than the context, over real HTTP and WebSocket on a tiny
random-weight model with a short context: chips count tokens with the model's tokenizer, text and
PDF files are read, binary and too-large files are refused with a reason, a sent message stores its
documents inside the user turn (an edit of a later turn reuses them from the prefix cache), an
overflowing message is not recorded but answered once the user opts in to dropping old turns, and
the API's `"truncate": "oldest"` does the same for clients."""

import html
import json
import re

import openai
import pytest

from app.uploads.documents import with_documents
from live_server import engine_serving, new_conversation, openai_client, turn
from tiny_models import tiny_llama
from bench.document_corpus import pdf_file

pytestmark = pytest.mark.fast

CONTEXT = 256


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(tmp_path_factory, lm):
    with engine_serving(tmp_path_factory.mktemp("attach"), lm) as s:
        yield s


def pdf(text: str) -> bytes:
    """A one-page PDF showing `text` in Helvetica."""
    stream = f"BT /F1 12 Tf 20 100 Td ({text}) Tj ET".encode()
    objects = [b"<</Type/Catalog/Pages 2 0 R>>", b"<</Type/Pages/Kids[3 0 R]/Count 1>>",
               b"<</Type/Page/Parent 2 0 R/MediaBox[0 0 300 200]/Contents 4 0 R"
               b"/Resources<</Font<</F1 5 0 R>>>>>>",
               b"<</Length %d>>stream\n" % len(stream) + stream + b"\nendstream",
               b"<</Type/Font/Subtype/Type1/BaseFont/Helvetica>>"]
    return pdf_file(objects)


def chips(http, *files: tuple[str, bytes]) -> list[str]:
    r = http.post("/attachments", files=[("files", f) for f in files])
    assert r.status_code == 200
    return re.findall(r'<span class="chip.*?</span>\n?(?=<span class="chip|$)', r.text, re.S)


def payload(chip: str) -> str:
    return html.unescape(re.search(r'name="attachments" value="([^"]*)"', chip).group(1))


def socket_send(server, cid: int, message: dict) -> list[str]:
    """Send one action; collect fragments until the answer ends or a notice comes instead."""
    return turn(server, cid, ends=('id="send"', 'class="context-overflow"', 'class="notice-text"'),
                **message)


def test_chips_count_tokens_with_the_models_tokenizer(http, lm):
    text = "name,qty\napples,3\npears,5\n"
    csv, notes, from_pdf = chips(http, ("fruit.csv", text.encode()), ("notes.md", b"# Title\n\nSome *notes*."),
                                 ("paper.pdf", pdf("Hello from a PDF")))
    assert "fruit.csv" in csv
    assert f"{len(lm.tokenizer.encode(text))} tokens" in csv
    assert json.loads(payload(csv)) == {"name": "fruit.csv", "text": text,
                                        "tokens": len(lm.tokenizer.encode(text))}
    assert json.loads(payload(notes))["text"] == "# Title\n\nSome *notes*."
    assert json.loads(payload(from_pdf))["text"] == "Hello from a PDF"


def test_binary_empty_and_too_large_files_are_refused_with_a_reason(http):
    png, empty, big = chips(http, ("image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"),
                            ("empty.txt", b"   \n"), ("big.txt", b"word " * (CONTEXT * 2)))
    assert "refused" in png and "not a text file" in png and 'name="attachments"' not in png
    assert "refused" in empty and "empty" in empty
    assert "refused" in big and f"context of {CONTEXT} tokens" in big


def test_documents_are_stored_in_the_user_turn_and_reused_on_a_later_edit(http, server):
    cid = new_conversation(http, max_tokens=4)
    doc = payload(chips(http, ("facts.txt", b"The sky is blue. Grass is green. " * 4))[0])
    fragments = socket_send(server, cid, {"action": "send", "content": "Summarise.", "attachments": doc})
    assert "facts.txt" in "".join(fragments)  # the chip under the sent message
    user, answer = server.storage.active_path(cid)
    assert user.attachments == [json.loads(doc)] and user.content == "Summarise."
    with_doc = answer.prompt_tokens
    socket_send(server, cid, {"action": "send", "content": "And again."})
    second_user = server.storage.active_path(cid)[2]
    socket_send(server, cid, {"action": "edit", "message_id": second_user.id, "content": "Once more."})
    path = server.storage.active_path(cid)
    assert path[0].attachments == [json.loads(doc)]
    # The edited turn's prompt starts with the first turn, document included, from the cache.
    assert path[-1].cached_tokens >= with_doc


def test_an_overflowing_message_is_not_recorded_until_the_user_chooses(http, server):
    cid = new_conversation(http, max_tokens=4)
    http.post(f"/c/{cid}/settings", data={"max_tokens": "4", "system_prompt": "Be brief."})
    long_text = "Tell me about rivers and mountains and seas. " * 6
    for _ in range(3):  # fill most of the context
        socket_send(server, cid, {"action": "send", "content": long_text})
    before = len(server.storage.active_path(cid))
    fragments = socket_send(server, cid, {"action": "send", "content": long_text})
    notice = fragments[-1]
    assert "too long for the model" in notice and f"holds {CONTEXT}" in notice
    assert 'id="drop-oldest"' in notice and 'id="continue-new"' in notice
    assert len(server.storage.active_path(cid)) == before  # nothing recorded

    retry = json.loads(html.unescape(re.search(r"hx-vals='([^']*)'", notice).group(1)))
    assert retry["truncate"] == "oldest" and retry["content"] == long_text.strip()
    socket_send(server, cid, retry)
    answer = server.storage.active_path(cid)[-1]
    assert answer.role == "assistant" and answer.state == "done"
    assert answer.prompt_tokens + 4 <= CONTEXT
    assert server.storage.get_conversation(cid).settings["truncate"] == "oldest"
    socket_send(server, cid, {"action": "send", "content": long_text})  # now without asking
    assert server.storage.active_path(cid)[-1].state == "done"


def test_continue_in_a_new_conversation_keeps_settings_and_the_message(http, server):
    cid = new_conversation(http, max_tokens=4)
    http.post(f"/c/{cid}/settings", data={"max_tokens": "4", "system_prompt": "Be brief."})
    doc = payload(chips(http, ("a.txt", b"alpha beta"))[0])
    r = http.post(f"/c/{cid}/continue", data={"content": "Go on <please>", "attachments": json.dumps([doc])},
                  follow_redirects=False)
    assert r.status_code == 303
    new = int(r.headers["location"].rsplit("/", 1)[1])
    assert new != cid
    assert server.storage.get_conversation(new).settings["system_prompt"] == "Be brief."
    page = http.get(f"/c/{new}").text
    assert "Go on &lt;please&gt;</textarea>" in page
    assert "a.txt" in page and "tokens" in page
    socket_send(server, new, {"action": "send", "content": "Go on"})
    assert "draft" not in server.storage.get_conversation(new).settings


def test_api_truncate_oldest_is_opt_in(server):
    client = openai_client(server)
    model = client.models.list().data[0].id
    filler = "Tell me about rivers and mountains and seas. " * 6
    messages = [{"role": "system", "content": "Be brief."}]
    for _ in range(4):
        messages += [{"role": "user", "content": filler}, {"role": "assistant", "content": filler}]
    messages.append({"role": "user", "content": "Last question?"})
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(messages=messages, model=model, max_tokens=4)
    assert refused.value.code == "context_length_exceeded"
    answer = client.chat.completions.create(messages=messages, model=model, max_tokens=4,
                                            extra_body={"truncate": "oldest"})
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens + 4 <= CONTEXT
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(messages=messages, model=model, max_tokens=4,
                                       extra_body={"truncate": "middle"})
    assert bad.value.code == "invalid_value"


def test_documents_lead_the_user_turn():
    docs = [{"name": 'say "hi".txt', "text": "hello", "tokens": 1}]
    assert with_documents("Question?", docs) == \
        "<document name=\"say 'hi'.txt\">\nhello\n</document>\n\nQuestion?"
    assert with_documents("Question?", None) == "Question?"
