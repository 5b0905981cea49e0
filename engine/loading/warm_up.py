"""A freshly loaded model's first steps, taken at load time: on a GPU the first call of each
kernel compiles it (MLX's CUDA and Metal kernels are built on first use, and CUDA's compiled
one-token step on its first call), which otherwise lands on the first answer. On the CPU the
steps cost a few tens of milliseconds."""

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

log = logging.getLogger(__name__)

WARM_TOKENS = (1, 2)  # a two-token prefill, then one single-token step, as an answer begins


def warm_up(model: nn.Module) -> None:
    """Run `model` once as a short request would (a prefill, then a decode step) on a throwaway
    cache; nothing it computes is kept. A model that cannot take these steps (one that only
    embeds, say) loads all the same: its own requests say what is wrong."""
    try:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([list(WARM_TOKENS)]), cache=cache))
        mx.eval(model(mx.array([[WARM_TOKENS[0]]]), cache=cache))
    except Exception as exc:  # noqa: BLE001 - a warm-up is an optimisation, never a failed load
        log.info("no warm-up for this model: %s", exc)
