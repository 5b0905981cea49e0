"""Issue 24 figures (not a benchmark suite; the machine is shared, so read them as orientation):
the time to render 2,001 messages with their checkpoints, and /health latency (p50, p99, max) on a
real server with a tiny random llama while one heavy request is prepared.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python scripts/health_during_heavy_requests.py
"""
import statistics
import sys
import tempfile
import time
sys.path.insert(0, 'tests'); sys.path.insert(0, '.')
from pathlib import Path
import httpx
from live_server import engine_serving
from loop_probe import health_probe
from tiny_models import tiny_llama
from engine.decoding import chat
lm = tiny_llama()
msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(2000)] + [{"role":"user","content":"q"}]
ts=[]
for _ in range(3):
    t=time.perf_counter(); chat.render(lm.tokenizer, msgs); ts.append(time.perf_counter()-t)
print(f"render 2,001 messages with checkpoints: best {min(ts):.3f} s of 3")
def p99(l): return sorted(l)[max(0, int(len(l)*0.99)-1)]
with engine_serving(Path(tempfile.mkdtemp()), lm) as s:
    cases = {
      "2,001 msgs (context 400)": ("post", "/v1/chat/completions", {"json": {"model": lm.name, "max_tokens": 3, "messages": msgs}}),
      "2,001 msgs truncate=oldest, none fits": ("post", "/v1/chat/completions", {"json": {"model": lm.name, "max_tokens": 3, "truncate": "oldest", "messages": msgs + [{"role":"assistant","content":"a"},{"role":"user","content":"word "*9000}]}}),
      "1,000 tools": ("post", "/v1/chat/completions", {"json": {"model": lm.name, "max_tokens": 2, "tool_choice": "none", "messages": [{"role":"user","content":"hi"}], "tools": [{"type":"function","function":{"name":f"f{i}","parameters":{"type":"object","properties":{"a":{"type":"integer","minimum":i}}}}} for i in range(1000)]}}),
    }
    for name, (m, path, kw) in cases.items():
        with health_probe(s.url) as p:
            t=time.perf_counter(); r = getattr(httpx, m)(f"{s.url}{path}", timeout=300, **kw); took=time.perf_counter()-t
        print(f"{name}: HTTP {r.status_code} in {took:.2f} s; /health n={len(p.latencies)} p50 {statistics.median(p.latencies)*1000:.0f} ms p99 {p99(p.latencies)*1000:.0f} ms max {p.worst*1000:.0f} ms")
