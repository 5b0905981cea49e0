"""What the protocol adapters cost: time to first token and decode tok/s of one streamed, greedy
answer through Anthropic's `/v1/messages`, OpenAI's `/v1/responses` and Ollama's `/api/chat`,
each against `/v1/chat/completions` on the same prompt, the same server and the same engine.

    python -m bench.protocols [--model tiny|bundled] [--reps 5] [--gen 64] [--context WORDS]
                              [--out FILE]

The server is the real app on 127.0.0.1 (tests/live_server.py `engine_serving`, uvicorn in a
thread of this process) on a tiny random-weight llama (tests/tiny_models.py; default) or the
bundled SmolLM2-135M (`--model bundled`). Each protocol is read as its clients read it, over
HTTP with httpx: SSE for the first three, newline-delimited JSON for Ollama. A run's time to first
token is from sending the request to the first event carrying answer text; its decode rate is the
answer's token count (each protocol's own usage figure) less one over the time from the first
to the last text event. Every side runs once untimed, then `--reps` times interleaved (order
reversed every other rep), so drift and the prefix cache (the same prompt each time: every timed
run reuses the cached prompt) hit every side alike. Each adapter's figure is a ratio against chat
completions' median: goal <= 1.05 for time to first token, >= 0.95 for decode tok/s.

JSON goes to bench/results/protocols-<backend>-<model>[-ctx<WORDS>]-<date>.json (bench/common.py's format:
rows of ours against the baseline, with every run's figures in `extra`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from . import common
from .common import Row

PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."
BASELINE = "chat"
TTFT_GOAL, TPS_GOAL = "<= 1.05", ">= 0.95"


# -- each protocol: its path, its request and how its stream is read ----------------------------------
# `read(lines)` yields (kind, value) for each event: ("text", str) for answer text, ("tokens",
# int) for the answer's token count from the protocol's usage figure.

def _sse(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event name, data object) of each SSE event; `[DONE]` ends."""
    event = ""
    for line in lines:
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield event, json.loads(data)
            event = ""


def _read_chat(lines):
    for _, d in _sse(lines):
        for c in d.get("choices") or []:
            if (c.get("delta") or {}).get("content"):
                yield "text", c["delta"]["content"]
        if d.get("usage"):
            yield "tokens", d["usage"]["completion_tokens"]


def _read_anthropic(lines):
    for event, d in _sse(lines):
        if event == "content_block_delta" and d["delta"].get("type") == "text_delta":
            yield "text", d["delta"]["text"]
        elif event == "message_delta":
            yield "tokens", d["usage"]["output_tokens"]
        elif event == "error":
            raise RuntimeError(d)


def _read_responses(lines):
    for event, d in _sse(lines):
        if event == "response.output_text.delta":
            yield "text", d["delta"]
        elif event == "response.completed":
            yield "tokens", d["response"]["usage"]["output_tokens"]
        elif event in ("response.failed", "error"):
            raise RuntimeError(d)


def _read_ollama(lines):
    for line in lines:
        if not line.strip():
            continue
        d = json.loads(line)
        if "error" in d:
            raise RuntimeError(d["error"])
        if (d.get("message") or {}).get("content"):
            yield "text", d["message"]["content"]
        if d.get("done"):
            yield "tokens", d["eval_count"]


def _user(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


# name -> (path, body(model, prompt, max_tokens), read)
PROTOCOLS: dict[str, tuple[str, Callable[[str, str, int], dict[str, Any]], Callable]] = {
    "chat": ("/v1/chat/completions",
             lambda m, p, n: {"model": m, "messages": _user(p), "max_tokens": n, "temperature": 0,
                              "stream": True, "stream_options": {"include_usage": True}},
             _read_chat),
    "anthropic": ("/v1/messages",
                  lambda m, p, n: {"model": m, "messages": _user(p), "max_tokens": n,
                                   "temperature": 0, "stream": True},
                  _read_anthropic),
    "responses": ("/v1/responses",
                  lambda m, p, n: {"model": m, "input": p, "max_output_tokens": n, "temperature": 0,
                                   "stream": True},
                  _read_responses),
    "ollama": ("/api/chat",
               lambda m, p, n: {"model": m, "messages": _user(p), "stream": True,
                                "options": {"temperature": 0, "num_predict": n}},
               _read_ollama),
}


def stream_once(client, url: str, protocol: str, model: str, prompt: str, gen: int) -> dict[str, Any]:
    """One streamed answer through `protocol`: time to first text, decode rate, token count, text."""
    path, body, read = PROTOCOLS[protocol]
    times, text, tokens = [], [], None
    t0 = time.perf_counter()
    with client.stream("POST", url + path, json=body(model, prompt, gen)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {r.read().decode(errors='replace')[:500]}")
        for kind, value in read(r.iter_lines()):
            if kind == "text":
                times.append(time.perf_counter())
                text.append(value)
            else:
                tokens = value
    if not times or not tokens:
        raise RuntimeError(f"{path}: no answer text or no token count in the stream")
    span = times[-1] - times[0]
    return {"ttft_s": times[0] - t0, "tps": (tokens - 1) / span if tokens > 1 and span > 0 else None,
            "tokens": tokens, "events": len(times), "text": "".join(text)}


def long_prompt(prompt: str, words: int) -> str:
    """`prompt` after `words` words of text (a document to answer about), for `--context`."""
    filler = " ".join(f"line {i}: the keeper logged the weather, the ships and the lamp."
                      for i in range(words // 11 + 1)).split()[:words]
    return (" ".join(filler) + "\n\n" + prompt) if words else prompt


def _load(model: str):
    """The model to serve: None (the bundled one, as `Engine()` loads it) or a tiny llama."""
    if model == "bundled":
        return None
    from tests.tiny_models import tiny_llama

    return tiny_llama()


def measure(model: str = "tiny", reps: int = 5, gen: int = 64, prompt: str = PROMPT,
            bar=None) -> tuple[list[Row], dict[str, Any]]:
    """Rows (each adapter's TTFT and decode tok/s against chat completions') and what the server
    said about itself (model name, device)."""
    import httpx

    from tests.live_server import engine_serving

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise

    with tempfile.TemporaryDirectory(prefix="bench-protocols-") as folder, \
            engine_serving(Path(folder), _load(model)) as server, \
            httpx.Client(timeout=600) as client:
        name = server.app.state.engine.model_name
        runs = common.interleave({p: (lambda p=p: stream_once(client, server.url, p, name, prompt, gen))
                                  for p in PROTOCOLS}, reps, bar, warmup=True)
    info = {"model": name, "prompt": prompt[-200:], "prompt_chars": len(prompt), "gen": gen,
            "reps": reps}
    return rows_of(runs, model, info), info


def rows_of(runs: dict[str, list[dict[str, Any]]], model: str, info: dict[str, Any]) -> list[Row]:
    base = runs[BASELINE]
    base_ttft = common.median([r["ttft_s"] for r in base])
    base_tps = common.median([r["tps"] for r in base])
    same_text = {p: all(r["text"] == base[0]["text"] for r in rs) for p, rs in runs.items()}
    rows = []
    for p, rs in runs.items():
        if p == BASELINE:
            continue
        ttft = [r["ttft_s"] for r in rs]
        tps = [r["tps"] for r in rs]
        common_notes = (f"median of {len(rs)} interleaved, {rs[0]['tokens']} tokens "
                        f"(chat completions: {base[0]['tokens']}), greedy, streamed; same text as "
                        f"chat completions: {'yes' if same_text[p] else 'NO'}")
        extra = {"ours_all": ttft, "baseline_all": [r["ttft_s"] for r in base],
                 "tokens": [r["tokens"] for r in rs], "events": [r["events"] for r in rs],
                 "same_text_as_chat": same_text[p], **info}
        rows.append(Row("protocols", model, f"TTFT {PROTOCOLS[p][0]}", "ms",
                        common.median(ttft) * 1e3, base_ttft * 1e3, "/v1/chat/completions",
                        TTFT_GOAL, f"{common_notes}; ours {common.spread(ttft, 1e3)} ms, chat "
                        f"completions {common.spread(extra['baseline_all'], 1e3)} ms", extra))
        extra = dict(extra, ours_all=tps, baseline_all=[r["tps"] for r in base])
        rows.append(Row("protocols", model, f"decode {PROTOCOLS[p][0]}", "tok/s",
                        common.median(tps), base_tps, "/v1/chat/completions", TPS_GOAL,
                        f"{common_notes}; ours {common.spread(tps)}, chat completions "
                        f"{common.spread(extra['baseline_all'])} tok/s", extra))
    return rows


def run_suite(a) -> list[dict[str, Any]]:
    """`python -m bench protocols`: the tiny model, `a.reps` reps of `a.gen` tokens (rows as dicts
    for bench/__main__.py's delegation)."""
    with common.progress(len(PROTOCOLS) * (a.reps + 1), "protocols tiny") as bar:
        rows, _ = measure("tiny", max(a.reps, 1), min(a.gen, 64), bar=bar)
    return [r.as_dict() for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.protocols", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny", "bundled"), default="tiny")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per protocol (median, spread)")
    ap.add_argument("--gen", type=int, default=64, help="answer tokens at most (max_tokens)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--context", type=int, default=0, metavar="WORDS",
                    help="put WORDS words of text before the prompt (a long prompt: what every "
                         "side pays to render and count it shows in its time to first token)")
    ap.add_argument("--note", default="", help="said with the figures (e.g. what else the machine ran)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    meta = common.run_meta(["python", "-m", "bench.protocols"] + list(sys.argv[1:] if argv is None else argv))
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    out = a.out or common.RESULTS_DIR / f"protocols-{meta['device']['backend']}-{a.model}" \
        f"{f'-ctx{a.context}' if a.context else ''}-{stamp}.json"
    load_before = os.getloadavg()
    with common.progress(len(PROTOCOLS) * (a.reps + 1), f"protocols {a.model}") as bar:
        rows, info = measure(a.model, a.reps, a.gen, long_prompt(a.prompt, a.context), bar=bar)
    meta["settings"] = info
    # what else the machine ran: 1-minute load average before and after, against its cores
    meta["load_average_1m"] = {"before": load_before[0], "after": os.getloadavg()[0],
                               "cpus": os.cpu_count()}
    if a.note:
        meta["note"] = a.note
    common.print_table(rows, title=f"protocol adapters vs /v1/chat/completions ({info['model']})")
    common.write_json(out, meta, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    from engine import restart_with_blas

    restart_with_blas("bench.protocols")
    sys.exit(main())
