"""How far a lossy path (int8 activations, the 8-bit KV cache) moves a model's predictions: the
perplexity of a fixed public-domain text (bench/data/declaration-of-independence.txt, the US
Declaration of Independence, 1776), and each position's next-token distribution against the exact
path's (mean KL divergence, top-1 agreement). The text goes in `step` tokens a forward, so every
product takes the 1-8 row kernels and every chunk attends over the cache the earlier ones left."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

TEXT = Path(__file__).resolve().parent / "data" / "declaration-of-independence.txt"
GATE = 0.005  # relative perplexity difference allowed


def text_tokens(lm: Any) -> list[int]:
    return lm.tokenizer.encode(TEXT.read_text())


def logprobs(lm: Any, tokens: list[int], step: int = 8) -> mx.array:
    """(len(tokens), vocab) log-probabilities of the next token after each position."""
    cache = make_prompt_cache(lm.model)
    out = []
    for start in range(0, len(tokens), step):
        logits = lm.model(mx.array([tokens[start:start + step]]), cache=cache)[0].astype(mx.float32)
        out.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        mx.eval(out[-1])
    return mx.concatenate(out)


def perplexity_of(lp: mx.array, tokens: list[int]) -> float:
    """exp(mean negative log-likelihood of each token after the first), from `logprobs`."""
    picked = mx.take_along_axis(lp[:-1], mx.array(tokens[1:])[:, None], axis=-1)
    return math.exp(-mx.mean(picked).item())


def perplexity(lm: Any, tokens: list[int], step: int = 8) -> float:
    return perplexity_of(logprobs(lm, tokens, step), tokens)


def compare(exact: mx.array, lossy: mx.array, tokens: list[int]) -> dict[str, float]:
    """Perplexities, their relative difference, mean and max KL(exact || lossy) in nats, and the
    share of positions whose most likely next token is the same."""
    ppl, lossy_ppl = perplexity_of(exact, tokens), perplexity_of(lossy, tokens)
    kl = mx.sum(mx.exp(exact) * (exact - lossy), axis=-1)
    same = mx.mean((mx.argmax(exact, -1) == mx.argmax(lossy, -1)).astype(mx.float32))
    return dict(perplexity=ppl, lossy_perplexity=lossy_ppl, relative=lossy_ppl / ppl - 1,
                mean_kl=mx.mean(kl).item(), max_kl=mx.max(kl).item(), top1_agreement=same.item(),
                tokens=len(tokens))
