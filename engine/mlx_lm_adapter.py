"""What the engine takes from mlx-lm beyond its public API, declared once: its private helpers,
and where its multimodal models keep their text model. An mlx-lm release that moves one of them
breaks here, in one place (read from mlx-lm 0.32).
"""

from typing import Any

import mlx.nn as nn
from mlx_lm.tokenizer_utils import _byte_decoder
from mlx_lm.utils import _get_classes


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's own (model class, model args class) for a config.json, as its loader picks them
    when no `get_model_classes` is given."""
    return _get_classes(config)


def byte_decoder() -> dict[str, int]:
    """The byte each character of a byte-level BPE piece stands for (GPT-2's table)."""
    return _byte_decoder()


def text_model(model: nn.Module) -> nn.Module:
    """The text model of a multimodal mlx-lm model (its `language_model`: Qwen3.5, Gemma 3,
    Mistral 3), or the model itself: the part with `.model` (embeddings, decoder layers, final
    norm), `.args` and the head."""
    return getattr(model, "language_model", model)
