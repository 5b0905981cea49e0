"""Relevance scores for reranking, one model call a batch of rows (the formats and which model
uses which: engine/loading/rerank_recipe.py).

- `yes_no_scores`: an LLM reranker's probability of "yes" against "no" after each (query,
  document) prompt, as Qwen3-Reranker's model card computes it: the softmax of the two tokens'
  logits at the prompt's last position.
- `cosine_scores`: each document's vector against the query's (unit vectors: their dot product).

Rows are padded on the right: under the causal mask no real token attends to a later pad, so a
row's last real position is computed as for the row alone.
"""

import mlx.core as mx
import numpy as np

from ..kernels.head import split_head


def yes_no_scores(model, rows: list[list[int]], yes: int, no: int) -> mx.array:
    """P("yes") against "no" at each row's last token: shape (rows, 1), float32."""
    lengths = mx.array([len(r) for r in rows])
    width = max(len(r) for r in rows)
    ids = mx.array([r + [0] * (width - len(r)) for r in rows])
    last = mx.arange(len(rows)), lengths - 1
    parts = split_head(model)
    if parts is not None:  # the head over the last positions only
        body, head = parts
        logits = head(body(ids)[last])
    else:
        logits = model(ids)[last]
    pair = mx.stack([logits[:, no], logits[:, yes]], axis=-1).astype(mx.float32)
    scores = mx.softmax(pair, axis=-1)[:, 1:]
    mx.eval(scores)
    return scores


def cosine_scores(vectors: np.ndarray) -> np.ndarray:
    """The cosine similarity of rows 1.. (documents) with row 0 (the query), all unit vectors."""
    return vectors[1:] @ vectors[0]
