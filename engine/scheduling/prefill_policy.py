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

# Prompt tokens per tick while others decode, by backend (None: one prefill chunk). Measured on
# the H200 (docs/gpu.md "Many streams", Qwen3-8B, 8 streams, a 4,000-token prompt arriving): with
# the chunk riding in mixed steps, one memory-sized chunk (1,024) per tick gave the running
# streams' p95 gap 2.25x steady and the prompt's TTFT 1.19x idle; 512 tokens 2.23x and 1.66x;
# 256 1.87x and 2.95x. On the CPU smaller budgets lower the gaps (the bundled model, 4 streams:
# p95 60x steady at 512, 14x at 32) but none reaches 2x, and prompts arriving together would
# start in different ticks: it stays at one chunk.
DECODING_TOKENS: dict[str, int | None] = {"cuda": None, "cpu": None}
# Prefill chunks per tick while nothing decodes.
IDLE_CHUNKS = 4


def tick_budget(chunk: int, decoding: bool) -> int:
    """Prompt tokens this tick may prefill, given the model's prefill `chunk` and whether other
    requests are decoding (at least 1, at most one chunk while decoding)."""
    if not decoding:
        return IDLE_CHUNKS * chunk
    tokens = DECODING_TOKENS.get(backend())
    return chunk if tokens is None else max(1, min(tokens, chunk))
