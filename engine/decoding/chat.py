"""Render conversations through the model's chat template, with a checkpoint at each message end.

A checkpoint is a token offset into the rendered prompt where one message ends. The prefix cache
keeps snapshots there. A checkpoint counts only where the rendering of the conversation up to that
message is a true token prefix of the whole prompt: templates may render earlier turns differently
once later turns exist, and only equal tokens may be reused.

Finding them costs time linear in the conversation: the template renders each message once, in a
window of two (`_pieces`: message i's text is the rendering of messages i-1..i minus that of
message i-1 alone), the pieces are laid end to end along the whole prompt's text, and the
tokenizer's character offsets turn each piece's end into a token offset. Where a piece is not
where the whole prompt has it (a template that renders turns differently once later turns exist),
the checkpoints stop there; a short conversation then falls back to rendering every prefix
(`_prefix_checkpoints`, quadratic, exact).
"""

import bisect
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
    vision: Any = None  # its images, as engine/decoding/vision.py's VisionPrompt (None: text only)
    stop_tokens: tuple[int, ...] = ()  # end the answer besides the model's EOS (a FIM middle's end)


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
        if not isinstance(content, str) and not _is_parts(content):
            raise InvalidRequest(f"messages[{i}].content must be a string")
        clean.append({"role": role, "content": content, **{k: m[k] for k in _TOOL_KEYS if m.get(k)}})
    if not any(_has_content(m["content"]) or m.get("tool_calls") for m in clean):
        raise InvalidRequest("the prompt is empty: every message has empty content")
    return clean


def _is_parts(content: Any) -> bool:
    """Content as a list of parts, as a vision model's template takes it (engine/decoding/vision.py
    makes them): `{"type": "text", "text": str}` and `{"type": "image"}`."""
    return isinstance(content, list) and all(
        isinstance(p, dict) and (p.get("type") == "image" or
                                 (p.get("type") == "text" and isinstance(p.get("text"), str)))
        for p in content)


def _has_content(content: str | list[dict[str, Any]]) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    return any(p["type"] == "image" or p["text"].strip() for p in content)


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
           add_generation_prompt: bool = True, with_checkpoints: bool = True,
           **template_kwargs: Any) -> Prompt:
    """Render `messages`; checkpoints at each message end that is a token prefix of the result.

    A conversation that ends with an assistant message is continued from that message's text
    (a prefill), not answered anew. Without `with_checkpoints` only the prompt's end is one (for
    counting tokens)."""
    msgs = validate_messages(messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequest("this model has no chat template; send prompt tokens or text instead")
    continued = msgs[-1]["role"] == "assistant" and not msgs[-1].get("tool_calls")
    whole = ((False, {**template_kwargs, "continue_final_message": True}) if continued
             else (add_generation_prompt, template_kwargs))
    tokens = _encode(tokenizer, msgs, *whole)
    checkpoints = _checkpoints(tokenizer, msgs, tokens, template_kwargs, whole) if with_checkpoints else []
    if not checkpoints or checkpoints[-1] != len(tokens):
        checkpoints.append(len(tokens))
    return Prompt(tokens=tokens, checkpoints=checkpoints, continued=continued)


# Conversations up to this many messages whose template is not prefix-stable get every checkpoint
# by rendering each prefix (quadratic); longer ones keep the checkpoints up to the first mismatch.
EXACT_FALLBACK_MESSAGES = 64


def _checkpoints(tokenizer: TokenizerWrapper, msgs: list[dict[str, Any]], tokens: list[int],
                 template_kwargs: dict[str, Any], whole: tuple[bool, dict[str, Any]]) -> list[int]:
    """Token offsets of the message ends 1..len(msgs)-1, ascending (the prompt's end not included).
    `whole`: how the whole prompt was rendered (generation prompt, template arguments)."""
    if len(msgs) < 2:
        return []
    found = _piece_checkpoints(tokenizer, msgs, tokens, template_kwargs, whole)
    if found is not None and (found[1] or len(msgs) > EXACT_FALLBACK_MESSAGES):
        return found[0]
    return _prefix_checkpoints(tokenizer, msgs, tokens, template_kwargs)


def _render_text(tokenizer: TokenizerWrapper, messages: list[dict[str, Any]],
                 template_kwargs: dict[str, Any], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                         tokenize=False, **template_kwargs)


def _pieces(tokenizer: TokenizerWrapper, msgs: list[dict[str, Any]],
            template_kwargs: dict[str, Any]) -> list[str] | None:
    """The text each of msgs[:-1] adds to the rendering of the ones before it, each rendered in a
    window of at most two messages; None where a window's text does not extend its first
    message's (the template is not local, or refuses such a window)."""
    try:
        single = [_render_text(tokenizer, [m], template_kwargs) for m in msgs[:-1]]
        pieces = [single[0]]
        for i in range(1, len(msgs) - 1):
            pair = _render_text(tokenizer, msgs[i - 1:i + 1], template_kwargs)
            if not pair.startswith(single[i - 1]):
                return None
            pieces.append(pair[len(single[i - 1]):])
    except Exception:  # a template may raise on a window (e.g. "roles must alternate")
        return None
    return pieces


def _piece_checkpoints(tokenizer: TokenizerWrapper, msgs: list[dict[str, Any]], tokens: list[int],
                       template_kwargs: dict[str, Any],
                       whole: tuple[bool, dict[str, Any]]) -> tuple[list[int], bool] | None:
    """(checkpoints, whether every message end was found) from the pieces laid along the whole
    prompt's text; None when the tokenizer gives no character offsets or its tokens differ."""
    backend = getattr(tokenizer, "_tokenizer", None)
    pieces = _pieces(tokenizer, msgs, template_kwargs)
    if backend is None or pieces is None or not getattr(backend, "is_fast", False):
        return None
    text = _render_text(tokenizer, msgs, whole[1], generation_prompt=whole[0])
    encoding = backend(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(encoding["input_ids"]) != tokens:
        return None
    ends = [end for _, end in encoding["offset_mapping"]]
    checkpoints: list[int] = []
    position = 0
    for piece in pieces:
        if not text.startswith(piece, position):
            return checkpoints, False
        position += len(piece)
        # Tokens that end at or before the message's end; one straddling it is not shared.
        offset = bisect.bisect_right(ends, position)
        if offset > (checkpoints[-1] if checkpoints else 0):
            checkpoints.append(offset)
    return checkpoints, True


def _prefix_checkpoints(tokenizer: TokenizerWrapper, msgs: list[dict[str, Any]], tokens: list[int],
                        template_kwargs: dict[str, Any]) -> list[int]:
    """Every message end by rendering each prefix: exact for any template, quadratic."""
    checkpoints: list[int] = []
    for i in range(1, len(msgs)):
        part = _encode(tokenizer, msgs[:i], False, template_kwargs)
        # Where a later turn changes how earlier ones render, only the equal prefix counts.
        offset = _common_prefix(part, tokens)
        if offset > (checkpoints[-1] if checkpoints else 0):
            checkpoints.append(offset)
    return checkpoints


def encode_text(tokenizer: TokenizerWrapper, text: str) -> Prompt:
    """A raw text prompt (no template): one checkpoint at its end; the answer continues it."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest("the prompt is empty")
    tokens = list(tokenizer.encode(text))
    return Prompt(tokens=tokens, checkpoints=[len(tokens)], continued=True)
