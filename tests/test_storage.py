"""Storage on a real SQLite file: schema migrations, branches, search, crash recovery."""

import sqlite3

import pytest

from app.storage import MIGRATIONS, SCHEMA_VERSION, Storage, connect, migrate

pytestmark = pytest.mark.fast


def test_new_database_is_current_version_in_wal_mode(tmp_path):
    Storage(tmp_path / "db.sqlite").close()
    db = sqlite3.connect(tmp_path / "db.sqlite")
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_default_path_follows_mlxchat_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXCHAT_HOME", str(tmp_path))
    s = Storage()
    assert s.path == tmp_path / "data" / "mlxchat.db"
    assert s.path.exists()
    s.close()


def test_migrates_a_version_1_database_and_keeps_its_data(tmp_path):
    path = tmp_path / "old.db"
    db = connect(path)
    assert migrate(db, target=1) == 1
    db.execute("INSERT INTO conversations (title, created, updated, settings) "
               "VALUES ('old chat', 1, 1, '{\"temperature\": 0.5}')")
    db.execute("INSERT INTO messages (conversation_id, parent_id, role, content, created) "
               "VALUES (1, NULL, 'user', 'hello from v1', 1)")
    db.execute("INSERT INTO messages (conversation_id, parent_id, role, content, created) "
               "VALUES (1, 1, 'assistant', 'hi there', 2)")
    db.close()

    s = Storage(path)
    conv = s.get_conversation(1)
    assert conv.title == "old chat" and conv.settings == {"temperature": 0.5}
    # v2 backfills the active branch: the newest message is the leaf.
    assert conv.leaf_id == 2
    assert [m.content for m in s.active_path(1)] == ["hello from v1", "hi there"]
    s.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)


def test_refuses_a_database_from_a_newer_version(tmp_path):
    path = tmp_path / "new.db"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(RuntimeError, match="newer"):
        Storage(path)


def test_failed_migration_leaves_previous_version(tmp_path, monkeypatch):
    path = tmp_path / "db.sqlite"
    db = connect(path)
    migrate(db, target=1)
    broken = "ALTER TABLE conversations ADD COLUMN leaf_id INTEGER; SELECT * FROM no_such_table"
    monkeypatch.setattr("app.storage.migrations.MIGRATIONS", [MIGRATIONS[0], broken])
    with pytest.raises(sqlite3.OperationalError):
        migrate(db)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 1
    columns = [r[1] for r in db.execute("PRAGMA table_info(conversations)")]
    assert "leaf_id" not in columns


def test_conversation_round_trip_and_search(storage):
    a = storage.create_conversation(model="m", settings={"system_prompt": "be brief"})
    b = storage.create_conversation(model="m")
    storage.rename_conversation(a.id, "Rust lifetimes")
    storage.add_message(b.id, None, "user", "How do I bake 100% sourdough_bread?")
    assert storage.get_conversation(a.id).settings == {"system_prompt": "be brief"}
    assert [c.id for c in storage.list_conversations()] == [b.id, a.id]  # newest activity first
    assert [c.id for c in storage.list_conversations("rust")] == [a.id]
    assert [c.id for c in storage.list_conversations("SOURDOUGH")] == [b.id]
    assert [c.id for c in storage.list_conversations("100%")] == [b.id]
    assert [c.id for c in storage.list_conversations("sourdough_bread")] == [b.id]  # FTS words
    assert storage.list_conversations("1000%") == []
    assert storage.empty_conversation().id == a.id
    storage.delete_conversation(b.id)
    assert storage.get_conversation(b.id) is None
    assert storage.get_message(1) is None  # messages go with their conversation


def test_branches_siblings_and_switching(storage):
    c = storage.create_conversation()
    u1 = storage.add_message(c.id, None, "user", "first question")
    a1 = storage.add_message(c.id, u1.id, "assistant", "answer v1")
    a2 = storage.add_message(c.id, u1.id, "assistant", "answer v2")  # regenerate
    assert [m.id for m in storage.active_path(c.id)] == [u1.id, a2.id]
    assert [m.id for m in storage.siblings(a1)] == [a1.id, a2.id]

    u2 = storage.add_message(c.id, a2.id, "user", "follow-up")
    u2b = storage.add_message(c.id, a2.id, "user", "follow-up, edited")  # edit last user message
    a3 = storage.add_message(c.id, u2b.id, "assistant", "answer to the edit")
    assert [m.content for m in storage.active_path(c.id)] == [
        "first question", "answer v2", "follow-up, edited", "answer to the edit"]
    assert [m.id for m in storage.siblings(u2)] == [u2.id, u2b.id]

    storage.select_branch(c.id, a1.id)
    assert [m.id for m in storage.active_path(c.id)] == [u1.id, a1.id]
    storage.select_branch(c.id, a2.id)  # back to v2: down to its newest descendant
    assert [m.id for m in storage.active_path(c.id)] == [u1.id, a2.id, u2b.id, a3.id]

    other = storage.create_conversation()
    storage.select_branch(other.id, a1.id)  # a message of another conversation: ignored
    assert storage.get_conversation(other.id).leaf_id is None
    assert storage.active_path(other.id) == []


def test_streaming_answer_is_saved_partially_then_finished(storage):
    c = storage.create_conversation()
    u = storage.add_message(c.id, None, "user", "hi")
    a = storage.add_message(c.id, u.id, "assistant", "", state="streaming", model="m",
                            sampling={"temperature": 0.0})
    storage.save_partial(a.id, "Hel")
    assert storage.get_message(a.id).content == "Hel"
    done = storage.finish_message(a.id, "Hello", "done", finish_reason="stop", ttft_ms=12.5,
                                  tokens_per_s=8.0, prompt_tokens=20, completion_tokens=2,
                                  cached_tokens=15)
    assert (done.content, done.state, done.cached_tokens, done.sampling) == (
        "Hello", "done", 15, {"temperature": 0.0})


def test_interrupted_answers_are_marked_stopped_with_their_text(tmp_path):
    path = tmp_path / "db.sqlite"
    s = Storage(path)
    c = s.create_conversation()
    u = s.add_message(c.id, None, "user", "hi")
    a = s.add_message(c.id, u.id, "assistant", "", state="streaming")
    s.save_partial(a.id, "partial text")
    # No close(): as after a crash.
    again = Storage(path)
    assert again.interrupt_streaming() == 1
    m = again.get_message(a.id)
    assert (m.content, m.state, m.finish_reason) == ("partial text", "stopped", "interrupted")
