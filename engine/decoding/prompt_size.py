"""A prompt too long for the model, told from its characters before anything is tokenised: a token
is at most `max_token_chars` characters of text (the longest entry of the model's vocabulary), so
text longer than that many times the context cannot fit whatever the tokenizer makes of it. The
tokenizer takes seconds per megabyte (a 5 MB prompt: 15 s here, holding the interpreter at times),
so a 60 MB prompt is refused at once instead.

What is counted is text every chat template writes out in full: the content of user, system and
tool messages (an assistant's may be left out of the prompt: earlier thinking), the tools' JSON in
its most compact form, a raw text, a fill-in-the-middle prompt and its files."""

import json
from typing import Any, Sequence

from ..errors import InvalidRequest
from ..loading.registry import LoadedModel
from .fim import Infill
from .tools import ToolRequest

_FULL_ROLES = ("user", "system", "tool")


def max_token_chars(lm: LoadedModel) -> int:
    """The most characters one token of `lm` stands for (its longest vocabulary entry)."""
    if "max_token_chars" not in lm.extras:
        vocab = getattr(lm.tokenizer, "vocab", None) or {}
        lm.extras["max_token_chars"] = max((len(t) for t in vocab), default=0) or 1 << 10
    return lm.extras["max_token_chars"]


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def prompt_chars(messages: Sequence[dict] | None, text: str | None, tools: ToolRequest | None,
                 infill: Infill | None) -> int:
    """The characters of a prompt that its rendering certainly holds (see the module docstring)."""
    chars = len(text or "")
    chars += sum(_content_chars(m.get("content")) for m in messages or ()
                 if isinstance(m, dict) and m.get("role") in _FULL_ROLES)
    if tools is not None:
        chars += sum(len(json.dumps(t, separators=(",", ":"), ensure_ascii=False))
                     for t in tools.tools)
    if infill is not None:
        chars += len(infill.prefix) + len(infill.suffix) + sum(len(t) for _, t in infill.files)
    return chars


def check_prompt_size(lm: LoadedModel, messages: Sequence[dict] | None = None,
                      text: str | None = None, tools: ToolRequest | None = None,
                      infill: Infill | None = None) -> None:
    """Raise InvalidRequest (`context_length_exceeded`) for a prompt whose characters alone are
    more than the context can hold."""
    chars = prompt_chars(messages, text, tools, infill)
    per_token = max_token_chars(lm)
    if chars > lm.context_length * per_token:
        raise InvalidRequest(
            f"the prompt is {chars:,} characters, more than this model's context of "
            f"{lm.context_length} tokens can hold (a token is at most {per_token} characters)",
            field="suffix" if infill is not None and messages is None else "messages",
            code="context_length_exceeded")
