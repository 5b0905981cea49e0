"""Prefix-cache benchmark: edit the last user message of a ~2,000-token, 8-turn conversation.

    python -m bench.prefix [--models dense,hybrid] [--port 8765]

For each model, time to first token (TTFT) of
  cold: the conversation on an empty cache,
  warm: the same conversation with only its last user message edited, right after it,
(after one short warm-up request each) for (a) our engine (engine.decoding.generate + engine.prefix_cache.store) and (b) `mlx_lm.server` started as a
real server on 127.0.0.1 with the same model folder, sent the same messages through its OpenAI API
(streaming, max_tokens=1; its reused-token count from usage.prompt_tokens_details.cached_tokens).

Models: the bundled dense SmolLM2 (its converted mlx-lm folder) and a tiny random qwen3_5 hybrid
(bench/shapes.py's tiny-hybrid, saved as an mlx-lm folder). Results: a table on stdout and JSON in
bench/results/prefix-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "bench" / "results" / "prefix-cpu.json"
WARMUP = [{"role": "user", "content": "Hi"}]
TOPICS = ["rivers", "bridges", "volcanoes", "libraries", "tides", "glaciers", "markets", "owls"]


def conversation(edited: bool = False) -> list[dict]:
    """8 user turns (7 answered), ~2,250 tokens with the SmolLM2 tokenizer."""
    messages = [{"role": "system", "content": "You are a terse assistant."}]
    for i, topic in enumerate(TOPICS):
        messages.append({"role": "user", "content": f"Tell me about {topic}. " + (
            f"I want history, science and stories about {topic}, with examples from many "
            "countries. " * 8)})
        if i < len(TOPICS) - 1:
            messages.append({"role": "assistant", "content": f"Here is what I know about {topic}. "
                             + (f"{topic.title()} have shaped how people live, trade and travel "
                                "for centuries; each region tells its own story. " * 8)})
    if edited:
        messages[-1] = {"role": "user", "content": "Actually, tell me about owls in one line."}
    return messages


def model_folder(kind: str) -> Path:
    if kind == "dense":
        from engine.loading.registry import resolve
        return resolve(None)[1]
    from bench.shapes import SHAPES, build_folder
    # The tiny hybrid with the bundled tokenizer's vocabulary: it is sent real text.
    return build_folder({**SHAPES["tiny-hybrid"].config, "vocab_size": 49152})


# -- ours -----------------------------------------------------------------------------------------

def ours(folder: Path) -> dict:
    from engine.decoding.generate import build_prompt, generate
    from engine.prefix_cache.store import PrefixCache
    from engine.loading.registry import load_model
    from engine.decoding.sampling import SamplingParams

    lm = load_model(str(folder))
    cache = PrefixCache(lm)
    params = SamplingParams(max_tokens=1)
    list(generate(lm, build_prompt(lm, messages=WARMUP), params))  # first-call costs, off the clock
    rows = {}
    for name, messages in (("cold", conversation()), ("warm", conversation(edited=True))):
        prompt = build_prompt(lm, messages=messages)
        done = list(generate(lm, prompt, params, prefix_cache=cache))[-1]
        rows[name] = {"ttft_s": done.timings.ttft_s, "prompt_tokens": len(prompt.tokens),
                      "cached_tokens": done.usage.cached_tokens}
    rows["cache"] = cache.stats().as_dict()
    return rows


# -- mlx_lm.server --------------------------------------------------------------------------------

def _request(port: int, messages: list[dict]) -> dict:
    body = json.dumps({"messages": messages, "max_tokens": 1, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = None
    usage = {}
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and any("content" in c.get("delta", {}) or c.get("finish_reason")
                                     for c in chunk.get("choices", [])):
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    return {"ttft_s": first, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def mlx_lm_server(folder: Path, port: int) -> dict:
    (Path.home() / ".cache" / "huggingface" / "hub").mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(folder),
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError("mlx_lm.server exited during start-up")
                time.sleep(0.5)
        _request(port, WARMUP)  # first-call costs, off the clock
        return {"cold": _request(port, conversation()),
                "warm": _request(port, conversation(edited=True))}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dense,hybrid")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    results = {"machine": platform.platform(), "python": sys.version.split()[0], "models": {}}
    for i, kind in enumerate(args.models.split(",")):
        folder = model_folder(kind)
        row = {"folder": str(folder), "ours": ours(folder),
               "mlx_lm_server": mlx_lm_server(folder, args.port + i)}
        for side in ("ours", "mlx_lm_server"):
            r = row[side]
            r["warm_over_cold"] = r["warm"]["ttft_s"] / r["cold"]["ttft_s"]
        results["models"][kind] = row
        print(f"{kind}: {json.dumps(row, indent=1)}", flush=True)
    print(f"\n{'model':8} {'side':14} {'cold TTFT':>10} {'warm TTFT':>10} {'ratio':>6} {'reused':>7}")
    for kind, row in results["models"].items():
        for side in ("ours", "mlx_lm_server"):
            r = row[side]
            print(f"{kind:8} {side:14} {r['cold']['ttft_s']:10.3f} {r['warm']['ttft_s']:10.3f} "
                  f"{r['warm_over_cold']:6.3f} {r['warm']['cached_tokens']:>7}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
