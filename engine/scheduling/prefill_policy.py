"""How many prompt tokens one scheduler tick prefills.

While other requests decode, every token a tick prefills delays their next token: a tick is one
batched decode step plus the prefill work in front of it, so the gap between the running streams'
tokens is (step + prefill of the tick's budget). While nothing decodes, a larger budget lets
requests that arrive together start together and the batch run full from its first step.

The budget while decoding is a token count, not a number of chunks, so that it holds whatever
chunk size the model's memory allowed (engine/decoding/generate.py `memory_sized_chunk`: 1,024
tokens for an 8B model on CUDA, 512 on the CPU). `DECODING_TOKENS` None means one prefill chunk
per tick (the policy before issue 33); bench.concurrency_step's `interfere` part sweeps it.
"""

from ..device import backend

# Prompt tokens per tick while others decode, by backend (None: one prefill chunk). See
# docs/gpu.md "Many streams" for the figures that chose them.
DECODING_TOKENS: dict[str, int | None] = {"cuda": 512, "cpu": 64}
# Prefill chunks per tick while nothing decodes.
IDLE_CHUNKS = 4


def tick_budget(chunk: int, decoding: bool) -> int:
    """Prompt tokens this tick may prefill, given the model's prefill `chunk` and whether other
    requests are decoding (at least 1, at most one chunk while decoding)."""
    if not decoding:
        return IDLE_CHUNKS * chunk
    tokens = DECODING_TOKENS.get(backend())
    return chunk if tokens is None else max(1, min(tokens, chunk))
