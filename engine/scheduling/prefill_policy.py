"""How many prompt tokens one scheduler tick prefills.

While other requests decode, every token a tick prefills delays their next token: the tick's
prompt tokens ride in the batch's decode step (a mixed step, engine/decoding/mixed.py) or, where
that cannot run, go through calls of their own before it. Either way the running streams' gap
grows with the budget and the new prompt's time to first token shrinks with it. While nothing
decodes, a larger budget lets requests that arrive together start together and the batch run
full from its first step.

The budget while decoding is a token count, not a number of chunks, so that it holds whatever
chunk size the model's memory allowed (engine/decoding/generate.py `memory_sized_chunk`: 1,024
tokens for an 8B model on CUDA, 512 on the CPU). `DECODING_TOKENS` None means one prefill chunk
per tick (the policy before issue 33); bench.concurrency_step's `interfere` part sweeps it.
"""

from ..device import backend

# Prompt tokens per tick while others decode, by backend (None: one prefill chunk). Measured on
# the H200 (docs/gpu.md "Many streams", Qwen3-8B bf16, 8 streams decoding, a 4,000-token prompt
# arriving, its chunks riding in mixed steps, medians pooled over 3-4 calls): 768 tokens kept the
# streams' p95 gap at 38 ms (2.41x their steady p95; 1.99x in the two calls after the one-read
# filter) with the prompt's TTFT 1.40x an idle engine's; one 1,024-token chunk 44 ms (2.57x) and
# 1.11x; 512 tokens 42 ms (2.25x) and 1.67x (before mixed steps, one chunk per tick: 3.25x and
# 1.74x). On the CPU smaller budgets lower the gaps (the bundled model, 4 streams: p95 60x steady
# at 512, 14x at 32) but none came near 2x, and prompts arriving together would start in
# different ticks: it stays at one chunk.
DECODING_TOKENS: dict[str, int | None] = {"cuda": 768, "cpu": None}
# Prefill chunks per tick while nothing decodes.
IDLE_CHUNKS = 4


def tick_budget(chunk: int, decoding: bool) -> int:
    """Prompt tokens this tick may prefill, given the model's prefill `chunk` and whether other
    requests are decoding (at least 1, at most one chunk while decoding)."""
    if not decoding:
        return IDLE_CHUNKS * chunk
    tokens = DECODING_TOKENS.get(backend())
    return chunk if tokens is None else max(1, min(tokens, chunk))
