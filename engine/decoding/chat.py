"""Render conversations through the model's chat template, with a checkpoint at each message end.

A checkpoint is a token offset into the rendered prompt where one message ends. The prefix cache
keeps snapshots there. We find them by rendering each prefix of the conversation and keeping the
offset only where that rendering is a true token prefix of the whole prompt: templates may render
earlier turns differently once later turns exist, and only equal tokens may be reused.
"""

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..errors import InvalidRequest

ROLES = ("system", "user", "assistant", "tool")


class _NoLengthWarning(logging.Filter):
    """Drops transformers' warning that a prompt is longer than the tokenizer's maximum: such a
    prompt is refused with a clear error (`check_fits`), so the warning only adds noise to the log.
    The tokenizer's other warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token indices sequence length is longer")


logging.getLogger("transformers.tokenization_utils_base").addFilter(_NoLengthWarning())


@dataclass(frozen=True)
class Prompt:
    """Token ids of a rendered prompt and the offsets where its messages end (ascending)."""

    tokens: list[int]
    checkpoints: list[int]
    continued: bool = False  # it ends inside an assistant message that the answer continues


# Kept for templates that render tool calls and results (engine/decoding/tools.py).
_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


def validate_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        raise InvalidRequest("messages must not be empty")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string")
        clean.append({"role": role, "content": content, **{k: m[k] for k in _TOOL_KEYS if m.get(k)}})
    if not any(m["content"].strip() or m.get("tool_calls") for m in clean):
        raise InvalidRequest("the prompt is empty: every message has empty content")
    return clean


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _encode(tokenizer: TokenizerWrapper, messages: list[dict[str, str]], generation_prompt: bool,
            template_kwargs: dict[str, Any]) -> list[int]:
    return list(tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, **template_kwargs
    ))


def render(tokenizer: TokenizerWrapper, messages: Sequence[dict[str, Any]],
           add_generation_prompt: bool = True, **template_kwargs: Any) -> Prompt:
    """Render `messages`; checkpoints at each message end that is a token prefix of the result.

    A conversation that ends with an assistant message is continued from that message's text
    (a prefill), not answered anew."""
    msgs = validate_messages(messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequest("this model has no chat template; send prompt tokens or text instead")
    continued = msgs[-1]["role"] == "assistant" and not msgs[-1].get("tool_calls")
    if continued:
        tokens = _encode(tokenizer, msgs, False, {**template_kwargs, "continue_final_message": True})
    else:
        tokens = _encode(tokenizer, msgs, add_generation_prompt, template_kwargs)
    checkpoints: list[int] = []
    for i in range(1, len(msgs)):
        part = _encode(tokenizer, msgs[:i], False, template_kwargs)
        # Where a later turn changes how earlier ones render, only the equal prefix counts.
        offset = _common_prefix(part, tokens)
        if offset > (checkpoints[-1] if checkpoints else 0):
            checkpoints.append(offset)
    if not checkpoints or checkpoints[-1] != len(tokens):
        checkpoints.append(len(tokens))
    return Prompt(tokens=tokens, checkpoints=checkpoints, continued=continued)


def encode_text(tokenizer: TokenizerWrapper, text: str) -> Prompt:
    """A raw text prompt (no template): one checkpoint at its end; the answer continues it."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest("the prompt is empty")
    tokens = list(tokenizer.encode(text))
    return Prompt(tokens=tokens, checkpoints=[len(tokens)], continued=True)
