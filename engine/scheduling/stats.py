"""The engine's running totals for monitoring (the app exports them as Prometheus metrics,
app/metrics.py): requests by how they ended, prompt, cached and generated tokens, time to first
token and time per output token as histograms, and model loads.

Each finished request is recorded once, by the scheduler thread as it ends (a few additions and
two bucket searches, under the engine's lock it already holds); a reader takes a consistent copy
(`StatsRecorder.snapshot`) whenever it likes, off the scheduler's path.
"""

import bisect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

# Histogram bucket upper bounds, in seconds (Prometheus adds +Inf).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class Histogram:
    """Observations per bucket (`counts[i]`: those <= `bounds[i]`, not cumulative; the last
    count is those above every bound), their sum and number."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass
class _Buckets:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def frozen(self) -> Histogram:
        return Histogram(self.bounds, tuple(self.counts), self.sum)


@dataclass(frozen=True)
class RequestTotals:
    """Totals over every request that ended since the engine started."""

    ended: dict[str, int]  # by final state: finished, cancelled, failed
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft: Histogram
    time_per_output_token: Histogram
    model_loads: dict[tuple[str, str], int]  # by (model, outcome: "loaded" | "failed")


class StatsRecorder:
    """Running totals; `record` from the scheduler thread, `snapshot` from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended: dict[str, int] = {}
        self._prompt = self._cached = self._generated = 0
        self._ttft = _Buckets(TTFT_BUCKETS)
        self._tpot = _Buckets(TPOT_BUCKETS)
        self._loads: dict[tuple[str, str], int] = {}

    def record(self, state: str, usage: Any, times: dict[str, float]) -> None:
        """A request ended in `state` with `usage` (engine Usage) and its `times` (the
        RequestHandle's: queued, first_token, last_token, ...)."""
        with self._lock:
            self._ended[state] = self._ended.get(state, 0) + 1
            self._prompt += usage.prompt_tokens
            self._cached += usage.cached_tokens
            self._generated += usage.completion_tokens
            first, queued = times.get("first_token"), times.get("queued")
            if first is not None and queued is not None:
                self._ttft.observe(max(first - queued, 0.0))
                last = times.get("last_token", first)
                if usage.completion_tokens > 1:
                    self._tpot.observe(max(last - first, 0.0) / (usage.completion_tokens - 1))

    def counted(self, load: Callable[..., Any]) -> Callable[..., Any]:
        """`load` (a model loader) counting each load by the model it gave, or its failure."""
        def counting(name: Any = None, **options: Any) -> Any:
            try:
                lm = load(name, **options)
            except Exception:
                self._loaded(str(name or "default"), "failed")
                raise
            self._loaded(lm.name, "loaded")
            return lm
        return counting

    def _loaded(self, model: str, outcome: str) -> None:
        with self._lock:
            self._loads[(model, outcome)] = self._loads.get((model, outcome), 0) + 1

    def snapshot(self) -> RequestTotals:
        with self._lock:
            return RequestTotals(dict(self._ended), self._prompt, self._cached, self._generated,
                                 self._ttft.frozen(), self._tpot.frozen(), dict(self._loads))


@dataclass(frozen=True)
class MemoryUse:
    """Bytes in use now, by what holds them."""

    weights: dict[str, int]  # by model: the chat model's and dedicated models' resident weights
    reserved_kv: int  # model-cache bytes the admitted requests reserve
    memory_budget: int


@dataclass(frozen=True)
class PrefixCacheUse:
    """The loaded model's prefix cache (engine/prefix_cache/store.py CacheStats, by name)."""

    model: str
    entries: int
    bytes: int
    disk_entries: int
    hits: int
    misses: int
    saves: int
    evictions: int
    file_reads: int
    file_writes: int
    reused_tokens: int

    @classmethod
    def of(cls, model: str, c) -> "PrefixCacheUse":
        """From a prefix cache's `stats()` (its CacheStats)."""
        return cls(model, c.entries, c.bytes, c.disk_entries, c.hits, c.misses, c.saves,
                   c.evictions, c.file_reads, c.file_writes, c.reused_tokens)


@dataclass(frozen=True)
class EngineStats:
    """One reading of the engine for monitoring (`Engine.stats`)."""

    at: float
    model: str | None
    running: int
    queued: int
    embedding_queue: int  # embedding and rerank requests waiting or running
    totals: RequestTotals
    memory: MemoryUse
    prefix_cache: PrefixCacheUse | None
