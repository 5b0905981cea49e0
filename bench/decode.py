"""CPU decode/prefill benchmark: our engine (CPU kernels, or the fp32 layout) vs mlx-lm vs llama.cpp.

    python -m bench.decode [--models bundled,llama-350m,llama-1b] [--rows ...] [--llama-python PY]

Each row runs in its own subprocess (BLAS preloads must be set before MLX loads; llama.cpp lives in
another venv). Every row of a model gets the same token ids: a 512-token prompt for prefill, and a
short chat prompt followed by 128 greedy tokens for decode. Results: a table on stdout and JSON in
bench/results/decode-cpu.json.

Models:
  bundled       SmolLM2-135M-Instruct (Q4, group 32, fp16 scales; 8-bit tied embedding), the mlx-lm
                folder converted from its GGUF, and the GGUF itself for llama.cpp.
  llama-350m    random-weight llama, ~350M parameters, 4-bit group 32 (embedding too), fp16 scales.
  llama-1b      random-weight llama, ~1.1B parameters, likewise.
  llama-3b      Llama-3.2-3B's shape (~3.0B with SmolLM2's vocabulary), likewise (~1.7 GB).
  llama-8b      Llama-3.1-8B's shape (~7.0B), likewise (~4 GB; build and rows need ~10 GB of RAM).
  qwen3-4b      Qwen3-4B's shape (q/k norms, head dim 128), likewise: our products, mlx-lm's
  qwen3-8b      attention; Qwen3-8B's shape.
Rows:
  engine        our engine as shipped: engine.scheduling.service.Engine on load_model(folder) (the
                CPU kernels; OpenBLAS preloaded, as `mlxchat` does), scheduler thread, prefix cache
                off, greedy. Prefill tok/s = prompt tokens / TTFT of the 512-token prompt (sent as
                raw text); decode tok/s = tokens after the first / time from the first to the last
                token event, after the short chat prompt.
  engine-int8   the same with MLXCHAT_KERNELS=int8: int8 activations for the output head and the
                attention projections in 1-8 row products (lossy; tests/test_kernels_quality.py).
  engine-kv8    the same with MLXCHAT_KV_BITS=8: the 8-bit KV cache (engine/kernels/kv8.py).
  engine-fp32   the same with MLXCHAT_KERNELS=0: the fallback fp32 layout (engine/kernels/cpu_layout.py).
  mlx-lm        mlx_lm.load() as is (quantized layers, MLX's own CPU ops), mlx_lm generate_step.
  llama.cpp     llama-cpp-python on a GGUF, threads = ours, greedy argmax: the bundled model's own
                GGUF; for a random model the same weights written by bench/llama_gguf.py
                (dequantized, then requantized to Q4_0 by llama.cpp itself, cached next to the
                folder as <folder>.Q4_0.gguf), so its greedy tokens only mostly match ours.
                Its interpreter: --llama-python, else $MLXCHAT_LLAMA_PYTHON, else
                bench/.venv-llamacpp/bin/python, made by `bash bench/setup-llamacpp` (llama-cpp-python
                0.3.36 built with GGML_NATIVE=OFF, AVX2/FMA/F16C); without it the row is skipped.
  llama.cpp-avx512  the same, built with AVX-512 and VNNI but without AMX (what Ollama's per-CPU
                builds run on such a machine): --llama-avx512-python, else
                $MLXCHAT_LLAMA_AVX512_PYTHON, else bench/.venv-llamacpp-avx512/bin/python, made by
                `bash bench/setup-llamacpp avx512`. Ratios against it are in the JSON
                (x_llama_cpp_avx512); the table's "x llama" is against the AVX2 build.
Memory: resident set size (VmRSS) after the runs and its peak (VmHWM), in MB, for each row's process.
The limit: each engine row measures the read bandwidth of our kernels' threads in its own process
(a STREAM-style sum over as many bytes as a token reads, on 2 MB pages as the engine's weights,
`read_bandwidth()`) before and after every decode run, and the bytes one decode step reads
(`bytes_per_token()`: the weights as stored plus the KV cache at the run's mean context); "GB/s"
is decode tok/s x those bytes, "of read" that over the bandwidth.

The full CPU bench, for a quiet machine (no other process on the cores; see docs/performance.md):
  bash bench/setup-llamacpp && bash bench/setup-llamacpp avx512
  python -m bench.decode --models bundled,llama-350m,llama-1b,llama-3b,llama-8b \
      --rows engine,engine-int8,engine-kv8,llama.cpp,llama.cpp-avx512 --reps 3 --rounds 3 \
      --out bench/results/decode-cpu-quiet.json
  python -m bench.decode --models qwen3-4b,qwen3-8b --rows engine,engine-kv8,llama.cpp,llama.cpp-avx512 \
      --reps 3 --rounds 3 --out bench/results/decode-cpu-quiet-qwen3.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_VENV = Path(__file__).resolve().parent / ".venv-llamacpp"
# the second anchor: llama.cpp with AVX-512 and VNNI, without AMX (`bench/setup-llamacpp avx512`)
LLAMA_VENV_AVX512 = Path(__file__).resolve().parent / ".venv-llamacpp-avx512"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
RESULTS = Path(__file__).resolve().parent / "results" / "decode-cpu.json"
ROWS = ("engine", "engine-int8", "engine-kv8", "engine-fp32", "mlx-lm", "llama.cpp",
        "llama.cpp-avx512")
# the engine rows: the environment each adds (MLXCHAT_KERNELS, MLXCHAT_KV_BITS)
ENGINE_ROWS = {"engine": {}, "engine-int8": {"MLXCHAT_KERNELS": "int8"},
               "engine-kv8": {"MLXCHAT_KV_BITS": "8"}, "engine-fp32": {"MLXCHAT_KERNELS": "0"}}

# Random-weight llama shapes (mlx-lm configs); the SmolLM2 vocabulary, so its tokenizer serves.
RANDOM_MODELS = {
    "llama-350m": dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=2816,
                       num_attention_heads=16, num_key_value_heads=4),
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                     num_attention_heads=32, num_key_value_heads=8),
    # Llama-3.2-3B's and Llama-3.1-8B's shapes (their own vocabularies replaced by SmolLM2's)
    "llama-3b": dict(hidden_size=3072, num_hidden_layers=28, intermediate_size=8192,
                     num_attention_heads=24, num_key_value_heads=8),
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                     num_attention_heads=32, num_key_value_heads=8),
    # Qwen3-4B's and Qwen3-8B's shapes: q/k norms, head dim 128 (mlx-lm's attention, our products)
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36,
                     intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rope_theta=1000000.0),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36,
                     intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rope_theta=1000000.0),
}


_PEAK_BEFORE_READS = [0.0]  # the peak RSS (MB) before read_bandwidth's buffers reset it


def _memory() -> dict[str, float]:
    from bench.common import process_memory

    out = process_memory()
    out["peak_rss_mb"] = max(out["peak_rss_mb"], _PEAK_BEFORE_READS[0])
    return out


def random_folder(name: str, shape: dict | None = None) -> Path:
    """An mlx-lm folder with random 4-bit weights (group 32, fp16 scales), built once in the cache;
    `shape` (default RANDOM_MODELS[name]) gives the sizes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from bench.shapes import Shape, build_module, publish, scratch_for
    from engine.loading.registry import resolve
    from engine.paths import cache_dir

    folder = cache_dir() / "bench-models" / name
    if (folder / "model.safetensors").exists():
        return folder
    config = {**dict(model_type="llama", rms_norm_eps=1e-5, vocab_size=49152, rope_theta=100000.0,
                     tie_word_embeddings=True, max_position_embeddings=8192),
              **(shape or RANDOM_MODELS[name])}
    model = build_module(Shape(name, config, bits=4, group_size=32), dtype=mx.float16)
    tmp = scratch_for(folder)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 32, "bits": 4}}))
    _, bundled = resolve(None)
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (bundled / file).exists():
            shutil.copy(bundled / file, tmp / file)
    return publish(tmp, folder)


# ------------------------------------------------------------ bytes a token reads, the limit
STREAM_BYTES = 512 * 2**20  # the read-bandwidth buffer by default


def tensor_bytes(path: str) -> dict[str, int]:
    """Each tensor's bytes in a safetensors file (its header only)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
            if k != "__metadata__"}


def bytes_per_token(folder: str, context: float, kv_bytes_per_value: float) -> dict[str, float]:
    """What one decode step reads from memory: every weight as stored (codes, scales and biases;
    the output head once: a tied embedding's whole matrix, else lm_head's, not the embedding's),
    plus the keys and values of `context` cached positions at `kv_bytes_per_value` (4 for our fp32
    cache, 1.25 for the 8-bit one: codes plus an fp32 scale and bias per 32)."""
    sizes = tensor_bytes(str(Path(folder) / "model.safetensors"))
    if any(k.startswith("lm_head.") for k in sizes):
        sizes = {k: v for k, v in sizes.items() if not k.startswith("model.embed_tokens.")}
    config = json.loads((Path(folder) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv = (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * context
          * kv_bytes_per_value)
    weights = sum(sizes.values())
    return dict(weights=weights, kv=kv, total=weights + kv)


def read_bandwidth(nbytes: int = STREAM_BYTES, huge: bool = False) -> float:
    """Bytes/s our kernels' threads read from memory now, in this process: the limit a decode step
    is held to. A STREAM-style sum over a buffer of `nbytes` (give it the footprint of what it is
    compared with: one token's bytes, the copies of a matrix; a buffer that fits the last-level
    cache reads faster than one that does not), on the pool the products run on, each 64-bit word
    added with the active unit's widest loads (`kernels.read_bandwidth`); two passes after one to
    warm up. `huge`: back the buffer with 2 MB pages (`kernels.huge_pages`)."""
    import mlx.core as mx

    from engine.kernels import native

    _PEAK_BEFORE_READS[0] = _memory()["peak_rss_mb"]
    buf = mx.ones((max(int(nbytes), 2**20) // 8 * 2,), dtype=mx.uint32)
    mx.eval(buf)
    kernels = native.kernels()
    if huge:
        kernels.huge_pages(buf)
    kernels.read_bandwidth(buf, 1)
    seconds, _ = kernels.read_bandwidth(buf, 2)
    read = 2 * buf.nbytes / seconds
    del buf
    mx.clear_cache()
    try:  # the buffer is not the model's memory: reset the peak (Linux 4.0+), kept above
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return read


# ----------------------------------------------------------------------------- workers
def _measure(run, job, load_s):
    """run(prompt_ids, n) -> (seconds to the first token, seconds for the n after it, tokens)."""
    run(job["short"], 8)  # warm-up (allocator, caches)
    pre = [len(job["long"]) / run(job["long"], 0)[0] for _ in range(job["reps"])]
    decs, toks = [], None
    for _ in range(job["reps"]):
        _, td, toks = run(job["short"], job["gen"])
        decs.append(job["gen"] / td)
    return dict(load_s=load_s, prefill_tps=max(pre), decode_tps=max(decs), prefill_all=pre,
                decode_all=decs, tokens=toks[1:], **_memory())


def _mlx_lm_worker(model_path, job):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    t = time.perf_counter()
    model, _ = load(model_path)
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


def _engine_worker(model_path, job):
    """Our engine end to end: the Engine service on load_model(folder)."""
    from engine.decoding.sampling import SamplingParams
    from engine.device import describe
    from engine.kernels import active_path
    from engine.scheduling.service import Engine

    t = time.perf_counter()
    eng = Engine(model_path, max_running=1, max_queued=1, prefix_cache=False).start()
    load_s = time.perf_counter() - t

    def run(n, **prompt):
        t0 = time.perf_counter()
        stamps, toks, done = [], [], None
        for e in eng.submit(params=SamplingParams(max_tokens=n), **prompt).events(timeout=1800):
            if e.kind == "token":
                stamps.append(time.perf_counter())
                toks.append(e.token)
            elif e.kind == "done":
                done = e
        return t0, stamps, toks, done

    try:
        run(8, prompt_tokens=job["short"])  # warm-up
        pre, decs, n_prompt, toks = [], [], None, None
        for _ in range(job["reps"]):
            t0, stamps, _, done = run(1, text=job["long_text"])
            n_prompt = done.usage.prompt_tokens
            pre.append(n_prompt / (stamps[0] - t0))
        kv8 = os.environ.get("MLXCHAT_KV_BITS") == "8"
        read = bytes_per_token(model_path, len(job["short"]) + job["gen"] / 2, 1.25 if kv8 else 4)
        # the limit, next to each decode run: one token's bytes, on 2 MB pages as the weights
        bandwidth = [read_bandwidth(read["total"], huge=True)]
        for _ in range(job["reps"]):
            _, stamps, toks, _ = run(job["gen"] + 1, prompt_tokens=job["short"])
            decs.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
            bandwidth.append(read_bandwidth(read["total"], huge=True))
    finally:
        eng.stop()
    return dict(load_s=load_s, prefill_tps=max(pre), decode_tps=max(decs), prefill_all=pre,
                decode_all=decs, prompt_tokens=n_prompt, tokens=toks[1:], device=describe(),
                path=active_path(), bytes_per_token=read, read_bandwidth_all=bandwidth,
                read_bandwidth=max(bandwidth), decode_bandwidth=max(decs) * read["total"],
                fraction_of_limit=max(decs) * read["total"] / max(bandwidth), **_memory())


def _llama_worker(gguf, job):
    import numpy as np
    from llama_cpp import Llama

    t = time.perf_counter()
    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=job["threads"], n_threads_batch=job["threads"],
                n_batch=512, verbose=False)
    load_s = time.perf_counter() - t
    n_vocab = llm.n_vocab()

    def last_argmax():
        # llama-cpp-python 0.3.36 no longer copies logits into llm.scores unless logits_all
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    def run(prompt, n):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        toks = [last_argmax()]
        t1 = time.perf_counter()
        for _ in range(n):
            llm.eval([toks[-1]])
            toks.append(last_argmax())
        return t1 - t0, time.perf_counter() - t1, toks

    return _measure(run, job, load_s)


# ------------------------------------------------------------------------------ driver
def llama_worker_command(python: str, gguf: str) -> list[str]:
    """The llama.cpp row's child: `python` (llama-cpp-python's venv, which has none of our
    packages) runs this module as `bench.decode` from the repository's root (`_sub`'s cwd), so
    the worker's own imports of `bench` resolve without PYTHONPATH."""
    return [python, "-m", "bench.decode", "--worker", "llama.cpp", "--model-path", gguf]


def _sub(cmd, env_extra, job):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    env = dict(os.environ, **env_extra)
    p = subprocess.run(cmd + ["--job", f.name], env=env, capture_output=True, text=True, cwd=str(ROOT))
    os.unlink(f.name)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (p.stderr or p.stdout)[-2000:]}


def _job(folder: str, a) -> dict:
    from mlx_lm import load

    _, tok = load(folder)
    text = (ROOT / "engine" / "loading" / "gguf.py").read_text()
    while len(tok.encode(text)) < a.prompt_tokens:
        text += text
    long_ids = tok.encode(text)[: a.prompt_tokens]
    short_ids = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
        add_generation_prompt=True)
    # The engine rows take the long prompt as raw text: text that encodes back to the same ids.
    return dict(long=long_ids, long_text=tok.decode(long_ids), short=list(short_ids),
                gen=a.gen_tokens, reps=a.reps, threads=a.threads)


def _table(model: str, rows: dict) -> None:
    base, llama = rows.get("mlx-lm", {}), rows.get("llama.cpp", {})
    avx512 = rows.get("llama.cpp-avx512", {})
    ref = rows.get("mlx-lm", {}).get("tokens")
    print(f"\n{model}\n{'row':<12} {'prefill tok/s':>13} {'x mlx-lm':>8} {'x llama':>8} "
          f"{'decode tok/s':>12} {'x mlx-lm':>8} {'x llama':>8} {'RSS MB':>7} {'peak MB':>7} "
          f"{'GB/s':>6} {'of read':>7}  greedy match")
    ratio = lambda r, other, key: r[key] / other[key] if key in other else float("nan")  # noqa: E731
    for name, r in rows.items():
        if "error" in r or "skipped" in r:
            print(f"{name:<12} {r.get('skipped') or 'ERROR ' + r['error'][-300:]}")
            continue
        same = 0
        for x, y in zip(r["tokens"], ref or []):
            if x != y:
                break
            same += 1
        r["greedy_prefix_match_vs_mlx_lm"] = same if ref else None
        r["x_mlx_lm"] = dict(prefill=ratio(r, base, "prefill_tps"), decode=ratio(r, base, "decode_tps"))
        r["x_llama_cpp"] = dict(prefill=ratio(r, llama, "prefill_tps"), decode=ratio(r, llama, "decode_tps"))
        r["x_llama_cpp_avx512"] = dict(prefill=ratio(r, avx512, "prefill_tps"),
                                       decode=ratio(r, avx512, "decode_tps"))
        print(f"{name:<12} {r['prefill_tps']:>13.1f} {r['x_mlx_lm']['prefill']:>8.2f} "
              f"{r['x_llama_cpp']['prefill']:>8.2f} {r['decode_tps']:>12.2f} {r['x_mlx_lm']['decode']:>8.2f} "
              f"{r['x_llama_cpp']['decode']:>8.2f} {r['rss_mb']:>7.0f} {r['peak_rss_mb']:>7.0f} "
              f"{r.get('decode_bandwidth', float('nan')) / 1e9:>6.2f} "
              f"{r.get('fraction_of_limit', float('nan')):>7.2f}  {f'{same}/{len(ref)}' if ref else '-'}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="bundled",
                    help=f"bundled, {', '.join(RANDOM_MODELS)} (comma-separated)")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--llama-python", default=os.environ.get("MLXCHAT_LLAMA_PYTHON"),
                    help="python with llama_cpp importable (default: $MLXCHAT_LLAMA_PYTHON, else "
                         f"{LLAMA_VENV}/bin/python from `bash bench/setup-llamacpp`)")
    ap.add_argument("--llama-avx512-python", default=os.environ.get("MLXCHAT_LLAMA_AVX512_PYTHON"),
                    help="python with an AVX-512 (no AMX) llama_cpp (default: "
                         "$MLXCHAT_LLAMA_AVX512_PYTHON, else "
                         f"{LLAMA_VENV_AVX512}/bin/python from `bash bench/setup-llamacpp avx512`)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="run every row this many times, in turn")
    ap.add_argument("--threads", type=int, default=None, help="threads for every row (default: ours)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        job = json.load(open(a.job))
        worker = {"llama.cpp": _llama_worker, "mlx-lm": _mlx_lm_worker}.get(a.worker, _engine_worker)
        print("RESULT " + json.dumps(worker(a.model_path, job)), flush=True)
        return

    from bench.llama_gguf import random_gguf
    from engine.kernels.native import thread_count
    from engine.loading import bundled
    from engine.loading.registry import resolve

    a.threads = a.threads or thread_count()
    llama_py = a.llama_python or str(LLAMA_VENV / "bin" / "python")
    llama_avx512_py = a.llama_avx512_python or str(LLAMA_VENV_AVX512 / "bin" / "python")
    me = [sys.executable, "-m", "bench.decode"]
    threads_env = {"MLXCHAT_THREADS": str(a.threads)}
    blas_env = {"LD_PRELOAD": OPENBLAS} if os.path.exists(OPENBLAS) else {}
    results = {}
    for model in a.models.split(","):
        folder = str(resolve(None)[1]) if model == "bundled" else str(random_folder(model))
        job = _job(folder, a)

        def run_row(name):
            if name in ENGINE_ROWS:
                return _sub(me + ["--worker", "engine", "--model-path", folder],
                            {**blas_env, **threads_env, **ENGINE_ROWS[name]}, job)
            if name == "mlx-lm":
                return _sub(me + ["--worker", "mlx-lm", "--model-path", folder], {}, job)
            if name in ("llama.cpp", "llama.cpp-avx512"):
                py = llama_py if name == "llama.cpp" else llama_avx512_py
                if not os.path.exists(py):
                    how = "bash bench/setup-llamacpp" + (" avx512" if name != "llama.cpp" else "")
                    return {"skipped": f"no {name}: run `{how}` (makes {py})"}
                gguf = str(bundled.ensure_bundled_gguf() if model == "bundled"
                           else random_gguf(Path(folder), llama_py if os.path.exists(llama_py) else py))
                r = _sub(llama_worker_command(py, gguf), {}, job)
                return {**r, "python": py, "gguf": gguf}
            raise SystemExit(f"unknown row {name}")

        # Rows run in rounds (every row once per round) and each keeps its best figures: on a
        # shared machine, load that comes and goes then hits every row alike.
        rows = {}
        for round_ in range(a.rounds):
            for name in a.rows.split(","):
                r = run_row(name)
                best = rows.get(name)
                if best is None or "error" in best or "skipped" in best:
                    rows[name] = r
                elif "error" not in r and "skipped" not in r:
                    for key in ("prefill", "decode"):
                        best[f"{key}_all"] += r[f"{key}_all"]
                        best[f"{key}_tps"] = max(best[f"{key}_all"])
                shown = (f"prefill {r['prefill_tps']:.1f} tok/s, decode {r['decode_tps']:.2f} tok/s"
                         if "prefill_tps" in r else r.get("skipped") or "ERROR " + r["error"][-300:])
                print(f"  [{model} {round_ + 1}] {name}: {shown}", flush=True)
        _table(model, rows)
        results[model] = dict(folder=folder, rows=rows)

    from bench.common import cpu_model

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(prompt_tokens=a.prompt_tokens, gen_tokens=a.gen_tokens, reps=a.reps, rounds=a.rounds,
                threads=a.threads, llama_python=llama_py, cpus=os.cpu_count(), cpu=cpu_model(),
                load_avg=os.getloadavg(),
                time=time.time(),
                command="python -m bench.decode " + " ".join(argv if argv is not None else sys.argv[1:]))
    out.write_text(json.dumps(dict(meta=meta, models=results), indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
