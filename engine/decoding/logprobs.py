"""The log-probabilities a request reports per token (OpenAI's `logprobs` / `top_logprobs`): the
model's own log-softmax over its logits, before penalties, bias, grammar or temperature."""

from typing import Any

import mlx.core as mx
import numpy as np

from ..events import TokenLogprob, TopLogprob
from ..mlx_lm_adapter import byte_decoder


def _text(tokenizer: Any, token: int) -> tuple[str, tuple[int, ...]]:
    """A token's text and its UTF-8 bytes (a token holding part of a character decodes as U+FFFD;
    its bytes are then the ones the tokenizer's byte-level pieces stand for, when it has them)."""
    text = tokenizer.decode([token])
    if "\ufffd" in text:
        piece = tokenizer.convert_ids_to_tokens(token)
        decoder = byte_decoder()
        if isinstance(piece, str) and all(c in decoder for c in piece):
            return text, tuple(decoder[c] for c in piece)
    return text, tuple(text.encode("utf-8"))


def most_likely(values: np.ndarray, top: int) -> np.ndarray:
    """The ids of the `top` largest `values`, largest first and equal values by id: the first
    `top` of a stable argsort of `-values` (MLX's `argsort`), without sorting the whole
    vocabulary (a full sort of 49,152 log-probabilities took ~4 ms a token on this CPU)."""
    k = min(top, values.size)
    kth = values[np.argpartition(-values, k - 1)[:k]].min()
    candidates = np.flatnonzero(values >= kth)  # every value tied with the k-th too
    return candidates[np.lexsort((candidates, -values[candidates]))][:k]


def token_logprob(tokenizer: Any, row: mx.array, token: int, top: int) -> TokenLogprob:
    """`row` is the (1, vocab) log-softmax the token was sampled from (read once, on the host)."""
    values = np.array(row.reshape(-1).astype(mx.float32))  # bf16 on a GPU: exact in float32
    alternatives: tuple[TopLogprob, ...] = ()
    if top:
        ids = most_likely(values, top)
        alternatives = tuple(TopLogprob(text, v, raw)
                             for i, v in zip(ids.tolist(), values[ids].tolist())
                             for text, raw in [_text(tokenizer, i)])
    text, raw = _text(tokenizer, token)
    return TokenLogprob(token=text, logprob=values[token].item(), bytes=raw, top=alternatives)

