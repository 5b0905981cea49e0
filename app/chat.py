"""Conversation logic shared by the UI views: settings, what to send to the model, new turns.

A conversation's settings are `{"preset": ..., "sampling": {...}, "system_prompt": ...,
"speculative": None | {"draft": ...}}`; `sampling` holds the `SamplingParams` fields the user set
(the others take the model's defaults, engine.ModelDefaults) and is validated by `SamplingParams`; `speculative` opts the conversation in to speculative decoding (off unless
turned on).
"""

from dataclasses import dataclass
from typing import Any, Mapping

from engine import (SAMPLING_OPTIONS, InvalidRequest, ModelDefaults, SamplingOption,
                    SamplingParams, SpeculativeOptions)

from .documents import parse_attachments, with_documents
from .storage import DEFAULT_TITLE, Conversation, Message, Storage

# Form fields of the settings panel, one per sampling option. Blank means the default.
SAMPLING_FIELDS: dict[str, SamplingOption] = {o.name: o for o in SAMPLING_OPTIONS}
TITLE_LENGTH = 60


def preset_settings(name: str, system_prompt: str = "") -> dict[str, Any]:
    """`recommended`: every sampling value from the model's defaults; `greedy`: temperature 0."""
    sampling: dict[str, Any] = {"temperature": 0.0} if name == "greedy" else {}
    return {"preset": name, "sampling": sampling, "system_prompt": system_prompt}


def sampling_params(settings: Mapping[str, Any], defaults: ModelDefaults | None) -> SamplingParams:
    """The conversation's own values over the model's defaults."""
    sampling = settings.get("sampling", {})
    return defaults.params(sampling) if defaults is not None else SamplingParams(**sampling)


def default_sources(settings: Mapping[str, Any], defaults: ModelDefaults | None) -> dict[str, str]:
    """What the settings panel says under each field: where its value comes from."""
    if defaults is None:
        return {}
    own = settings.get("sampling", {})
    out = {}
    for name, d in defaults.values.items():
        if own.get(name) is not None:
            out[name] = f"this conversation's setting (model default: {_shown(d.value)}, {d.source_text})"
        else:
            out[name] = f"{_shown(d.value)}: {d.source_text}"
    return out


def _shown(value: Any) -> str:
    return "random" if value is None else str(value)


def speculative_options(settings: Mapping[str, Any]) -> SpeculativeOptions | None:
    """The conversation's speculative decoding opt-in, or None (plain decoding)."""
    chosen = settings.get("speculative")
    return SpeculativeOptions(**chosen) if chosen else None


def speculative_form(form: Mapping[str, str]) -> tuple[dict[str, Any] | None, str | None]:
    """The panel's "Speculative decoding" toggle and draft choice: (setting, error message)."""
    if form.get("speculative") != "on":
        return None, None
    draft = (form.get("draft") or "").strip()
    try:
        SpeculativeOptions(draft)
    except InvalidRequest:
        return None, "Choose a draft for speculative decoding."
    return {"draft": draft}, None


def parse_settings_form(form: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Settings from the panel's form, and an error message per field that is wrong."""
    errors: dict[str, str] = {}
    sampling: dict[str, Any] = {}
    for name, option in SAMPLING_FIELDS.items():
        raw = (form.get(name) or "").strip()
        if not raw:
            continue
        try:
            sampling[name] = option.kind(raw)
        except ValueError:
            kind = "a whole number" if option.kind is int else "a number"
            errors[name] = f"{option.label} must be {kind}."
    if not errors:
        try:
            SamplingParams(**sampling)
        except InvalidRequest as exc:
            errors[exc.field if exc.field in SAMPLING_FIELDS else "form"] = str(exc)
    speculative, error = speculative_form(form)
    if error:
        errors["draft"] = error
    settings = {"preset": "custom", "sampling": sampling,
                "system_prompt": (form.get("system_prompt") or "").strip(), "speculative": speculative}
    return settings, errors


def engine_messages(settings: Mapping[str, Any], path: list[Message]) -> list[dict[str, Any]]:
    """The prompt for the next answer: the system prompt, then the active path (a user turn with
    its attached documents, tool calls and results as OpenAI writes them).

    Failed answers without text are left out; a stopped answer is part of the conversation.
    """
    messages: list[dict[str, Any]] = []
    if settings.get("system_prompt"):
        messages.append({"role": "system", "content": settings["system_prompt"]})
    for m in path:
        if m.role == "assistant" and m.state == "failed" and not m.content and not m.tool_calls:
            continue
        message: dict[str, Any] = {"role": m.role, "content": with_documents(m.content, m.attachments)}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


@dataclass(frozen=True)
class Turn:
    """Where the next answer goes (under `parent_id`), and whether the message list must be
    re-rendered whole (edit and regenerate change the branch) or only grows (a new message)."""

    parent_id: int
    new_user: Message | None
    rerender: bool


def start_turn(storage: Storage, conv: Conversation, action: str, data: Mapping[str, Any]) -> Turn:
    """Record the user's side of a turn before anything is generated; raises ValueError."""
    if action not in ("send", "edit", "regenerate"):
        raise ValueError(f"Unknown action {action!r}.")
    content = str(data.get("content") or "").strip()
    if action == "send":
        if not content:
            raise ValueError("Type a message first.")
        path = storage.active_path(conv.id)
        user = storage.add_message(conv.id, path[-1].id if path else None, "user", content,
                                   attachments=parse_attachments(data.get("attachments")))
        if conv.title == DEFAULT_TITLE and not path:
            storage.rename_conversation(conv.id, chat_title(content))
        return Turn(user.id, user, rerender=False)
    target = _own_message(storage, conv, data.get("message_id"))
    if action == "edit":
        if target.role != "user":
            raise ValueError("Only your own messages can be edited.")
        if not content:
            raise ValueError("The edited message is empty.")
        user = storage.add_message(conv.id, target.parent_id, "user", content,
                                   attachments=target.attachments)  # an edit keeps its documents
        return Turn(user.id, user, rerender=True)
    if target.role != "assistant" or target.parent_id is None:  # regenerate
        raise ValueError("Only answers can be regenerated.")
    return Turn(target.parent_id, None, rerender=True)


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

