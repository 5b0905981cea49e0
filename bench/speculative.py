"""Speculative decoding vs baseline, side by side, one row per target/draft pair.

    python -m bench.speculative                       # CPU: the bundled model's pairs
    python -m bench.speculative --openblas            # same, fp32 matmuls through OpenBLAS threads
    python -m bench.speculative --device gpu --pairs random --dtype bfloat16 \\
        --target-shape qwen3-8b --draft-shape qwen3-0.6b --trunc-layers 4

Pairs:
  bundled  fp32 dequantized SmolLM2-135M target with (a) its own Q4 weights as draft and (b) its
           first --trunc-layers layers as a self-draft.
  random   random-weight target/draft built from config shapes (no checkpoint): (a) an independent
           smaller model as draft (acceptance near 0: a draft "trained for nothing"), (b) the
           target's own truncation. Vocabulary 49152 (SmolLM2's); prompts are token ids and the
           tokenizer bench.shapes.IdTokenizer, so these pairs run offline (`python -m bench
           speculative` runs them); the shapes are otherwise the named models'.

For each pair: per-token costs are measured first (a draft step and each extra verified token, in
units of one target step) and given to the adaptive k policy; then each prompt is decoded greedily
by plain `Generation` and by `Generation` with a speculator. Reported: decode tokens/s of both,
speedup, acceptance rate, tokens per target step, mean k, whether the tokens were identical, and
the recommendation: speculation only where it is at least MIN_SPEEDUP faster with identical output,
baseline elsewhere. JSON in bench/results/speculative-<device>.json.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
MIN_SPEEDUP = 1.1
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "Explain what a prime number is to a child.",
]
SHAPES = {  # the named models' shapes (vocabulary replaced, see above)
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, intermediate_size=6144,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64),
}


def random_model(shape: str, dtype, seed: int):
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    config = dict(model_type="qwen3", vocab_size=49152, rms_norm_eps=1e-6, rope_theta=1e6,
                  max_position_embeddings=40960, tie_word_embeddings=False, **SHAPES[shape])
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model, config


def step_time(model, n_tokens: int, repeats: int = 5) -> float:
    """Seconds for one forward of `n_tokens` tokens after a 64-token context (trimmed back after)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(64)[None] % 1000 + 100, cache=cache))
    inputs = mx.arange(n_tokens)[None] + 200
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        mx.eval(model(inputs, cache=cache))
        times.append(time.perf_counter() - start)
        for c in cache:
            c.trim(n_tokens)
    return sorted(times[1:])[repeats // 2]


def measure_costs(target, draft, k: int) -> dict:
    one, verify, draft_step = step_time(target, 1), step_time(target, k + 1), step_time(draft, 1)
    return dict(target_step_s=one, verify_step_s=verify, draft_step_s=draft_step,
                draft_cost=draft_step / one, verify_cost=max(verify - one, 0) / (k * one))


def run_pair(name: str, target_lm, draft, prompts, max_tokens: int, k_max: int, reps: int = 1) -> dict:
    """`prompts`: engine `Prompt`s; each is decoded `reps` times by plain and speculative greedy
    decoding, alternating; tok/s is the median over all runs, with the spread."""
    from engine.decoding.generate import generate
    from engine.decoding.sampling import SamplingParams
    from engine.decoding.speculative import SpecConfig, Speculator, ModelDrafter

    costs = measure_costs(target_lm.model, draft, k_max)
    config = SpecConfig(k_max=k_max, draft_cost=costs["draft_cost"], verify_cost=costs["verify_cost"])
    params = SamplingParams(max_tokens=max_tokens)
    rates = {"base": [], "spec": []}
    totals = dict(drafted=0, accepted=0, steps=0, emitted=0)
    identical = True
    tokens = lambda events: [e.token for e in events if e.kind == "token"]  # noqa: E731
    list(generate(target_lm, prompts[0], SamplingParams(max_tokens=4)))  # warm-up
    for rep in range(reps):
        for prompt in prompts:
            spec = Speculator(target_lm.model, ModelDrafter(draft), config)
            order = ("base", "spec") if rep % 2 == 0 else ("spec", "base")
            runs = {key: list(generate(target_lm, prompt, params,
                                       **({"speculator": spec} if key == "spec" else {})))
                    for key in order}
            identical &= tokens(runs["base"]) == tokens(runs["spec"])
            for key, events in runs.items():
                if events[-1].timings.tokens_per_s:
                    rates[key].append(events[-1].timings.tokens_per_s)
            totals["drafted"] += spec.drafted
            totals["accepted"] += spec.accepted
            totals["steps"] += spec.steps
            totals["emitted"] += spec.emitted
    base_tps, spec_tps = statistics.median(rates["base"]), statistics.median(rates["spec"])
    speedup = spec_tps / base_tps
    acceptance = totals["accepted"] / totals["drafted"] if totals["drafted"] else None
    row = dict(
        pair=name, baseline_tokens_per_s=round(base_tps, 2), speculative_tokens_per_s=round(spec_tps, 2),
        speedup=round(speedup, 3), runs=len(rates["base"]),
        baseline_spread=[round(min(rates["base"]), 2), round(max(rates["base"]), 2)],
        speculative_spread=[round(min(rates["spec"]), 2), round(max(rates["spec"]), 2)],
        acceptance_rate=None if acceptance is None else round(acceptance, 3),
        tokens_per_target_step=round(totals["emitted"] / totals["steps"], 3) if totals["steps"] else None,
        mean_k=round(totals["drafted"] / totals["steps"], 2) if totals["steps"] else None,
        identical_greedy=identical,
        costs={k: round(v, 5) for k, v in costs.items()}, k_max=k_max,
        best_k_at_measured_acceptance=config.best_k(min(acceptance or 0.0, 0.999)),
        recommended="speculative" if identical and speedup >= MIN_SPEEDUP else "baseline",
    )
    print(json.dumps(row), flush=True)
    return row


def id_prompts(n: int, vocab: int):
    """Token-id prompts (no tokenizer needed): the random pairs run offline."""
    from engine.decoding.chat import Prompt
    from bench.shapes import prompt_ids

    return [Prompt(ids, [len(ids)]) for ids in (prompt_ids(64, vocab, seed=50 + i) for i in range(n))]


def random_pairs(target_shape: str, draft_shape: str, dtype, trunc_layers: int | None, prompts,
                 max_tokens: int, k_max: int, reps: int) -> list[dict]:
    """A random target with an independent random draft, and with its own first layers as draft."""
    from engine.loading.registry import LoadedModel
    from engine.decoding.speculative import truncated
    from bench.shapes import IdTokenizer

    model, config = random_model(target_shape, dtype, seed=0)
    target = LoadedModel(name=target_shape, model=model, tokenizer=IdTokenizer(config["vocab_size"]),
                         config=config, path=Path(f"/nonexistent/random-{target_shape}"))
    draft, _ = random_model(draft_shape, dtype, seed=1)
    layers = trunc_layers or max(len(model.layers) // 9, 1)
    return [run_pair(f"random {target_shape} <- random {draft_shape}", target, draft, prompts,
                     max_tokens, k_max, reps),
            run_pair(f"random {target_shape} <- own first {layers} layers", target,
                     truncated(model, layers), prompts, max_tokens, k_max, reps)]


def run_suite(a) -> list[dict]:
    """`python -m bench speculative`: the random pairs (offline), as bench rows."""
    import mlx.core as mx

    gpu = a.device == "gpu"
    target, draft = ("qwen3-8b", "qwen3-0.6b") if gpu else ("smollm2-135m", "smollm2-135m")
    dtype = mx.bfloat16 if gpu else mx.float32
    prompts = id_prompts(1 if a.quick else 2, 49152)
    reps = max(1, -(-a.reps // len(prompts)))
    out = []
    for r in random_pairs(target, draft, dtype, None, prompts, a.gen if not a.quick else 16, 4, reps):
        out.append(dict(shape=target, metric=f"decode with speculation: {r['pair']}", unit="tok/s",
                        ours=r["speculative_tokens_per_s"], baseline=r["baseline_tokens_per_s"],
                        baseline_name="plain greedy decoding", goal=">= 0.95",
                        notes=f"median of {r['runs']}; spec {r['speculative_spread']}, plain "
                              f"{r['baseline_spread']}; acceptance {r['acceptance_rate']}, mean k "
                              f"{r['mean_k']}, identical greedy: {r['identical_greedy']}",
                        extra=r))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--pairs", choices=("bundled", "random", "all"), default="bundled")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--target-shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--draft-shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--trunc-layers", type=int, default=None,
                    help="layers kept by the truncated self-draft (default: a third, at least 1)")
    ap.add_argument("--k-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=2, help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--openblas", action="store_true", help="re-run with Debian's OpenBLAS preloaded")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.openblas and OPENBLAS not in os.environ.get("LD_PRELOAD", ""):
        os.environ["LD_PRELOAD"] = OPENBLAS
        os.execv(sys.executable, [sys.executable, "-m", "bench.speculative", *sys.argv[1:]])

    import mlx.core as mx

    from engine.loading.registry import load_model
    from engine.decoding.speculative import dequantize, truncated

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    dtype = getattr(mx, args.dtype)
    prompts = PROMPTS[: args.prompts]
    rows = []
    if args.pairs in ("bundled", "all"):
        from engine.decoding.generate import build_prompt

        bundled_q4 = load_model(None)
        target = load_model(None, transform=dequantize(dtype))
        texts = [build_prompt(target, messages=[{"role": "user", "content": t}]) for t in prompts]
        layers = args.trunc_layers or max(len(target.model.layers) // 3, 1)
        rows.append(run_pair(f"smollm2-{args.dtype} <- own Q4", target, bundled_q4.model, texts,
                             args.max_tokens, args.k_max))
        rows.append(run_pair(f"smollm2-{args.dtype} <- own first {layers} layers", target,
                             truncated(target.model, layers), texts, args.max_tokens, args.k_max))
    if args.pairs in ("random", "all"):
        rows += random_pairs(args.target_shape, args.draft_shape, dtype, args.trunc_layers,
                             id_prompts(len(prompts), 49152), args.max_tokens, args.k_max, 1)
    out = args.out or RESULTS / f"speculative-{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(device=args.device, dtype=args.dtype, machine=platform.machine(), mlx=mx.__version__,
                ld_preload=os.environ.get("LD_PRELOAD", ""), max_tokens=args.max_tokens,
                prompts=len(prompts), min_speedup=MIN_SPEEDUP)
    out.write_text(json.dumps(dict(meta=meta, pairs=rows), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
