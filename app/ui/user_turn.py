"""The user's side of a chat turn, recorded before anything is generated: a new message, an edit
(a new branch) or a regeneration, and where the answer goes."""

from dataclasses import dataclass
from typing import Any, Mapping

from ..storage import DEFAULT_TITLE, Conversation, Message, Storage
from ..uploads.documents import parse_attachments
from ..uploads.store import attached_uploads

TITLE_LENGTH = 60


@dataclass(frozen=True)
class Turn:
    """Where the next answer goes (under `parent_id`), and whether the message list must be
    re-rendered whole (edit and regenerate change the branch) or only grows (a new message)."""

    parent_id: int
    rerender: bool


def record_user_turn(storage: Storage, conv: Conversation, action: str, data: Mapping[str, Any]) -> Turn:
    """Record the user's side of a turn before anything is generated; raises ValueError."""
    if action not in ("send", "edit", "regenerate"):
        raise ValueError(f"Unknown action {action!r}.")
    content = str(data.get("content") or "").strip()
    if action == "send":
        if not content:
            raise ValueError("Type a message first.")
        path = storage.active_path(conv.id)
        user = storage.add_message(conv.id, path[-1].id if path else None, "user", content,
                                   attachments=parse_attachments(data.get("attachments"))
                                   + attached_uploads(storage, conv.id, data.get("uploads")))
        if conv.title == DEFAULT_TITLE and not path:
            storage.rename_conversation(conv.id, chat_title(content))
        return Turn(user.id, rerender=False)
    target = _own_message(storage, conv, data.get("message_id"))
    if action == "edit":
        if target.role != "user":
            raise ValueError("Only your own messages can be edited.")
        if not content:
            raise ValueError("The edited message is empty.")
        user = storage.add_message(conv.id, target.parent_id, "user", content,
                                   attachments=target.attachments)  # an edit keeps its documents
        return Turn(user.id, rerender=True)
    if target.role != "assistant" or target.parent_id is None:  # regenerate
        raise ValueError("Only answers can be regenerated.")
    return Turn(target.parent_id, rerender=True)


def _own_message(storage: Storage, conv: Conversation, mid: Any) -> Message:
    try:
        message = storage.get_message(int(mid))
    except (TypeError, ValueError, OverflowError):  # not an id, 1e400, or past SQLite's range
        message = None
    if message is None or message.conversation_id != conv.id:
        raise ValueError("That message is not in this conversation.")
    return message


def chat_title(text: str) -> str:
    """A conversation's title from its first message, as a new chat names itself."""
    line = " ".join(text.split())
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1].rstrip() + "…"
