"""The UI's pages, fragments and chat socket over real HTTP and WebSocket (no browser)."""

import json
import re
import time

import pytest
from websockets.sync.client import connect

from app.storage import Storage
from live_server import engine_serving, frames_until, new_conversation, turn, ws_url


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with engine_serving(tmp_path_factory.mktemp("ui")) as s:
        yield s


def test_index_redirects_to_a_conversation_and_new_chats_reuse_an_empty_one(http):
    first = http.get("/", follow_redirects=False)
    assert first.status_code == 303
    again = http.post("/conversations", data={}, follow_redirects=False)
    assert again.headers["location"] == first.headers["location"]  # still empty: reused
    page = http.get(first.headers["location"])
    assert page.status_code == 200 and 'ws-connect="/c/' in page.text
    assert http.get("/c/999999").status_code == 404


def test_every_asset_the_page_links_is_served(http):
    """Stylesheet, scripts and the icon (without one, browsers ask for /favicon.ico and log a 404)."""
    page = http.get("/", follow_redirects=True).text
    assets = re.findall(r'(?:href|src)="(/static/[^"]+)"', page)
    assert any("favicon" in a for a in assets) and len(assets) >= 4
    for asset in assets:
        assert http.get(asset).status_code == 200, asset


def test_new_chat_copies_the_settings_of_the_current_one(http, server):
    cid = new_conversation(http, max_tokens=7)
    http.post(f"/c/{cid}/settings", data={"max_tokens": "7", "system_prompt": "Be terse."})
    server.storage.add_message(cid, None, "user", "not empty any more")
    r = http.post("/conversations", data={"from": str(cid)}, follow_redirects=False)
    copy = server.storage.get_conversation(int(r.headers["location"].rsplit("/", 1)[1]))
    assert copy.id != cid
    assert copy.settings["sampling"]["max_tokens"] == 7 and copy.settings["system_prompt"] == "Be terse."


def test_settings_validation_and_presets(http, server):
    cid = new_conversation(http)
    r = http.post(f"/c/{cid}/settings", data={"temperature": "warm", "top_p": "0"})
    assert "Temperature must be a number." in r.text and 'value="warm"' in r.text
    r = http.post(f"/c/{cid}/settings", data={"top_p": "0"})
    assert "top_p must be in (0, 1]" in r.text
    assert server.storage.get_conversation(cid).settings["sampling"]["max_tokens"] == 4  # unchanged
    r = http.post(f"/c/{cid}/settings/preset", data={"preset": "recommended", "system_prompt": "Hi"})
    settings = server.storage.get_conversation(cid).settings
    assert settings["preset"] == "recommended" and settings["system_prompt"] == "Hi"
    assert settings["sampling"] == {"max_tokens": 4}  # the rest from the model's defaults
    assert "0.2: mlxchat&#39;s preset for this model" in r.text
    assert "Unknown preset" in http.post(f"/c/{cid}/settings/preset", data={"preset": "wild"}).text


def test_max_tokens_is_bounded_by_the_models_context_length(http, server):
    """The bound a request meets (prompt + max_tokens must fit the context), not any number."""
    cid = new_conversation(http)
    limit = server.app.state.engine.model.context_length
    huge = "9" * 30
    r = http.post(f"/c/{cid}/settings", data={"max_tokens": huge})
    assert f"Max tokens must be at most {limit}" in r.text and f'value="{huge}"' in r.text
    assert server.storage.get_conversation(cid).settings["sampling"]["max_tokens"] == 4
    r = http.post(f"/c/{cid}/settings", data={"max_tokens": str(limit + 1)})
    assert "must be at most" in r.text
    assert "Saved." in http.post(f"/c/{cid}/settings", data={"max_tokens": str(limit)}).text


def test_a_preset_keeps_the_values_no_preset_sets(http, server):
    """A preset sets sampling values; the user's max tokens and seed stay (as the panel shows them)."""
    cid = new_conversation(http, max_tokens=9)
    http.post(f"/c/{cid}/settings", data={"max_tokens": "9", "seed": "5", "temperature": "0.5"})
    http.post(f"/c/{cid}/settings/preset", data={"preset": "greedy"})
    assert server.storage.get_conversation(cid).settings["sampling"] == \
        {"temperature": 0.0, "max_tokens": 9, "seed": 5}
    r = http.post(f"/c/{cid}/settings/preset",  # typed, not yet saved: kept too
                  data={"preset": "recommended", "max_tokens": "12", "seed": "5", "temperature": "1"})
    assert server.storage.get_conversation(cid).settings["sampling"] == {"max_tokens": 12, "seed": 5}
    assert 'name="max_tokens" value="12"' in r.text
    http.post(f"/c/{cid}/settings/preset", data={"preset": "greedy", "max_tokens": "", "seed": "x"})
    assert server.storage.get_conversation(cid).settings["sampling"] == {"temperature": 0.0, "seed": 5}


def test_saving_settings_keeps_the_opt_in_to_dropping_old_turns(http, server):
    cid = new_conversation(http)
    turn(server, cid, action="send", content="Hi", truncate="oldest")
    assert server.storage.get_conversation(cid).settings["truncate"] == "oldest"
    http.post(f"/c/{cid}/settings", data={"temperature": "0", "max_tokens": "5"})
    http.post(f"/c/{cid}/settings/preset", data={"preset": "greedy"})
    assert server.storage.get_conversation(cid).settings["truncate"] == "oldest"


def test_send_streams_then_finalises_with_statistics(http, server):
    cid = new_conversation(http)
    fragments = turn(server, cid, action="send", content="Say hello.")
    assert 'hx-swap-oob="beforeend"' in fragments[0] and "Say hello." in fragments[0]
    assert 'id="stop"' in fragments[0]
    assert any('-body" hx-swap-oob="innerHTML"' in f for f in fragments[1:-1])  # streamed
    final = fragments[-1]
    assert 'data-state="done"' in final and re.search(r"reused \d+ of \d+ prompt tokens", final)
    user, answer = server.storage.active_path(cid)
    assert user.content == "Say hello." and answer.state == "done" and answer.content
    assert answer.completion_tokens == 4 and answer.sampling["max_tokens"] == 4
    assert server.storage.get_conversation(cid).title == "Say hello."
    listing = http.get("/conversations", params={"q": "say hel"}).text
    assert "Say hello." in listing


def _leave_after_the_first_token(server, cid: int, content: str) -> None:
    with connect(ws_url(server, cid), origin=server.url) as ws:
        ws.recv(timeout=60)
        ws.send(json.dumps({"action": "send", "content": content}))
        frames_until(ws, '-body" hx-swap-oob="innerHTML"')


def test_a_reload_mid_answer_keeps_it_going(http, server):
    """The page goes (a reload, a dropped connection) and comes back: the answer goes on."""
    cid = new_conversation(http, max_tokens=48)
    _leave_after_the_first_token(server, cid, "Tell me a long story about a dragon.")
    with connect(ws_url(server, cid), origin=server.url) as ws:
        assert 'id="stop"' in ws.recv(timeout=60)  # the state it finds: still answering
        frames_until(ws, 'id="send"')
    answer = server.storage.active_path(cid)[-1]
    assert answer.state == "done" and answer.finish_reason in ("length", "stop")


def test_an_answer_nobody_comes_back_to_stops(http, server, monkeypatch):
    monkeypatch.setattr("app.ui.chat_socket.RECONNECT_GRACE_S", 0.2)
    cid = new_conversation(http, max_tokens=400)
    _leave_after_the_first_token(server, cid, "Tell me a long story about a dragon.")
    for _ in range(600):
        answer = server.storage.active_path(cid)[-1]
        if answer.state != "streaming":
            break
        time.sleep(0.1)
    assert (answer.state, answer.finish_reason) == ("stopped", "cancelled")
    assert answer.completion_tokens < 400


def test_regenerate_edit_and_version_switching(http, server):
    cid = new_conversation(http)
    turn(server, cid, action="send", content="Name a fruit.")
    user, first = server.storage.active_path(cid)
    turn(server, cid, action="regenerate", message_id=first.id)
    _, second = server.storage.active_path(cid)
    assert second.id != first.id and second.parent_id == user.id

    page = http.post(f"/c/{cid}/select/{first.id}").text
    assert f'id="m-{first.id}"' in page and "1/2" in page

    # Only the last user message can be edited.
    assert 'class="edit-form"' in http.get(f"/c/{cid}/m/{user.id}/edit").text
    fragments = turn(server, cid, action="edit", message_id=user.id, content="Name a vegetable.")
    assert 'id="messages"' in fragments[0] and "Name a vegetable." in fragments[0]
    edited, answer = server.storage.active_path(cid)
    assert edited.parent_id is None and edited.id != user.id and answer.state == "done"
    assert [m.id for m in server.storage.siblings(edited)] == [user.id, edited.id]


def test_bad_actions_get_a_notice_and_change_nothing(http, server):
    cid = new_conversation(http)
    other = server.storage.create_conversation().id
    foreign = server.storage.add_message(other, None, "user", "elsewhere")
    for message, notice in [
        ({"action": "send", "content": "   "}, "Type a message first."),
        ({"action": "edit", "message_id": foreign.id, "content": "x"}, "not in this conversation"),
        ({"action": "regenerate", "message_id": "nope"}, "not in this conversation"),
        ({"action": "dance"}, "Unknown action"),
    ]:
        fragments = turn(server, cid, **message)
        assert len(fragments) == 1 and notice in fragments[0]
    assert server.storage.active_path(cid) == []


def test_rename_delete_and_storage_on_disk(http, server):
    cid = new_conversation(http)
    r = http.post(f"/c/{cid}/rename", headers={"HX-Prompt": "My \t  title",
                                               "HX-Current-URL": f"{server.url}/c/{cid}"})
    assert "My title" in r.text and 'id="chat-title" hx-swap-oob="true"' in r.text
    evil = http.post(f"/c/{cid}/rename", headers={"HX-Prompt": "<script>alert(1)</script>"})
    assert "<script>" not in evil.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in evil.text
    assert "<script>alert" not in http.get(f"/c/{cid}").text
    r = http.post(f"/c/{cid}/delete", headers={"HX-Current-URL": f"{server.url}/c/{cid}"})
    assert r.headers["hx-redirect"] == "/"
    on_disk = Storage(server.storage.path)
    assert on_disk.get_conversation(cid) is None
    on_disk.close()
