"""Images in a prompt: what a request with images carries through generation.

A message's content may be a list of parts, `{"type": "text", "text": str}` and
`{"type": "image", "image": ImageInput}`, in order. `render_with_images` renders such a
conversation with the model's chat template (given the parts, as mlx-vlm gives them, so each image
goes where the template puts its placeholder), expands each placeholder into the image's tokens with the model's processor (mlx-vlm), and returns
a `Prompt` whose `vision` is a `VisionPrompt`.

Generation (engine/decoding/generate.py) feeds a `VisionPrompt`'s prompt through
`VisionPrompt.forward`: a prefill chunk that covers image tokens takes the merged input embeddings
(mlx-vlm's vision tower and merge, computed once per request and only if some chunk needs them: a
follow-up whose image tokens all come from the prefix cache never runs the vision tower); every
other chunk and every decode step is the language model on token ids. Multimodal-RoPE families
(Qwen2.5-VL) take their positions from the image grids; past the prompt, a token's position is its
index plus the prompt's `rope_delta`.

Prefix cache: an image's tokens are one id repeated, so the cache is keyed by `keys` instead of
the token ids: each image token replaced by a number derived from its image's pixel digest (above
any vocabulary), so a follow-up about the same image reuses its prefill and another image reuses
nothing past the text before it. Snapshot files record the same keys.

One image request runs at a time in its own model calls (not batched): its decode positions and
cache keys are its own (engine/scheduling/ticks.py steps it alone).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import mlx.core as mx
import numpy as np

from ..errors import InvalidRequest
from ..loading.registry import known_vision_models

if TYPE_CHECKING:
    from PIL import Image

    from ..loading.registry import LoadedModel
    from ..loading.vision import VisionParts
    from .chat import Prompt
    from .tools import ToolRequest

# Cache keys of image tokens lie above every vocabulary.
IMAGE_KEY_BASE = 1 << 62


@dataclass(frozen=True)
class ImageInput:
    """A decoded image (RGB pixels only, orientation applied, no metadata) and the sha256 of its
    pixels."""

    image: "Image.Image"
    digest: str

    @classmethod
    def from_pil(cls, image: "Image.Image") -> "ImageInput":
        from PIL import Image

        rgb = image if image.mode == "RGB" else image.convert("RGB")
        pixels = rgb.tobytes()
        digest = hashlib.sha256(f"{rgb.width}x{rgb.height}\0".encode() + pixels).hexdigest()
        return cls(Image.frombytes("RGB", rgb.size, pixels), digest)  # pixels only: no metadata

    @functools.cached_property
    def key(self) -> int:
        """The prefix-cache key of this image's tokens."""
        return IMAGE_KEY_BASE + int(self.digest[:15], 16)


def has_images(messages: Sequence[dict[str, Any]] | None) -> bool:
    return bool(messages) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                  and any(_is_image(p) for p in m["content"]) for m in messages)


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def _not_vision() -> str:
    """The refusal of an image by a text-only model, naming the vision models known here."""
    known = known_vision_models()
    offer = (f"switch to a vision model ({', '.join(known)})" if known else
             "load a vision model (e.g. `mlxchat pull mlx-community/Qwen2.5-VL-3B-Instruct-4bit`)")
    return f"this model cannot see images: {offer}, or send text only"


def split_images(messages: Sequence[dict[str, Any]], vision: bool
                 ) -> tuple[list[dict[str, Any]], list[ImageInput]]:
    """The messages as the chat template takes them (each image part as `{"type": "image"}`) and
    the images in order; `vision`: whether the model sees images (else image parts are refused)."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            if _is_image(part) and isinstance(part.get("image"), ImageInput):
                if not vision:
                    raise InvalidRequest(_not_vision(), field=f"messages[{i}].content",
                                         code="model_not_vision")
                images.append(part["image"])
                parts.append({"type": "image"})
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise InvalidRequest(f"messages[{i}].content[{j}] must be a text or image part",
                                     field=f"messages[{i}].content", code="invalid_value")
        out.append({**m, "content": parts})
    return out, images


def placeholder(lm: "LoadedModel") -> str | None:
    """The text the model's chat template writes for one image (None: not a vision model), found
    by rendering an image part between two marked text parts; the processor's image token when the
    template does not render image parts."""
    parts: VisionParts | None = lm.extras.get("vision")
    if parts is None:
        return None
    if "placeholder" not in lm.extras:
        found = None
        try:
            text = lm.tokenizer.apply_chat_template(
                [{"role": "user", "content": [{"type": "text", "text": "[[A]]"}, {"type": "image"},
                                              {"type": "text", "text": "[[B]]"}]}],
                tokenize=False, add_generation_prompt=False)
            found = text.split("[[A]]", 1)[1].split("[[B]]", 1)[0] or None
        except Exception:  # noqa: BLE001 - a template that refuses list content
            found = None
        lm.extras["placeholder"] = found or getattr(parts.processor, "image_token", None)
    return lm.extras["placeholder"]


def render_with_images(lm: "LoadedModel", messages: Sequence[dict[str, Any]],
                       tools: "ToolRequest | None" = None, with_checkpoints: bool = True) -> "Prompt":
    """The prompt of a conversation with image parts (see the module docstring)."""
    from .chat import Prompt, render, validate_messages
    from .tools import prepare as prepare_tools

    msgs, images = split_images(messages, "vision" in lm.extras)
    msgs, kwargs = prepare_tools(lm.tokenizer, msgs, tools)
    if not images:
        return render(lm.tokenizer, msgs, with_checkpoints=with_checkpoints, **kwargs)
    validate_messages(msgs)
    if getattr(lm.tokenizer, "chat_template", None) is None:
        raise InvalidRequest("this model has no chat template; it cannot take images")
    # Rendered once, as text: the processor tokenizes it with each image's tokens expanded. The
    # one checkpoint is the prompt's end (a dense model's cache serves any shorter prefix).
    continued = msgs[-1]["role"] == "assistant" and not msgs[-1].get("tool_calls")
    text = lm.tokenizer.apply_chat_template(
        msgs, tokenize=False, **({**kwargs, "continue_final_message": True} if continued
                                 else {**kwargs, "add_generation_prompt": True}))
    mark = placeholder(lm)
    if mark and text.count(mark) != len(images):
        raise InvalidRequest(f"the conversation contains this model's image marker {mark!r} as "
                             "text; send images as image parts", field="messages",
                             code="invalid_value")
    vision = VisionPrompt.build(lm.extras["vision"], text, images)
    return Prompt(tokens=vision.tokens, checkpoints=[len(vision.tokens)], continued=continued,
                  vision=vision)


@dataclass(eq=False)
class VisionPrompt:
    """A prompt's images as the model takes them; see the module docstring."""

    parts: "VisionParts"
    # The processor's outputs as numpy arrays: MLX arrays belong to the thread that made them,
    # and the model runs on the scheduler's (`_arrays` makes them there, on first use).
    host_inputs: dict[str, Any]  # input_ids (1, L), pixel values, grids, masks
    tokens: list[int]
    keys: list[int]  # tokens with image tokens replaced by their image's key
    images: tuple[ImageInput, ...]
    _device_inputs: dict[str, Any] | None = field(default=None, repr=False)
    _embeds: mx.array | None = field(default=None, repr=False)
    _positions: mx.array | None = field(default=None, repr=False)
    rope_delta: int = 0

    @classmethod
    def build(cls, parts: "VisionParts", text: str, images: Sequence[ImageInput]) -> "VisionPrompt":
        """Run the processor over the rendered `text` and the `images` (on the calling thread;
        the model runs later, on the scheduler's)."""
        pil = [im.image for im in images]
        try:
            out = dict(parts.processor(text=[text], images=pil, return_tensors="mlx"))
        except Exception as exc:  # noqa: BLE001 - the processor rejects an image it cannot size
            raise InvalidRequest(f"the model's processor refused the image: {exc}",
                                 field="messages", code="invalid_image") from exc
        out.pop("attention_mask", None)
        host = {k: np.asarray(v) if isinstance(v, (mx.array, np.ndarray)) else v
                for k, v in out.items()}
        host["input_ids"] = host["input_ids"].reshape(1, -1)
        tokens = [int(t) for t in host["input_ids"].reshape(-1)]
        keys = cls._keys(parts, tokens, images, host.get("image_grid_thw"))
        return cls(parts, host, tokens, keys, tuple(images))

    @staticmethod
    def _keys(parts: "VisionParts", tokens: list[int], images: Sequence[ImageInput],
              grids: Any = None) -> list[int]:
        """Image tokens in order belong to the images in order. How many each image has: all of
        them for one image; from its grid for Qwen2.5-VL (t*h*w / merge^2); otherwise what the
        processor gives the image alone."""
        if len(images) == 1:
            counts = [tokens.count(parts.image_token_id)]
        elif grids is not None and parts.mrope:
            merge = parts.vlm.config.vision_config.spatial_merge_size ** 2
            counts = [int(np.prod(g)) // merge for g in np.asarray(grids).reshape(len(images), -1)]
        else:
            mark = getattr(parts.processor, "image_token", "<image>")
            counts = [sum(1 for t in np.asarray(parts.processor(
                text=[mark], images=[im.image], return_tensors="mlx")["input_ids"]).reshape(-1)
                if t == parts.image_token_id) for im in images]
        keys, image, seen = [], 0, 0
        for t in tokens:
            if t == parts.image_token_id and image < len(images):
                keys.append(images[image].key)
                seen += 1
                if seen == counts[image]:
                    image, seen = image + 1, 0
            else:
                keys.append(t)
        return keys

    def __len__(self) -> int:
        return len(self.tokens)

    def key(self, tokens: Sequence[int]) -> list[int]:
        """The prefix-cache key of `tokens` (this prompt, then what follows it)."""
        n = len(self.keys)
        return self.keys[:len(tokens)] + list(tokens[n:])

    def _image_in(self, start: int, end: int) -> bool:
        return any(k >= IMAGE_KEY_BASE for k in self.keys[start:end])

    def _arrays(self) -> dict[str, Any]:
        """The processor's outputs as MLX arrays (made on the calling thread, once)."""
        if self._device_inputs is None:
            self._device_inputs = {k: mx.array(v) if isinstance(v, np.ndarray) else v
                                   for k, v in self.host_inputs.items()}
        return self._device_inputs

    def _rope(self) -> mx.array:
        """The prompt's multimodal RoPE positions (3, 1, L); sets `rope_delta`."""
        if self._positions is None:
            lang = self.parts.vlm.language_model
            arrays = self._arrays()
            positions, delta = lang.get_rope_index(arrays["input_ids"], arrays.get("image_grid_thw"),
                                                   None, None)
            self._positions = positions
            self.rope_delta = int(mx.array(delta).reshape(-1)[0].item())
        return self._positions

    def embeddings(self) -> mx.array:
        """The merged input embeddings (1, L, hidden) of the whole prompt: the vision tower over
        every image, once per request."""
        if self._embeds is None:
            kwargs = dict(self._arrays())
            input_ids, pixel_values = kwargs.pop("input_ids"), kwargs.pop("pixel_values")
            out = self.parts.vlm.get_input_embeddings(input_ids, pixel_values, **kwargs)
            self._embeds = out.inputs_embeds
            delta = getattr(out, "rope_deltas", None)
            if self.parts.mrope and self._positions is None and delta is not None:
                self._positions = out.position_ids  # computed with the embeddings: not twice
                self.rope_delta = int(mx.array(delta).reshape(-1)[0].item())
        return self._embeds

    def forward(self, model: Any, inputs: mx.array, start: int, cache: Any) -> mx.array:
        """Logits (1, L, vocab) of `inputs` (1-D tokens at positions start.. of the sequence)."""
        n, end = len(self.tokens), start + inputs.shape[0]
        embeds = self.embeddings()[:, start:end] if start < n and self._image_in(start, end) else None
        positions = None
        if self.parts.mrope:
            rope = self._rope()
            if end <= n:
                positions = rope[..., start:end]
            else:
                steps = mx.arange(start, end) + self.rope_delta
                positions = mx.broadcast_to(steps[None, None], (3, 1, end - start))
        return model(inputs[None], cache=cache, inputs_embeds=embeds, position_ids=positions)
