"""Coding agents' sessions replayed against mlxchat: each round's prompt tokens, the tokens read
from the prefix cache and the time to the first output, with and without Claude Code's billing
line, and how fast a prompt over the context gets the error the clients compact on.

    python -m bench.agents [--model bundled|llama-1b] [--sessions NAME,...]
                           [--variants billing,no-billing,unknown-noise] [--max-tokens 8] [--out FILE]

The sessions are recordings of the real clients (bench/data/agents/*.json, made with
bench/agent_capture.py: what Claude Code 2.1.332 and Codex CLI 0.171.0 sent, round after round, in
a scripted session of three tool calls and an answer; `-bare`/`-lean`: as `mlxchat launch` runs
them on a model whose context is too small for their full prompt). Each round is sent as recorded
(streamed; `max_tokens` lowered to `--max-tokens`, greedy, `model` the served model's name as
`mlxchat launch` sets it) to the real app on 127.0.0.1 (uvicorn in a thread of this process), a
fresh engine (a cold prefix cache) for every session and variant.

Variants of a Claude Code session (its first system block):
  billing        the billing line as interactive Claude Code sends it, `cch` new every round:
                 the server drops it (app/api/prompt_noise.py)
  no-billing     without it, as `CLAUDE_CODE_ATTRIBUTION_HEADER=0` (`mlxchat launch`) sends it
  unknown-noise  the same per-request line under a name the server does not know, so it stays:
                 what every round of a session was before the billing line was dropped
A Codex session runs as recorded.

Models: `bundled` (SmolLM2-135M, an 8,192-token context: the lean sessions fit) and `llama-1b` (a
random-weight llama of ~1.1B parameters, 4-bit, the SmolLM2 tokenizer, a 32,768-token context:
the full sessions), both on the CPU unless the device says otherwise.

Goals (issue 48): every round after the first reads >= 90% of its prompt from the cache (billing
and no-billing); a prompt over the context is refused in <= 1 s. Rows: each later round's cached
tokens against its prompt tokens (goal >= 0.9), the later rounds' median TTFT against the
unknown-noise variant's (the speed-up), and the seconds to the compaction error against 1 s.
JSON: bench/results/agents-<backend>-<model>-<date>.json (bench/common.py's format).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from . import common
from .common import Row

DATA = Path(__file__).resolve().parent / "data" / "agents"
MODELS = {"bundled": ("claude-code-bare", "codex-lean"), "llama-1b": ("claude-code", "codex")}
LONG_CONTEXT = 32768
VARIANTS = ("billing", "no-billing", "unknown-noise")
BILLING = "x-anthropic-billing-header:"


def recording(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


def rounds(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """Each round's request body, as the client sent it (bench/agent_capture.py's format)."""
    return [{**rec["body"], rec["key"]: [rec["items"][i] for i in ids]} for ids in rec["rounds"]]


def with_variant(body: dict[str, Any], variant: str | None, rng: random.Random) -> dict[str, Any]:
    """`body` with its billing line as `variant` says (None: as recorded)."""
    if variant is None or not isinstance(body.get("system"), list):
        return body
    rest = [b for b in body["system"] if not str(b.get("text", "")).startswith(BILLING)]
    cch = f"{rng.randrange(16 ** 5):05x}"
    line = f"{BILLING} cc_version=2.1.332.f0c; cc_entrypoint=cli; cch={cch};"
    if variant == "no-billing":
        return {**body, "system": rest}
    if variant == "unknown-noise":
        line = line.replace("x-anthropic-billing-header", "x-session-header")
    return {**body, "system": [{"type": "text", "text": line}, *rest]}


# -- the stream of each protocol ---------------------------------------------------------------------

def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            yield json.loads(line[5:])


def send(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed round: prompt and cached tokens (the protocol's usage), TTFT and wall time."""
    import httpx

    start = time.perf_counter()
    first = None
    usage: dict[str, Any] = {}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=3600) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
        for event in _events(r.iter_lines()):
            kind = event.get("type", "")
            if first is None and (kind.endswith(".delta") or kind in (
                    "content_block_start", "content_block_delta", "response.output_item.added")):
                first = time.perf_counter() - start
            if kind == "message_start":
                usage = event["message"]["usage"]
            elif kind == "message_delta":
                usage = {**usage, **event.get("usage", {})}
            elif kind == "response.completed":
                usage = event["response"]["usage"]
    wall = time.perf_counter() - start
    if "cache_read_input_tokens" in usage:  # Anthropic: input tokens computed, the rest cached
        cached = usage["cache_read_input_tokens"]
        prompt = usage["input_tokens"] + cached
    else:
        prompt, cached = usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
    return {"prompt": prompt, "cached": cached, "ttft_s": first if first is not None else wall,
            "wall_s": wall}


def too_long(url: str, context: int, reps: int = 3) -> dict[str, list[float]]:
    """Seconds to the compaction error of a prompt ~1.5x the context, per protocol."""
    import httpx

    text = "word " * int(context * 1.5)
    bodies = {"anthropic": ("/v1/messages", {"model": "claude-opus-5-5", "max_tokens": 32000,
                                             "stream": True,
                                             "messages": [{"role": "user", "content": text}]}),
              "responses": ("/v1/responses", {"model": "gpt-5", "stream": True, "input": text})}
    out: dict[str, list[float]] = {}
    for name, (path, body) in bodies.items():
        for _ in range(reps):
            start = time.perf_counter()
            r = httpx.post(f"{url}{path}", json=body, timeout=600)
            took = time.perf_counter() - start
            error = r.json().get("error", {})
            if r.status_code != 400 or ("too long" not in error.get("message", "") and
                                        error.get("code") != "context_length_exceeded"):
                raise RuntimeError(f"{path}: not the compaction error: {r.status_code} {r.text[:200]}")
            out.setdefault(name, []).append(took)
    return out


# -- the models and the servers ------------------------------------------------------------------------

def load(model: str):
    from engine.loading.registry import load_model

    if model == "bundled":
        return load_model(None)
    from .decode import RANDOM_MODELS, random_folder

    shape = {**RANDOM_MODELS["llama-1b"], "max_position_embeddings": LONG_CONTEXT}
    return load_model(str(random_folder(f"llama-1b-{LONG_CONTEXT // 1024}k", shape)))


def replay(lm, session: str, variant: str | None, max_tokens: int, seed: int = 0) -> list[dict]:
    """Every round of `session` against a fresh server on `lm`."""
    from engine import Engine

    rec = recording(session)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as folder:
        engine = Engine(lm.name, load=lambda name, **_: lm, keep_alive=-1).start()
        with common.served_app(engine, Path(folder)) as app:
            out = []
            for k, body in enumerate(rounds(rec)):
                body = with_variant(body, variant, rng)
                limit = "max_tokens" if "messages" in body else "max_output_tokens"
                # the served model by its name, as `mlxchat launch` has the client name it
                body = {**body, "model": lm.name, limit: max_tokens, "temperature": 0,
                        "stream": True}
                try:
                    row = send(app.url, rec["path"].split("?")[0], body)
                except RuntimeError as exc:  # kept in the results: the run goes on
                    out.append({"error": str(exc)})
                    print(f"  {session} {variant or 'as recorded'} round {k + 1}: {exc}",
                          file=sys.stderr, flush=True)
                    continue
                out.append(row)
                print(f"  {session} {variant or 'as recorded'} round {k + 1}: prompt "
                      f"{row['prompt']}, cached {row['cached']}, TTFT {row['ttft_s']:.2f} s",
                      file=sys.stderr, flush=True)
    return out


def measure(lm, model: str, sessions: list[str], max_tokens: int,
            variants: tuple[str, ...] = VARIANTS) -> tuple[list[Row], dict]:
    rows: list[Row] = []
    runs: dict[str, Any] = {}
    for session in sessions:
        chosen = variants if session.startswith("claude") else (None,)
        runs[session] = {v or "as recorded": replay(lm, session, v, max_tokens) for v in chosen}
        for variant, found in runs[session].items():
            for k, r in enumerate(found[1:], 2):
                if "error" in r:
                    rows.append(common.failed("agents", f"{model}/{session}/{variant}", r["error"]))
                    continue
                rows.append(Row("agents", f"{model}/{session}/{variant}", f"round {k} cached",
                                "tokens", r["cached"], r["prompt"], "prompt tokens",
                                goal=">= 0.9" if variant != "unknown-noise" else "",
                                extra={"ttft_s": r["ttft_s"], "wall_s": r["wall_s"]}))
        if "unknown-noise" in runs[session]:
            before = common.median([r.get("ttft_s") for r in runs[session]["unknown-noise"][1:]])
            for variant in [v for v in ("billing", "no-billing") if v in runs[session]]:
                after = common.median([r.get("ttft_s") for r in runs[session][variant][1:]])
                rows.append(Row("agents", f"{model}/{session}/{variant}",
                                "later rounds' median TTFT", "s", after, before,
                                "unknown-noise (cold rounds)", goal="<= 0.5"))
    return rows, runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="bundled")
    parser.add_argument("--sessions", help=f"recordings in {DATA} (default: those that fit)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="of a Claude Code session (a 1B shape on a busy CPU: fewer)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sessions = args.sessions.split(",") if args.sessions else list(MODELS[args.model])
    lm = load(args.model)
    print(f"{lm.name}: context {lm.context_length} tokens; sessions {', '.join(sessions)}",
          file=sys.stderr)
    rows, runs = measure(lm, args.model, sessions, args.max_tokens,
                         tuple(args.variants.split(",")))
    from engine import Engine

    with tempfile.TemporaryDirectory() as folder:
        engine = Engine(lm.name, load=lambda name, **_: lm, keep_alive=-1).start()
        with common.served_app(engine, Path(folder)) as app:
            errors = too_long(app.url, lm.context_length)
    for protocol, times in errors.items():
        rows.append(Row("agents", f"{args.model}/{protocol}", "seconds to the compaction error",
                        "s", common.median(times), 1.0, "1 s", goal="<= 1.0",
                        notes=common.spread(times), extra={"runs": times}))
    common.print_table(rows, f"bench.agents ({args.model})")
    import mlx.core as mx

    backend = "gpu" if mx.default_device() == mx.gpu else "cpu"
    out = args.out or common.RESULTS_DIR / \
        f"agents-{backend}-{args.model}-{dt.date.today().isoformat()}.json"
    common.write_json(out, common.run_meta(sys.argv if argv is None else argv), rows, runs=runs)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
