"""A model's fill-in-the-middle (FIM) tokens, read from its own files: the GGUF's
`tokenizer.ggml.fim_*_token_id` keys where the model came from a GGUF, else the special tokens
of the FIM families its tokenizer's vocabulary holds (`FAMILIES`, one declaration each).

How a FIM prompt is laid out from them: engine/decoding/fim.py.

    tokens = fim_tokens(lm.tokenizer, lm.path)   # FimTokens, or None: the model has no FIM
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .gguf_metadata import scalar_metadata

# Where the suffix goes: before the middle (prefix, suffix, middle) or first (suffix, prefix).
Order = Literal["psm", "spm"]


@dataclass(frozen=True)
class FimFamily:
    """One family's FIM token strings (None where it has no such token) and its order."""

    name: str
    prefix: str
    suffix: str
    middle: str | None  # Codestral has none: the middle follows the prefix directly
    order: Order = "psm"
    repo: str | None = None  # names the repository before the extra files
    file_sep: str | None = None  # starts each extra file (its name, a newline, its text)
    end: str | None = None  # ends the middle where that is not the tokenizer's end of sequence


FAMILIES = (
    FimFamily("qwen2.5-coder", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
              repo="<|repo_name|>", file_sep="<|file_sep|>", end="<|fim_pad|>"),
    FimFamily("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>",
              repo="<repo_name>", file_sep="<file_sep>", end="<fim_pad>"),
    FimFamily("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", end="▁<EOT>"),
    FimFamily("deepseek-coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    FimFamily("codestral", "[PREFIX]", "[SUFFIX]", None, order="spm"),
)

# The GGUF metadata keys (`tokenizer.ggml.<key>_token_id`) and the FimTokens fields they fill.
GGUF_KEYS = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle", "fim_rep": "repo",
             "fim_sep": "file_sep", "fim_pad": "end"}


@dataclass(frozen=True)
class FimTokens:
    """A loaded model's FIM token ids (None where it has no such token) and where they came from
    (a family's name, or "gguf")."""

    source: str
    prefix: int
    suffix: int
    middle: int | None
    order: Order = "psm"
    repo: int | None = None
    file_sep: int | None = None
    end: int | None = None


def fim_tokens(tokenizer: Any, folder: Path | None) -> FimTokens | None:
    """The model's FIM tokens: its GGUF's keys first, then the first family whose prefix and
    suffix tokens (and middle, where it has one) the vocabulary holds as single tokens."""
    found = _from_gguf(folder) if folder is not None else None
    if found is not None:
        return found
    vocab = _vocab(tokenizer)
    for family in FAMILIES:
        ids = {field: vocab.get(text) if text is not None else None
               for field, text in (("prefix", family.prefix), ("suffix", family.suffix),
                                   ("middle", family.middle), ("repo", family.repo),
                                   ("file_sep", family.file_sep), ("end", family.end))}
        if ids["prefix"] is None or ids["suffix"] is None or \
                (family.middle is not None and ids["middle"] is None):
            continue
        return FimTokens(family.name, order=family.order, **ids)
    return None


def _vocab(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's whole vocabulary, its added tokens included."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    get_vocab = getattr(inner, "get_vocab", None)
    return dict(get_vocab()) if get_vocab is not None else dict(getattr(tokenizer, "vocab", {}))


def _from_gguf(folder: Path) -> FimTokens | None:
    """The FIM token ids the metadata of the folder's source GGUF declares, if it names all three."""
    from .gguf import source_gguf

    gguf = source_gguf(folder)
    if gguf is None:
        return None
    metadata = scalar_metadata(gguf)
    ids = {name: int(metadata[f"tokenizer.ggml.{key}_token_id"]) for key, name in GGUF_KEYS.items()
           if f"tokenizer.ggml.{key}_token_id" in metadata}
    if ids.get("prefix") is None or ids.get("suffix") is None or ids.get("middle") is None:
        return None
    return FimTokens("gguf", **ids)
