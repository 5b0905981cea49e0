"""Vision-language models (VLMs) through mlx-vlm: which folders are VLMs, how one loads, and the
text view of it that the engine runs.

mlx-vlm (the `mlxchat[vision]` extra) supplies the model code: the vision tower, the merge of image
features into the input embeddings and the language model. The engine runs that language model
through its own prefill/decode loop, sampling, constrained decoding and prefix cache
(engine/decoding/generate.py); what an image adds to a request is prepared by
engine/decoding/vision.py. Families served so far: Qwen2.5-VL (`qwen2_5_vl`: multimodal RoPE, the
positions of a prompt's tokens come from its image grids) and Idefics3 / SmolVLM (`idefics3`,
`smolvlm`: plain RoPE).

A loaded VLM is a `LoadedModel` whose `model` is `TextView` (the language model, called as an
mlx-lm model is: `model(tokens, cache=...)` gives logits) and whose `extras["vision"]` is the
`VisionParts` (mlx-vlm's whole model and its processor).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ModelLoadError

# mlx-vlm model types served (others are refused at load, with this list).
FAMILIES = ("qwen2_5_vl", "idefics3", "smolvlm")
# Of those, the families whose language model takes multimodal RoPE positions (3, batch, tokens).
MROPE_FAMILIES = ("qwen2_5_vl",)


def is_vision_folder(folder: Path) -> bool:
    """Whether the model folder holds a vision-language model (its config has a vision tower)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def available() -> bool:
    """Whether mlx-vlm is installed (the `mlxchat[vision]` extra)."""
    import importlib.util

    return importlib.util.find_spec("mlx_vlm") is not None


@dataclass
class VisionParts:
    """What a request with images needs beyond the language model: mlx-vlm's model (vision tower,
    projector, embedding merge) and its processor (image resizing and normalisation, and the
    expansion of each image's placeholder into its tokens)."""

    vlm: nn.Module
    processor: Any
    family: str
    image_token_id: int

    @property
    def mrope(self) -> bool:
        return self.family in MROPE_FAMILIES


class TextView(nn.Module):
    """The VLM's language model, called as an mlx-lm model: `(tokens (B, L), cache)` -> logits
    (B, L, vocab). A prefill chunk of an image-bearing prompt passes its merged `inputs_embeds`
    and, for multimodal RoPE, its `position_ids`; without them a multimodal-RoPE model takes each
    row's position from its cache (text tokens: the three sections equal), which is what a
    text-only request and mlx-vlm's own decode step compute."""

    def __init__(self, parts: VisionParts):
        super().__init__()
        self.vlm = parts.vlm
        self._mrope = parts.mrope

    @property
    def layers(self) -> list[nn.Module]:
        return self.vlm.language_model.layers

    def __call__(self, inputs: mx.array, cache: Any = None, inputs_embeds: mx.array | None = None,
                 position_ids: mx.array | None = None) -> mx.array:
        if self._mrope and position_ids is None:
            position_ids = _text_positions(inputs, cache)
        kwargs = {"position_ids": position_ids} if position_ids is not None else {}
        out = self.vlm.language_model(inputs, inputs_embeds=inputs_embeds, cache=cache, **kwargs)
        return out.logits


def _text_positions(inputs: mx.array, cache: Any) -> mx.array:
    """Multimodal RoPE positions (3, B, L) for text tokens after what `cache` holds."""
    B, L = inputs.shape
    offset = cache[0].offset if cache else 0
    steps = mx.arange(L)
    if isinstance(offset, mx.array) and offset.ndim > 0:  # a batch cache: one offset per row
        positions = mx.maximum(offset, 0)[:, None] + steps[None]
    else:
        positions = mx.broadcast_to((int(offset) + steps)[None], (B, L))
    return mx.broadcast_to(positions[None], (3, B, L))


def load_vision(folder: Path, display: str) -> tuple[TextView, VisionParts, dict[str, Any]]:
    """mlx-vlm's model and processor from `folder`; returns the text view, the parts and the
    config (as config.json has it). Raises ModelLoadError for a family not served or when mlx-vlm
    is not installed."""
    config = json.loads((folder / "config.json").read_text())
    family = str(config.get("model_type", ""))
    if family not in FAMILIES:
        raise ModelLoadError(f"{display!r} is a vision model of family {family!r}, which mlxchat "
                             f"does not serve yet (served: {', '.join(FAMILIES)})")
    if not available():
        raise ModelLoadError(f"{display!r} is a vision model: install the vision extra "
                             "(pip install 'mlxchat[vision]') to load it", code="vision_unavailable")
    from mlx_vlm.utils import load as vlm_load

    try:
        vlm, processor = vlm_load(str(folder))
    except Exception as exc:  # mlx-vlm raises ValueError/KeyError/OSError...
        raise ModelLoadError(f"cannot load vision model {display!r} from {folder}: {exc}") from exc
    image_token = getattr(vlm.config, "image_token_id", None)
    if image_token is None:
        image_token = getattr(vlm.config, "image_token_index")
    parts = VisionParts(vlm=vlm, processor=processor, family=family, image_token_id=int(image_token))
    return TextView(parts), parts, config


def adapt_template(tokenizer: Any) -> None:
    """Let `tokenizer` (mlx-lm's wrapper) render string message content with a chat template that
    takes only lists of parts (SmolVLM's iterates `message['content']`): such a template then gets
    each string as one text part. Templates that render strings are left as they are."""
    hf = tokenizer._tokenizer
    original = hf.apply_chat_template
    probe = "[[probe]]"
    try:
        if probe in original([{"role": "user", "content": probe}], tokenize=False):
            return
    except Exception:  # noqa: BLE001 - a template that refuses strings: adapt it
        pass

    def as_parts(conversation: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(conversation, list):
            conversation = [{**m, "content": [{"type": "text", "text": m["content"]}]}
                            if isinstance(m, dict) and isinstance(m.get("content"), str) else m
                            for m in conversation]
        return original(conversation, *args, **kwargs)

    hf.apply_chat_template = as_parts
