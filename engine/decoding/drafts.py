"""Speculative decoding as a per-request opt-in: which drafts a loaded model can use, and loading them.

A request asks for speculation with `SpeculativeOptions(draft=..., k=...)`; the default everywhere is
plain decoding (on this machine's CPU speculation does not pay: see bench/speculative.py). Drafts:

  "self-q4"       the target's own weights at 4 bits: the checkpoint as stored when it is quantized
                  (the bundled model is Q4), else quantized here. Where the target already runs its
                  quantized weights (no CPU fp32 layout, e.g. on a GPU) the draft is the target itself.
  "truncated:N"   the target's first N decoder layers with its final norm and head (shared weights).
  "mtp"           the target's multi-token-prediction head (Qwen3.5 / Qwen3-Next checkpoints with
                  mtp.* weights), drafting from its hidden states.
  anything else   a model name or path (as `load_model` takes it) of the same tokenizer.

A draft is known by `draft_identity`: the built-in names as written, a model by the real path of
the folder the registry resolves it to, so that every spelling of one model is one draft.
`load_draft` may run on any thread: the weights it loads are evaluated there (MLX arrays belong to
the thread that made them until evaluated); the result is a factory of fresh per-request
`Speculator`s sharing the weights, to be called on the thread that runs them.
"""

import os
from dataclasses import dataclass
from typing import Callable, Literal

import mlx.core as mx
import mlx.nn as nn

from ..errors import EngineError, InvalidRequest
from ..loading.registry import LoadedModel, load_model, resolve
from ..mlx_lm_adapter import text_model
from .speculative import ModelDrafter, SpecConfig, Speculator, check_compatible, truncated

K_LIMIT = 16
BUILTIN = ("self-q4", "truncated:N", "mtp")

SpeculatorFactory = Callable[[SpecConfig], Speculator]


@dataclass(frozen=True)
class SpeculativeOptions:
    """A request's opt-in: the draft (see the module doc), the most tokens drafted per target step
    and whether k adapts to the running acceptance rate."""

    draft: str
    k: int = 4
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.draft, str) or not self.draft.strip():
            raise InvalidRequest("speculative.draft must be a non-empty string (self-q4, "
                                 "truncated:N, mtp, or a draft model's name or path)",
                                 field="speculative.draft", code="invalid_value")
        if not isinstance(self.k, int) or isinstance(self.k, bool) or not 1 <= self.k <= K_LIMIT:
            raise InvalidRequest(f"speculative.k must be an integer in [1, {K_LIMIT}], got {self.k!r}",
                                 field="speculative.k", code="invalid_value")
        if not isinstance(self.adaptive, bool):
            raise InvalidRequest(f"speculative.adaptive must be a boolean, got {self.adaptive!r}",
                                 field="speculative.adaptive", code="invalid_type")

    def config(self) -> SpecConfig:
        return SpecConfig(k_max=self.k, adaptive=self.adaptive)


@dataclass(frozen=True)
class DraftChoice:
    """A draft the loaded model can use, for a picker to offer: `draft` is the value to pass as
    `SpeculativeOptions.draft`; `kind` is "self-q4", "truncated" (keeping `layers` of the model's
    `of_layers`) or "mtp"."""

    draft: str
    kind: Literal["self-q4", "truncated", "mtp"]
    layers: int | None = None
    of_layers: int | None = None


def _layers(lm: LoadedModel) -> int:
    return len(text_model(lm.model).model.layers)


def _truncations(lm: LoadedModel) -> range:
    """The layer counts a truncated self-draft may keep: fewer than all, and enough to hold each
    layer the model reads by index (hybrid models take masks from their first full-attention
    and first recurrent layers' caches)."""
    text = text_model(lm.model).model
    indices = [v for k, v in vars(text).items() if k.endswith("_idx") and isinstance(v, int)]
    return range(max(indices, default=0) + 1, _layers(lm))


def _truncation(lm: LoadedModel, draft: str) -> int:
    allowed = _truncations(lm)
    raw = draft.split(":", 1)[1]
    if not raw.isdigit() or int(raw) not in allowed:
        valid = f"in [{allowed.start}, {allowed.stop - 1}]" if allowed else "(none can be dropped)"
        raise InvalidRequest(f"draft {draft!r}: N must be a whole number of layers {valid}; "
                             f"{lm.name} has {_layers(lm)}",
                             field="speculative.draft", code="invalid_value")
    return int(raw)


def _has_mtp(lm: LoadedModel) -> bool:
    from .mtp import MTP_FAMILIES, _mtp_layer_count

    return lm.family in MTP_FAMILIES and _mtp_layer_count(lm.config) == 1


def draft_choices(lm: LoadedModel) -> tuple[DraftChoice, ...]:
    """The drafts worth offering for `lm`, the recommended one first (none for a vision model,
    whose language model runs in mlx-vlm's layers: engine/loading/vision.py)."""
    if "vision" in lm.extras:
        return ()
    choices = [DraftChoice("self-q4", "self-q4")]
    allowed = _truncations(lm)
    if allowed:
        n = min(max(_layers(lm) // 3, allowed.start), allowed.stop - 1)
        choices.append(DraftChoice(f"truncated:{n}", "truncated", n, _layers(lm)))
    if _has_mtp(lm):
        choices.append(DraftChoice("mtp", "mtp"))
    return tuple(choices)


def check_draft(lm: LoadedModel, draft: str) -> None:
    """Refuse at once what cannot be a draft for `lm` without loading anything big."""
    if draft.startswith("truncated:"):
        _truncation(lm, draft)
    elif draft == "mtp" and not _has_mtp(lm):
        raise InvalidRequest(f"draft 'mtp': {lm.name} ({lm.family or 'unknown family'}) declares no "
                             "multi-token-prediction head",
                             field="speculative.draft", code="invalid_value")


def draft_identity(draft: str) -> str:
    """What `draft` is, whatever its spelling: a built-in as written ("truncated:N" with N as a
    number), a model as the real path of the folder the registry resolves it to (relative paths,
    `..`, symlinks and trailing slashes resolved; a GGUF file by its converted folder). Resolving a
    model may convert a GGUF file: call it off the scheduler thread. Raises InvalidRequest."""
    if draft in ("self-q4", "mtp"):
        return draft
    if draft.startswith("truncated:"):
        raw = draft.split(":", 1)[1]
        return f"truncated:{int(raw)}" if raw.isdigit() else draft
    try:
        _, folder = resolve(draft)
    except EngineError as exc:
        raise InvalidRequest(f"unknown draft {draft!r}: not one of {', '.join(BUILTIN)} and not a "
                             f"loadable model ({exc})", field="speculative.draft",
                             code="invalid_value") from None
    return os.path.realpath(folder)


def _quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
               for _, m in model.named_modules())


def _self_q4(lm: LoadedModel) -> nn.Module:
    from mlx_lm.utils import load_model as mlx_lm_load_model

    if _quantized(lm.model):  # the target runs its quantized weights: nothing cheaper to load
        return lm.model
    model, config = mlx_lm_load_model(lm.path)
    if "quantization" not in config:
        nn.quantize(model, group_size=64, bits=4,
                    class_predicate=lambda _, m: hasattr(m, "to_quantized")
                    and m.weight.shape[-1] % 64 == 0)
    mx.eval(model.parameters())
    return model


def load_draft(lm: LoadedModel, draft: str) -> SpeculatorFactory:
    """Load `draft` for target `lm` (on any thread: weights are evaluated here); raises
    InvalidRequest."""
    check_draft(lm, draft)
    if draft == "self-q4":
        model = _self_q4(lm)
        return lambda config: Speculator(lm.model, ModelDrafter(model), config)
    if draft.startswith("truncated:"):
        model = truncated(lm.model, _truncation(lm, draft))
        return lambda config: Speculator(lm.model, ModelDrafter(model), config)
    if draft == "mtp":
        from .mtp import MtpDrafter, load_mtp_head

        try:
            head = load_mtp_head(lm)
        except EngineError as exc:
            raise InvalidRequest(f"draft 'mtp': {exc}", field="speculative.draft",
                             code="invalid_value") from None
        return lambda config: Speculator(lm.model, MtpDrafter(lm.model, head), config)
    try:
        other = load_model(draft)
    except EngineError as exc:
        raise InvalidRequest(f"unknown draft {draft!r}: not one of {', '.join(BUILTIN)} and not a "
                             f"loadable model ({exc})", field="speculative.draft",
                             code="invalid_value") from None
    check_compatible(lm, other)  # refuses another vocabulary with InvalidRequest
    return lambda config: Speculator(lm.model, ModelDrafter(other.model), config)
