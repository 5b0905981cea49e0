"""Export and import over HTTP against a real server (real engine, real SQLite): downloads of one
conversation and of all, uploads that create copies equal to the originals, refusals of bad files,
and the Host / Origin guards on the new routes."""

import io
import json
import zipfile

import httpx
import pytest

from app.storage import export_conversation
from live_server import engine_serving


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with engine_serving(tmp_path_factory.mktemp("export")) as s:
        yield s


@pytest.fixture
def conversation(server):
    storage = server.storage
    conv = storage.create_conversation(model="smollm2", settings={"system_prompt": "Be brief."},
                                       title="Fruit & <veg>")
    q = storage.add_message(conv.id, None, "user", "Name a fruit.",
                            attachments=[{"name": "list.csv", "text": "a,b\n1,2", "tokens": 7}])
    storage.add_message(conv.id, q.id, "assistant", "A kumquat.")
    storage.add_message(conv.id, None, "user", "Name a vegetable.")  # a second version
    return conv


def upload(server, name: str, body: bytes, **headers) -> httpx.Response:
    return httpx.post(f"{server.url}/import", files={"file": (name, body)}, headers=headers,
                      follow_redirects=False)


def imported_id(response: httpx.Response) -> int:
    assert response.status_code == 303, response.text
    return int(response.headers["location"].rsplit("/", 1)[1])



def test_json_download_and_upload_round_trip(server, conversation):
    r = httpx.get(f"{server.url}/c/{conversation.id}/export.json")
    assert r.status_code == 200
    assert r.headers["content-disposition"].startswith("attachment;")
    exported = r.json()
    assert exported == export_conversation(server.storage, conversation.id)
    assert len(exported["messages"]) == 3
    copy = imported_id(upload(server, "fruit.json", r.content))
    assert copy != conversation.id
    assert export_conversation(server.storage, copy) == exported


def test_markdown_download_shows_the_branch(server, conversation):
    r = httpx.get(f"{server.url}/c/{conversation.id}/export.md")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/markdown")
    text = r.text
    assert text.startswith("# Fruit & <veg>")
    assert "Be brief." in text and "Name a vegetable." in text
    assert "A kumquat." not in text  # another branch: the shown one is the edited question


def test_archive_of_all_imports_every_conversation(server, conversation):
    before = {c.id for c in server.storage.list_conversations(limit=-1)}
    r = httpx.get(f"{server.url}/export.zip")
    assert r.status_code == 200
    with zipfile.ZipFile(io.BytesIO(r.content)) as archive:
        assert len(archive.namelist()) == len(before)
    imported_id(upload(server, "all.zip", r.content))
    after = {c.id for c in server.storage.list_conversations(limit=-1)}
    new = after - before
    assert len(new) == len(before)
    originals = sorted(json.dumps(export_conversation(server.storage, c), sort_keys=True) for c in before)
    copies = sorted(json.dumps(export_conversation(server.storage, c), sort_keys=True) for c in new)
    assert copies == originals


def test_openai_messages_list_imports_with_tool_calls(server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
                {"role": "assistant", "content": "It is sunny."}]
    cid = imported_id(upload(server, "chat.json", json.dumps(messages).encode()))
    path = server.storage.active_path(cid)
    assert [m.role for m in path] == ["user", "assistant", "tool", "assistant"]
    assert path[1].tool_calls == messages[1]["tool_calls"]
    assert path[2].tool_call_id == "call_1"


def test_plain_messages_list_opens_like_a_new_chat(server):
    messages = [{"role": "user", "content": "hello there, imported"}, {"role": "assistant", "content": "hi back"}]
    cid = imported_id(upload(server, "chat.json", json.dumps(messages).encode()))
    conv = server.storage.get_conversation(cid)
    assert conv.title == "hello there, imported"
    assert conv.model == httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    page = httpx.get(f"{server.url}/c/{cid}")
    assert page.status_code == 200, page.text
    assert "hello there, imported" in page.text and "hi back" in page.text
    home = httpx.get(f"{server.url}/", follow_redirects=True)
    assert home.status_code == 200 and home.url.path == f"/c/{cid}"


@pytest.mark.parametrize("settings", [{}, {"system_prompt": "old"}, {"sampling": None}])
def test_conversations_with_old_settings_render(server, settings):
    conv = server.storage.create_conversation(model=None, settings=settings, title="Old one")
    server.storage.add_message(conv.id, None, "user", "From an old version.")
    page = httpx.get(f"{server.url}/c/{conv.id}")
    assert page.status_code == 200, page.text
    assert "From an old version." in page.text


@pytest.mark.parametrize("body", [b"not json", b'{"messages": [{"role": "wizard", "content": "x"}]}',
                                  b"", b'{"title": "no messages"}'])
def test_bad_files_are_refused_and_import_nothing(server, body):
    before = len(server.storage.list_conversations(limit=-1))
    r = upload(server, "bad.json", body)
    assert r.status_code == 400
    assert "import" in r.text.lower()
    assert len(server.storage.list_conversations(limit=-1)) == before


def test_guards_cover_the_new_routes(server, conversation):
    evil_host = httpx.get(f"{server.url}/c/{conversation.id}/export.json",
                          headers={"Host": "evil.example"})
    assert evil_host.status_code == 400
    assert httpx.get(f"{server.url}/export.zip", headers={"Host": "evil.example"}).status_code == 400
    body = httpx.get(f"{server.url}/c/{conversation.id}/export.json").content
    before = len(server.storage.list_conversations(limit=-1))
    assert upload(server, "x.json", body, Origin="http://evil.example").status_code == 403
    assert upload(server, "x.json", body, **{"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert len(server.storage.list_conversations(limit=-1)) == before
