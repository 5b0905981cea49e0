"""Gemma 2 with its sliding window, which mlx-lm's gemma2 class leaves out (there every layer
attends to the whole context, so answers drift from the model's own once a conversation is longer
than the window).

Gemma 2 alternates: even layers attend to the last `sliding_window` tokens, odd layers to all of
them (Hugging Face's and llama.cpp's layout). Done as mlx-lm's gemma3 does it: a rotating cache of
the window's size and a window mask for the sliding layers, mlx-lm's own gemma2 layers otherwise.
`model_classes` picks this class for every gemma2 config (a converted GGUF or a downloaded mlx-lm
folder; without a `sliding_window` key, Gemma 2's 4096) and mlx-lm's own class for the others.
It also makes batched decoding work, which fails in mlx-lm's gemma2 with grouped-query heads.
"""

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import gemma2
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..mlx_lm_adapter import model_classes as mlx_lm_classes


@dataclass
class ModelArgs(gemma2.ModelArgs):
    sliding_window: int = 4096


class GemmaModel(gemma2.GemmaModel):
    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.embed_tokens(inputs)
        h = h * (self.args.hidden_size**0.5)
        if cache is None:
            cache = [None] * len(self.layers)
        window = self._fit(create_attention_mask(h, cache[0], return_array=True,
                                                 window_size=self.args.sliding_window))
        full = self._fit(create_attention_mask(h, cache[1], return_array=True)
                         if len(cache) > 1 else None)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, window if i % 2 == 0 else full, c)
        return self.norm(h)


    def _fit(self, mask: mx.array | None) -> mx.array | None:
        """A batch's per-row mask (B, 1, L, S) made to broadcast over gemma2's grouped-query
        scores (B, kv heads, repeats, L, S); mlx-lm's gemma2 fails on batched decoding there."""
        grouped = self.args.num_attention_heads > self.args.num_key_value_heads
        return mask[:, :, None] if mask is not None and mask.ndim == 4 and grouped else mask


class Model(gemma2.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model = GemmaModel(args)

    def make_cache(self) -> list[Any]:
        return [RotatingKVCache(max_size=self.args.sliding_window) if i % 2 == 0 else KVCache()
                for i in range(self.args.num_hidden_layers)]


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's `get_model_classes`: this module's Gemma 2 for gemma2, else mlx-lm's class."""
    if config.get("model_type") == "gemma2":
        return Model, ModelArgs
    return mlx_lm_classes(config)
