"""Concurrent decoding: our engine (batched decode) vs `mlx_lm.server`, same model and requests.

    python -m bench.concurrency [--streams 1 2 4 8] [--max-tokens 32] [--port 8765]
                                [--sampling greedy|app]

For each concurrency N, N chat requests (greedy; `--sampling app`: the app's default sampling,
temperature 0.7 and top_p 0.9, each request seeded) (distinct questions, the same N for both sides)
start together and stream `--max-tokens` tokens each. Per side and N:
  aggregate_decode_tok_s  tokens after each stream's first one, divided by the window from the
                          first stream's first token to the last stream's last token
  aggregate_total_tok_s   all tokens divided by the wall time from submission (prefill included)
  p95_inter_token_ms      95th percentile of the gaps between consecutive tokens of a stream
  ttft_mean_s             mean time to first token
  first_token_s           each stream's time to first token, sorted (how admission spreads them)
  cpu_ms_per_token        (ours only) this process's CPU time over the run (all its threads) per
                          token: the work a token costs, which other load on the machine moves far
                          less than the rates
Ours runs in-process (`engine.scheduling.service.Engine`, prefix cache off so every prompt is prefilled);
mlx_lm.server runs as a real server (subprocess) on the bundled model's mlx-lm folder, with
`--decode-concurrency` and `--prompt-concurrency` set to N, read over HTTP with SSE streaming.
JSON goes to bench/results/concurrency-cpu.json (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "concurrency-cpu.json"
QUESTIONS = ["Why is the sky blue?", "What is a prime number?", "How do bees make honey?",
             "What causes tides?", "Why do cats purr?", "How does a rainbow form?",
             "What is photosynthesis?", "Why is the sea salty?"]


def requests_for(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]


def summarize(streams: list[list[float]], started: float) -> dict:
    """`streams`: per request, the arrival time of each token."""
    firsts = [s[0] for s in streams if s]
    lasts = [s[-1] for s in streams if s]
    gaps = sorted(b - a for s in streams for a, b in zip(s, s[1:]))
    after_first = sum(max(len(s) - 1, 0) for s in streams)
    window = max(lasts) - min(firsts) if firsts else 0.0
    return {
        "streams": len(streams),
        "tokens": [len(s) for s in streams],
        "aggregate_decode_tok_s": round(after_first / window, 3) if window > 0 else None,
        "aggregate_total_tok_s": round(sum(map(len, streams)) / (max(lasts) - started), 3),
        "p95_inter_token_ms": round(1000 * gaps[int(0.95 * (len(gaps) - 1))], 1) if gaps else None,
        "ttft_mean_s": round(statistics.mean(f - started for f in firsts), 3),
        "first_token_s": sorted(round(f - started, 3) for f in firsts),  # admission spread
    }


# -- our engine ------------------------------------------------------------------------------------
SAMPLING = {"greedy": {"temperature": 0.0}, "app": {"temperature": 0.7, "top_p": 0.9}}


def run_ours(concurrency: list[int], max_tokens: int, sampling: str = "greedy") -> list[dict]:
    from engine.decoding.sampling import SamplingParams
    from engine.scheduling.service import Engine

    engine = Engine(None, max_running=max(concurrency), max_queued=0, prefix_cache=False).start()

    def params(i: int) -> SamplingParams:
        seed = {"seed": i} if sampling != "greedy" else {}
        return SamplingParams(max_tokens=max_tokens, **SAMPLING[sampling], **seed)

    try:
        list(engine.submit(requests_for(1)[0], SamplingParams(max_tokens=4)).events())  # warm up
        rows = []
        for n in concurrency:
            started, cpu = time.perf_counter(), time.process_time()
            handles = [engine.submit(chat, params(i)) for i, chat in enumerate(requests_for(n))]
            streams: list[list[float]] = [[] for _ in handles]

            def read(i: int) -> None:
                for event in handles[i].events():
                    if event.kind == "token":
                        streams[i].append(time.perf_counter())

            threads = [threading.Thread(target=read, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            cpu = time.process_time() - cpu
            rows.append(summarize(streams, started))
            rows[-1]["cpu_ms_per_token"] = round(1000 * cpu / max(sum(map(len, streams)), 1), 3)
            print("ours     ", rows[-1], flush=True)
        return rows
    finally:
        engine.stop()


# -- mlx_lm.server ---------------------------------------------------------------------------------
def start_server(folder: str, port: int, concurrency: int) -> subprocess.Popen:
    (Path.home() / ".cache" / "huggingface" / "hub").mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", folder, "--port", str(port),
         "--decode-concurrency", str(concurrency), "--prompt-concurrency", str(concurrency),
         "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlx_lm.server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("mlx_lm.server did not start within 120 s")


def stream_server(port: int, chat: list[dict], max_tokens: int, arrivals: list[float],
                  sampling: str = "greedy") -> None:
    body = json.dumps({"messages": chat, "max_tokens": max_tokens, **SAMPLING[sampling],
                       "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    for line in response:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        choices = chunk.get("choices") or [{}]
        if choices[0].get("delta", {}).get("content"):  # one chunk per generated token
            arrivals.append(time.perf_counter())


def run_server(folder: str, port: int, concurrency: list[int], max_tokens: int,
               sampling: str = "greedy") -> list[dict]:
    rows = []
    for n in concurrency:
        proc = start_server(folder, port, n)
        try:
            stream_server(port, requests_for(1)[0], 4, [])  # warm up
            started = time.perf_counter()
            streams: list[list[float]] = [[] for _ in range(n)]
            threads = [threading.Thread(target=stream_server,
                                        args=(port, chat, max_tokens, streams[i], sampling))
                       for i, chat in enumerate(requests_for(n))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rows.append(summarize(streams, started))
            print("mlx_lm   ", rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()

    from engine.loading.registry import load_model

    folder = str(load_model(None).path)
    ours = run_ours(args.streams, args.max_tokens, args.sampling)
    theirs = [] if args.skip_server else run_server(folder, args.port, args.streams,
                                                    args.max_tokens, args.sampling)
    load = os.getloadavg()
    result = {
        "model": "bundled SmolLM2-135M-Instruct (Q4_1, 8-bit embedding)",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load avg {load[0]:.1f}",
        "max_tokens": args.max_tokens,
        "sampling": SAMPLING[args.sampling],
        "command": "python -m bench.concurrency " + " ".join(sys.argv[1:]),
        "ours": ours,
        "mlx_lm_server": theirs,
    }
    print(f"\n{'N':>2}  {'ours tok/s':>10} {'mlx_lm tok/s':>12}  {'ours p95 ms':>11} "
          f"{'mlx_lm p95 ms':>13}")
    for i, row in enumerate(ours):
        other = theirs[i] if i < len(theirs) else {}
        print(f"{row['streams']:>2}  {row['aggregate_decode_tok_s']!s:>10} "
              f"{other.get('aggregate_decode_tok_s')!s:>12}  {row['p95_inter_token_ms']!s:>11} "
              f"{other.get('p95_inter_token_ms')!s:>13}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
