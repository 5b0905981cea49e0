"""Fill-in-the-middle prompts: the text before the cursor, the text after it and other files of
the project, laid out with the model's FIM tokens (engine/loading/fim_tokens.py) into one
engine prompt, so that a completion is an ordinary request (one scheduler, one prefix cache).

The layout is llama.cpp's (`format_infill` of its server): the extra files first, each opened by
the family's file separator and its name (a family without one gets a plain snippet header),
after the repository token where the family has one; then the prefix and suffix in the family's
order, then the middle token. Only the end moves while a file is edited at its cursor, so the next
completion in the same file reads everything before the cursor from the prefix cache.

    prompt = render_infill(lm, Infill(prefix="def add(a, b):\\n    return ", suffix="\\n"))
"""

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest
from ..loading.fim_tokens import FimTokens, fim_tokens
from ..loading.registry import LoadedModel
from .chat import Prompt

REPOSITORY = "myproject"  # llama.cpp's name for the repository, before the extra files
CURRENT_FILE = "filename"  # llama.cpp's name for the file being edited, after them
SNIPPET = "\n\n--- snippet ---\n\n"  # heads each extra file where the family has no separator


@dataclass(frozen=True)
class Infill:
    """A fill-in-the-middle request: the text before the gap, the text after it, and other
    files as context (`(file name, text)` pairs, most relevant last)."""

    prefix: str
    suffix: str = ""
    files: tuple[tuple[str, str], ...] = ()


def model_fim(lm: LoadedModel) -> FimTokens | None:
    """The model's FIM tokens (read from its files once per loaded model)."""
    if "fim" not in lm.extras:
        lm.extras["fim"] = fim_tokens(lm.tokenizer, lm.path)
    return lm.extras["fim"]


def render_infill(lm: LoadedModel, infill: Infill) -> Prompt:
    """The prompt of `infill` for `lm`; raises InvalidRequest (field `suffix`) when the model has
    no FIM tokens. Checkpoints: the end of the extra files, and the prompt's end."""
    fim = model_fim(lm)
    if fim is None:
        raise InvalidRequest(f"{lm.name} cannot fill in the middle: its files declare no FIM "
                             "tokens (a code model such as Qwen2.5-Coder, StarCoder2, CodeLlama, "
                             "DeepSeek-Coder or Codestral has them); send the prompt without a "
                             "suffix", field="suffix", code="fim_not_supported")
    tok = lm.tokenizer
    encode = _encoder(tok)
    head = [tok.bos_token_id] if _adds_bos(lm) else []
    context = _extra(fim, infill.files, encode) if infill.files else []
    prefix = [fim.prefix, *encode(infill.prefix)]
    suffix = [fim.suffix, *encode(infill.suffix)]
    body = prefix + suffix if fim.order == "psm" else suffix + prefix
    middle = [fim.middle] if fim.middle is not None else []
    tokens = head + context + body + middle
    checkpoints = [len(head) + len(context)] if context else []
    stops = tuple(t for t in (fim.end, fim.file_sep, fim.repo) if t is not None)
    return Prompt(tokens=tokens, checkpoints=checkpoints + [len(tokens)], continued=True,
                  stop_tokens=stops)


def _extra(fim: FimTokens, files: tuple[tuple[str, str], ...], encode: Any) -> list[int]:
    out = [fim.repo, *encode(f"{REPOSITORY}\n")] if fim.repo is not None else []
    for name, text in files:
        if fim.file_sep is not None:
            out += [fim.file_sep, *encode(f"{name}\n")]
        else:
            out += encode(SNIPPET)
        out += encode(text)
    if fim.file_sep is not None:
        out += [fim.file_sep, *encode(f"{CURRENT_FILE}\n")]
    return out


def _encoder(tokenizer: Any) -> Any:
    """Text to token ids with no special tokens added (the FIM tokens are placed by id)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)

    def encode(text: str) -> list[int]:
        return list(inner.encode(text, add_special_tokens=False)) if text else []
    return encode


def _adds_bos(lm: LoadedModel) -> bool:
    """Whether the tokenizer starts every encoding with its BOS token (CodeLlama's does); asked
    once per loaded model."""
    if "fim_bos" not in lm.extras:
        bos = getattr(lm.tokenizer, "bos_token_id", None)
        ids = list(lm.tokenizer.encode("a")) if bos is not None else []
        lm.extras["fim_bos"] = bool(ids) and ids[0] == bos
    return lm.extras["fim_bos"]
