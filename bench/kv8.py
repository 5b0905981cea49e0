"""The 8-bit KV cache (`--kv-bits 8`, engine/kernels/kv8.py) against the full cache, one process,
the same model folder loaded twice:

    python -m bench.kv8 [--model bundled|llama-350m|llama-1b|...|FOLDER] [--contexts 512,2048] [--reps 3]
    python -m bench.kv8 --probe     # which shapes this device's MLX runs mlx-lm's 8-bit attention at

Rows:
  quality   perplexity of bench/quality.py's text (all of it, 8 tokens a step) with each cache,
            the relative difference (gate: <= +0.5%), mean and max KL(full || 8-bit) of the
            next-token distributions, top-1 agreement.
  bytes     the cache's bytes holding each context (a prefix-cache snapshot's arrays), and their
            ratio (goal <= 0.5; 0.3125 by construction on the CPU: codes plus an fp32 scale and
            bias per 32 values, against fp32).
  decode    greedy one-token steps (our fused layer ops) after each context, tok/s with each
            cache, runs interleaved, best of --reps; the ratio says what dequantizing the 8-bit
            rows costs or saves at that length. Speed is load-sensitive: run it on a quiet machine.
  edit      with each cache, a conversation and then the same one with its last user turn edited,
            through the prefix cache (snapshots written to files and read back by a fresh one):
            prompt tokens the edited turn reused, and whether every answer's tokens equal those of
            a run without the prefix cache; then two requests at once through the Engine service
            (scheduler, prefix cache), and whether each answer equals the one it gets alone.
On the GPU (and for a model in half precision) the 8-bit cache is mlx-lm's `QuantizedKVCache`;
`meta.kv_format` says which group size this device runs. Results: a table on stdout and JSON in
bench/results/kv8-cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "kv8-cpu.json"


def _load(model: str, kv_bits: str | None):
    from engine.kernels.kv8 import ENV
    from engine.loading.registry import load_model

    from .decode import random_folder

    folder = None if model == "bundled" else model if Path(model).is_dir() else str(random_folder(model))
    if kv_bits:
        os.environ[ENV] = kv_bits
    try:
        return load_model(folder)
    finally:
        os.environ.pop(ENV, None)


def _context(lm, tokens: list[int], n: int) -> list[int]:
    out = list(tokens)
    while len(out) < n:
        out += tokens
    return out[:n]


def _fill(lm, ids: list[int], chunk: int = 512):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm.model)
    for start in range(0, len(ids), chunk):
        logits = lm.model(mx.array([ids[start:start + chunk]]), cache=cache)
        mx.eval(logits)
    return cache, logits[:, -1:]


def _decode_tps(lm, ids: list[int], steps: int) -> float:
    import mlx.core as mx

    cache, logits = _fill(lm, ids)
    token = mx.argmax(logits, axis=-1)
    mx.eval(token)
    t0 = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(lm.model(token, cache=cache), axis=-1)
        mx.eval(token)
    return steps / (time.perf_counter() - t0)


def _ask(lm, messages: list[dict], cache=None) -> tuple[list[int], int]:
    from engine.decoding.generate import build_prompt, generate
    from engine.decoding.sampling import SamplingParams

    events = list(generate(lm, build_prompt(lm, messages=messages), SamplingParams(max_tokens=16),
                           prefix_cache=cache))
    return [e.token for e in events if e.kind == "token"], events[-1].usage.cached_tokens


def edited_turn(lm) -> dict:
    """A conversation, then its last user turn edited, through a prefix cache persisting to files,
    then the edited one again through a fresh cache reading those files: the prompt tokens each
    reused and whether each answer's tokens equal a run without the prefix cache."""
    import tempfile

    from engine.prefix_cache.store import PrefixCache

    def turn(topic: str) -> dict:
        return {"role": "user", "content": f"And {topic}, in one sentence?"}

    chat = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Tell me about rivers and the towns on them. " * 6},
            {"role": "assistant", "content": "Rivers carry water, trade and stories. " * 6}]
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = PrefixCache(lm, persist_dir=Path(tmp), write_delay=None)
        for name, messages, store in (("first", chat + [turn("bridges")], cache),
                                      ("edited", chat + [turn("owls")], cache),
                                      ("from files", chat + [turn("owls")], None)):
            if store is None:
                cache.persist()
                store = PrefixCache(lm, persist_dir=Path(tmp), write_delay=None)
            on, cached = _ask(lm, messages, store)
            off, _ = _ask(lm, messages)
            out[name] = dict(cached=cached, same_as_without_cache=on == off, tokens=len(on))
    return out


def two_at_once(lm) -> dict:
    """Two requests submitted together to an Engine (two may run at once), then each alone: do
    the answers agree, and did the one asked again reuse its snapshot?"""
    from engine.decoding.sampling import SamplingParams
    from engine.scheduling.service import Engine

    engine = Engine(lm.name, load=lambda name, **_: lm, max_running=2).start()
    try:
        params = SamplingParams(max_tokens=16)
        asks = [[{"role": "user", "content": "Tell me about the sea."}],
                [{"role": "user", "content": "And the mountains, in a few words?"}]]

        def tokens(handles) -> list[list[int]]:
            return [[e.token for e in h.events(timeout=300) if e.kind == "token"] for h in handles]

        together = tokens([engine.submit(messages=m, params=params) for m in asks])
        again = engine.submit(messages=asks[0], params=params)
        alone = tokens([again]) + tokens([engine.submit(messages=asks[1], params=params)])
        return dict(same_as_alone=together == alone, tokens=[len(t) for t in together],
                    reused=again.usage.cached_tokens)
    finally:
        engine.stop()


def probe() -> None:
    """mlx-lm's quantized attention (8 bits, fp16) at each head size and group, for 1, 64 and 300
    keys and 1 or 7 queries: ok, or MLX's refusal (on the GPU each new shape compiles first)."""
    import mlx.core as mx
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    t0 = time.time()
    for dim, group in ((128, 128), (128, 64), (128, 32), (64, 64), (64, 32)):
        for keys in (1, 64, 300):
            for queries in (1, 7):
                kv = mx.quantize(mx.random.normal((1, 2, keys, dim)).astype(mx.float16),
                                 group_size=group, bits=8)
                q = mx.random.normal((1, 4, queries, dim)).astype(mx.float16)
                try:
                    mx.eval(quantized_scaled_dot_product_attention(
                        q, kv, kv, scale=1.0, mask=None, group_size=group, bits=8))
                    said = "ok"
                except (RuntimeError, ValueError) as exc:
                    said = f"no: {str(exc)[:100]}"
                print(f"head {dim} group {group} keys {keys} queries {queries}: {said} "
                      f"({time.time() - t0:.0f} s)", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--probe", action="store_true", help="only the shapes table (see probe)")
    a = ap.parse_args(argv)
    if a.probe:
        return probe()

    import mlx.core as mx

    from engine.kernels import active_path
    from engine.model_cache import LOCAL
    from engine.kernels.kv8 import kv_format

    from .common import cpu_model
    from .quality import compare, logprobs, text_tokens

    full, kv8 = _load(a.model, None), _load(a.model, "8")
    tokens = text_tokens(full)
    quality = compare(logprobs(full, tokens), logprobs(kv8, tokens), tokens)
    print(f"{a.model} ({active_path()}; {kv_format(kv8.model)})")
    print(f"quality over {quality['tokens']} tokens: perplexity {quality['perplexity']:.4f} full, "
          f"{quality['lossy_perplexity']:.4f} 8-bit ({quality['relative'] * 100:+.3f}%, gate <= "
          f"+0.5%); mean KL {quality['mean_kl']:.5f} nats (max {quality['max_kl']:.4f}); top-1 "
          f"agreement {quality['top1_agreement'] * 100:.1f}%")
    rows = []
    print(f"{'context':>8} {'full bytes':>12} {'8-bit bytes':>12} {'ratio':>6} "
          f"{'full tok/s':>10} {'8-bit tok/s':>11} {'ratio':>6}")
    for n in map(int, a.contexts.split(",")):
        ids = _context(full, tokens, n)
        sizes = [LOCAL.nbytes(LOCAL.copy(_fill(lm, ids)[0])) for lm in (full, kv8)]
        speeds: dict[str, list[float]] = {"full": [], "kv8": []}
        for _ in range(a.reps):  # interleaved: load that comes and goes hits both alike
            speeds["full"].append(_decode_tps(full, ids, a.steps))
            speeds["kv8"].append(_decode_tps(kv8, ids, a.steps))
        best = {k: max(v) for k, v in speeds.items()}
        rows.append(dict(context=n, full_bytes=sizes[0], kv8_bytes=sizes[1],
                         bytes_ratio=sizes[1] / sizes[0], decode_tps=best, decode_all=speeds,
                         decode_ratio=best["kv8"] / best["full"]))
        print(f"{n:>8} {sizes[0]:>12} {sizes[1]:>12} {sizes[1] / sizes[0]:>6.3f} "
              f"{best['full']:>10.2f} {best['kv8']:>11.2f} {best['kv8'] / best['full']:>6.2f}")
    edits = {}
    for name, lm in (("full", full), ("kv8", kv8)):
        turns, together = edited_turn(lm), two_at_once(lm)
        print(f"two requests at once, {name} cache: {together}")
        print(f"edited turn, {name} cache: " + "; ".join(
            f"{k}: reused {v['cached']} tokens, same as without the prefix cache: {v['same_as_without_cache']}"
            for k, v in turns.items()))
        edits[name] = {**turns, "engine": together}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(model=a.model, path=active_path(), kv_format=kv_format(kv8.model), steps=a.steps,
                device=str(mx.default_device()), cpu=cpu_model(),
                reps=a.reps, cpus=os.cpu_count(), load_avg=os.getloadavg(), time=time.time(),
                command="python -m bench.kv8 " + " ".join(argv if argv is not None else sys.argv[1:]))
    out.write_text(json.dumps(dict(meta=meta, quality=quality, contexts=rows, edited_turn=edits),
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    from engine import restart_with_blas

    restart_with_blas("bench.kv8")  # as `mlxchat` does: prompt chunks of 64+ rows go to BLAS
    main()
