"""Where a scheduler tick's wall time goes with 1 and with N concurrent streams (bundled model).

    python -m bench.tick_profile [--streams 1 4] [--max-tokens 32] [--rounds 3] [--out FILE]
                                 [--sampling greedy|app]

Runs the engine in-process as bench.concurrency does (N chats submitted together, greedy or with
the app's sampling as there, each request seeded; one reader thread per stream), with the scheduler's parts wrapped in timers (each call's wall time and
the scheduler thread's own CPU time, `time.thread_time`):

  next_work    admission and the lock, once per tick (`Scheduler._next_work`)
  regroup      moving requests into and out of the batch (`Scheduler._regroup`)
  solo_step    a lone stream's decode step (`Generation._plain_step`); inside it `forward`
               (building the model graph: the step less `Generation.decode_output`), `sample`
               (building the sampling graph), `launch`, `emit` (`Generation.accept`:
               detokenizing, stop strings, events)
  batch_step   the batched step (`DecodeBatch.step`); inside it `forward` (building the model
               graph), `sample` (`sample_rows`), `sample_next` (per-row bookkeeping), `launch`,
               `emit`
  launch       `mx.async_eval`: MLX walks the step's graph and queues it on its CPU stream; it
               blocks while more than ~100 operations are queued (MLX's back-pressure), i.e.
               through most of the step before it: the kernels' time shows here
  wait         what is left of the step: the host read of the tokens fed
  publish      handing each row's events to its reader (`Scheduler._advance`)

Also the scheduler thread's context switches per tick (voluntary: it blocked; involuntary:
preempted). Each part: ms per tick of wall time, and of the scheduler thread's CPU time (wall above CPU is time
off the CPU: blocked on the GIL, preempted, or waiting for the kernels). Per thread, the CPU
seconds of the run (from /proc/self/task/*/schedstat): the scheduler, the reader threads, and the
rest (MLX's CPU stream thread and the kernels' pool). The rates are bench.concurrency's
(aggregate decode tok/s from the first stream's first token to the last stream's last token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from .concurrency import SAMPLING, requests_for, summarize

RESULTS = Path(__file__).resolve().parent / "results" / "tick-profile-cpu.json"


class Timers:
    """Wall and scheduler-thread CPU seconds per named part, and the calls of each."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - w
                self.cpu[name] += time.thread_time() - c
                self.calls[name] += 1
        return timed


@contextmanager
def patched(timers: Timers) -> Iterator[None]:
    """The scheduler's parts wrapped in `timers` for the duration."""
    import mlx.core as mx

    from engine.decoding import generate
    from engine.decoding.sampling import TokenSampler
    from engine.scheduling import batch, ticks

    targets = [
        (ticks.Scheduler, "_next_work", "next_work"),
        (ticks.Scheduler, "_regroup", "regroup"),
        (generate.Generation, "_plain_step", "solo_step"),
        (ticks.Scheduler, "_advance", "publish"),
        (batch.DecodeBatch, "step", "batch_step"),
        (batch.DecodeBatch, "_forward", "forward"),
        (batch, "sample_rows", "sample"),
        (TokenSampler, "__call__", "sample"),
        (generate.Generation, "sample_next", "sample_next"),
        (generate.Generation, "decode_output", "solo_output"),
        (generate.Generation, "accept", "emit"),
        (mx, "async_eval", "launch"),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in targets]
    try:
        for owner, attr, name in targets:
            setattr(owner, attr, timers.wrap(name, getattr(owner, attr)))
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


@contextmanager
def recorded(done: dict[str, threading.Event], times: dict[str, list[float]]) -> Iterator[None]:
    """Each request's token events' publishing times (`times`), and `done[id]` set once its
    final event is published."""
    from engine.scheduling.requests import RequestHandle

    publish = RequestHandle._publish

    def _publish(handle: RequestHandle, event: Any) -> None:
        if event.kind == "token":
            times[handle.id].append(time.perf_counter())
        publish(handle, event)
        if event.kind == "done":
            done[handle.id].set()

    RequestHandle._publish = _publish
    try:
        yield
    finally:
        RequestHandle._publish = publish


def thread_cpu() -> dict[int, float]:
    """CPU seconds so far of each thread of this process, by native id."""
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                out[int(task)] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return out


def switches(tid: int) -> tuple[int, int]:
    """The voluntary (blocked: the GIL, a lock, MLX's back-pressure) and involuntary (preempted)
    context switches of thread `tid` so far."""
    counts = {}
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if "ctxt_switches" in line:
                counts[line.split(":")[0]] = int(line.split()[-1])
    return counts.get("voluntary_ctxt_switches", 0), counts.get("nonvoluntary_ctxt_switches", 0)


def run(engine: Any, n: int, max_tokens: int, consume: str = "stream",
        sampling: str = "greedy") -> dict:
    """N streams once, instrumented: the rates, the parts per tick and the threads' CPU.
    `consume`: "stream" reads each event as it comes (a reader woken per token), "end" only once
    the request has finished (no reader runs while decoding: the hand-off's cost, by difference;
    the tokens' times are then when the scheduler published them)."""
    from engine.decoding.sampling import SamplingParams

    seeded = {"seed": 0} if sampling != "greedy" else {}
    timers = Timers()
    readers: list[threading.Thread] = []
    readers_cpu: list[float] = []
    published: dict[str, threading.Event] = defaultdict(threading.Event)
    publish_times: dict[str, list[float]] = defaultdict(list)
    before = thread_cpu()
    switched = switches(engine.scheduler.thread_id)
    with patched(timers), recorded(published, publish_times):
        started = time.perf_counter()
        handles = [engine.submit(chat, SamplingParams(max_tokens=max_tokens, **SAMPLING[sampling],
                                                      **{k: v + i for k, v in seeded.items()}))
                   for i, chat in enumerate(requests_for(n))]
        streams: list[list[float]] = [[] for _ in handles]

        def read(i: int) -> None:
            cpu0 = time.thread_time()
            if consume == "end":
                published[handles[i].id].wait()
            for event in handles[i].events():
                if event.kind == "token" and consume == "stream":
                    streams[i].append(time.perf_counter())
            readers_cpu.append(time.thread_time() - cpu0)

        readers = [threading.Thread(target=read, args=(i,)) for i in range(n)]
        for t in readers:
            t.start()
        reader_ids = [t.native_id for t in readers]
        for t in readers:
            t.join()
        wall = time.perf_counter() - started
    after = thread_cpu()
    switched = tuple(b - a for a, b in zip(switched, switches(engine.scheduler.thread_id)))
    if consume == "end":
        streams = [publish_times[h.id] for h in handles]
    cpu = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    scheduler = engine.scheduler.thread_id
    me = threading.get_native_id()
    others = sum(v for tid, v in cpu.items() if tid not in (scheduler, me) and tid not in reader_ids)
    ticks = max(timers.calls["next_work"], 1)
    parts = {}
    for name in ("next_work", "regroup", "solo_step", "solo_output", "batch_step", "forward",
                 "sample", "sample_next", "launch", "emit", "publish"):
        parts[name] = {"wall_ms": round(1e3 * timers.wall[name] / ticks, 3),
                       "cpu_ms": round(1e3 * timers.cpu[name] / ticks, 3),
                       "calls_per_tick": round(timers.calls[name] / ticks, 2)}
    if not timers.calls["batch_step"]:  # a lone stream: its graph is built outside decode_output
        parts["forward"] = {k: round(parts["solo_step"][k] - parts["solo_output"][k], 3)
                            for k in ("wall_ms", "cpu_ms")}
    step = "batch_step" if timers.calls["batch_step"] else "solo_step"
    inner = ("forward", "sample", "sample_next", "launch", "emit")
    parts["wait"] = {k: round(parts[step][k] - sum(parts[i][k] for i in inner), 3)
                     for k in ("wall_ms", "cpu_ms")}
    return {
        **summarize(streams, started),
        "ticks": ticks,
        "tick_ms": round(1e3 * wall / ticks, 3),
        "parts_per_tick": parts,
        "scheduler_switches_per_tick": {"voluntary": round(switched[0] / ticks, 1),
                                        "involuntary": round(switched[1] / ticks, 1)},
        "cpu_s": {"scheduler": round(cpu.get(scheduler, 0.0), 3),
                  "readers": round(sum(readers_cpu), 3),
                  "mlx_and_kernel_threads": round(others, 3),
                  "wall": round(wall, 3)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--consume", choices=("stream", "end"), nargs="+", default=["stream"],
                        help="readers take each event as it comes, or all at the end (several: "
                             "they take turns)")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval after the engine starts (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy")
    args = parser.parse_args()

    from engine.decoding.sampling import SamplingParams
    from engine.scheduling.service import Engine

    engine = Engine(None, max_running=max(args.streams), max_queued=0, prefix_cache=False).start()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    keys = [(mode, n) for mode in args.consume for n in args.streams]
    runs: dict[tuple[str, int], list[dict]] = {k: [] for k in keys}
    try:
        list(engine.submit(requests_for(1)[0], SamplingParams(max_tokens=4)).events())  # warm up
        for _ in range(args.rounds):  # the sizes and modes take turns: load changes hit each alike
            for mode, n in keys:
                runs[mode, n].append(run(engine, n, args.max_tokens, mode, args.sampling))
                row = runs[mode, n][-1]
                print(f"{mode} {n} streams: {row['aggregate_decode_tok_s']} tok/s, tick "
                      f"{row['tick_ms']} ms, cpu {row['cpu_s']}", flush=True)
    finally:
        engine.stop()
    summary = {}
    for mode, n in keys:
        rows = runs[mode, n]
        first = runs[mode, args.streams[0]]
        rate = statistics.median(r["aggregate_decode_tok_s"] for r in rows)
        # each round's ratio to the first size measured just before it, then their median
        ratios = [r["aggregate_decode_tok_s"] / f["aggregate_decode_tok_s"] for r, f in zip(rows, first)]
        best = min(rows, key=lambda r: abs(r["aggregate_decode_tok_s"] - rate))  # the median run
        summary[f"{mode}-{n}"] = {"median_decode_tok_s": rate,
                                  "ratio_to_first": round(statistics.median(ratios), 3),
                                  "ratios": [round(x, 3) for x in ratios], "median_run": best}
        print(f"\n{mode}, {n} streams: median {rate} tok/s, ratio to {args.streams[0]} "
              f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}), "
              f"tick {best['tick_ms']} ms")
        for name, part in best["parts_per_tick"].items():
            print(f"  {name:<12} wall {part['wall_ms']:>7.3f} ms  cpu {part['cpu_ms']:>7.3f} ms")
        print(f"  threads' CPU s: {best['cpu_s']}; the scheduler's context switches per tick: "
              f"{best['scheduler_switches_per_tick']}")
    load = os.getloadavg()
    result = {"command": "python -m bench.tick_profile " + " ".join(sys.argv[1:]),
              "load_avg_1m": round(load[0], 2), "max_tokens": args.max_tokens,
              "switch_interval_s": sys.getswitchinterval(), "summary": summary,
              "runs": {f"{mode}-{n}": rows for (mode, n), rows in runs.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
