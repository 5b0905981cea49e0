"""Issue 54's attack cases against a real server, with the figures the issue's goals name: each
request's status and time, `/health`'s worst round trip during it (beside the idle baseline; "-"
when the request ended before one), and the peak resident memory it added (the server runs in
this process, the bodies encoded before the clock starts); then a chat stream's worst gap while an
embedding request runs, beside its gap alone.

    python -m bench.hardening                 # the bundled model
    python -m bench.hardening --model tiny    # a tiny random llama (no bundled model needed)

Goals: 0 x 5xx; /health worst <= 1 s; peak RSS <= +1 GB per request; a stream's worst gap <= 2 s
while any legal embedding runs. (The tests in tests/test_hardening_round4.py and friends assert
these with margins for a shared CI machine; this prints the figures.)
"""

from __future__ import annotations

import argparse
import base64
import json
import struct
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Iterator

import httpx

from . import common


def _hwm_reset() -> float:
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _status(key: str) -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1]) / 1024


class _Probe:
    """`/health` polled back to back in a thread; `worst` round trip."""

    def __init__(self, url: str):
        self.url, self.worst, self._stop = url, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=600) as client:
            while not self._stop.is_set():
                t = time.perf_counter()
                client.get(f"{self.url}/health")
                self.worst = max(self.worst, time.perf_counter() - t)
                time.sleep(0.01)

    def __enter__(self) -> "_Probe":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(600)


def gif_canvas(side: int = 9400) -> bytes:
    return (b"GIF89a" + struct.pack("<HHBBB", side, side, 0, 0, 0) + b"\x2c"
            + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00\x3b")


def png_header(side: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def cases(model: str) -> Iterator[tuple[str, str, dict]]:
    """(name, path, body) of each case."""
    b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    gif, one = b64(gif_canvas()), b64(png_header(1))
    yield "8 GIFs declaring 9,400² (chat)", "/v1/chat/completions", {
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/gif;base64,{gif}"}}] * 8}]}
    yield "8 GIFs declaring 9,400² (messages)", "/v1/messages", {
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/gif",
                                         "data": gif}}] * 8}]}
    yield "8 PNGs declaring 9,400² (api/chat)", "/api/chat", {
        "model": model, "stream": False, "messages": [
            {"role": "user", "content": "x", "images": [b64(png_header(9400))] * 8}]}
    yield "100,000 1×1 PNGs (messages)", "/v1/messages", {
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": one}}] * 100_000}]}
    tools = [{"type": "function", "function": {"name": f"fn_{i}", "parameters": {
        "type": "object", "properties": {
            "a": {"type": "string", "enum": [f"v{i}_{k}" for k in range(300)]},
            "b": {"type": "string", "pattern": "^[a-z]{3,8}-[0-9]+$"}}}}} for i in range(1000)]
    yield "1,000 tools, 300-enum + pattern (chat)", "/v1/chat/completions", {
        "model": model, "max_tokens": 2, "tools": tools,
        "messages": [{"role": "user", "content": "hi"}]}
    yield "1,000 tools (messages)", "/v1/messages", {
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                  for t in tools]}
    yield "1,000 tools (responses)", "/v1/responses", {
        "model": model, "max_output_tokens": 2, "input": "hi",
        "tools": [{"type": "function", **t["function"]} for t in tools]}
    yield "1,000 tools (api/chat)", "/api/chat", {
        "model": model, "stream": False, "tools": tools,
        "messages": [{"role": "user", "content": "hi"}]}
    yield "60 MB text prompt (chat)", "/v1/chat/completions", {
        "model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hello " * 10_000_000}]}
    yield "6 MB text prompt (chat)", "/v1/chat/completions", {
        "model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hello " * 1_000_000}]}
    yield "6 MB /infill prefix", "/infill", {
        "input_prefix": "def f():\n" * 600_000, "input_suffix": "x", "n_predict": 2}
    yield "metadata of 50 MB (responses)", "/v1/responses", {
        "model": model, "input": "hi", "metadata": {"a": "x" * 50_000_000}}
    yield "reasoning.effort an object (responses)", "/v1/responses", {
        "model": model, "input": "hi", "reasoning": {"effort": {"x": 1}}}


def stream_gaps(url: str, model: str, during: Any) -> tuple[float, float]:
    """A chat stream's worst token gap before and while `during()` runs."""
    times: list[float] = []
    body = {"model": model, "max_tokens": 4000, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story about the sea."}]}

    def read() -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3000) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.monotonic())
                    if stop.is_set():
                        return

    stop = threading.Event()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while len(times) < 20:
        time.sleep(0.05)
    start = time.monotonic()
    during()
    end = time.monotonic()
    stop.set()
    reader.join(60)
    gaps = list(zip(times, times[1:]))
    alone = max(b - a for a, b in gaps if b <= start)
    while_running = max((b - a for a, b in gaps if b > start and a < end), default=0.0)
    return alone, while_running


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["bundled", "tiny"], default="bundled")
    args = parser.parse_args()
    from engine import Engine

    if args.model == "tiny":
        from engine.loading.registry import load_model

        from .shapes import build_folder

        lm = load_model(str(build_folder({
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 49152, "rope_theta": 10000.0,
            "max_position_embeddings": 8192, "tie_word_embeddings": False})))
        engine = Engine(lm.name, load=lambda name, **_: lm).start()
    else:
        engine = Engine().start()
    with tempfile.TemporaryDirectory() as folder, common.served_app(engine, Path(folder)) as app:
        model = engine.model_name
        idle = _Probe(app.url)
        with idle:
            time.sleep(1)
        print(f"model {model}; /health idle worst {idle.worst:.3f} s")
        print(f"{'case':42} {'status':>6} {'time s':>7} {'/health worst s':>16} {'peak RSS +MB':>13}")
        for name, path, body in cases(model):
            raw = json.dumps(body).encode()  # before the clock: the client shares this process
            del body
            start_mb = _hwm_reset()
            with _Probe(app.url) as probe:
                t = time.perf_counter()
                r = httpx.post(f"{app.url}{path}", content=raw, timeout=3000,
                               headers={"content-type": "application/json"})
                took = time.perf_counter() - t
            added = _status("VmHWM") - start_mb
            worst = f"{probe.worst:.3f}" if probe.worst else "-"
            print(f"{name:42} {r.status_code:>6} {took:>7.2f} {worst:>16} {added:>13.0f}",
                  flush=True)
        for tokens in (2048, 4096):
            alone, during = stream_gaps(app.url, model, lambda: httpx.post(
                f"{app.url}/v1/embeddings", json={"input": [[5] * tokens]}, timeout=3000))
            print(f"a stream's worst gap: {alone:.2f} s alone, {during:.2f} s while a "
                  f"{tokens}-token input is embedded", flush=True)


if __name__ == "__main__":
    main()
