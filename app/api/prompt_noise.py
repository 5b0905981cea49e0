"""Per-request noise that clients put early in a prompt, dropped before the prompt is rendered so
that it never splits the prefix cache.

The prefix cache reuses a prompt's tokens up to the first one that differs from a cached prompt.
A value that changes on every request, placed before the conversation, makes every round of an
agent session cold. One is known (each line of `NOISE_PREFIXES` names it and why):

- `x-anthropic-billing-header:` — Claude Code (2.1.36 on) sends it as the first system text block,
  `x-anthropic-billing-header: cc_version=…; cc_entrypoint=cli; cch=<5 hex digits>;`, the `cch`
  value new on every request of its interactive mode. It is billing metadata for Anthropic's API
  and says nothing to a model (`CLAUDE_CODE_ATTRIBUTION_HEADER=0` turns it off at the source;
  `mlxchat launch claude` sets it).

The other values the real clients send early change per day or per session, not per request, so
they stay (they are what the model is told): Claude Code's "Today's date is …" and working
directory, and Codex's `<environment_context>` (cwd, date). Session ids (`metadata.user_id`,
`prompt_cache_key`, `client_metadata`) travel in fields that never reach the prompt.
"""

from typing import Any

# Lines that begin with one of these are dropped from system text (compared after leading spaces).
NOISE_PREFIXES = ("x-anthropic-billing-header:",)


def is_noise(line: str) -> bool:
    """Whether `line` is per-request noise."""
    return line.lstrip().lower().startswith(NOISE_PREFIXES)


def without_noise(text: str) -> str:
    """`text` without its noise lines (the rest byte for byte as it was)."""
    if not any(p in text.lower() for p in NOISE_PREFIXES):
        return text
    return "".join(line for line in text.splitlines(keepends=True) if not is_noise(line))


def without_noise_blocks(blocks: list[Any]) -> list[Any]:
    """Text blocks (Anthropic's `system` array) without noise: a block of noise alone goes, one
    that holds other lines keeps them. Other blocks pass as they are."""
    out = []
    for block in blocks:
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            text = without_noise(block["text"])
            if text != block["text"]:
                if not text.strip():
                    continue
                block = {**block, "text": text}
        out.append(block)
    return out
