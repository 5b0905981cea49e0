"""Embedding requests, scheduled beside chat on the engine's one scheduler thread.

`Engine.embed` (service.py) hands a request to `EmbeddingQueue.submit`, which validates it at
once in the caller's thread (InvalidRequest for bad input or more than MAX_REQUEST_TOKENS tokens
in all, Overloaded past MAX_PENDING requests) and queues it. The scheduler thread (ticks.py,
`Scheduler.soon`) then runs one chunk, one model call, between two of its ticks. While chat
requests decode, a chunk holds as many padded tokens as the model embeds in TICK_S (its speed
measured on the chunks before; FIRST_TOKENS until it is known), at most the model's prefill chunk
(engine/scheduling/prefill_policy.py); while nothing decodes, up to CHUNK_TOKENS. An input longer
than that goes through in segments, one per tick, with a model cache (engine/decoding/pooling.py
`pool_segment`), so a running chat stream waits about TICK_S for its next token whatever the
embedding request holds; requests run in arrival order. A cancelled handle
(its client left) ends at its next chunk.

The model: a chat model of the engine's pool (mean pooling, engine/decoding/pooling.py) when the
request names it (no name: the default model), or a dedicated embedding model (Qwen3-Embedding)
named by the request. Either is a member of the engine's model pool (engine/scheduling/pool.py):
one that is not in memory loads on this queue's loader thread when the queue reaches its first
request (its weights reserved in the one memory budget, idle models evicted where it needs room),
a job holds its model in memory while it runs (`Scheduler.hold`: it is never evicted under it),
and an idle model leaves memory after its keep-alive like any other.

Reranking (engine/scheduling/rerank.py) runs through this same queue: its rows are (query,
document) prompts scored by an LLM reranker, or the query and documents embedded for cosine
similarity; a job's `run` is the model call its chunks make.
"""

import asyncio
import concurrent.futures
import functools
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, Union

import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..decoding.generate import default_prefill_chunk
from ..decoding.pooling import embed_batch, finish_pooled, pool_segment
from ..decoding.prompt_size import max_token_chars
from ..loading.embedding_recipe import EmbeddingRecipe, embedding_recipe
from ..loading.rerank_recipe import rerank_recipe
from ..errors import EngineError, InvalidRequest, ModelLoadError, Overloaded
from ..loading.registry import LoadedModel, context_length, resolve
from .keep_alive import keep_alive_seconds
from .pool import ModelPool
from .prefill_policy import tick_budget
from .slot import ModelSlot
from .ticks import Scheduler

log = logging.getLogger(__name__)

MAX_INPUTS = 2048  # inputs in one request (OpenAI's own limit)
MAX_PENDING = 8  # embedding requests admitted at once; past it, Overloaded (HTTP 429)
CHUNK_TOKENS = 2048  # padded tokens in one model call at most (one chunk between two ticks)
CHUNK_ROWS = 64  # inputs in one model call
# While chat requests decode, an embedding chunk may take this long (sized by the model's measured
# speed), starting at FIRST_TOKENS; never fewer than MIN_TOKENS (a model call has a fixed cost).
TICK_S = 0.5
FIRST_TOKENS = 64
MIN_TOKENS = 16
# Tokens one request may hold in all (every input together): its work is bounded, whatever the
# inputs; OpenAI's own limit is 300,000 per request on models of larger context.
MAX_REQUEST_TOKENS = 65_536

# An input: a string, or token ids.
EmbeddingInput = Union[str, Sequence[int]]


@dataclass(frozen=True)
class Embeddings:
    """A request's answer: one unit vector per input, in input order."""

    vectors: np.ndarray  # float32, shape (inputs, dimensions)
    prompt_tokens: int
    model: str


@dataclass(eq=False)
class EmbeddingHandle:
    """A submitted embedding request; its result is readable from any thread or loop."""

    id: str
    _future: "concurrent.futures.Future[Embeddings]" = field(default_factory=concurrent.futures.Future)
    cancelled: bool = False

    def cancel(self) -> None:
        """Stop the request (its client left): it ends at its next chunk, failing with
        EngineError, and a request not started yet never runs."""
        self.cancelled = True

    def result(self, timeout: float | None = None) -> Embeddings:
        """Block for the vectors; raises the EngineError that failed the request."""
        return self._future.result(timeout)

    async def wait(self) -> Embeddings:
        return await asyncio.wrap_future(self._future)


@dataclass(eq=False)
class _Model:
    """A model embeddings run on: a chat model of the pool or a dedicated one, with what
    validating a request needs (tokenizer, vocabulary, context) known before it loads."""

    name: str
    folder: Path
    recipe: EmbeddingRecipe
    tokenizer: Any
    vocab_size: int
    context_length: int
    hidden_size: int
    asked: str  # how the pool is asked for it (a chat model's name, a dedicated model's folder)
    dedicated: bool = False  # loaded by the queue's own loader (`load_model`)
    longest: int = 0  # its tokenizer's longest entry, where known (a chat model's, kept by it)

    @functools.cached_property
    def token_chars(self) -> int:
        """The most characters one token stands for (its tokenizer's longest entry: reading the
        vocabulary takes ~30 ms, once per model)."""
        if self.longest:
            return self.longest
        vocab = getattr(self.tokenizer, "vocab", None) or {}
        return max((len(t) for t in vocab), default=0) or 1 << 10


@dataclass(eq=False)
class _Long:
    """An input longer than one chunk, embedded a segment per tick (`done` tokens so far) into
    `cache`, its pooled state so far in `pooled`; `reserved`: its cache's bytes in the budget."""

    index: int
    cache: list[Any]
    reserved: int
    done: int = 0
    pooled: Any = None


@dataclass(eq=False)
class _Job:
    handle: EmbeddingHandle
    model: _Model
    rows: list[list[int]]
    dimensions: int | None
    keep_alive: float | None | str  # seconds; _MODEL_DEFAULT: the model's own (pool.default_keep)
    order: list[int] = field(default_factory=list)  # rows by length: less padding per chunk
    slot: ModelSlot | None = None  # the pool's model, held in memory while the job runs
    done: int = 0  # rows of `order` embedded
    vectors: np.ndarray | None = None
    # the model call of a chunk: (model, rows) -> one row of floats each (None: embed them)
    run: Callable[[Any, list[list[int]]], Any] | None = None
    long: _Long | None = None  # the input being embedded in segments, if one is


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


class EmbeddingQueue:
    """The engine's embedding requests and dedicated embedding models (see the module's doc)."""

    def __init__(self, scheduler: Scheduler, pool: ModelPool, keep_alive: float | None,
                 load: Callable[..., LoadedModel]):
        """Chunks run on `scheduler`'s thread, on members of `pool` (a dedicated model loaded by
        `load`); `keep_alive`: the server's default idle time (seconds; None: no unload), which a
        model's settings or a request may change."""
        self._scheduler = scheduler
        self._pool = pool
        self._keep_alive = keep_alive
        self._load_fn = load
        self._lock = threading.Lock()
        self._jobs: deque[_Job] = deque()
        self._dedicated: dict[Path, _Model] = {}  # by folder, once named by a request
        self._loading: set[str] = set()  # models (as asked) the loader thread loads
        self._posted = False  # a chunk is waiting on the scheduler thread
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlxchat-embed-load")
        self._ids = 0
        self._speed: dict[Path, float] = {}  # padded tokens per second, by model folder

    # -- any thread ------------------------------------------------------------------------------
    def submit(self, inputs: EmbeddingInput | Sequence[EmbeddingInput], *, model: str | None = None,
               dimensions: int | None = None, truncate: bool = False, query: bool = False,
               keep_alive: float | str | None = None) -> EmbeddingHandle:
        """Validate and queue; raises InvalidRequest (with `field`) or Overloaded at once.
        `inputs`: a string, token ids, or a list of either. `truncate`: cut inputs longer than
        the model's context instead of refusing them. `query`: prefix the model's query prompt
        (a dedicated model's search-query instruction), else its document prompt."""
        target = self.target(model)
        rows = self.tokenize(target, inputs, truncate, query)
        if dimensions is not None:
            if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
                raise InvalidRequest("dimensions must be a positive integer", field="dimensions",
                                     code="invalid_value")
            if dimensions > target.hidden_size or (dimensions < target.hidden_size
                                                   and not target.recipe.truncatable):
                allowed = (f"1 to {target.hidden_size}" if target.recipe.truncatable
                           else f"only {target.hidden_size} (its vectors are not trained to be "
                                f"truncated)")
                raise InvalidRequest(f"dimensions {dimensions} is not available for "
                                     f"{target.name}: {allowed}", field="dimensions",
                                     code="invalid_value")
        return self.queue(target, rows, dimensions, keep_alive)

    def queue(self, target: "_Model", rows: list[list[int]], dimensions: int | None = None,
              keep_alive: float | str | None = None,
              run: Callable[[Any, list[list[int]]], Any] | None = None) -> EmbeddingHandle:
        """Queue validated token rows for `target` (`run`: the model call of each chunk, None to
        embed); raises Overloaded past MAX_PENDING requests."""
        keep = keep_alive_seconds(keep_alive, _MODEL_DEFAULT)  # type: ignore[arg-type]
        check_request_tokens(sum(map(len, rows)))
        with self._lock:
            if self._scheduler.halted is not None:
                raise EngineError(self._scheduler.halted)
            if len(self._jobs) >= MAX_PENDING:
                raise Overloaded(f"server busy: {len(self._jobs)} embedding requests queued "
                                 f"(limit {MAX_PENDING})", retry_after=1.0)
            self._ids += 1
            handle = EmbeddingHandle(id=f"emb-{self._ids}")
            order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
            self._jobs.append(_Job(handle, target, rows, dimensions, keep, order, run=run))
        self._kick()
        return handle

    def fail(self, reason: str) -> None:
        """End every queued request with `reason` (the engine halted)."""
        with self._lock:
            jobs, self._jobs = list(self._jobs), deque()
        for job in jobs:
            job.handle._future.set_exception(EngineError(reason))

    def close(self) -> None:
        """The engine stops: the loader thread ends."""
        self._loader.shutdown(wait=True, cancel_futures=True)

    def pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def target(self, name: str | None, reranker: bool = False) -> _Model:
        """The model a request names (the default model when none); `reranker`: an LLM
        reranker's folder is also a dedicated model (engine/loading/rerank_recipe.py)."""
        unnamed = name in (None, "", "default")
        slot = self._pool.default if unnamed else self._pool.find(name)
        if slot is not None and slot.lm is not None and not slot.embedding_only:
            return self._chat_model(slot.lm)
        if unnamed:
            raise EngineError("no model is loaded yet")
        if slot is not None and slot.lm is not None:  # a dedicated model the pool knows
            name = str(slot.lm.path)
        try:
            display, folder = resolve(name)
        except ModelLoadError as exc:
            raise InvalidRequest(str(exc), field="model", code=exc.code or "model_not_found") from exc
        folder = folder.resolve()
        with self._lock:
            known = self._dedicated.get(folder)
        if known is not None:
            return known
        recipe = embedding_recipe(folder)
        if not recipe.dedicated and not (reranker and rerank_recipe(folder) is not None):
            default = self._pool.default
            chat = default.name if default is not None else None
            raise InvalidRequest(f"{display} is not an embedding model (it has no "
                                 f"sentence-transformers pooling); name an embedding model or a "
                                 f"loaded chat model such as {chat!r}, which embeds by mean "
                                 f"pooling", field="model", code="model_not_embedding")
        from mlx_lm.utils import load_tokenizer

        config = json.loads((folder / "config.json").read_text())
        text = _text_config(config)
        tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
        target = _Model(display, folder, recipe, tokenizer, int(text["vocab_size"]),
                        context_length(config), int(text["hidden_size"]), asked=str(folder),
                        dedicated=True)
        with self._lock:
            return self._dedicated.setdefault(folder, target)

    def _chat_model(self, lm: LoadedModel) -> _Model:
        text = _text_config(lm.config)
        return _Model(lm.name, lm.path, embedding_recipe(lm.path), lm.tokenizer,
                      int(text["vocab_size"]), lm.context_length, int(text["hidden_size"]),
                      asked=lm.name, longest=max_token_chars(lm))

    def tokenize(self, target: _Model, inputs: Any, truncate: bool, query: bool,
                 field: str = "input") -> list[list[int]]:
        """The token rows of a request's inputs on `target` (`query`: with its query prompt);
        raises InvalidRequest naming `field` (and the input's index in it)."""
        items = _items(inputs, field)
        texts = sum(len(item) for item in items if isinstance(item, str))
        if not truncate and texts > MAX_REQUEST_TOKENS * target.token_chars:  # before encoding
            check_request_tokens(texts // target.token_chars)
        prompt = target.recipe.prompt(query)
        return [_row(target, item, field if len(items) == 1 else f"{field}[{i}]", field, prompt,
                     truncate) for i, item in enumerate(items)]

    def _kick(self) -> None:
        """Have the scheduler thread run the next chunk between two ticks (once posted)."""
        with self._lock:
            if self._posted or not self._jobs:
                return
            self._posted = True
        self._scheduler.soon(self._run_chunk)

    # -- the scheduler thread -------------------------------------------------------------------
    def _run_chunk(self) -> None:
        """One model call for the oldest request, then post the next (one chunk per tick)."""
        with self._lock:
            self._posted = False
            job = self._jobs[0] if self._jobs else None
        if job is None:
            return
        if job.handle.cancelled:  # its client left: no more of its chunks
            self._finish(job, EngineError("the embedding request was cancelled"))
            self._kick()
            return
        try:
            model = self._resident(job)
            if model is None:  # its model loading: the loader posts the next chunk
                return
            self._step(job, model)
        except Exception as exc:  # this request fails alone; the queue goes on
            failure = exc if isinstance(exc, EngineError) else EngineError(
                f"{type(exc).__name__}: {exc}")
            log.error("embedding request %s failed", job.handle.id, exc_info=exc)
            self._finish(job, failure)
        self._kick()

    def _chunk_tokens(self, job: _Job) -> int:
        """Padded tokens in this chunk's model call: while chat requests decode, what the model
        embeds in TICK_S (at most its prefill chunk); CHUNK_TOKENS when none does."""
        assert job.slot is not None  # held by `_resident`
        lm = job.slot.lm
        chunk = min(CHUNK_TOKENS, default_prefill_chunk(lm))
        if self._scheduler.load().running == 0:
            return min(CHUNK_TOKENS, tick_budget(chunk, decoding=False))
        speed = self._speed.get(job.model.folder)
        tokens = FIRST_TOKENS if speed is None else int(speed * TICK_S)
        return max(MIN_TOKENS, min(chunk, tokens))

    def _timed(self, job: _Job, tokens: int, call: Callable[[], Any]) -> Any:
        """`call()` (a model call over `tokens` padded tokens), its speed noted for the model."""
        started = time.monotonic()
        out = call()
        speed = tokens / max(time.monotonic() - started, 1e-6)
        known = self._speed.get(job.model.folder)
        self._speed[job.model.folder] = speed if known is None else (known + speed) / 2
        return out

    def _step(self, job: _Job, model: Any) -> None:
        budget = self._chunk_tokens(job)
        if job.run is None and (job.long is not None or len(job.rows[job.order[job.done]]) > budget):
            self._segment(job, model, budget)
            return
        picked = next_chunk(job.rows, job.order[job.done:], budget)
        rows = [job.rows[i] for i in picked]
        vectors = np.array(self._timed(job, max(map(len, rows)) * len(rows), lambda: (
            job.run(model, rows) if job.run is not None else
            embed_batch(model, rows, job.model.recipe, job.dimensions))))
        if job.vectors is None:
            job.vectors = np.empty((len(job.rows), vectors.shape[1]), dtype=np.float32)
        job.vectors[picked] = vectors
        job.done += len(picked)
        if job.done == len(job.rows):
            self._finish(job, None)

    def _segment(self, job: _Job, model: Any, budget: int) -> None:
        """The next segment of the job's input too long for one chunk (its cache reserved in the
        memory budget on the chat model, from the first segment to the last)."""
        if job.long is None:
            index = job.order[job.done]
            assert job.slot is not None  # held by `_resident`
            reserved = job.slot.footprint.bytes_for(len(job.rows[index]))  # (a dedicated: 0)
            self._pool.reserve(reserved, "this embedding input")
            job.long = _Long(index, make_prompt_cache(model), reserved)
        long, row = job.long, job.rows[job.long.index]
        piece = row[long.done:long.done + budget]
        long.pooled = self._timed(job, len(piece), lambda: pool_segment(
            model, piece, long.cache, job.model.recipe, long.pooled))
        long.done = min(long.done + budget, len(row))
        if long.done < len(row):
            return
        vector = np.array(finish_pooled(long.pooled, len(row), job.model.recipe, job.dimensions))
        self._release_long(job)
        if job.vectors is None:
            job.vectors = np.empty((len(job.rows), vector.shape[1]), dtype=np.float32)
        job.vectors[long.index] = vector[0]
        job.done += 1
        if job.done == len(job.rows):
            self._finish(job, None)

    def _release_long(self, job: _Job) -> None:
        if job.long is not None:
            self._pool.budget.release(job.long.reserved)
            job.long = None

    def _finish(self, job: _Job, failure: Exception | None) -> None:
        self._release_long(job)
        with self._lock:
            self._jobs.remove(job)
        if job.slot is not None:  # the model may leave memory once idle past its keep-alive
            keep = self._pool.default_keep(job.slot) if job.keep_alive is _MODEL_DEFAULT \
                else job.keep_alive
            self._scheduler.unhold(job.slot, keep)  # type: ignore[arg-type]
            job.slot = None
        if failure is not None:
            job.handle._future.set_exception(failure)
        else:
            assert job.vectors is not None
            job.handle._future.set_result(Embeddings(job.vectors, sum(map(len, job.rows)),
                                                     job.model.name))

    def _resident(self, job: _Job) -> Any:
        """The module to run `job` on now (its model held in memory until the job ends), or None
        while the model loads (the loader posts the next chunk)."""
        if job.slot is None:
            target = job.model
            slot = self._pool.find(target.asked)
            if slot is None or slot.lm is None or not self._scheduler.hold(slot):
                if target.asked not in self._loading:
                    self._loading.add(target.asked)
                    self._loader.submit(self._load, target)
                return None
            job.slot = slot
        assert job.slot.lm is not None
        return job.slot.lm.model

    def _load(self, target: _Model) -> None:
        """On the loader thread: bring `target` into the pool's memory, then resume the queue."""
        failure: Exception | None = None
        try:
            self._pool.acquire(target.asked, load=self._load_fn if target.dedicated else None)
        except Exception as exc:  # every request waiting for it fails
            failure = exc if isinstance(exc, EngineError) else ModelLoadError(
                f"cannot load {target.name}: {exc}")
        self._scheduler.soon(lambda: self._loaded(target, failure))

    def _loaded(self, target: _Model, failure: Exception | None) -> None:
        self._loading.discard(target.asked)
        if failure is not None:
            with self._lock:
                waiting = [j for j in self._jobs if j.model.asked == target.asked]
            for job in waiting:
                self._finish(job, failure)
        else:
            log.info("embedding model %s in memory", target.name)
        self._kick()


_MODEL_DEFAULT = "model-default"  # a job's keep_alive when its request gave none


def _items(inputs: Any, field: str) -> list[EmbeddingInput]:
    """A request's `field` (its input) as its list of inputs (a string or token ids alone is
    one)."""
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs
                                   and all(_is_id(t) for t in inputs)):
        items = [inputs]
    elif isinstance(inputs, (list, tuple)):
        items = list(inputs)
    else:
        raise InvalidRequest(f"{field} must be a string, a list of strings, token ids or a "
                             "list of token-id lists", field=field, code="invalid_type")
    if not items:
        raise InvalidRequest(f"{field} is empty: give at least one text", field=field,
                             code="empty_input")
    if len(items) > MAX_INPUTS:
        raise InvalidRequest(f"{len(items)} inputs in one request; the maximum is {MAX_INPUTS}",
                             field=field, code="too_many_inputs")
    return items


def _row(target: _Model, item: Any, where: str, field: str, prompt: str, truncate: bool
         ) -> list[int]:
    """One input's token ids on `target` (`where` names it in a refusal of `field`): a text with
    the model's `prompt` before it, or token ids within its vocabulary; cut to its context if
    `truncate`."""
    if isinstance(item, str):
        if not item:
            raise InvalidRequest(f"{where} is an empty string", field=field, code="empty_input")
        ids = list(target.tokenizer.encode(prompt + item))
    elif isinstance(item, (list, tuple)) and item and all(_is_id(t) for t in item):
        ids = list(item)
        bad = next((t for t in ids if not 0 <= t < target.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{where} has token id {bad}, outside {target.name}'s "
                                 f"vocabulary of {target.vocab_size}", field=field,
                                 code="invalid_token")
    else:
        raise InvalidRequest(f"{where} must be a non-empty string or a non-empty list of "
                             f"token ids", field=field, code="invalid_type")
    if len(ids) > target.context_length:
        if not truncate:
            raise InvalidRequest(f"{where} is {len(ids)} tokens, over {target.name}'s "
                                 f"context of {target.context_length}; shorten it or ask "
                                 f"for truncation", field=field,
                                 code="context_length_exceeded")
        ids = ids[:target.context_length]
    return ids


def check_request_tokens(tokens: int) -> None:
    """Raise InvalidRequest (field `input`) for a request over MAX_REQUEST_TOKENS tokens."""
    if tokens > MAX_REQUEST_TOKENS:
        raise InvalidRequest(f"the request's inputs hold {tokens:,} tokens; at most "
                             f"{MAX_REQUEST_TOKENS:,} in one request: send them in several",
                             field="input", code="too_many_tokens")


def next_chunk(rows: Sequence[Sequence[int]], order: Sequence[int],
               budget: int = CHUNK_TOKENS) -> list[int]:
    """The rows (indices, taken from the front of `order`) of the next model call: as many as
    fit `budget` tokens once padded to the longest of them, at most CHUNK_ROWS, at least one."""
    picked: list[int] = []
    width = 0
    for i in order:
        width = max(width, len(rows[i]))
        if picked and (width * (len(picked) + 1) > budget or len(picked) >= CHUNK_ROWS):
            break
        picked.append(i)
    return picked


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
