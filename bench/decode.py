"""CPU decode/prefill benchmark: mlx-lm vs our fastest MLX recipe vs llama.cpp.

    python -m bench.decode [--mlx-model FOLDER] [--gguf PATH] [--llama-python PY] [--rows ...]

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
  engine        our engine as shipped: engine.loading.registry.load_model(None) (on this CPU with OpenBLAS
                preloaded: engine/kernels/cpu_layout.py's layout) timed through engine.scheduling.service.Engine
                (scheduler thread, prefix cache off): one request with the 512-token prompt as raw
                text (`text=`) and max_tokens=128, greedy. Prefill tok/s = prompt tokens / TTFT,
                decode tok/s = tokens after the first / time from the first to the last token event.
  engine-generate  the same request through engine.decoding.generate.generate (no scheduler thread).
                Both engine rows also decode 128 tokens after the short chat prompt
                (`decode_short_tps`, and the tokens compared for the greedy match).
  llama.cpp     llama-cpp-python on the GGUF, n_threads=2, greedy argmax over its logits. Its
                interpreter: --llama-python, else $MLXCHAT_LLAMA_PYTHON, else the first of
                /work/llamacpp2/bin/python (built with GGML_NATIVE=OFF, AVX2/FMA/F16C, no
                AVX-512/AMX) and /work/llamacpp-venv/bin/python that exists.

Defaults: the mlx-lm folder and GGUF of the bundled model as engine.loading.registry resolves them.
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

LLAMA_PYTHONS = ["/work/llamacpp2/bin/python", "/work/llamacpp-venv/bin/python"]
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


# --------------------------------------------------------------------------- our engine
def _engine_worker(variant, job):
    """Our engine end to end: load_model(None) and the Engine service or generate()."""
    from engine.decoding.generate import build_prompt, generate
    from engine.loading.registry import load_model
    from engine.decoding.sampling import SamplingParams
    from engine.scheduling.service import Engine

    t = time.perf_counter()
    if variant == "engine":
        eng = Engine(None, max_running=1, max_queued=1, prefix_cache=False).start()
        lm = eng.lm

        def events(params, **prompt):
            return eng.submit(params=params, **prompt).events(timeout=600)
    else:
        lm = eng = load_model(None)

        def events(params, **prompt):
            return generate(lm, build_prompt(lm, **prompt), params)
    load_s = time.perf_counter() - t

    def run(n, **prompt):
        t0 = time.perf_counter()
        stamps, toks, done = [], [], None
        for e in events(SamplingParams(max_tokens=n), **prompt):
            if e.kind == "token":
                stamps.append(time.perf_counter())
                toks.append(e.token)
            elif e.kind == "done":
                done = e
        return t0, stamps, toks, done

    try:
        run(8, prompt_tokens=job["short"])  # warm-up
        pre, decs, decs_short, n_prompt, toks = [], [], [], None, None
        for _ in range(job["reps"]):
            t0, stamps, _, done = run(job["gen"], text=job["long_text"])
            n_prompt = done.usage.prompt_tokens
            pre.append(n_prompt / (stamps[0] - t0))
            decs.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        for _ in range(job["reps"]):
            _, stamps, toks, _ = run(job["gen"] + 1, prompt_tokens=job["short"])
            decs_short.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    finally:
        if variant == "engine":
            eng.stop()
    from engine.device import describe
    return dict(load_s=load_s, prefill_tps=max(pre), decode_tps=max(decs), prefill_all=pre,
                decode_all=decs, decode_short_tps=max(decs_short), decode_short_all=decs_short,
                prompt_tokens=n_prompt, tokens=toks[1:], device=describe(),
                layout=sorted({type(m).__name__ for _, m in lm.model.named_modules()
                               if "Linear" in type(m).__name__}))


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
    ap.add_argument("--mlx-model", help="mlx-lm folder (default: the bundled model's, converted)")
    ap.add_argument("--gguf", help="GGUF for llama.cpp (default: the bundled model's)")
    ap.add_argument("--llama-python", default=os.environ.get("MLXCHAT_LLAMA_PYTHON"),
                    help="python with llama_cpp importable (default: $MLXCHAT_LLAMA_PYTHON, else "
                         "the first of " + ", ".join(LLAMA_PYTHONS) + " that exists)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="run every row this many times, in turn")
    ap.add_argument("--blas", default="auto", help="'auto', 'none', or a path to a BLAS .so")
    ap.add_argument("--rows", default="mlx-lm,mlx-f32-openblas,mlx-fast-openblas,mlx-fast,engine,"
                                      "engine-generate,llama.cpp")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        job = json.load(open(a.job))
        if a.worker == "llama.cpp":
            r = _llama_worker(a.gguf, job)
        elif a.worker.startswith("engine"):
            r = _engine_worker(a.worker, job)
        else:
            r = _mlx_worker(a.worker, a.mlx_model, job)
        print("RESULT " + json.dumps(r), flush=True)
        return

    if a.mlx_model is None or a.gguf is None:
        from engine.loading import bundled
        from engine.loading.registry import resolve
        a.mlx_model = a.mlx_model or str(resolve(None)[1])
        a.gguf = a.gguf or str(bundled.ensure_bundled_gguf())
    if a.llama_python is None:
        a.llama_python = next((p for p in LLAMA_PYTHONS if os.path.exists(p)), sys.executable)

    from mlx_lm import load
    _, tok = load(a.mlx_model)
    text = (Path(__file__).resolve().parent.parent / "engine" / "gguf.py").read_text()
    while len(tok.encode(text)) < a.prompt_tokens:
        text += text
    long_ids = tok.encode(text)[: a.prompt_tokens]
    short_ids = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
        add_generation_prompt=True)
    # The engine rows take the long prompt as raw text: text that encodes back to the same ids.
    long_text = tok.decode(long_ids)
    job = dict(long=long_ids, long_text=long_text, short=list(short_ids), gen=a.gen_tokens,
               reps=a.reps)

    if a.blas == "auto":
        blas, blas_env = _blas_preload()
    elif a.blas == "none":
        blas, blas_env = None, {}
    else:
        blas, blas_env = a.blas, {"LD_LIBRARY_PATH": os.path.dirname(a.blas)}
    me = [sys.executable, "-m", "bench.decode", "--mlx-model", a.mlx_model, "--gguf", a.gguf]
    def run_row(name):
        if name == "mlx-lm":
            r = _sub(me + ["--worker", "mlx-lm"], {}, job)
        elif name == "mlx-fast":
            env = dict(blas_env, LD_PRELOAD=blas) if blas else {}
            r = _sub(me + ["--worker", "mlx-fast"], env, job)
            r["blas"] = blas
        elif name in ("mlx-f32-openblas", "mlx-fast-openblas"):
            env = {"LD_PRELOAD": OPENBLAS} if os.path.exists(OPENBLAS) else {}
            r = _sub(me + ["--worker", name], env, job)
        elif name in ("engine", "engine-generate"):
            env = {"LD_PRELOAD": OPENBLAS} if os.path.exists(OPENBLAS) else {}
            r = _sub(me + ["--worker", name], env, job)
        elif name == "llama.cpp":
            py = a.llama_python
            r = _sub([py, str(Path(__file__).resolve()), "--gguf", a.gguf, "--worker", "llama.cpp"], {}, job)
            r["python"] = py
        else:
            raise SystemExit(f"unknown row {name}")
        return r

    # Rows run in rounds (every row once per round) and each keeps its best figures: on a shared
    # machine, load that comes and goes then hits every row alike.
    rows = {}
    for round_ in range(a.rounds):
        for name in a.rows.split(","):
            r = run_row(name)
            if name not in rows or "error" in rows[name]:
                rows[name] = r
            elif "error" not in r:
                best = rows[name]
                for key in ("prefill", "decode", "decode_short"):
                    if f"{key}_tps" in r:
                        best[f"{key}_all"] = best.get(f"{key}_all", []) + r[f"{key}_all"]
                        best[f"{key}_tps"] = max(best[f"{key}_all"])
            print(f"  [{round_ + 1}] {name}: " + (f"prefill {r['prefill_tps']:.1f} tok/s, decode {r['decode_tps']:.2f} tok/s"
                                   if "error" not in r else "ERROR " + r["error"][-300:]), flush=True)

    # Ratios against mlx-lm (the baseline) and llama.cpp. "decode" is after the short chat prompt
    # for every row (the engine rows: `decode_short_tps`); the engine rows also give decode after
    # their 512-token raw-text prompt (`decode_tps` in the JSON).
    base, llama = rows.get("mlx-lm", {}), rows.get("llama.cpp", {})
    ref = base.get("tokens")
    dec = lambda r: r.get("decode_short_tps", r.get("decode_tps", float("nan")))  # noqa: E731
    ratio = lambda x, r, key: x / r[key] if key in r else float("nan")  # noqa: E731
    print(f"\n{'variant':<18} {'prefill tok/s':>13} {'x mlx-lm':>8} {'x llama':>8} {'decode tok/s':>12} "
          f"{'x mlx-lm':>8} {'x llama':>8} {'decode@512':>10}  greedy match")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<18} ERROR")
            continue
        match = "-"
        if ref and r.get("tokens"):
            same = 0
            for x, y in zip(r["tokens"], ref):
                if x != y:
                    break
                same += 1
            r["greedy_prefix_match"] = same
            match = f"{same}/{len(ref)}"
        r["x_mlx_lm"] = dict(prefill=ratio(r["prefill_tps"], base, "prefill_tps"),
                             decode=dec(r) / dec(base) if "decode_tps" in base else float("nan"))
        r["x_llama_cpp"] = dict(prefill=ratio(r["prefill_tps"], llama, "prefill_tps"),
                                decode=dec(r) / dec(llama) if "decode_tps" in llama else float("nan"))
        at512 = f"{r['decode_tps']:.2f}" if "decode_short_tps" in r else "-"
        print(f"{name:<18} {r['prefill_tps']:>13.1f} {r['x_mlx_lm']['prefill']:>8.2f} "
              f"{r['x_llama_cpp']['prefill']:>8.2f} {dec(r):>12.2f} {r['x_mlx_lm']['decode']:>8.2f} "
              f"{r['x_llama_cpp']['decode']:>8.2f} {at512:>10}  {match}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(prompt_tokens=a.prompt_tokens, gen_tokens=a.gen_tokens, reps=a.reps, rounds=a.rounds,
                mlx_model=a.mlx_model, gguf=a.gguf, llama_python=a.llama_python,
                cpus=os.cpu_count(), load_avg=os.getloadavg(), time=time.time(),
                command="python -m bench.decode " + " ".join(argv if argv is not None else sys.argv[1:]))
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
