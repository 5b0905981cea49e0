"""Text embeddings from a decoder model: its last hidden state, pooled to one L2-normalised vector.

Two kinds of model embed (which one a folder holds: engine/loading/embedding_recipe.py):

- A dedicated embedding model (the Qwen3-Embedding family, an mlx-lm `qwen3` folder) says so in
  its sentence-transformers files: `modules.json` lists a `Pooling` module whose `config.json`
  sets `pooling_mode_lasttoken` (or `pooling_mode_mean_tokens`), and
  `config_sentence_transformers.json` carries its `prompts` (Qwen3-Embedding's query prompt is
  `Instruct: Given a web search query, retrieve relevant passages that answer the query\\nQuery:`,
  its document prompt empty). Its vector is the hidden state of the last token, as its model card's
  `last_token_pool` takes it, and may be truncated to fewer `dimensions` (Matryoshka training).
- Any chat model: the mean of its last hidden state over the input's tokens, as llama.cpp's
  `--embeddings` pools a decoder; its full width only.

A batch is padded on the right: under the causal mask a real token never attends to a later pad,
so each row's hidden states are those of the row alone, and pooling reads only its real tokens.
An input longer than one model call takes (engine/scheduling/embedding_queue.py) goes through in
segments with a model cache (`pool_segment`, one per scheduler tick), each segment attending to
those before it as in one call, its pooled state carried over; `finish_pooled` normalises it.

    recipe = embedding_recipe(folder, config)
    vectors = embed_batch(model, [[1, 2, 3], [4, 5]], recipe)     # mx.array (2, hidden), unit rows
"""

import mlx.core as mx
import mlx.nn as nn

from ..loading.embedding_recipe import EmbeddingRecipe
from ..mlx_lm_adapter import text_model

def backbone(model: nn.Module) -> nn.Module:
    """The module that maps token ids to the last hidden state (after the final norm), without
    the language-model head: `model.model` for llama/qwen3-style mlx-lm models, inside
    `language_model` for the multimodal wrappers."""
    inner = text_model(model)
    found = getattr(inner, "model", None)
    if found is None:
        raise TypeError(f"{type(model).__name__} has no inner `model` giving hidden states")
    return found


def embed_batch(model: nn.Module, rows: list[list[int]], recipe: EmbeddingRecipe,
                dimensions: int | None = None) -> mx.array:
    """One model call: each row's pooled, L2-normalised vector (float32, shape (rows, width));
    `dimensions` keeps the first that many components before normalising."""
    lengths = mx.array([len(r) for r in rows])
    width = max(len(r) for r in rows)
    ids = mx.array([r + [0] * (width - len(r)) for r in rows])
    hidden = backbone(model)(ids).astype(mx.float32)  # (rows, width, hidden)
    if recipe.pooling == "last":
        pooled = hidden[mx.arange(len(rows)), lengths - 1]
    else:
        real = (mx.arange(width)[None, :] < lengths[:, None]).astype(mx.float32)
        pooled = (hidden * real[..., None]).sum(axis=1) / lengths[:, None].astype(mx.float32)
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    norms = mx.linalg.norm(pooled, axis=1, keepdims=True)
    out = pooled / mx.maximum(norms, 1e-12)
    mx.eval(out)
    return out


def pool_segment(model: nn.Module, tokens: list[int], cache: list, recipe: EmbeddingRecipe,
                 pooled: mx.array | None) -> mx.array:
    """One segment of a long input, after the segments already in `cache`: the running sum of
    the hidden states (mean pooling) or the segment's last one (last-token pooling)."""
    hidden = backbone(model)(mx.array([tokens]), cache=cache)[0].astype(mx.float32)
    out = hidden[-1] if recipe.pooling == "last" else \
        hidden.sum(axis=0) + (pooled if pooled is not None else 0.0)
    mx.eval(out)
    return out


def finish_pooled(pooled: mx.array, length: int, recipe: EmbeddingRecipe,
                  dimensions: int | None = None) -> mx.array:
    """A long input's vector from its pooled state (`length` tokens): shape (1, width), unit."""
    vector = pooled if recipe.pooling == "last" else pooled / length
    if dimensions is not None:
        vector = vector[:dimensions]
    out = (vector / mx.maximum(mx.linalg.norm(vector), 1e-12))[None]
    mx.eval(out)
    return out
