"""Export / import of conversations on a real SQLite database: a conversation with an edited
message (two versions) and its settings survives the round trip unchanged, an OpenAI `messages`
list imports as a new conversation, and search finds the copy by a message's text."""

import pytest

from app.storage import export_conversation, import_conversation

pytestmark = pytest.mark.fast


def sample(storage):
    conv = storage.create_conversation(model="smollm2", settings={"preset": "greedy",
                                                                   "system_prompt": "Be brief."},
                                       title="Fruit talk")
    q = storage.add_message(conv.id, None, "user", "Name a fruit.")
    a = storage.add_message(conv.id, q.id, "assistant", "", state="streaming",
                            sampling={"temperature": 0.0})
    storage.finish_message(a.id, "A kumquat.", "done", prompt_tokens=12, completion_tokens=4,
                           finish_reason="stop", ttft_ms=80.5)
    storage.add_message(conv.id, None, "user", "Name a vegetable.")  # an edit: a second version
    return conv


def test_round_trip_loses_nothing(storage):
    conv = sample(storage)
    exported = export_conversation(storage, conv.id)
    copy = import_conversation(storage, exported)
    assert copy.id != conv.id
    again = export_conversation(storage, copy.id)
    assert again == exported
    assert len(exported["messages"]) == 3
    assert [m.content for m in storage.active_path(copy.id)] == \
        [m.content for m in storage.active_path(conv.id)]


def test_openai_messages_import(storage):
    conv = import_conversation(storage, {"messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}]})
    assert [(m.role, m.content) for m in storage.active_path(conv.id)] == [
        ("system", "S"), ("user", "Hi"), ("assistant", "Hello!")]
    with pytest.raises(ValueError):
        import_conversation(storage, {"messages": [{"role": "wizard", "content": "x"}]})


def test_search_finds_an_imported_message(storage):
    conv = sample(storage)
    copy = import_conversation(storage, export_conversation(storage, conv.id))
    found = {c.id for c in storage.list_conversations("kumquat")}
    assert found == {conv.id, copy.id}
    assert storage.list_conversations("durian") == []
