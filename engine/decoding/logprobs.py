"""The log-probabilities a request reports per token (OpenAI's `logprobs` / `top_logprobs`): the
model's own log-softmax over its logits, before penalties, bias, grammar or temperature."""

from typing import Any

import mlx.core as mx

from ..events import TokenLogprob, TopLogprob


def _text(tokenizer: Any, token: int) -> tuple[str, tuple[int, ...]]:
    """A token's text and its UTF-8 bytes (a token holding part of a character decodes as U+FFFD;
    its bytes are then the ones the tokenizer's byte-level pieces stand for, when it has them)."""
    text = tokenizer.decode([token])
    if "\ufffd" in text:
        from mlx_lm.tokenizer_utils import _byte_decoder

        piece = tokenizer.convert_ids_to_tokens(token)
        decoder = _byte_decoder()
        if isinstance(piece, str) and all(c in decoder for c in piece):
            return text, tuple(decoder[c] for c in piece)
    return text, tuple(text.encode("utf-8"))


def token_logprob(tokenizer: Any, row: mx.array, token: int, top: int) -> TokenLogprob:
    """`row` is the (1, vocab) log-softmax the token was sampled from."""
    row = row.reshape(-1)
    alternatives: tuple[TopLogprob, ...] = ()
    if top:
        ids = mx.argsort(-row)[:top]
        values = row[ids].tolist()
        alternatives = tuple(TopLogprob(text, v, raw) for i, v in zip(ids.tolist(), values)
                             for text, raw in [_text(tokenizer, i)])
    text, raw = _text(tokenizer, token)
    return TokenLogprob(token=text, logprob=row[token].item(), bytes=raw, top=alternatives)

