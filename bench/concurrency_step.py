"""The step loop around the batched model call: 8 concurrent streams on a model whose layers are
tiny (2 layers, hidden 64) but whose vocabulary is a real one's, so that a step is the work that
scales with the vocabulary (output head, log-softmax, sampling) and the host work around the model
call (building the step, host syncs, handing tokens to the readers).

    python -m bench.concurrency_step [--streams 8] [--gen 64] [--reps 5] [--vocab 49152]
                                     [--layers 2] [--hidden 64] [--profile FILE]
                                     [--baseline-engine DIR]

Ours (`engine.scheduling.service.Engine`, prefix cache off, greedy) against mlx-lm's
`batch_generate` on the same model object and the same prompt ids, runs interleaved. Per side:
aggregate tok/s (all tokens over the wall time from submission, prefill included) and the host
CPU time per token of the thread that drives the model (our scheduler thread; the caller of
`batch_generate`): on a GPU that time is what the device waits for when it is not hidden behind
the step in flight. Our reader threads' time (tokens handed to the streams) is not in it.
`--profile FILE` also runs ours once under cProfile (the scheduler thread) and writes the
cumulative-time listing to FILE. JSON goes to bench/results/concurrency-step-cpu.json.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import importlib.util
import io
import json
import os
import pstats
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx

from . import common
from .shapes import Shape, ours_and_mlx_lm, prompt_ids

RESULTS = Path(__file__).resolve().parent / "results" / "concurrency-step-cpu.json"
CONFIG = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 8192,
}


def tiny_lm(vocab: int, layers: int = 2, hidden: int = 64):
    """A small llama (`layers` layers of width `hidden`) with a `vocab`-token head, fp32, as an
    engine `LoadedModel`."""
    from engine.loading.registry import LoadedModel
    from .shapes import IdTokenizer

    config = {**CONFIG, "vocab_size": vocab, "num_hidden_layers": layers, "hidden_size": hidden,
              "intermediate_size": 2 * hidden}
    model, extras, compute = ours_and_mlx_lm(Shape("tiny-vocab", config), mx.float32)
    return LoadedModel(name=f"random:tiny-vocab-{vocab}", model=model, tokenizer=IdTokenizer(vocab),
                       config=config, path=Path("/nonexistent/tiny-vocab"), extras=extras,
                       compute=compute)


def mlx_batch(lm, prompts: list[list[int]], gen: int) -> dict:
    from mlx_lm.generate import batch_generate

    with common.mlx_lm_paths(lm) as model:
        t, cpu = time.perf_counter(), time.thread_time()
        batch_generate(model, lm.tokenizer, prompts, max_tokens=gen)
        mx.synchronize()
    n = len(prompts) * gen
    return {"aggregate_tps": n / (time.perf_counter() - t),
            "host_us_per_token": (time.thread_time() - cpu) / n * 1e6}


def on_scheduler(svc: common.EngineService, fn) -> None:
    """Run `fn` on the scheduler thread between requests (a baseline copy of the engine from
    before `Engine.run_on_scheduler` has it as `_call`)."""
    run = getattr(svc.engine, "run_on_scheduler", None) or svc.engine._call  # noqa: SLF001
    run(fn)


def scheduler_cpu_s(svc: common.EngineService) -> float:
    """CPU time the scheduler thread has used so far (read on that thread, between requests)."""
    out: list[float] = []
    on_scheduler(svc, lambda: out.append(time.thread_time()))
    return out[0]


def ours(svc: common.EngineService, prompts: list[list[int]], gen: int) -> dict:
    cpu = scheduler_cpu_s(svc)
    run = svc.concurrent(prompts, gen)
    run["host_us_per_token"] = (scheduler_cpu_s(svc) - cpu) / run["tokens"] * 1e6
    return run


def profiled(svc: common.EngineService, prompts: list[list[int]], gen: int) -> str:
    """One concurrent run of ours with the scheduler thread under cProfile (switched on and off
    from that thread, between requests)."""
    profile = cProfile.Profile()
    svc.engine.run_on_scheduler(profile.enable)  # the bench profiles the thread it measures
    svc.concurrent(prompts, gen)
    svc.engine.run_on_scheduler(profile.disable)
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(30)
    return out.getvalue()


def engine_copy(folder: str, lm, streams: int) -> common.EngineService:
    """An `EngineService` running another copy of the engine package (`folder`/engine, e.g. from
    `git archive main engine`), imported as `engine_base`, so that two versions of the step loop
    run side by side in one process."""
    spec = importlib.util.spec_from_file_location(
        "engine_base", Path(folder) / "engine" / "__init__.py",
        submodule_search_locations=[str(Path(folder) / "engine")])
    package = importlib.util.module_from_spec(spec)
    sys.modules["engine_base"] = package
    spec.loader.exec_module(package)
    service = importlib.import_module("engine_base.scheduling.service")
    svc = common.EngineService.__new__(common.EngineService)
    svc.note, svc.prefix_cache = f"engine from {folder}", False
    svc.engine = service.Engine(load=lambda *a, **k: lm, max_running=streams, max_queued=64,
                                prefix_cache=False).start()
    return svc


# -- many streams on a shape (issue 33): --shapes ... --parts streams,interfere,cache,mixcost ------

def _reader(handle, times: list[float]) -> threading.Thread:
    """A thread recording the arrival time of each token of `handle`."""
    def read() -> None:
        for ev in handle.events(timeout=600):
            if ev.kind == "token":
                times.append(time.perf_counter())
            elif ev.error:
                times.append(float("nan"))  # a failed stream shows as a NaN arrival
    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def smallmm_layers(model) -> list:
    """The layers of `model` that gpu_layout.py put on the small-rows kernel."""
    from engine.kernels.smallmm_cuda import SmallMMLinear

    return [m for _, m in model.named_modules() if isinstance(m, SmallMMLinear)]


def without_smallmm(model, fn):
    """`fn()` with every small-rows layer of `model` sending its products to MLX's matmul."""
    layers = smallmm_layers(model)
    saved = [(m.min_rows, m.max_rows) for m in layers]
    for m in layers:
        m.min_rows, m.max_rows = 1, 0
    try:
        return fn()
    finally:
        for m, (least, most) in zip(layers, saved):
            m.min_rows, m.max_rows = least, most


def uncompiled_smallmm(fn):
    """`fn()` with the small-rows kernel launched without `mx.compile`."""
    from engine.kernels import smallmm_cuda

    saved, smallmm_cuda.COMPILED = smallmm_cuda.COMPILED, False
    try:
        return fn()
    finally:
        smallmm_cuda.COMPILED = saved


def part_streams(lm, svc: common.EngineService, counts: list[int], prompt: int, gen: int,
                 reps: int) -> list[dict]:
    """Aggregate tok/s of N streams (N in `counts`) through the Engine against mlx-lm's
    `batch_generate` of the same N prompts, interleaved; host CPU ms per batched step of the thread
    that drives the model (our scheduler thread; the caller of `batch_generate`)."""
    vocab = lm.config["vocab_size"]
    out = []
    for n in counts:
        prompts = [prompt_ids(prompt, vocab, seed=200 + i) for i in range(n)]
        sides = {"ours": lambda: ours(svc, prompts, gen), "mlx": lambda: mlx_batch(lm, prompts, gen)}
        if smallmm_layers(lm.model):  # ours again with the small-rows kernel off: MLX's matmul;
            # and with the kernel launched without mx.compile
            sides["ours_mlx_matmul"] = lambda: without_smallmm(lm.model, lambda: ours(svc, prompts, gen))
            sides["ours_uncompiled"] = lambda: uncompiled_smallmm(lambda: ours(svc, prompts, gen))
        runs = common.interleave(sides, reps, warmup=True)
        tps = {k: [r["aggregate_tps"] for r in v] for k, v in runs.items()}
        host = {k: [r["host_us_per_token"] * n / 1e3 for r in v] for k, v in runs.items()}
        med = {k: common.median(v) for k, v in tps.items()}
        out.append({"streams": n, "prompt": prompt, "gen": gen, "tps": tps, "median_tps": med,
                    "ratio": med["ours"] / med["mlx"], "host_ms_per_step": host,
                    "median_host_ms_per_step": {k: common.median(v) for k, v in host.items()},
                    "first_token_s": [r.get("first_token_s") for r in runs["ours"]]})
        print(f"  streams {n}: ours {med['ours']:.1f} tok/s ({common.spread(tps['ours'])}), "
              f"batch_generate {med['mlx']:.1f} ({common.spread(tps['mlx'])}), "
              f"{out[-1]['ratio']:.2f}x; host ms/step ours "
              f"{out[-1]['median_host_ms_per_step']['ours']:.2f}, mlx "
              f"{out[-1]['median_host_ms_per_step']['mlx']:.2f}" + (
                  f"; ours with MLX's matmul {med['ours_mlx_matmul']:.1f} tok/s "
                  f"({common.spread(tps['ours_mlx_matmul'])}), uncompiled kernel "
                  f"{med['ours_uncompiled']:.1f}" if "ours_mlx_matmul" in med else ""),
              flush=True)
    return out


def _pcts(gaps: list[float]) -> dict:
    gaps = sorted(g * 1e3 for g in gaps)
    if not gaps:
        return {"n": 0, "p50": None, "p95": None, "max": None}
    pick = lambda q: gaps[min(int(q * len(gaps)), len(gaps) - 1)]
    return {"n": len(gaps), "p50": pick(0.5), "p95": pick(0.95), "max": gaps[-1]}


def interfere_once(svc: common.EngineService, lm, streams: int, long_prompt: int,
                   warm_tokens: int, seed: int) -> dict:
    """`streams` streams decoding, then a `long_prompt`-token prompt submitted: the gaps between
    the streams' tokens while it is prefilled (those ending between its submission and its first
    token, and each stream's first gap after it) against the same streams' gaps over the
    `warm_tokens` tokens before it; the new prompt's time to first token."""
    from engine.decoding.sampling import SamplingParams

    vocab = lm.config["vocab_size"]
    params = SamplingParams(max_tokens=4096)
    handles = [svc.engine.submit(prompt_tokens=prompt_ids(64, vocab, seed=seed + i), params=params)
               for i in range(streams)]
    times: list[list[float]] = [[] for _ in handles]
    threads = [_reader(h, t) for h, t in zip(handles, times)]
    while min(len(t) for t in times) < warm_tokens + 8:
        time.sleep(0.002)
    submitted = time.perf_counter()
    new = svc.engine.submit(prompt_tokens=prompt_ids(long_prompt, vocab, seed=seed + 99),
                            params=SamplingParams(max_tokens=2))
    first = next(time.perf_counter() for ev in new.events(timeout=600) if ev.kind == "token")
    list(new.events(timeout=600))
    while min(sum(1 for x in t if x > first) for t in times) < 4:
        time.sleep(0.002)
    for h in handles:
        h.cancel()
    for t in threads:
        t.join(60)
    steady, during = [], []
    for ts in times:
        gaps = [(a, b) for a, b in zip(ts, ts[1:])]
        before = [b - a for a, b in gaps if b <= submitted][-warm_tokens:]
        inside = [b - a for a, b in gaps if submitted < b <= first]
        after = [b - a for a, b in gaps if b > first][:1]
        steady += before
        during += inside + after
    # one stream's gaps through the window (ms after submission the gap ended, its ms): where the
    # worst one sits (a prefill step, the prompt's row joining, the steps after)
    ts = times[0]
    timeline = [(round((b - submitted) * 1e3, 1), round((b - a) * 1e3, 1)) for a, b in zip(ts, ts[1:])
                if submitted - 0.03 < b and sum(1 for x in ts if first < x <= b) <= 4]
    return {"ttft_s": first - submitted, "steady": _pcts(steady), "during": _pcts(during),
            "timeline_ms": timeline}


def part_interfere(lm, svc: common.EngineService, streams: int, long_prompt: int, budgets: list,
                   reps: int, warm_tokens: int = 32) -> dict:
    """The interference row for each prefill budget of `budgets` (engine/scheduling/
    prefill_policy.py DECODING_TOKENS; "chunk": one prefill chunk per tick; "alt" before it: with
    mixed steps off, the chunks in calls of their own), interleaved with the same prompt's time to
    first token on the idle engine and mlx-lm's prefill of it."""
    from engine.device import backend
    from engine.scheduling import prefill_policy

    vocab = lm.config["vocab_size"]
    long_ids = prompt_ids(long_prompt, vocab, seed=999)
    saved = dict(prefill_policy.DECODING_TOKENS)
    sides = {}
    for b in budgets:
        def run(b=b) -> dict:
            alternate = b.startswith("alt")  # mixed steps off: chunks in calls of their own
            tokens = b[3:] if alternate else b
            prefill_policy.DECODING_TOKENS[backend()] = None if tokens == "chunk" else int(tokens)
            batch = svc.engine.slot.batch
            mixed, batch.mixed = batch.mixed, batch.mixed and not alternate
            try:
                return {**interfere_once(svc, lm, streams, long_prompt, warm_tokens, seed=300),
                        "mixed_steps": batch.mixed}
            finally:
                prefill_policy.DECODING_TOKENS.update(saved)
                batch.mixed = mixed
        sides[f"budget_{b}"] = run
    sides["idle"] = lambda: {"ttft_s": svc.stream(long_ids, 2)["ttft_s"]}
    sides["mlx_prefill"] = lambda: {"ttft_s": common.mlx_lm_stream(lm, long_ids, 2)["ttft_s"]}
    runs = common.interleave(sides, reps, warmup=True)
    idle = common.median([r["ttft_s"] for r in runs["idle"]])
    out = {"streams": streams, "long_prompt": long_prompt, "reps": reps, "runs": runs,
           "idle_ttft_s": idle,
           "mlx_prefill_s": common.median([r["ttft_s"] for r in runs["mlx_prefill"]]),
           "chunk": _chunk_of(lm), "summary": {}}
    for b in budgets:
        rs = runs[f"budget_{b}"]
        med = lambda part, key: common.median([r[part][key] for r in rs])
        s = {"steady_p50": med("steady", "p50"), "steady_p95": med("steady", "p95"),
             "during_p50": med("during", "p50"), "during_p95": med("during", "p95"),
             "during_max": med("during", "max"),
             "ttft_s": common.median([r["ttft_s"] for r in rs])}
        s["p95_over_steady"] = s["during_p95"] / s["steady_p95"]
        s["max_over_steady_p95"] = s["during_max"] / s["steady_p95"]
        s["ttft_over_idle"] = s["ttft_s"] / idle
        out["summary"][str(b)] = s
        print(f"  budget {b}, one stream's gaps (ms after submission: gap ms), first rep; the prompt's "
              f"first token at {rs[0]['ttft_s'] * 1e3:.0f} ms: "
              + ", ".join(f"{t:.0f}: {g:.1f}" for t, g in rs[0]["timeline_ms"]), flush=True)
        print(f"  budget {b}: steady p50/p95 {s['steady_p50']:.1f}/{s['steady_p95']:.1f} ms; during "
              f"p50/p95/max {s['during_p50']:.1f}/{s['during_p95']:.1f}/{s['during_max']:.1f} ms "
              f"(p95 {s['p95_over_steady']:.2f}x, max {s['max_over_steady_p95']:.2f}x steady p95); "
              f"TTFT {s['ttft_s'] * 1e3:.0f} ms = {s['ttft_over_idle']:.2f}x idle "
              f"{idle * 1e3:.0f} ms (mlx-lm prefill {out['mlx_prefill_s'] * 1e3:.0f} ms)", flush=True)
    return out


def _chunk_of(lm) -> int:
    from engine.decoding.generate import default_prefill_chunk

    return default_prefill_chunk(lm)


def _timed(fn, reps: int) -> float:
    """Median ms of `fn()` (which evaluates what it builds), after one untimed call."""
    fn()
    out = []
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return common.median(out)


def _mlx_merge(singles: list) -> list:
    """The rows' caches merged as mlx-lm merges them (its own batch classes, `BatchKVCache`)."""
    return [type(layers[0]).merge(list(layers)) for layers in zip(*singles)]


def _join_ms(model, caches, singles: list, joining: list, reps: int) -> dict:
    """Median ms of the batch of `singles` taking the row cache `joining`, evaluated (before each
    timed join the batch is merged afresh and takes one decode step, as a decoding batch has):
    ours (the engine's batch caches, `caches.merge` / `caches.extend`: a free slot takes the row)
    and mlx-lm's (`BatchKVCache` and its `extend`, which builds every row anew), interleaved."""
    state = lambda cache: [layer.state for layer in cache]  # noqa: E731
    sides = {"ours": (caches.merge, lambda batch: caches.extend(batch, caches.merge([joining]))),
             "mlx": (_mlx_merge, lambda batch: [a.extend(b) for a, b in
                                                zip(batch, _mlx_merge([joining]))])}
    runs: dict[str, list[float]] = {side: [] for side in sides}
    for i in range(reps + 1):
        for side in (list(sides) if i % 2 == 0 else list(reversed(sides))):
            merge, join = sides[side]
            batch = merge(singles)
            mx.eval(model(mx.array([[5]] * len(singles)), cache=batch))
            mx.eval(state(batch))
            mx.synchronize()
            t = time.perf_counter()
            join(batch)
            mx.eval(state(batch))
            if i:  # the first round warms up
                runs[side].append((time.perf_counter() - t) * 1e3)
            del batch
    return {side: common.median(v) for side, v in runs.items()}


def part_cache(lm, rows_list: list[int], context: int, reps: int, long_prompt: int = 0) -> list[dict]:
    """What rows joining and leaving cost at `rows` rows of `context` tokens each: mlx-lm's batch
    caches' extend (a row joins), filter (a row leaves), extract (a row's cache handed back),
    merge of all rows, each evaluated, against one batched decode step at that many rows; and a
    row of `context` tokens, then one of `long_prompt` tokens, joining them (ours against
    mlx-lm's extend)."""
    from mlx_lm.models.cache import make_prompt_cache

    caches, model, vocab = lm.caches, lm.model, lm.config["vocab_size"]
    out = []
    for n in rows_list:
        singles = []
        for i in range(n + 1):
            c = make_prompt_cache(model)
            mx.eval(model(mx.array([prompt_ids(context, vocab, seed=i)]), cache=c))
            singles.append(c)
        state = lambda cache: [layer.state for layer in cache]
        batch = caches.merge(singles[:n])
        mx.eval(state(batch))
        tokens = mx.array([[5]] * n)

        def extend_filter():  # a row joins, then leaves: the batch is as before
            caches.extend(batch, caches.merge([singles[n]]))
            mx.eval(state(batch))
            caches.filter(batch, list(range(n)))
            mx.eval(state(batch))

        def step():
            mx.eval(model(tokens, cache=batch))
        extend_ms = _timed(extend_filter, reps)
        row = {"rows": n, "context": context,
               "merge_ms": _timed(lambda: mx.eval(state(caches.merge(singles[:n]))), reps),
               "extend_then_filter_ms": extend_ms,
               "extract_ms": _timed(lambda: mx.eval(state(caches.extract(batch, n // 2))), reps),
               "decode_step_ms": _timed(step, reps),
               "join_ms": _join_ms(model, caches, singles[:n], singles[n], reps)}
        if long_prompt:
            long = make_prompt_cache(model)
            mx.eval(model(mx.array([prompt_ids(long_prompt, vocab, seed=77)]), cache=long))
            row["long_prompt"] = long_prompt
            row["join_long_ms"] = _join_ms(model, caches, singles[:n], long, reps)
            del long
        out.append(row)
        print(f"  cache ops at {n} rows of {context}+ tokens: merge {row['merge_ms']:.2f} ms, "
              f"join+leave {row['extend_then_filter_ms']:.2f} ms, extract {row['extract_ms']:.2f} "
              f"ms; one decode step {row['decode_step_ms']:.2f} ms; a row joining: ours "
              f"{row['join_ms']['ours']:.2f} ms, mlx-lm's extend {row['join_ms']['mlx']:.2f} ms" + (
                  f"; a {long_prompt}-token row joining: ours {row['join_long_ms']['ours']:.2f} ms, "
                  f"mlx-lm's {row['join_long_ms']['mlx']:.2f} ms" if long_prompt else ""), flush=True)
    return out


def part_mixcost(lm, rows: int, chunks: list[int], context: int, reps: int) -> list[dict]:
    """The model-call cost behind mixed steps: a decode step of `rows` rows, a prefill chunk of C
    tokens alone, and one call over rows + C tokens flattened into a single sequence (what a step
    carrying both pays for its matmuls; its attention is the chunk's), each evaluated."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.kernels.head import last_logits

    model, vocab = lm.model, lm.config["vocab_size"]
    batch = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt_ids(context, vocab, seed=i) for i in range(rows)]), cache=batch))
    decode = lambda: mx.eval(model(mx.array([[5]] * rows), cache=batch))
    out = []
    for c in chunks:
        def alone(n: int) -> float:
            ids = mx.array([prompt_ids(n, vocab, seed=7)])
            def call():
                cache = make_prompt_cache(model)
                mx.eval(last_logits(model, ids, cache))
            return _timed(call, reps)
        row = {"rows": rows, "chunk": c, "decode_ms": _timed(decode, reps),
               "chunk_ms": alone(c), "mixed_ms": alone(c + rows)}
        row["alternating_ms"] = row["decode_ms"] + row["chunk_ms"]
        out.append(row)
        print(f"  {rows} decode rows + {c}-token chunk: apart {row['decode_ms']:.2f} + "
              f"{row['chunk_ms']:.2f} = {row['alternating_ms']:.2f} ms; one call of {rows + c} "
              f"tokens {row['mixed_ms']:.2f} ms", flush=True)
    return out


def _smallmm_side():
    """Our small-rows product (engine/kernels/smallmm_cuda.py) as `make(kw, blocks, compiled)`
    giving a function of (x, w): the kernel on CUDA, its numpy emulation elsewhere (correct, not
    timed); and whether it is the kernel."""
    import numpy as np

    from engine.device import backend
    from engine.kernels import smallmm_cuda

    if backend() == "cuda":
        return smallmm_cuda.launcher, True
    f32 = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
    return (lambda kw=None, blocks=None, compiled=True: lambda x, w: mx.array(
        smallmm_cuda.emulate(f32(x), f32(w), kw)).astype(x.dtype)), False


def _variants(rows: int) -> list[tuple[int | None, int | None]]:
    """Other launch shapes than the default (warps per block, 32-blocks loaded at once) that the
    matmul part also checks and times at `rows` rows."""
    from engine.kernels import smallmm_cuda

    u = smallmm_cuda.unroll(rows)
    return [(4, None), (16, None), (None, max(1, u // 2)), (None, 2 * u)]


def check_smallmm(shapes: list[tuple[int, int]], rows_list: list[int]) -> list[dict]:
    """Our product (compiled, and not) against the fp32 product of the same bf16 (and fp16)
    values, next to MLX's own matmul's difference from it: ours is correct when within 2x MLX's
    difference or 1% of the output's scale. Launch shapes other than the default on the first
    shape at 8 and 32 rows."""
    from engine.kernels import smallmm_cuda

    make, _ = _smallmm_side()
    out = []
    for k, n in shapes:
        for dtype in (mx.bfloat16, mx.float16):
            w = (mx.random.normal((n, k)) / k ** 0.5).astype(dtype)
            for rows in rows_list:
                if rows > smallmm_cuda.MAX_ROWS:
                    continue
                x = mx.random.normal((rows, k)).astype(dtype)
                exact = x.astype(mx.float32) @ w.astype(mx.float32).T
                err = lambda y: mx.abs(y.astype(mx.float32) - exact).max().item()  # noqa: E731
                e_mlx, scale = err(x @ w.T), mx.abs(exact).max().item()
                launches = [(None, None, True), (None, None, False)] + (
                    [(kw, b, True) for kw, b in _variants(rows)] if (k, n) == shapes[0] and rows in (8, 32) else [])
                for kw, blocks, compiled in launches:
                    try:
                        e_ours = err(make(kw, blocks, compiled)(x, w))
                    except Exception as exc:  # a kernel that does not compile or launch: a wrong one
                        print(f"  smallmm kernel failed: {exc!r}"[:2000], flush=True)
                        e_ours = float("inf")
                    out.append({"k": k, "n": n, "rows": rows, "dtype": str(dtype), "kw": kw,
                                "blocks": blocks, "compiled": compiled, "err_ours": e_ours,
                                "err_mlx": e_mlx, "scale": scale,
                                "ok": e_ours <= max(2 * e_mlx, 0.01 * scale)})
            print(f"  check {k}->{n} {dtype}: " + ", ".join(
                f"{r['rows']} rows {r['err_ours']:.4f}/{r['err_mlx']:.4f}{'' if r['ok'] else ' WRONG'}"
                for r in out if (r["k"], r["n"], r["dtype"], r["kw"], r["blocks"], r["compiled"])
                == (k, n, str(dtype), None, None, True)), flush=True)
            if dtype == mx.bfloat16 and (k, n) != shapes[0]:
                break  # fp16 on the first shape only
    return out


def _chain_rates(ws: list[mx.array], rows_list: list[int], sides_at, reps: int) -> list[dict]:
    """For each rows of `rows_list`: the ms of one `mx.eval` of `ws` applied in a chain to
    (rows, K) activations by each product `sides_at(rows)` gives (name -> fn(x, w)), interleaved,
    the host ms spent building the chain's graph (before the eval) apart, as weight GB/s."""
    nbytes = sum(w.nbytes for w in ws)
    out = []
    for rows in rows_list:
        x = mx.random.normal((rows, ws[0].shape[1])).astype(ws[0].dtype)

        def chain(product) -> float:
            t = time.perf_counter()
            y = x
            for w in ws:
                y = product(y, w)
            built = time.perf_counter() - t
            mx.eval(y)
            return built
        sides = sides_at(rows)
        for product in sides.values():
            chain(product)  # untimed: compiled and allocated
        runs: dict[str, list[float]] = {side: [] for side in sides}
        build: dict[str, list[float]] = {side: [] for side in sides}
        for i in range(reps):
            for side in (list(sides) if i % 2 == 0 else list(reversed(sides))):
                mx.synchronize()
                t = time.perf_counter()
                build[side].append(chain(sides[side]) * 1e3)
                runs[side].append((time.perf_counter() - t) * 1e3)
        ms = {side: common.median(v) for side, v in runs.items()}
        row = {"rows": rows, "weights": len(ws), "shape": list(ws[0].shape), "bytes": nbytes,
               "ms": ms, "gb_per_s": {side: nbytes / v / 1e6 for side, v in ms.items()},
               "host_us_per_product": {side: common.median(v) * 1e3 / len(ws) for side, v in build.items()},
               "runs_ms": runs}
        out.append(row)
        print(f"  chain of {len(ws)} x {tuple(ws[0].shape)} ({nbytes / 1e9:.2f} GB), {rows} rows: " + "; ".join(
            f"{side} {row['gb_per_s'][side]:.0f} GB/s (host {row['host_us_per_product'][side]:.0f} us/product)"
            for side in sides), flush=True)
    return out


def part_matmul(rows_list: list[int], dim: int, layers: int, reps: int, head: int = 0) -> dict:
    """What a batched step's matmuls cost by rows: a chain of `layers` bf16 (dim x dim) weights
    applied to (rows, dim) activations, as the bytes of weights read per second, through MLX's
    matmul and (on CUDA, once `check_smallmm` found it correct) through our small-rows kernel,
    compiled and not, and other launch shapes at 8 and 32 rows; with `head`, also a chain of two
    (head x dim) weights (a vocabulary head: few launches, so the device's rate). A decode step
    reads every weight once whatever its rows, so a rate falling with rows is the matmul
    kernel's, not the bandwidth's."""
    from engine.kernels import smallmm_cuda

    shapes = [(dim, dim), (dim, 3 * dim // 2 + 7), (3 * dim, dim)]
    check = check_smallmm(shapes, sorted({1, 2, 5, 8, 13, 32} | set(rows_list)))
    make, timed = _smallmm_side()
    ok = lambda compiled: all(r["ok"] for r in check  # noqa: E731
                              if r["kw"] is None and r["blocks"] is None and r["compiled"] == compiled)
    default_ok = ok(True) or ok(False)
    wrong = {(r["kw"], r["blocks"], r["compiled"]) for r in check if not r["ok"]}
    if default_ok and not ok(True):
        smallmm_cuda.COMPILED = False  # the models built after this launch it uncompiled
        print("  smallmm kernel wrong through mx.compile: uncompiled for the rest of this run", flush=True)
    if not default_ok:
        os.environ[smallmm_cuda.SWITCH] = "0"  # the models built after this run MLX's matmul
        print(f"  smallmm kernel WRONG: {smallmm_cuda.SWITCH}=0 for the rest of this run", flush=True)
        timed = False

    def sides_at(rows: int, variants: bool = True) -> dict:
        sides = {"mlx": lambda a, w: a @ w.T}
        if timed and rows <= smallmm_cuda.MAX_ROWS:
            if (None, None, True) not in wrong:
                sides["ours"] = make(None, None, True)
            if (None, None, False) not in wrong:
                sides["ours_uncompiled"] = make(None, None, False)
            for kw, blocks in (_variants(rows) if variants and rows in (8, 32) else []):
                if (kw, blocks, True) not in wrong:
                    name = f"ours_kw{kw or smallmm_cuda.warps(dim)}_u{blocks or smallmm_cuda.unroll(rows)}"
                    sides[name] = make(kw, blocks, True)
        return sides

    ws = [mx.random.normal((dim, dim)).astype(mx.bfloat16) * 0.01 for _ in range(layers)]
    mx.eval(ws)
    chain = _chain_rates(ws, rows_list, sides_at, reps)
    del ws
    out = {"check": check, "check_ok": default_ok, "wrong": sorted(map(str, wrong)), "chain": chain}
    if head:
        ws = [mx.random.normal((head, dim)).astype(mx.bfloat16) * 0.01 for _ in range(2)]
        mx.eval(ws)
        # a chain of heads: each output (rows, head) is cut back to the first dim columns
        out["head_chain"] = _chain_rates(ws, [r for r in rows_list if r in (1, 8, 32)] or rows_list[:1],
                                         lambda rows: {k: (lambda f: lambda a, w: f(a, w)[:, :dim])(f)
                                                       for k, f in sides_at(rows).items()}, reps)
        del ws
    mx.clear_cache()
    return out


def main_shapes(a) -> None:
    """`--shapes`: the issue-33 parts on bench.shapes models (or `bundled`: the bundled model)."""
    from .shapes import build

    parts = a.parts.split(",")
    results = []
    if "matmul" in parts:
        results.append({"shape": f"bf16 {a.matmul_dim}x{a.matmul_dim} chain",
                        **part_matmul(a.matmul_rows, a.matmul_dim, a.matmul_layers, a.reps,
                                      a.matmul_head)})
        if a.shapes == "none":
            common.write_json(a.out, {**common.run_meta(sys.argv), "load_average": os.getloadavg()},
                              [], results=results)
            return
    for shape in a.shapes.split(","):
        if shape == "bundled":
            from engine.loading.registry import load_model

            lm = load_model(None)
        else:
            lm = build(shape)
        res: dict = {"shape": shape}
        svc = common.EngineService(lm, max_running=max(a.counts + [a.streams + 1]),
                                   prefix_cache=False)
        try:
            if "streams" in parts:
                res["streams"] = part_streams(lm, svc, a.counts, a.prompt, a.gen, a.reps)
            if "interfere" in parts:
                res["interfere"] = part_interfere(lm, svc, a.streams, a.long_prompt,
                                                  a.budgets.split(","), a.reps)
        finally:
            svc.close()
        if "cache" in parts:
            res["cache"] = part_cache(lm, a.cache_rows, a.prompt + a.gen // 2, a.reps, a.long_prompt)
        if "mixcost" in parts:
            res["mixcost"] = part_mixcost(lm, a.streams, a.chunks, a.prompt + a.gen // 2, a.reps)
        results.append(res)
        del lm, svc
        common.fresh_memory()
        common.write_json(a.out, {**common.run_meta(sys.argv), "load_average": os.getloadavg()},
                          [], results=results)
    print(f"wrote {a.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--baseline-engine", default=None, metavar="DIR",
                        help="also run the engine package in DIR/engine (e.g. main's), side by side")
    # issue 33's parts on bench.shapes models (--shapes switches to them)
    parser.add_argument("--shapes", default=None, help="e.g. qwen3-8b (or bundled)")
    parser.add_argument("--parts", default="streams,interfere,cache,mixcost")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    parser.add_argument("--counts", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--long-prompt", type=int, default=4000)
    parser.add_argument("--budgets", default="chunk,512,256")
    parser.add_argument("--cache-rows", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32])
    parser.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[256, 512, 1024])
    parser.add_argument("--matmul-rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 136, 520])
    parser.add_argument("--matmul-dim", type=int, default=4096)
    parser.add_argument("--matmul-layers", type=int, default=96)
    parser.add_argument("--matmul-head", type=int, default=0, help="also a chain of 2 (N x dim) heads")
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args()
    if a.shapes:
        from engine import device

        device.select_device(a.device)
        a.out = a.out or RESULTS.with_name("concurrency-shapes.json")
        return main_shapes(a)

    lm = tiny_lm(a.vocab, a.layers, a.hidden)
    prompts = [prompt_ids(a.prompt, a.vocab, seed=100 + i) for i in range(a.streams)]
    svc = common.EngineService(lm, max_running=a.streams, prefix_cache=False)
    base = engine_copy(a.baseline_engine, lm, a.streams) if a.baseline_engine else None
    sides = {"ours": lambda: ours(svc, prompts, a.gen), "mlx": lambda: mlx_batch(lm, prompts, a.gen)}
    if base is not None:
        sides["base"] = lambda: ours(base, prompts, a.gen)
    try:
        runs = common.interleave(sides, a.reps, warmup=True)
        if a.profile:
            with open(a.profile, "w") as f:
                f.write(profiled(svc, prompts, a.gen))
    finally:
        svc.close()
        if base is not None:
            base.close()
    print(f"{a.streams} streams x {a.gen} tokens, vocab {a.vocab}, median of {a.reps}:")
    result = {"command": "python -m bench.concurrency_step " + " ".join(sys.argv[1:]),
              "load_average": os.getloadavg()[0], "streams": a.streams, "gen": a.gen,
              "vocab": a.vocab, "layers": a.layers, "hidden": a.hidden, "reps": a.reps, "runs": runs}
    for key, unit in (("aggregate_tps", "tok/s"), ("host_us_per_token", "us of host CPU per token")):
        got = {k: [r[key] for r in v] for k, v in runs.items()}
        med = {k: common.median(v) for k, v in got.items()}
        result[f"median_{key}"] = med
        print(f"  {unit}: ours {med['ours']:.1f} ({common.spread(got['ours'])}), batch_generate "
              f"{med['mlx']:.1f} ({common.spread(got['mlx'])}), ratio {med['ours'] / med['mlx']:.3f}x")
        if "base" in med:
            print(f"    baseline engine {med['base']:.1f} ({common.spread(got['base'])}), ratio "
                  f"{med['base'] / med['mlx']:.3f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {RESULTS}")

if __name__ == "__main__":
    main()
