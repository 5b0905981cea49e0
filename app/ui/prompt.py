"""What a chat turn sends to the model: the conversation's system prompt and active path as engine
messages (documents attached to a user turn inlined, tool calls and results as OpenAI writes
them), the oldest turns dropped when the conversation opted in."""

from typing import Any, Mapping

from engine import Engine

from ..context_window import TRUNCATE_MODES, drop_oldest
from ..doc_index.answering import DocumentPrompt
from ..state import AppState
from ..storage import Message
from ..uploads.documents import with_documents
from ..uploads.image_uploads import resolve_images, with_images


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
        content = with_images(with_documents(m.content, m.attachments), m.attachments)
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def answer_messages(engine: Engine, settings: Mapping[str, Any], path: list[Message],
                    max_tokens: int) -> list[dict[str, Any]]:
    """The prompt for the next answer: the oldest turns dropped if the conversation opted in."""
    messages = engine_messages(settings, path)
    if settings.get("truncate") in TRUNCATE_MODES:
        return drop_oldest(engine, messages, max_tokens)
    return messages


def document_prompt(state: AppState) -> DocumentPrompt:
    """How the app's uploaded documents enter prompts (app/doc_index/answering.py)."""
    return DocumentPrompt(state.storage, state.chunks, state.engine, state.document_embeddings)


def prompt_with_documents(state: AppState, settings: Mapping[str, Any], path: list[Message],
                          max_tokens: int) -> list[dict[str, Any]]:
    """`answer_messages` for `path` once its uploads are resolved: the newest user turn's chunks
    retrieved (and stored) when it has documents too large to go in whole. CPU-bound."""
    docs = document_prompt(state)
    path = docs.retrieve(settings, path, max_tokens, engine_messages)
    path = resolve_images(state.uploads, path)  # app/uploads/image_uploads.py
    return answer_messages(state.engine, settings, docs.resolve(path), max_tokens)
