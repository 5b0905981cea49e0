"""Where a decode step's time goes on our CPU kernels (bundled model, one token, warm KV cache).

    python -m bench.profile_decode [--threads N] [--context 200]

CPU time (process_time) per token, so that load from other processes on a shared machine
counts less: the whole step, the tied 8-bit output head alone, the fused layer ops alone
(30 x attn_in + block_out on the same input and cache), and the rest (embedding, KV-cache updates, final
norm, graph building and MLX's scheduling). Also the bytes of weights read per token.
"""
from __future__ import annotations

import argparse
import os
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args(argv)
    os.environ["MLXCHAT_THREADS"] = str(a.threads)

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    from engine.kernels import active_path, native
    from engine.kernels.layout import quantized_product
    from engine.loading.registry import load_model

    lm = load_model(None)
    model, kernels = lm.model, native.kernels()
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 100 + a.context))]), cache=cache))
    token = mx.array([[42]])
    inner = model.model
    h = inner.embed_tokens(token)
    mx.eval(h)

    def layers_only():
        out = []
        for layer, c in zip(inner.layers, cache):
            attn, mlp = layer.self_attn, layer.mlp
            qw = lambda m: (m["weight"], m["scales"], m["biases"], m.group_size, m.bits)  # noqa: E731
            q, k, v = kernels.attn_in(h, layer.input_layernorm.weight, layer.input_layernorm.eps,
                                      qw(attn.q_proj), qw(attn.k_proj), qw(attn.v_proj), attn.n_heads,
                                      attn.n_kv_heads, attn.rope.dims, attn.rope.traditional,
                                      attn.rope.base, attn.rope.scale, c.offset)
            k, v = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]  # the cache as it is
            out.append(kernels.block_out(h, q, k, v, attn.scale, qw(attn.o_proj),
                                         layer.post_attention_layernorm.weight,
                                         layer.post_attention_layernorm.eps, qw(mlp.gate_proj),
                                         qw(mlp.up_proj), qw(mlp.down_proj)))
        return out

    def step():
        out = model(token, cache=cache)
        for c in cache:  # stay at the same context length
            c.offset -= 1
        return out

    cases = {"whole step": step,
             "output head (8-bit, 49152 x 576)": lambda: quantized_product(inner.embed_tokens, h),
             "30 layers: attn_in + block_out": layers_only}
    times = {}
    for name, fn in cases.items():
        for _ in range(3):
            mx.eval(fn())
        t = time.process_time()
        for _ in range(a.steps):
            mx.eval(fn())
        times[name] = (time.process_time() - t) / a.steps * 1e3
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    print(f"{active_path()}; context {a.context} tokens; CPU ms per token:")
    for name, ms in times.items():
        print(f"  {name:<36} {ms:7.2f}")
    rest = times["whole step"] - times["output head (8-bit, 49152 x 576)"] - times["30 layers: attn_in + block_out"]
    print(f"  {'rest (cache updates, graph, MLX)':<36} {rest:7.2f}")
    print(f"  weights {weights / 1e6:.0f} MB: {weights / times['whole step'] / 1e6:.1f} GB/s of CPU time")


if __name__ == "__main__":
    main()
