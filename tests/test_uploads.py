"""The one upload endpoint, over real HTTP on a tiny random-weight model: a file streamed to the
data folder by content (sha256, one copy however often it is attached), its kind told from its
content, read off the event loop into a chip that polls its progress and then shows its tokens, too
large / unsupported / empty files refused with a reason and nothing left behind, a message storing
the upload's id (not its text), and deleting the conversation deleting its uploads and their bytes."""

import hashlib
import time

import httpx
import pytest

from app.uploads import receiving
from live_server import engine_serving, new_conversation, turn
from tiny_models import tiny_llama

pytestmark = pytest.mark.fast

CONTEXT = 512


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(tmp_path_factory, lm):
    with engine_serving(tmp_path_factory.mktemp("uploads"), lm) as s:
        yield s


def folder(server):
    return server.app.state.uploads.folder


def post(http, cid: int, name: str, body, **headers) -> httpx.Response:
    return http.post(f"/c/{cid}/uploads", params={"name": name}, content=body, headers=headers)


def ready(http, cid: int, uid: int, timeout: float = 60) -> dict:
    """The upload once read (polled as the chip polls)."""
    deadline = time.monotonic() + timeout
    while True:
        got = http.get(f"/c/{cid}/uploads/{uid}").json()
        if got["status"] != "reading" or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_a_file_is_stored_by_content_read_off_the_loop_and_counted(http, server, lm):
    cid = new_conversation(http)
    text = "name,qty\napples,3\npears,5\n"
    r = post(http, cid, "../fruit\x07.csv", text.encode())
    assert r.status_code == 201
    up = r.json()
    assert {k: up[k] for k in ("kind", "name", "size")} == {"kind": "text", "name": "fruit.csv",
                                                            "size": len(text)}
    sha = hashlib.sha256(text.encode()).hexdigest()
    assert (folder(server) / sha).read_bytes() == text.encode()
    done = ready(http, cid, up["id"])
    assert done["status"] == "ready" and done["tokens"] == len(lm.tokenizer.encode(text))
    again = post(http, cid, "copy.csv", text.encode()).json()  # the same bytes: one file
    assert again["id"] != up["id"] and again["status"] == "ready"
    assert [p.name for p in folder(server).iterdir()].count(sha) == 1
    # The chip htmx swaps in: name, size, tokens, and the id the message form carries.
    chip = http.get(f"/c/{cid}/uploads/{up['id']}", headers={"HX-Request": "true"}).text
    assert "fruit.csv" in chip and f"{done['tokens']:,} tokens" in chip
    assert f'name="uploads" value="{up["id"]}"' in chip and "hx-trigger" not in chip


def test_kind_comes_from_the_content(http):
    cid = new_conversation(http)
    notes = post(http, cid, "notes.txt", b"# Title\n\nSome *notes*.").json()
    assert notes["kind"] == "markdown"
    pdf = post(http, cid, "paper.bin", b"%PDF-1.4 not really").json()
    assert pdf["kind"] == "pdf"
    assert ready(http, cid, pdf["id"])["status"] == "refused"  # the reason is on the chip
    chip = http.get(f"/c/{cid}/uploads/{pdf['id']}", headers={"HX-Request": "true"}).text
    assert "refused" in chip and "cannot be read" in chip and 'name="uploads"' not in chip


def test_unsupported_empty_and_too_large_files_are_refused_and_leave_nothing(http, server, monkeypatch):
    cid = new_conversation(http)
    before = sorted(p.name for p in folder(server).iterdir())
    # (a PNG is an image upload since app/uploads/image_uploads.py: an archive is unsupported)
    archive = post(http, cid, "files.zip", b"PK\x03\x04\x14\x00\x00\x00" + bytes(range(256)))
    assert archive.status_code == 415 and archive.json()["error"]["code"] == "unsupported_file"
    empty = post(http, cid, "empty.txt", b"")
    assert empty.status_code == 400 and empty.json()["error"]["field"] == "file"
    monkeypatch.setattr(receiving, "UPLOAD_MAX_BYTES", 100_000)
    declared = post(http, cid, "big.txt", b"x" * 100_001)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "file_too_large"
    streamed = post(http, cid, "big.txt", (b"y" * 50_000 for _ in range(4)))  # chunked: no length
    assert streamed.status_code == 413
    assert sorted(p.name for p in folder(server).iterdir()) == before  # no partial file left


def test_bodies_beyond_the_json_limit_stream_through(http, server):
    """The 8 MiB limit of JSON and form bodies does not apply: uploads have their own. (Binary
    bytes: the whole body arrives and is then refused for its kind, not its size.)"""
    cid = new_conversation(http)
    big = bytes(9 * 1024 * 1024)
    r = post(http, cid, "zeros.bin", big)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_file"


def test_cross_site_uploads_are_refused(http):
    cid = new_conversation(http)
    r = post(http, cid, "a.txt", b"hello", Origin="http://evil.example")
    assert r.status_code == 403
    assert post(http, 10**9, "a.txt", b"hello").status_code == 404


def test_a_message_stores_upload_ids_and_deleting_the_conversation_removes_them(http, server):
    cid = new_conversation(http)
    text = b"The meeting is on Tuesday at noon in room 4."
    up = post(http, cid, "meeting.txt", text).json()
    done = ready(http, cid, up["id"])
    assert done["status"] == "ready"
    turn(server, cid, action="send", content="When is the meeting?", uploads=[str(up["id"])])
    storage = server.storage
    user = next(m for m in storage.active_path(cid) if m.role == "user")
    assert user.attachments == [{"upload": up["id"], "name": "meeting.txt", "kind": "text",
                                 "size": len(text), "tokens": done["tokens"],
                                 "pages": None}]
    assert "text" not in user.attachments[0]
    sha = hashlib.sha256(text).hexdigest()
    assert (folder(server) / sha).exists()
    assert storage._query("SELECT count(*) FROM chunks WHERE sha256 = ?", (sha,))[0][0] > 0
    other = new_conversation(http)
    assert post(http, other, "same.txt", text).json()["status"] == "ready"  # the same file
    assert http.post(f"/c/{cid}/delete").status_code in (200, 204)
    assert (folder(server) / sha).exists()  # still used by the other conversation
    assert http.post(f"/c/{other}/delete").status_code in (200, 204)
    assert not (folder(server) / sha).exists()
    for table in ("files", "chunks"):  # the index goes with the last conversation using the file
        assert storage._query(f"SELECT count(*) FROM {table} WHERE sha256 = ?", (sha,))[0][0] == 0
    assert not storage._query("SELECT 1 FROM chunks_fts WHERE chunks_fts MATCH 'Tuesday'")


def test_a_file_still_being_read_cannot_be_sent(http, server):
    cid = new_conversation(http)
    store = server.app.state.uploads
    up, _ = store.add(cid, "slow.txt", "0" * 64, "text", 3)  # never read: stays "reading"
    frames = turn(server, cid, action="send", content="hi", uploads=[up.id])
    assert "still being read" in "".join(frames)


def test_with_an_api_key_uploads_need_it_and_foreign_hosts_are_refused(tmp_path, lm):
    with engine_serving(tmp_path, lm, api_key="sesame") as s:
        with httpx.Client(base_url=s.url, timeout=60) as client:
            cid = s.storage.create_conversation().id
            refused = post(client, cid, "a.txt", b"hello")
            assert refused.status_code == 401
            assert not folder(s).exists() or not any(folder(s).iterdir())  # nothing was stored
            assert post(client, cid, "a.txt", b"hello", Host="evil.example",
                        Authorization="Bearer sesame").status_code == 400
            ok = post(client, cid, "a.txt", b"hello", Authorization="Bearer sesame")
            assert ok.status_code == 201 and ok.json()["kind"] == "text"


def test_continuing_in_a_new_conversation_keeps_the_uploads_in_its_composer(http, server):
    cid = new_conversation(http, max_tokens=CONTEXT - 8)  # no message fits with this answer room
    text = b"Notes about the harbour and its cranes."
    up = ready(http, cid, post(http, cid, "harbour.txt", text).json()["id"])
    frames = turn(server, cid, ends=('class="context-overflow"',), action="send",
                  content="Summarise the notes.", uploads=[up["id"]])
    assert f'name="uploads" value="[{up["id"]}]"' in frames[-1]  # the notice's form carries it
    r = http.post(f"/c/{cid}/continue", data={"content": "Summarise the notes.", "attachments": "[]",
                                              "uploads": f"[{up['id']}]"}, follow_redirects=False)
    new = int(r.headers["location"].rsplit("/", 1)[1])
    page = http.get(f"/c/{new}").text
    carried = server.storage.get_conversation(new).settings["draft"]["uploads"]
    assert len(carried) == 1 and carried[0] != up["id"]
    assert f'name="uploads" value="{carried[0]}"' in page and "harbour.txt" in page
    assert http.get(f"/c/{new}/uploads/{carried[0]}").json()["status"] == "ready"
