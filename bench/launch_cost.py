"""What a kernel launch costs a decode step against a grid-wide barrier inside one kernel.

    python -m bench.launch_cost [--phases 180] [--blocks 132,264] [--reps 10] [--out FILE]

A one-token step of an 8B model is ~190 launches (5 kernels a layer); with int8 activations its
host work (building the graph, recording and launching them) nearly equals its device time. One
kernel a layer that runs its phases (q/k/v, attention, o, gate/up, down) with a grid-wide barrier
between them would launch ~37. This measures that trade on the device, with trivial work in each
phase, all in one evaluation (MLX records it as CUDA graphs, as the step):

  launches   `--phases` kernels, each depending on the one before (one block writes a value the
             next reads)
  per layer  `--phases` / 5 kernels of 5 phases each, a grid barrier between phases
  one        one kernel of `--phases` phases

at each `--blocks` grid size (128 threads a block; a grid barrier needs every block resident at
once, so grids are at most a few blocks an SM). Each: wall ms of the evaluation, host ms up to
`mx.async_eval`'s return, and wall µs per phase; median of `--reps`. A barrier that spins past
its bound gives up and is reported (no hang). Results: a table, JSON at --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from . import common

PHASES_PER_LAYER = 5
SPIN_BOUND = 1 << 22  # polls before a barrier gives up (far past any real wait)

_TINY = """
  if (threadIdx.x == 0) y[blockIdx.x] = x[0] + 1.0f;
"""

_PHASED = """
  // PHASES phases of trivial work, a grid-wide barrier after each: every block's thread 0
  // releases its writes, counts itself in, then waits (acquire) for the whole grid.
  float v = x[0];
  for (int p = 0; p < PHASES; ++p) {
    if (threadIdx.x == 0) y[blockIdx.x] = v + static_cast<float>(p);
    __syncthreads();
    if (threadIdx.x == 0) {
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
      atomicAdd(bar, 1);
      const int target = (p + 1) * static_cast<int>(gridDim.x);
      int seen = 0, spins = 0;
      do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(bar) : "memory");
      } while (seen < target && ++spins < SPIN_BOUND);
      if (seen < target) atomicAdd(bad, 1);
    }
    __syncthreads();
  }
"""


@functools.cache
def _kernels():
    import mlx.core as mx

    tiny = mx.fast.cuda_kernel(name="mlxchat_launch_tiny", input_names=["x"], output_names=["y"], source=_TINY)
    phased = mx.fast.cuda_kernel(name="mlxchat_launch_phased", input_names=["x"], output_names=["y", "bar", "bad"],
                                 source=_PHASED)
    return tiny, phased


def phases_per_kernel(kind: str, phases: int) -> int:
    """Phases one kernel of `kind` runs: 1 (launches), PHASES_PER_LAYER (per layer), all (one)."""
    return {"launches": 1, "per layer": PHASES_PER_LAYER, "one": phases}[kind]


def chain(kind: str, phases: int, blocks: int, x) -> tuple[Any, list]:
    """The graph of `kind` (launches, per layer, one) for `phases` phases on `blocks` blocks from
    x (1,) float32: its last output and the barriers' give-up counts."""
    import mlx.core as mx

    tiny, phased = _kernels()
    launch = {"grid": (blocks * 128, 1, 1), "threadgroup": (128, 1, 1)}
    bad = []
    if kind == "launches":
        for _ in range(phases):
            x = tiny(inputs=[x], output_shapes=[(blocks,)], output_dtypes=[mx.float32], **launch)[0][:1]
        return x, bad
    per = phases_per_kernel(kind, phases)
    for _ in range(phases // per):
        y, _, b = phased(inputs=[x], template=[("PHASES", per), ("SPIN_BOUND", SPIN_BOUND)],
                         output_shapes=[(blocks,), (1,), (1,)], output_dtypes=[mx.float32, mx.int32, mx.int32],
                         init_value=0, **launch)
        x = y[:1]
        bad.append(b)
    return x, bad


def measure(kind: str, phases: int, blocks: int, reps: int) -> dict[str, Any]:
    """Median wall and host ms of evaluating `chain(kind, ...)`, built before the clock starts."""
    import mlx.core as mx

    walls, hosts, gave_up = [], [], 0
    for i in range(reps + 1):  # the first: compiling the kernels
        out, bad = chain(kind, phases, blocks, mx.zeros((1,), mx.float32))
        mx.synchronize()
        t = time.perf_counter()
        mx.async_eval(out, *bad)
        host = time.perf_counter() - t
        mx.eval(out, *bad)
        mx.synchronize()
        wall = time.perf_counter() - t
        gave_up += sum(int(b.item()) for b in bad)
        if i:
            walls.append(wall)
            hosts.append(host)
    w, h = statistics.median(walls), statistics.median(hosts)
    return {"kind": kind, "phases": phases, "blocks": blocks, "launches": phases // phases_per_kernel(kind, phases),
            "wall_ms": w * 1e3, "host_ms": h * 1e3, "us_per_phase": w / phases * 1e6,
            "wall_range_ms": [min(walls) * 1e3, max(walls) * 1e3], "barriers_gave_up": gave_up}


def main(argv: list[str] | None = None) -> int:
    from engine import device

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", type=int, default=180)
    ap.add_argument("--blocks", default="132,264")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="gpu")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    device.select_device(a.device)
    meta = common.run_meta(["python", "-m", "bench.launch_cost"] + list(argv if argv is not None else sys.argv[1:]))
    rows, results = [], []
    for blocks in (int(b) for b in a.blocks.split(",")):
        base = None
        for kind in ("launches", "per layer", "one"):
            try:
                r = measure(kind, a.phases, blocks, a.reps)
            except Exception as exc:  # noqa: BLE001 - one failed variant is reported, the rest still run
                rows.append(common.failed("launch_cost", f"{kind}, {blocks} blocks", f"{type(exc).__name__}: {exc}"))
                continue
            results.append(r)
            base = base or r
            rows.append(common.Row("launch_cost", f"{blocks} blocks", f"{kind}: {r['launches']} launches, "
                                   f"{a.phases} phases (wall ms)", "ms", r["wall_ms"], base["wall_ms"],
                                   f"{a.phases} launches", "", f"host {r['host_ms']:.2f} ms; "
                                   f"{r['us_per_phase']:.2f} us a phase; barriers gave up: {r['barriers_gave_up']}", r))
    common.print_table(rows, title="bench.launch_cost")
    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    out = Path(a.out) if a.out else common.RESULTS_DIR / f"{meta['device']['backend']}-{stamp}-launch-cost.json"
    common.write_json(out, meta, rows, results=results)
    print(f"wrote {out}")
    return 1 if any(r.metric == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
