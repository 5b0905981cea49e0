"""Where a decode step's time goes on our CPU kernels (one token, warm KV cache).

    python -m bench.profile_decode [--model llama-1b] [--threads N] [--context 200]
                                   [--batch 1 4] [--prefill 511] [--ab set_prefetch_bytes=0,1024]

`--model` takes a bench model (bench.decode's random llamas: llama-350m, llama-1b, ...) or a
model folder; the bundled model by default.

First the wall time of whole steps split into parts (`step_parts_wall`): building the graph
(Python, mlx-lm's modules), evaluating it, and inside the evaluation each part of our ops as the
kernels time it on MLX's CPU thread (norms, the fused q/k/v product, RoPE, the KV-cache write,
attention, o, gate/up, SwiGLU, down, the output head and other single products), the rest being
MLX's own work (the embedding, the final norm, scheduling); then the pool's dispatches per token, how many
woke a sleeping thread, and how long the calling thread waited for the others at their end.

`--ab one-op` times whole steps of the model (each layer one op, the embedding one op) against
the same steps as they ran before (`two_op_step`: attn_in, mlx-lm's KV-cache update, block_out;
MLX's gather and dequantize for the embedding), alternating in one process.

`--ab one-op --batch 1 4` does the same for steps of 1 and 4 rows over mlx-lm's BatchKVCache
(the scheduler's batch; the rows left-padded differently).

`--ab SETTER=V1,V2,...` (numbers, or names: `set_isa=avx512-vnni,avx2`) instead times whole steps with one of the kernels' switches taking each
value in turn (`set_prefetch_bytes`, `set_spin_us`, `set_interleave_rows`), --rounds rounds of
--steps steps, all in one process: a ratio that holds on a busy machine.

CPU time (process_time) per token, so that load from other processes on a shared machine
counts less: the whole step, the tied output head alone, the fused layer ops alone
(every layer's one op, kernels.FusedLayer, on the same input, writing the same cache position),
and the rest (embedding, final norm, graph building and MLX's scheduling). Also the bytes of weights read per token.

`--batch 1 4` also times whole decode steps of 1 and 4 rows over mlx-lm's BatchKVCache, as the
scheduler batches concurrent streams: the sizes take turns, five rounds, wall and CPU ms per step
(median [min-max]) and each size's wall time against the first; the context grows as it runs.
Then the same step's parts at each size, each evaluated on its own (wall ms, median): the
output head, the 30 layers' attn_in, block_out and, inside block_out, the attention alone, the
30 KV-cache updates, the mask; what grows most with the rows shows there.
"""
from __future__ import annotations

import argparse
import os
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a bench model name or a folder (default: bundled)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, nargs="+", default=[], help="also time steps of these many rows")
    ap.add_argument("--prefill", type=int, default=0, help="profile a prompt chunk of this many tokens")
    ap.add_argument("--ab", default=None, help="SETTER=V1,V2: whole steps with a kernel switch alternating")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of --ab")
    a = ap.parse_args(argv)
    os.environ["MLXCHAT_THREADS"] = str(a.threads)
    if a.prefill:
        return prefill_parts(a.prefill)

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    from engine.kernels import active_path, native
    from engine.kernels.layout import quantized_product
    from engine.loading.registry import load_model

    lm = load_model(model_path(a.model))
    model, kernels = lm.model, native.kernels()
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 100 + a.context))]), cache=cache))
    token = mx.array([[42]])
    inner = model.model
    h = inner.embed_tokens(token)
    mx.eval(h)

    fused = [layer._fused or layer._fuse() for layer in inner.layers]

    def layers_only():  # each layer's one op (attn_in, the cache write, block_out) at the same position
        return [f(h, c.keys, c.values, c.offset) for f, c in zip(fused, cache)]

    def step():
        out = model(token, cache=cache)
        for c in cache:  # stay at the same context length
            c.offset -= 1
        return out

    if a.ab == "one-op" and a.batch:
        return alternate_batched_steps(model, kernels, a.batch, a.context, a.steps, a.rounds)
    if a.ab == "one-op":
        def before():  # the step as it ran before the one-op layer, at the same context
            out = two_op_step(kernels, model, token, cache)
            for c in cache:
                c.offset -= 1
            return out

        return alternate_steps({"one-op layer": step, "two ops around mlx-lm's update": before},
                               kernels, a.steps, a.rounds)
    if a.ab:
        return alternate(kernels, step, a.ab, a.steps, a.rounds)
    step_parts_wall(model, kernels, token, cache, a.steps)
    emb = inner.embed_tokens
    head = f"output head ({emb.bits}-bit, {emb.weight.shape[0]} x {h.shape[-1]})"
    layers = f"{len(inner.layers)} layers: one op each"
    cases = {"whole step": step, head: lambda: quantized_product(emb, h), layers: layers_only}
    times = {}
    for name, fn in cases.items():
        for _ in range(3):
            mx.eval(fn())
        t = time.process_time()
        for _ in range(a.steps):
            mx.eval(fn())
        times[name] = (time.process_time() - t) / a.steps * 1e3
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    print(f"{active_path()}; context {a.context} tokens; CPU ms per token (all threads):")
    for name, ms in times.items():
        print(f"  {name:<36} {ms:7.2f}")
    rest = times["whole step"] - times[head] - times[layers]
    print(f"  {'rest (cache updates, graph, MLX)':<36} {rest:7.2f}")
    print(f"  weights {weights / 1e6:.0f} MB: {weights / times['whole step'] / 1e6:.1f} GB/s of CPU time")
    if a.batch:
        batched_steps(model, a.batch, a.context, a.steps)


def model_path(name: str | None) -> str | None:
    """A bench model's folder (bench.decode's random llamas), a folder as given, or None."""
    if name is None or os.path.isdir(name):
        return name
    from bench.decode import random_folder

    return str(random_folder(name))


def two_op_step(kernels, model, tokens, cache):
    """A llama model's one-token step as it ran before each layer became one op: the embedding
    through MLX's gather and mx.dequantize, and per layer our attn_in, mlx-lm's
    update_and_fetch (an 8-bit cache's `store`), our block_out; then the final norm and the head.
    Over a `BatchKVCache` each row takes RoPE at its own offset and attends from its left padding
    on."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from engine.kernels.layout import _append, _qw

    inner = model.model
    e = inner.embed_tokens
    h = mx.dequantize(e["weight"][tokens], e["scales"][tokens].astype(mx.float32),
                      e["biases"][tokens].astype(mx.float32), e.group_size, e.bits)
    for layer, c in zip(inner.layers, cache):
        attn, mlp = layer.self_attn, layer.mlp
        n1, n2, rope = layer.input_layernorm, layer.post_attention_layernorm, attn.rope
        rows = isinstance(c, BatchKVCache)  # or the 8-bit one (kv8.py)
        q, k, v = kernels.attn_in(h, n1.weight, n1.eps, _qw(attn.q_proj), _qw(attn.k_proj),
                                  _qw(attn.v_proj), attn.n_heads, attn.n_kv_heads, rope.dims,
                                  rope.traditional, rope.base, rope.scale, 0 if rows else c.offset,
                                  offsets=c.offset if rows else None)
        k, v = _append(c, k, v)
        h = kernels.block_out(h, q, k, v, attn.scale, _qw(attn.o_proj), n2.weight, n2.eps,
                              _qw(mlp.gate_proj), _qw(mlp.up_proj), _qw(mlp.down_proj),
                              starts=c.left_padding if rows else None)
    h = inner.norm(h)
    return e.as_linear(h) if model.args.tie_word_embeddings else model.lm_head(h)


def alternate_steps(steps_by_name, kernels, steps: int, rounds: int, setup=None) -> None:
    """Whole steps of each function in turn, `rounds` rounds of `steps` steps in one process
    (`setup(name)`, where given, runs before each name's steps); prints wall and process CPU ms
    per token (median of rounds)."""
    import statistics

    import mlx.core as mx

    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in steps_by_name}
    for name, fn in steps_by_name.items():
        if setup:
            setup(name)
        for _ in range(3):
            mx.eval(fn())
    for _ in range(rounds):
        for name, fn in steps_by_name.items():
            if setup:
                setup(name)
            w, c = time.perf_counter(), time.process_time()
            for _ in range(steps):
                mx.eval(fn())
            runs[name].append(((time.perf_counter() - w) / steps * 1e3,
                               (time.process_time() - c) / steps * 1e3))
    print(f"{kernels.num_threads()} threads, load average {os.getloadavg()[0]:.1f}, "
          f"{rounds} rounds of {steps} steps, ms per token (median [min-max]):")
    for name, r in runs.items():
        wall, cpu = [x[0] for x in r], [x[1] for x in r]
        print(f"  {name:<32} wall {statistics.median(wall):7.2f} [{min(wall):.2f}-{max(wall):.2f}]"
              f"  CPU {statistics.median(cpu):7.2f} [{min(cpu):.2f}-{max(cpu):.2f}]")


def alternate_batched_steps(model, kernels, sizes: list[int], context: int, steps: int,
                            rounds: int) -> None:
    """`--ab one-op --batch B...`: whole steps of B rows over mlx-lm's BatchKVCache (rows left-
    padded by 0, 3, 6...), each layer one op against `two_op_step`, alternating in one process at
    the same context (each step trimmed off again)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    cases = {}
    for b in sizes:
        padding = [3 * r for r in range(b)]
        cache = [BatchKVCache(padding) for _ in model.layers]
        prompt = [[0] * p + list(range(100, 100 + context - p)) for p in padding]
        mx.eval(model(mx.array(prompt), cache=cache))
        token = mx.array([[42]] * b)

        def trimmed(step, cache=cache):
            out = step()
            for c in cache:
                c.trim(1)
            return out

        cases[f"b={b} one op per layer"] = lambda c=cache, t=token: trimmed(lambda: model(t, cache=c), c)
        cases[f"b={b} two ops + mlx-lm's update"] = (
            lambda c=cache, t=token: trimmed(lambda: two_op_step(kernels, model, t, c), c))
    alternate_steps(cases, kernels, steps, rounds)


def alternate(kernels, step, spec: str, steps: int, rounds: int) -> None:
    """Whole steps with the kernels' switch `spec` (SETTER=V1,V2,...; numbers, or names as
    set_isa's) taking each value in turn (`alternate_steps`)."""
    setter, values = spec.split("=")
    named = {f"{setter}({v})": int(v) if v.lstrip("-").isdigit() else v for v in values.split(",")}

    def setup(name: str) -> None:
        v = named[name]
        getattr(kernels, setter)(bool(v) if setter == "set_interleave_rows" else v)

    alternate_steps({name: step for name in named}, kernels, steps, rounds, setup)


def step_parts_wall(model, kernels, token, cache, steps: int) -> None:
    """Prints where the wall time of `steps` one-token steps goes (median step; parts summed
    over the steps, per token), from the kernels' own profile (kernels.profile_start/stop)."""
    import statistics

    import mlx.core as mx

    def one():
        t0 = time.perf_counter()
        out = model(token, cache=cache)
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        for c in cache:  # stay at the same context length
            c.offset -= 1
        return t1 - t0, t2 - t1

    for _ in range(3):
        one()
    kernels.profile_start()
    runs = [one() for _ in range(steps)]
    prof = kernels.profile_stop()
    build = statistics.median(r[0] for r in runs) * 1e3
    evaluate = statistics.median(r[1] for r in runs) * 1e3
    whole = statistics.median(r[0] + r[1] for r in runs) * 1e3
    raw = dict(prof)
    parts = {name: (calls / steps, ns / steps / 1e6, cpu / steps / 1e6)
             for name, (calls, ns, cpu) in prof}
    ours = sum(ms for name, (_, ms, _) in parts.items() if not name.startswith("pool"))
    ours_cpu = sum(c for name, (_, _, c) in parts.items() if not name.startswith("pool"))
    print(f"wall ms per token, median of {steps} steps ({whole:.2f} ms = {1e3 / whole:.1f} tok/s):")
    print(f"  {'building the graph (Python)':<44} {build:7.2f}")
    print(f"  {'evaluating it':<44} {evaluate:7.2f}")
    print(f"  {'  our ops, on MLX CPU thread':<44} {ours:7.2f}  (that thread's CPU time {ours_cpu:.2f})")
    for name, (calls, ms, cpu) in parts.items():
        if not name.startswith("pool"):
            print(f"  {'    ' + name:<44} {ms:7.2f}  ({cpu:5.2f} CPU, {calls:.0f} calls)")
    print(f"  {'  the rest (MLX ops, scheduling, waits)':<44} {evaluate - ours:7.2f}")
    disp_calls, disp_ms, _ = parts["pool: dispatches"]
    tail_ms = parts["pool: caller's wait for the other threads"][1]
    blocks, mine, _ = (n / steps for n in raw["pool: blocks (all, the caller's)"])
    woke = parts["pool: dispatches that woke a sleeping thread"][0]
    serial = parts["pool: serial runs (one block, or the pool busy)"][0]
    print(f"pool per token: {disp_calls:.0f} dispatches ({disp_ms:.2f} ms in them, "
          f"{disp_ms * 1e3 / max(disp_calls, 1):.1f} us each), {woke:.0f} woke a sleeping thread, "
          f"the caller waited {tail_ms:.2f} ms at their ends; blocks {blocks:.0f}, "
          f"{mine / max(blocks, 1):.0%} by the caller; {serial:.0f} ran serially")


def batched_steps(model, sizes: list[int], context: int, steps: int, rounds: int = 5) -> None:
    """Decode steps of each batch size in turn over BatchKVCache; prints ms per step."""
    import statistics

    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    runs = {}
    for b in sizes:
        cache = [BatchKVCache([0] * b) for _ in model.layers]
        mx.eval(model(mx.array([list(range(100, 100 + context))] * b), cache=cache))
        token = mx.array([[42]] * b)
        runs[b] = lambda cache=cache, token=token: model(token, cache=cache)
    wall: dict[int, list[float]] = {b: [] for b in sizes}
    cpu: dict[int, list[float]] = {b: [] for b in sizes}
    per_round = max(1, steps // rounds)
    for _ in range(rounds):
        for b, fn in runs.items():
            mx.eval(fn())
            w, c = time.perf_counter(), time.process_time()
            for _ in range(per_round):
                mx.eval(fn())
            wall[b].append((time.perf_counter() - w) / per_round * 1e3)
            cpu[b].append((time.process_time() - c) / per_round * 1e3)

    def show(v: list[float]) -> str:
        return f"{statistics.median(v):6.1f} [{min(v):.1f}-{max(v):.1f}]"

    first = statistics.median(wall[sizes[0]])
    print(f"batched steps over BatchKVCache ({rounds} rounds of {per_round}), ms per step:")
    for b in sizes:
        print(f"  b={b}: wall {show(wall[b])}  CPU {show(cpu[b])}  "
              f"wall x{statistics.median(wall[b]) / first:.2f} of b={sizes[0]}")
    parts = {b: step_parts(model, b, context, steps) for b in sizes}
    print("parts of a batched step, each alone, wall ms (median):")
    print(f"  {'part':<34}" + "".join(f"{'b=' + str(b):>9}" for b in sizes))
    for name in parts[sizes[0]]:
        print(f"  {name:<34}" + "".join(f"{parts[b][name]:9.2f}" for b in sizes))


def step_parts(model, b: int, context: int, steps: int) -> dict[str, float]:
    """Wall ms (median of `steps`) of each part of a `b`-row decode step over BatchKVCache."""
    import statistics

    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from engine.kernels import native
    from engine.kernels.layout import quantized_product

    kernels, inner = native.kernels(), model.model
    cache = [BatchKVCache([0] * b) for _ in model.layers]
    mx.eval(model(mx.array([list(range(100, 100 + context))] * b), cache=cache))
    h = inner.embed_tokens(mx.array([[42]] * b))
    mx.eval(h)

    def qw(m):
        return m["weight"], m["scales"], m["biases"], m.group_size, m.bits

    def attn_in(layer, c):
        a, n, r = layer.self_attn, layer.input_layernorm, layer.self_attn.rope
        return kernels.attn_in(h, n.weight, n.eps, qw(a.q_proj), qw(a.k_proj), qw(a.v_proj),
                               a.n_heads, a.n_kv_heads, r.dims, r.traditional, r.base, r.scale, 0,
                               offsets=c.offset)

    qs = [attn_in(layer, c)[0] for layer, c in zip(inner.layers, cache)]
    kv = mx.zeros((b, model.layers[0].self_attn.n_kv_heads, 1, qs[0].shape[-1]))
    mx.eval(qs, kv)

    def block_out(layer, c, q):
        a, m, n = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        k, v = c.keys_and_values()
        return kernels.block_out(h, q, k, v, a.scale, qw(a.o_proj), n.weight, n.eps,
                                 qw(m.gate_proj), qw(m.up_proj), qw(m.down_proj),
                                 starts=c.left_padding)

    def updates():
        out = [c.update_and_fetch(kv, kv) for c in cache]
        for c in cache:
            c.trim(1)
        return out

    layers = list(zip(inner.layers, cache, qs))
    parts = {
        "output head (norm + 8-bit head)": lambda: quantized_product(inner.embed_tokens, inner.norm(h)),
        "30 x attn_in (norm, q/k/v, RoPE)": lambda: [attn_in(la, c) for la, c, _ in layers],
        "30 x block_out (attention .. MLP)": lambda: [block_out(*x) for x in layers],
        "  of which 30 x attention": lambda: [kernels.decode_attention(q, *c.keys_and_values(),
                                                                     la.self_attn.scale,
                                                                     starts=c.left_padding)
                                              for la, c, q in layers],
        "30 x KV-cache update": updates,
        "mask": lambda: cache[0].make_mask(1),
    }
    times = {}
    for name, fn in parts.items():
        for _ in range(3):
            mx.eval(fn())
        runs = []
        for _ in range(steps):
            t = time.perf_counter()
            mx.eval(fn())
            runs.append(time.perf_counter() - t)
        times[name] = statistics.median(runs) * 1e3
    return times


def prefill_parts(length: int, reps: int = 3) -> None:
    """Wall and CPU ms (median of `reps`) of a `length`-token prompt chunk and of its parts."""
    import statistics

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.kernels import active_path, native
    from engine.loading.registry import load_model

    model = load_model(None).model
    kernels, layers = native.kernels(), model.model.layers
    tokens = mx.array([[100 + (37 * i) % 40000 for i in range(length)]])
    attn, mlp = layers[0].self_attn, layers[0].mlp
    dim, heads, kv_heads = attn.o_proj.weight.shape[0], attn.n_heads, attn.n_kv_heads
    head_dim = dim // heads
    products = [m for la in layers for m in (la.self_attn.q_proj, la.self_attn.k_proj,
                                               la.self_attn.v_proj, la.self_attn.o_proj,
                                               la.mlp.gate_proj, la.mlp.up_proj, la.mlp.down_proj)]

    def qw(m):
        return m["weight"], m["scales"], m["biases"], m.group_size, m.bits

    def width(m):
        return m["weight"].shape[1] * 32 // m.bits

    xs = {width(m): mx.random.normal((1, length, width(m))) for m in products}
    dense = [kernels.dequantize(*qw(m)) for m in products]
    hidden = mlp.gate_proj["weight"].shape[0]
    gates = [mx.random.normal((1, length, hidden)) for _ in layers]
    h = mx.random.normal((1, length, dim))
    q = mx.random.normal((1, heads, length, head_dim))
    k = mx.random.normal((1, kv_heads, length, head_dim))
    mx.eval(list(xs.values()), dense, gates, h, q, k)

    def chunk():
        cache = make_prompt_cache(model)
        model(tokens, cache=cache)
        return [c.state for c in cache]

    def transposed(n):  # (1, L, n * D) as attention reads it: (1, n, L, D), strided
        return h[..., :n * head_dim].reshape(1, length, n, head_dim).transpose(0, 2, 1, 3)

    parts = {
        f"whole chunk ({length} tokens)": chunk,
        "30 x 7 dequantize": lambda: [kernels.dequantize(*qw(m)) for m in products],
        "30 x 7 BLAS products (fp32 weights)": lambda: [xs[w.shape[1]] @ w.T for w in dense],
        "30 x 7 dequantize + product": lambda: [xs[width(m)] @ kernels.dequantize(*qw(m)).T
                                                for m in products],
        "30 x causal attention": lambda: [kernels.prefill_attention(q, k, k, attn.scale)
                                          for _ in layers],
        "30 x SwiGLU": lambda: [kernels.swiglu(g, g) for g in gates],
        "60 x RMSNorm": lambda: [la.input_layernorm(h) for la in layers for _ in range(2)],
        "30 x RoPE of q and k": lambda: [attn.rope(transposed(n)) for _ in layers
                                         for n in (heads, kv_heads)],
    }
    print(f"{active_path()}; a prompt chunk of {length} tokens, ms (median of {reps}):")
    for name, fn in parts.items():
        mx.eval(fn())
        wall, cpu = [], []
        for _ in range(reps):
            w, c = time.perf_counter(), time.process_time()
            mx.eval(fn())
            wall.append((time.perf_counter() - w) * 1e3)
            cpu.append((time.process_time() - c) * 1e3)
        print(f"  {name:<38} wall {statistics.median(wall):8.1f}  CPU {statistics.median(cpu):8.1f}")


if __name__ == "__main__":
    main()
