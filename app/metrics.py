"""`GET /metrics`: Prometheus' text format, written by `prometheus-client` from one registry per
app (tests run several apps in one process; the library's global registry is not used).

Two sources:
- The API's requests by protocol and outcome, counted by `CountRequests` (a middleware: one
  counter increment when a response starts; the chat page's turns run over its WebSocket and count
  only in the engine's totals).
- The engine, read when Prometheus scrapes (`EngineCollector`, through `Engine.stats`, in a worker
  thread): running and waiting requests, requests by how they ended, prompt, cached and generated
  tokens, time to first token and time per output token, memory by model and the prefix cache,
  snapshot reads and writes, model loads. Nothing is computed per token for it.

The route is app/api/health.py's; it is guarded by the API key like every route but `/health`
(app/security/api_key.py).
"""

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine import Engine, EngineStats, Histogram


PREFIX = "mlxchat"

# The protocol a path belongs to, the most specific prefix first.
PROTOCOLS = (
    ("/v1/chat/completions", "openai_chat"), ("/v1/completions", "openai_completions"),
    ("/v1/responses", "openai_responses"), ("/v1/messages", "anthropic"),
    ("/v1/embeddings", "embeddings"), ("/v1/rerank", "rerank"), ("/rerank", "rerank"),
    ("/infill", "infill"), ("/api/", "ollama"), ("/v1/", "openai"),
)


def protocol_of(path: str) -> str | None:
    """The protocol `path` belongs to; None for the UI's pages and assets."""
    return next((name for prefix, name in PROTOCOLS if path.startswith(prefix)), None)


def outcome_of(status: int) -> str:
    """A response status as a request's outcome."""
    if status < 400:
        return "ok"
    if status == 429:
        return "overloaded"
    return "client_error" if status < 500 else "server_error"


class Metrics:
    """An app's registry: the request counter and the engine's collector."""

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_http_requests", "API requests by protocol and outcome "
                                "(the response's status)", ["protocol", "outcome"],
                                registry=self.registry)
        self.registry.register(EngineCollector(engine))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class CountRequests:
    """Counts each API request by protocol and outcome once its response starts (an exception
    before that counts as a server error)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        protocol = protocol_of(scope["path"]) if scope["type"] == "http" else None
        if protocol is None:
            await self.app(scope, receive, send)
            return
        counted = False

        async def counting(message: Message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.requests.labels(protocol, outcome_of(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting)
        finally:
            if not counted:
                self.metrics.requests.labels(protocol, "server_error").inc()


def _histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc)
    cumulative, buckets = 0, []
    for bound, count in zip([*map(str, h.bounds), "+Inf"], h.counts):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric([], buckets, h.sum)
    return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class EngineCollector(Collector):
    """The engine's reading (`Engine.stats`) as metric families, at each scrape."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        s: EngineStats = self.engine.stats()
        p = PREFIX
        yield _gauge(f"{p}_requests_running", "Generation requests running now", s.running)
        yield _gauge(f"{p}_requests_waiting", "Generation requests waiting to run", s.queued)
        yield _gauge(f"{p}_embedding_requests_pending",
                     "Embedding and rerank requests queued or running", s.embedding_queue)
        t = s.totals
        ended = CounterMetricFamily(f"{p}_requests_ended", "Generation requests by how they "
                                    "ended", labels=["state"])
        for state in ("finished", "cancelled", "failed"):
            ended.add_metric([state], t.ended.get(state, 0))
        yield ended
        yield _counter(f"{p}_prompt_tokens", "Prompt tokens of ended requests", t.prompt_tokens)
        yield _counter(f"{p}_cached_prompt_tokens", "Prompt tokens read from the prefix cache",
                       t.cached_tokens)
        yield _counter(f"{p}_generated_tokens", "Tokens generated", t.generated_tokens)
        yield _histogram(f"{p}_time_to_first_token_seconds", "From submission to the first "
                         "token", t.ttft)
        yield _histogram(f"{p}_time_per_output_token_seconds", "Each request's mean time "
                         "between output tokens", t.time_per_output_token)
        loads = CounterMetricFamily(f"{p}_model_loads", "Model loads (reloads after an idle "
                                    "unload included)", labels=["model", "outcome"])
        for (model, outcome), count in sorted(t.model_loads.items()):
            loads.add_metric([model, outcome], count)
        yield loads
        yield from self._memory(s)
        yield from self._prefix_cache(s)

    def _memory(self, s: EngineStats) -> Iterable[Metric]:
        p = PREFIX
        weights = GaugeMetricFamily(f"{p}_model_weights_bytes", "Weights in memory by model",
                                    labels=["model"])
        for model, size in sorted(s.memory.weights.items()):
            weights.add_metric([model], size)
        yield weights
        yield _gauge(f"{p}_kv_reserved_bytes", "Model-cache bytes the admitted requests "
                     "reserve", s.memory.reserved_kv)
        yield _gauge(f"{p}_memory_budget_bytes", "The engine's memory budget for the loaded "
                     "models' weights, model caches and the prefix caches", s.memory.memory_budget)

    def _prefix_cache(self, s: EngineStats) -> Iterable[Metric]:
        p, c = PREFIX, s.prefix_cache
        labels = ["model"]
        size = GaugeMetricFamily(f"{p}_prefix_cache_bytes", "Prefix-cache snapshots in memory",
                                 labels=labels)
        held = GaugeMetricFamily(f"{p}_prefix_cache_snapshots", "Prefix-cache snapshots by "
                                 "where they are", labels=["model", "where"])
        lookups = CounterMetricFamily(f"{p}_prefix_cache_lookups", "Prefix-cache lookups by "
                                      "outcome", labels=["model", "outcome"])
        reads = CounterMetricFamily(f"{p}_snapshot_reads", "Snapshots read (from memory or "
                                    "disk)", labels=["model", "source"])
        writes = CounterMetricFamily(f"{p}_snapshot_writes", "Snapshots written (to memory or "
                                     "disk)", labels=["model", "target"])
        evictions = CounterMetricFamily(f"{p}_prefix_cache_evictions", "Snapshots evicted from "
                                        "memory", labels=labels)
        if c is not None:
            size.add_metric([c.model], c.bytes)
            held.add_metric([c.model, "memory"], c.entries)
            held.add_metric([c.model, "disk"], c.disk_entries)
            lookups.add_metric([c.model, "hit"], c.hits)
            lookups.add_metric([c.model, "miss"], c.misses)
            reads.add_metric([c.model, "memory"], max(c.hits - c.file_reads, 0))
            reads.add_metric([c.model, "disk"], c.file_reads)
            writes.add_metric([c.model, "memory"], c.saves)
            writes.add_metric([c.model, "disk"], c.file_writes)
            evictions.add_metric([c.model], c.evictions)
        yield from (size, held, lookups, reads, writes, evictions)
