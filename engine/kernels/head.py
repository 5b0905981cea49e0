"""The output head on the last prompt position only.

mlx-lm's models end with a full-vocabulary head over every position they are given. For a prompt
chunk whose last token's logits start generation, only that last row is needed: the head over
every row of a 512-token chunk of a 248k-word vocabulary is a (512, 248320) array (254 MB in bf16)
and a GEMM over the head's weights for nothing. `last_logits` runs the model's body over the chunk
and the head over its last row alone; the row's logits are those of the full call (the same body,
the same head on the same hidden row; tests/test_gpu_layout.py checks them on the CPU).

It knows the mlx-lm classes whose forward is exactly "body, then the head" (`SPLIT_HEAD`); for any
other model (logit soft-capping, scaled heads, a sharded head) it falls back to the full call.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3, qwen3_5, qwen3_next

# mlx-lm model classes whose __call__ is `head(self.model(inputs, cache))`, the head being
# `lm_head` or, with tied embeddings, `model.embed_tokens.as_linear`.
SPLIT_HEAD = (llama.Model, qwen2.Model, qwen3.Model, qwen3_next.Model, qwen3_5.TextModel)


def split_head(model: nn.Module) -> tuple[nn.Module, Callable[[mx.array], mx.array]] | None:
    """(body, head) of `model` such that `model(x, cache) == head(body(x, cache))`, or None when
    its forward is not known to be that."""
    inner = model.language_model if isinstance(model, qwen3_5.Model) else model
    if not isinstance(inner, SPLIT_HEAD) or getattr(inner, "sharding_group", None) is not None:
        return None
    if inner.args.tie_word_embeddings:
        return inner.model, inner.model.embed_tokens.as_linear
    return inner.model, inner.lm_head


def last_logits(model: nn.Module, inputs: mx.array, cache: Any) -> mx.array:
    """The logits (B, 1, vocab) of the last position of `inputs` (B, L) after the model's forward
    over all of them (which fills `cache` as the full call does)."""
    parts = split_head(model)
    if parts is None:
        return model(inputs, cache=cache)[:, -1:, :]
    body, head = parts
    return head(body(inputs, cache)[:, -1:, :])
