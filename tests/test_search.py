"""Sidebar search on a real SQLite file: FTS5 over titles and message text, kept in step with
edits and deletions, filled for rows written before the search migration, and safe for any text."""

import sqlite3

import pytest

from app.storage import Storage, connect, migrate

pytestmark = pytest.mark.fast


def ids(storage, text):
    return {c.id for c in storage.list_conversations(text)}


def test_finds_titles_and_message_words_by_prefix_case_and_accents_aside(storage):
    a = storage.create_conversation(title="Trip to Lisbon")
    b = storage.create_conversation()
    q = storage.add_message(b.id, None, "user", "Tell me about the Café Zebra in Porto.")
    storage.add_message(b.id, q.id, "assistant", "It serves pastéis de nata.")
    assert ids(storage, "lisbon") == {a.id}
    assert ids(storage, "LISB") == {a.id}  # a word being typed matches by prefix
    assert ids(storage, "cafe zeb") == {b.id}  # accents and case aside, all words
    assert ids(storage, "pasteis") == {b.id}  # the answer's text too
    assert ids(storage, "zebra lisbon") == set()  # every word must be found in one text
    assert ids(storage, "") == {a.id, b.id}


def test_index_follows_renames_streamed_text_and_deletions(storage):
    conv = storage.create_conversation(title="Old name")
    answer = storage.add_message(conv.id, None, "assistant", "", state="streaming")
    storage.save_partial(answer.id, "First draft about otters")
    storage.finish_message(answer.id, "Final text about beavers", "done")
    storage.rename_conversation(conv.id, "Rodents")
    assert ids(storage, "otters") == set()
    assert ids(storage, "beavers") == {conv.id}
    assert ids(storage, "old") == set()
    assert ids(storage, "rodents") == {conv.id}
    storage.delete_conversation(conv.id)  # messages go by cascade: their index entries too
    assert ids(storage, "beavers") == set()
    assert ids(storage, "rodents") == set()


@pytest.mark.parametrize("text", ['"', 'say "hi', "NEAR(a b)", "a OR", "*", "title:x", "-x",
                                  "AND", "(", "x^2", "'; DROP TABLE messages; --", "✓✓", "100%_"])
def test_any_user_text_is_searched_not_parsed(storage, text):
    conv = storage.create_conversation(title="Symbols")
    storage.add_message(conv.id, None, "user", f"literal {text} here")
    found = ids(storage, text)  # never an FTS syntax error
    assert found == {conv.id}


def test_rows_written_before_the_search_migration_are_found(tmp_path):
    path = tmp_path / "old.sqlite"
    db = connect(path)
    migrate(db, target=3)  # the schema before full-text search
    db.execute("INSERT INTO conversations (title, created, updated) VALUES ('Old chat', 1, 1)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created) "
               "VALUES (1, 'user', 'remember the walrus', 1)")
    db.close()
    storage = Storage(path)
    try:
        assert ids(storage, "walrus") == {1}
        assert ids(storage, "old chat") == {1}
    finally:
        storage.close()
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA user_version").fetchone()[0] >= 4
