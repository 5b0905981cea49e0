"""Each kernel of a decode step (batch 1, or `--rows N` over the engine's batch cache), timed by Nsight Compute: where a step's device time goes.

    ncu --nvtx --nvtx-include "steps/" --clock-control none --csv \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread \
        python -m bench.step_kernels --device gpu --shape qwen3-8b-4bit --steps 2 > kernels.csv
    python -m bench.step_kernels --summarize kernels.csv --steps 2

The first command builds the shape's random model, prefills 64 tokens, takes 8 warm-up steps and
then `--steps` steps inside an NVTX range named "steps", which is all ncu profiles (each kernel
alone, so the sum is the device's work with no launch gaps). The second groups the rows by kernel
(per step: count, µs, GB read, GB/s) against the step's whole weight read. Without ncu the first
command still prints the steps' wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import statistics
import sys
import time
from collections import defaultdict
from typing import Any


def run(shape: str, steps: int, warm: int, rows: int = 1) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from .shapes import build, prompt_ids, vocab_size

    lm = build(shape)
    model = lm.model
    caches = []
    for r in range(rows):  # prompts of 48-79 tokens: the rows' lengths differ, as a batch's do
        prompt = prompt_ids(48 + (r * 13) % 32, vocab_size(shape), seed=1 + r)
        caches.append(make_prompt_cache(model))
        mx.eval(model(mx.array([prompt], dtype=mx.uint32), cache=caches[-1]))
    if rows == 1:
        cache = caches[0]
    else:  # the engine's batch cache (SlotKVCache), merged as a decode batch's join does
        from engine.model_cache import LocalCaches

        cache = LocalCaches().merge(caches)
    y = mx.array([[int(prompt[-1])]] * rows, dtype=mx.uint32)
    for _ in range(warm):
        mx.eval(model(y, cache=cache))
    mx.synchronize()
    with profiled():
        t, built = time.perf_counter(), 0.0
        for _ in range(steps):
            b = time.perf_counter()
            out = model(y, cache=cache)
            built += time.perf_counter() - b
            mx.eval(out)
        mx.synchronize()
        ms = (time.perf_counter() - t) / steps * 1e3
    program = getattr(model, "decode_program", None)
    print(f"# {shape}, {rows} row(s): {steps} steps, {ms:.2f} ms a step (wall, under the profiler if any), "
          f"{built / steps * 1e3:.2f} ms of it building the graph in Python; "
          f"decode program {'on' if program is not None and program.enabled else 'off'}", file=sys.stderr)


@contextlib.contextmanager
def profiled():
    """An NVTX range named "steps" around the block: what `ncu --nvtx --nvtx-include "steps/"`
    profiles (through the device image's PyTorch; without it ncu profiles every kernel)."""
    try:
        from torch.cuda import nvtx
    except Exception:  # noqa: BLE001 - no PyTorch
        nvtx = None
    if nvtx:
        nvtx.range_push("steps")
    try:
        yield
    finally:
        if nvtx:
            nvtx.range_pop()


def read_ncu(path: str) -> dict[tuple[str, str], dict[str, Any]]:
    """An `ncu --csv` report's metrics per (launch ID, kernel name), in launch order: its time in
    µs, its DRAM reads in bytes, and its grid."""
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    per: dict[tuple[str, str], dict[str, Any]] = defaultdict(dict)
    for r in csv.DictReader(lines):
        key = (r["ID"], r["Kernel Name"])
        unit, val = r["Metric Unit"], float(r["Metric Value"].replace(",", "") or 0)
        name = r["Metric Name"]
        if name == "gpu__time_duration.sum":
            val *= {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit, 1.0)
        elif name == "dram__bytes_read.sum":
            val *= {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(unit, 1.0)
        per[key][name] = val
        per[key]["grid"] = r.get("Grid Size", "")
    return per


def summarize(path: str, steps: int) -> None:
    per = read_ncu(path)
    groups: dict[str, list[dict[str, float]]] = defaultdict(list)
    for (_, name), m in per.items():
        short = name.split("(")[0].split("<")[0]
        groups[short + " " + str(m.get("grid", ""))].append(m)
    total_us = sum(m.get("gpu__time_duration.sum", 0) for m in per.values()) / steps
    total_b = sum(m.get("dram__bytes_read.sum", 0) for m in per.values()) / steps
    print(f"{'kernel (grid)':60s} {'n/step':>7s} {'us/step':>9s} {'med us':>8s} {'MB read':>9s} {'GB/s':>7s}")
    for k, ms in sorted(groups.items(), key=lambda kv: -sum(m.get("gpu__time_duration.sum", 0) for m in kv[1])):
        us = [m.get("gpu__time_duration.sum", 0) for m in ms]
        b = sum(m.get("dram__bytes_read.sum", 0) for m in ms)
        print(f"{k[:60]:60s} {len(ms) / steps:7.1f} {sum(us) / steps:9.1f} {statistics.median(us):8.2f} "
              f"{b / steps / 1e6:9.2f} {b / max(sum(us), 1e-9) / 1e3:7.0f}")
    print(f"{'all kernels':60s} {len(per) / steps:7.1f} {total_us:9.1f} {'':8s} {total_b / 1e6:9.2f} "
          f"{total_b / max(total_us, 1e-9) / 1e3:7.0f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-8b-4bit")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1, help="rows of a batched step (the engine's batch cache)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--summarize", help="an ncu --csv report to group by kernel")
    a = ap.parse_args(argv)
    if a.summarize:
        summarize(a.summarize, a.steps)
        return 0
    from engine import device

    device.select_device(a.device)
    run(a.shape, a.steps, a.warm, a.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
