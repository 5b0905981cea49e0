"""The scheduler: one thread runs every model of the pool (engine/scheduling/pool.py) and all MLX
work of their requests, and moves the admitted requests on, one tick at a time.

The `Engine` (engine/scheduling/service.py) validates and admits requests and hands them here; the
`Scheduler` holds them (`loading_draft`, queued, running), each with the pool's model it runs on
(`handle.slot`), runs the loop on its thread and ends each request with exactly one `done` event.
Besides ticks, the loop runs control tasks once no request is running or queued (`call`: a
measurement, a reload with other load-time options), short tasks between two ticks (`soon`: a
loaded draft, an embedding chunk), and the idle unload of models past their keep-alive. A request
whose model is loading waits queued; it starts once the weights are in memory.

Its lock is also the pool's residency lock: a model leaves memory (`retire`) only while no
admitted request and no other user (`hold`) has it, checked and decided under this lock, so that
admission and eviction never cross.

Each tick, for each model with running requests, prefills up to a budget of prompt tokens (oldest request first, short prompts that wait
together in shared model calls; engine/scheduling/prefill_policy.py), runs the solo steps that
cannot be batched (cancellations, speculative decoding, a lone decoder) and one batched decode
step for every other decoding request of that model (engine/scheduling/batch.py): two models'
streams take turns tick by tick. The requests' model caches are reserved in the engine's
`MemoryBudget` (engine/scheduling/budget.py) from admission to their end, when the scheduler
releases them; where the budget has no room, the pool evicts idle models first.
"""

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .batch import DecodeBatch, can_prefill_together, prefill_together
from .budget import MemoryBudget
from .prefill_policy import tick_budget
from .requests import RequestHandle
from .slot import ModelSlot
from .stats import StatsRecorder
from ..decoding.generate import Generation
from ..errors import EngineError
from ..events import FINAL_STATES, Event, FinishReason, RequestState, Timings

if TYPE_CHECKING:
    from .pool import ModelPool

log = logging.getLogger(__name__)

# The idle scheduler re-checks at least this often (a wait must stay under threading.TIMEOUT_MAX).
WAIT_MAX_S = 3600.0
# Requests submitted together (parallel calls of one client, a burst of streams) start together:
# an idle engine admits its first request once no other has arrived for ADMIT_QUIET_S, waiting at
# most ADMIT_WAIT_S, so that the burst prefills in shared calls and decodes as one batch.
ADMIT_QUIET_S = 5e-4
ADMIT_WAIT_S = 5e-3
# While requests run, idle models past their keep-alive are looked for this often.
EXPIRY_CHECK_S = 0.5

Rider = tuple[Generation, list[int]]  # a prompt chunk riding in the batch's decode step


@dataclass(frozen=True)
class Load:
    """The scheduler's requests at one moment, as admission and status read them."""

    running: int
    queued: int
    preparing: int  # loading_draft
    batch_rows: int  # decoding requests sharing a batched model call (every model's)
    reserved_bytes: int  # the memory budget's reservations
    switching: bool  # a control task (a model switch) waits for the requests to drain

    @property
    def admitted(self) -> int:
        return self.running + self.queued + self.preparing


class Scheduler:
    """The admitted requests of the pool's models and the thread that serves them."""

    def __init__(self, pool: "ModelPool", budget: MemoryBudget, *, max_running: int,
                 batching: bool = True, stats: StatsRecorder | None = None,
                 on_halt: Callable[[str], None] = lambda reason: None):
        """`max_running`: at most this many requests run (and share batched steps) at once, the
        others wait queued. `stats`: records each request as it ends (engine/scheduling/stats.py).
        `on_halt(reason)`: called once if the engine halts (see `halt`)."""
        self.pool = pool
        self.budget = budget
        self.stats = stats if stats is not None else StatsRecorder()
        self.max_running = max_running
        self.batching = batching
        self._on_halt = on_halt
        self._queued: deque[RequestHandle] = deque()
        self._running: list[RequestHandle] = []
        self._preparing: list[RequestHandle] = []  # loading_draft
        # SimpleQueues: the loop checks both every tick, and their `empty` is one C call
        self._control: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._soon: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._halted: str | None = None  # why serving stopped for good (see `halt`)
        self._next_expiry_check = 0.0
        self._busy_since: float | None = None  # when the tick or task running now began

    # -- from any thread -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mlxchat-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop once every admitted request has ended (cancel them first to hurry it)."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            # a halted scheduler's thread may be blocked for good (see `halt`)
            self._thread.join(timeout=1 if self._halted else 30)

    @property
    def thread_id(self) -> int | None:
        """The scheduler thread's native id (as /proc and profilers name it), once started."""
        return self._thread.native_id if self._thread is not None else None

    @property
    def halted(self) -> str | None:
        """Why serving stopped for good, or None."""
        return self._halted

    def busy_s(self) -> float:
        """How long the tick or between-ticks task (an embedding chunk) running now has run (0
        when none is): a scheduler stuck in one piece of work shows here (`/health`). Control
        tasks (a model switch) are not counted: the engine reports those as loading."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def halt(self, reason: str) -> None:
        """Fail every admitted request with `reason` and stop serving; safe from any thread. For
        failures the scheduler thread cannot recover from, such as a rank of a sharded model
        gone: that thread may stay blocked in a collective that never returns, so this does not
        wait for it."""
        with self._wake:
            if self._halted is not None:
                return
            self._halted = reason
            self._on_halt(reason)
            handles = self._preparing + list(self._queued) + self._running
            self._preparing, self._running = [], []
            self._queued.clear()
            for h in handles:
                self._end(h, "failed", [Event("done", finish_reason="failed", error=reason,
                                              usage=h.usage, timings=Timings())])
            self._wake.notify_all()

    def load(self) -> Load:
        """A consistent reading of the requests and reservations."""
        with self._lock:
            return self._load()

    def _load(self) -> Load:
        rows = sum(len(b) for b in (s.batch for s in self.pool.resident()) if b is not None)
        return Load(running=len(self._running), queued=len(self._queued),
                    preparing=len(self._preparing), batch_rows=rows,
                    reserved_bytes=self.budget.reserved, switching=not self._control.empty())

    def admitted(self) -> list[RequestHandle]:
        """Every request admitted and not ended yet (loading its draft, queued or running)."""
        with self._lock:
            return self._preparing + list(self._queued) + self._running

    def admit(self, handle: RequestHandle, admission: Callable[[Load], None],
              prepare: Callable[[], None] | None = None) -> None:
        """Admit `handle`: `admission(load)` (under the lock, with the requests as they are)
        raises to refuse it, then its `kv_bytes` are reserved in the memory budget, idle models
        evicted first where it has no room (else Overloaded is raised). A handle with its
        generation is queued and accepted at once; otherwise it waits in `loading_draft` while
        `prepare()` (called under the lock) arranges for its generation, and `prepared` queues
        it."""
        with self._wake:
            if self._halted is not None:
                raise EngineError(self._halted)
            admission(self._load())
            if not self.budget.try_reserve(handle.kv_bytes):
                self.pool.evict_for(handle.kv_bytes, handle.slot)  # under this lock
                self.budget.reserve(handle.kv_bytes, "this request")
            if prepare is None:
                handle._enter("queued")
                self._queued.append(handle)
            else:
                handle._enter("loading_draft")
                self._preparing.append(handle)
                prepare()
            self._wake.notify_all()
        if prepare is None:
            handle._accepted.set_result(None)

    def prepared(self, handle: RequestHandle, generation: Generation | None,
                 failure: Exception | None) -> None:
        """A request that waited in `loading_draft` is queued with its `generation`, or ends:
        failed with `failure`, or cancelled (no generation, or cancelled meanwhile)."""
        with self._wake:
            self._preparing.remove(handle)
            if generation is None or handle.cancel_requested:
                reason: FinishReason = "cancelled" if failure is None else "failed"
                self._end(handle, reason, [Event("done", finish_reason=reason,
                                                 error=str(failure) if failure else None)])
            else:
                handle.generation = generation
                handle._enter("queued")
                self._queued.append(handle)
            self._wake.notify_all()
        if failure is not None:
            handle._accepted.set_exception(failure)
        else:
            handle._accepted.set_result(None)

    def cancelled(self, handle: RequestHandle) -> None:
        """`handle.cancel()` was called: a request not started yet ends now (a running one ends at
        its next step)."""
        with self._wake:
            if handle in self._queued:  # never started: end it here, nothing to release
                self._queued.remove(handle)
                self._end(handle, "cancelled", [Event("done", finish_reason="cancelled",
                                                      usage=handle.usage, timings=Timings())])
            self._wake.notify_all()

    def wake(self) -> None:
        """Have the loop look again (a model's keep-alive changed)."""
        with self._wake:
            self._wake.notify_all()

    def soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the scheduler thread between two ticks; returns at once."""
        with self._wake:
            self._soon.put(fn)
            self._wake.notify_all()

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the scheduler thread once no request is running or queued, and wait for it
        (requests arriving meanwhile are refused with Overloaded); raises what `fn` raised."""
        if self._thread is None or not self._thread.is_alive():
            raise EngineError("the engine is not running")
        done = threading.Event()
        failure: list[BaseException] = []

        def task() -> None:
            try:
                fn()
            except BaseException as exc:  # handed back to the caller below
                failure.append(exc)
            finally:
                done.set()

        with self._wake:
            self._control.put(task)
            self._wake.notify_all()
        while not done.wait(0.5):
            if self._halted is not None or not self._thread.is_alive():
                raise EngineError(self._halted or "the engine's scheduler stopped")
        if failure:
            raise failure[0]

    # -- the pool's residency, under the lock ----------------------------------------------------
    def busy(self, slot: ModelSlot) -> bool:
        """Under the lock: whether a request admitted and not ended runs on `slot`, or another
        user holds it."""
        return slot.holds > 0 or any(h.slot is slot for h in self._preparing) or \
            any(h.slot is slot for h in self._queued) or any(h.slot is slot for h in self._running)

    def retire(self, slot: ModelSlot) -> bool:
        """If `slot`'s weights are in memory and nothing uses them, mark them gone (the caller
        then unloads them, `ModelSlot.unload`); False when they stay."""
        with self._lock:
            return self.retire_locked(slot)

    def retire_locked(self, slot: ModelSlot) -> bool:
        """`retire` for a caller that holds the lock."""
        return not self.busy(slot) and slot.retire()

    def hold(self, slot: ModelSlot) -> bool:
        """Keep `slot`'s weights in memory for a user besides the requests (an embedding job)
        until `unhold`; False (nothing held) when they are not in memory."""
        with self._lock:
            if not slot.resident:
                return False
            slot.holds += 1
            return True

    def unhold(self, slot: ModelSlot, keep_alive: float | None) -> None:
        """The user of `hold` is done: the model stays loaded `keep_alive` seconds from now."""
        with self._wake:
            slot.holds -= 1
            slot.touch(keep_alive)
            self._wake.notify_all()

    def loaded(self, slot: ModelSlot) -> None:
        """`slot`'s weights came (on a loader thread): start the requests that waited for them,
        with its new prefix cache."""
        with self._wake:
            for handle in list(self._queued) + self._preparing:
                if handle.slot is slot and handle.generation is not None:
                    handle.generation.prefix_cache = slot.prefix_cache
            self._wake.notify_all()

    def fail_waiting(self, slot: ModelSlot, failure: Exception) -> None:
        """`slot`'s weights could not load: the queued requests that waited for them fail."""
        with self._wake:
            waiting = [h for h in self._queued if h.slot is slot]
            for h in waiting:
                self._queued.remove(h)
                self._end(h, "failed", [Event("done", finish_reason="failed", error=str(failure),
                                              usage=h.usage, timings=Timings())])
            self._wake.notify_all()

    # -- the scheduler thread --------------------------------------------------------------------
    def _run(self) -> None:
        """The scheduler thread. Whatever escapes the loop halts the engine (every request fails
        with the reason, new ones are refused and /health says so) rather than leaving requests
        waiting on a thread that is gone."""
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the thread must not die silently
            log.critical("the scheduler thread stopped", exc_info=exc)
            self.halt(f"the engine's scheduler stopped ({type(exc).__name__}: {exc}); "
                      f"restart the server")

    def _serve(self) -> None:
        """The loop: between ticks the tasks posted by `soon`, then one piece of work at a time
        (an idle unload, a control task such as a model switch, or a tick of the admitted
        requests)."""
        while self._halted is None:
            for _ in range(self._soon.qsize()):  # those posted before this tick: one chunk each
                self._busy_since = time.monotonic()
                self._soon.get()()
                self._busy_since = None
            work = self._next_work()
            if work is _STOP:
                return
            if work is _UNLOAD:
                self.pool.expire()
            elif callable(work):
                work()
            elif work:
                self._busy_since = time.monotonic()
                self._serve_tick(work)
                self._busy_since = None

    def _next_work(self) -> "object | Callable[[], None] | list[RequestHandle]":
        """Under the lock, once there is something to do: _STOP, _UNLOAD, a control task, or the
        running requests (the queued ones admitted as far as `max_running` allows); [] when only
        the tasks posted by `soon` wait. One lock section per tick: this runs once per token."""
        with self._wake:
            if self._idle_wait():
                return _UNLOAD
            if self._stopping and not (self._running or self._queued or self._preparing) \
                    and self._soon.empty():
                return _STOP
            if not self._running and not self._queued and not self._control.empty():
                return self._control.get()
            if not self._running and self._queued:
                self._settle()
            if self._queued and len(self._running) < self.max_running:
                for handle in list(self._queued):  # those whose model is in memory, in order
                    if len(self._running) >= self.max_running:
                        break
                    if handle.slot is None or handle.slot.resident:
                        self._queued.remove(handle)
                        handle._enter("prefill")
                        self._running.append(handle)
            return list(self._running)

    def _startable(self) -> bool:
        """Under the lock: a queued request whose model is in memory waits."""
        return any(h.slot is None or h.slot.resident for h in self._queued)

    def _idle_wait(self) -> bool:
        """Under the lock: wait until there is work; True when an idle model should unload (also
        while other models run, checked every EXPIRY_CHECK_S)."""
        if self._running and time.monotonic() >= self._next_expiry_check:
            self._next_expiry_check = time.monotonic() + EXPIRY_CHECK_S
            left = self._until_unload()
            if left is not None and left <= 0:
                return True
        # Stopping waits for the drafts being loaded: each request ends with its event.
        while not ((self._stopping and not self._preparing) or self._startable() or self._running
                   or (not self._control.empty() and not self._queued)
                   or not self._soon.empty()):
            wait_s = self._until_unload()
            if wait_s is not None and wait_s <= 0:
                return True
            self._wake.wait(None if wait_s is None else min(wait_s, WAIT_MAX_S))
        return False

    def _until_unload(self) -> float | None:
        """Under the lock, with nothing running: seconds until an idle model should be unloaded
        (<= 0: now), or None when every model stays (also while serving stops)."""
        if self._stopping:
            return None
        return self.pool.until_expiry()

    def _settle(self) -> None:
        """Under the lock: wait while requests keep arriving (see ADMIT_QUIET_S)."""
        deadline = time.monotonic() + ADMIT_WAIT_S
        while len(self._queued) < self.max_running and not self._stopping:
            seen = len(self._queued)
            quiet_until = time.monotonic() + ADMIT_QUIET_S
            while len(self._queued) == seen and (left := min(quiet_until, deadline) - time.monotonic()) > 0:
                self._wake.wait(left)
            if len(self._queued) == seen or time.monotonic() >= deadline:
                return

    def _serve_tick(self, running: list[RequestHandle]) -> None:
        """One tick of the running requests, model by model (two models' requests take turns,
        tick by tick); a tick-wide failure fails that model's requests and serving goes on."""
        first = running[0].slot
        groups = [running] if all(h.slot is first for h in running) else _by_slot(running)
        for handles in groups:
            slot = handles[0].slot
            try:
                if not slot.resident:  # never: a model with requests is not unloaded
                    raise EngineError(f"{slot.name} is not loaded")
                self._tick(slot, handles)
            except Exception as exc:  # its requests fail, serving goes on
                log.error("a scheduler tick failed", exc_info=exc)
                for h in handles:
                    if h.state not in FINAL_STATES:
                        self._advance(h, exc)

    def _tick(self, slot: ModelSlot, running: list[RequestHandle]) -> None:
        solo = self._regroup(slot, running)
        prefilling = [h for h in solo if h.generation.in_prefill and not h.cancel_requested]
        decoding = len(prefilling) < len(running)
        rider = None
        if prefilling:
            chunk = prefilling[0].generation.prefill_chunk
            budget = tick_budget(chunk, decoding)
            rider = self._rider(slot, prefilling[0], budget) if decoding else None
            if rider is None:
                self._prefill(prefilling, budget, chunk)
        for h in solo:
            if h not in prefilling:
                self._step(h)
        if len(slot.batch):
            self._step_batch(slot, running, rider)

    def _rider(self, slot: ModelSlot, handle: RequestHandle, budget: int) -> Rider | None:
        """The oldest waiting prompt's next chunk (at most `budget` tokens), to ride in the batch's
        step (a mixed step: engine/decoding/mixed.py), or None when it cannot (no batch, a model or
        cache the mixed step does not know, batching off): then it prefills in calls of its own."""
        batch, gen = slot.batch, handle.generation
        if not (self.batching and batch is not None and batch.mixed and len(batch)) or gen.done:
            return None
        try:
            tokens = gen.prefill_input(budget, with_last=gen.last_with_chunk)
        except Exception as exc:  # e.g. its prefix-cache fetch: this request fails alone
            self._advance(handle, exc)
            return None
        return (gen, tokens) if batch.can_carry(gen) else None

    def _regroup(self, slot: ModelSlot, running: list[RequestHandle]) -> list[RequestHandle]:
        """Move the decoders that can share the batched step into `slot`'s batch and the others
        out of it; returns the requests that step alone this tick."""
        batch = slot.batch
        # each request's state read once per tick (this runs for every token)
        states = [(h, h.generation.batchable, h.generation in batch) for h in running]
        # A lone decoder runs solo: its plain cache and pipelined step beat a one-row batch.
        use_batch = self.batching and slot.footprint.batchable and \
            sum(ok for _, ok, _ in states) >= 2
        joining, leaving, solo = [], [], []
        for h, ok, inside in states:
            if inside and not (ok and use_batch):
                leaving.append(h.generation)
                solo.append(h)
            elif not inside and ok and use_batch:
                joining.append(h.generation)
            elif not inside:
                solo.append(h)
        if leaving:
            batch.leave(leaving)
            self._release_padding(slot)
        if joining:
            taken = self._reserve_padding(slot, joining)
            solo += [h for h in running if h.generation in joining and h.generation not in taken]
            if taken:
                batch.join(taken)
        return solo

    def _reserve_padding(self, slot: ModelSlot, joining: list[Generation]) -> list[Generation]:
        """The joiners whose padding the memory budget has room for, the batch's reservation grown
        to hold it (`DecodeBatch.padding_need`), shortest first (a long row beside short ones is
        the padding); the others step alone (their own reservation holds their cache) and try
        again next tick."""
        batch, taken = slot.batch, []
        for gen in sorted(joining, key=lambda g: len(g.fed) + g.params.max_tokens - len(g.generated)):
            need = batch.padding_need(slot.footprint, taken + [gen])
            if need <= batch.reserved or self.budget.try_reserve(need - batch.reserved):
                batch.reserved = max(batch.reserved, need)
                taken.append(gen)
        if not len(batch) and len(taken) == 1:  # a lone decoder runs solo (see _regroup)
            self._release_padding(slot)
            return []
        return taken

    def _release_padding(self, slot: ModelSlot) -> None:
        """Give back the part of the batch's reservation its rows no longer need."""
        batch = slot.batch
        if batch is None:
            return
        need = batch.padding_need(slot.footprint) if len(batch) else 0
        if need < batch.reserved:
            self.budget.release(batch.reserved - need)
            batch.reserved = need

    def _step_batch(self, slot: ModelSlot, running: list[RequestHandle],
                    rider: Rider | None = None) -> None:
        """One batched decode step of `slot`'s batch (carrying `rider`'s prefill chunk, if any); a
        failing shared model call fails every row and the rider, and the engine serves on with a
        fresh batch."""
        batch = slot.batch
        by_gen = {id(h.generation): h for h in running}
        try:
            results = batch.step(rider)
        except Exception as exc:  # the shared model call: every row fails, the engine serves on
            results = [(gen, exc) for gen in batch.rows + ([rider[0]] if rider else [])]
            self.budget.release(batch.reserved)
            slot.batch = DecodeBatch(batch.model, batch.caches)
        finished = [gen for gen, _ in results if gen.done and gen in slot.batch]
        if finished:
            slot.batch.leave(finished)
            self._release_padding(slot)
        for gen, outcome in results:
            self._advance(by_gen[id(gen)], outcome)

    def _prefill(self, prefilling: list[RequestHandle], budget: int, chunk: int) -> None:
        """Prefill within `budget` prompt tokens (engine/scheduling/prefill_policy.py), oldest
        prompts first: the prompts that can share a model call in calls of several
        (`_prefill_together`, at most `chunk` tokens a call), the others each in its own calls,
        finishing one before starting the next."""
        if self.batching:
            budget = self._prefill_together(prefilling, budget, chunk)
        for h in prefilling:
            gen = h.generation
            while budget > 0 and gen.in_prefill and not gen.done and not h.cancel_requested:
                left = gen.prefill_left
                self._step(h, prefill_limit=budget)
                budget -= max(left - gen.prefill_left, 1)
            if budget <= 0:
                return

    def _prefill_together(self, prefilling: list[RequestHandle], budget: int, chunk: int) -> int:
        """Short prompts arriving together prefill together: a call feeds, oldest first, the
        next chunks of as many prompts as fit in one chunk's worth of tokens (right-padded,
        engine/scheduling/batch.py `prefill_together`; a long prompt fills a call alone, as
        before), and once no body is left within the budget, one call feeds all of them their last
        prompt token and samples their first tokens, so they join the decode batch at once (as
        mlx-lm's `BatchGenerator` starts its batch). A prompt's chunks end at the stops of its
        solo prefill. Returns the budget left."""
        alone: set[int] = set()

        def ready(tail: bool) -> list[tuple[RequestHandle, list[int]]]:
            nonlocal budget
            group, room = [], chunk
            for h in prefilling:
                gen = h.generation
                if id(h) in alone or gen.done or not gen.in_prefill or h.cancel_requested:
                    continue
                if not tail and (budget <= 0 or room <= 0):
                    continue
                try:
                    tokens = gen.prefill_input(max(min(budget, chunk), 1))
                except Exception as exc:  # e.g. its prefix-cache fetch: this request fails alone
                    self._advance(h, exc)
                    continue
                if (gen.prefill_left == 1) != tail:
                    continue
                if not can_prefill_together(gen):
                    alone.add(id(h))
                    continue
                if not tail and group and len(tokens) > room:  # a later call takes it
                    continue
                group.append((h, tokens))
                budget -= len(tokens)
                room -= len(tokens)
            return group

        while body := ready(tail=False):
            self._run_together(body)
        self._run_together(ready(tail=True))  # every prompt down to its last token: one each
        return max(budget, 0)

    def _run_together(self, group: list[tuple[RequestHandle, list[int]]]) -> None:
        """One call for `group`'s chunks; its merged cache is every row as long as the longest
        (left-padded), beyond what the rows' own reservations hold: that padding is reserved in
        the memory budget for the call, and where the budget has no room the longest prompt's
        chunk runs alone first (and so on)."""
        if len(group) == 1:  # alone it runs as its own prefill step does
            h, tokens = group[0]
            self._step(h, prefill_limit=len(tokens))
            return
        if not group:
            return
        footprint = group[0][0].slot.footprint
        lengths = [len(h.generation.fed) + len(t) for h, t in group]
        padding = sum(footprint.bytes_for(max(lengths)) - footprint.bytes_for(n) for n in lengths)
        if padding > 0 and not self.budget.try_reserve(padding):
            longest = lengths.index(max(lengths))
            self._run_together([group[longest]])
            self._run_together(group[:longest] + group[longest + 1:])
            return
        lm = group[0][0].slot.lm
        try:
            failures = prefill_together(lm.model, lm.caches, [(h.generation, t) for h, t in group])
            outcomes: list[list[Event] | Exception] = [f if f is not None else [] for f in failures]
        except Exception as exc:  # the shared model call: every request in it fails
            outcomes = [exc] * len(group)
        finally:
            self.budget.release(max(padding, 0))
        for (h, _), outcome in zip(group, outcomes):
            self._advance(h, outcome)

    def _step(self, handle: RequestHandle, prefill_limit: int | None = None) -> None:
        try:
            outcome: list[Event] | Exception = handle.generation.step(prefill_limit)
        except Exception as exc:
            outcome = exc
        self._advance(handle, outcome)

    def _advance(self, handle: RequestHandle, outcome: list[Event] | Exception) -> None:
        """Publish one step's events (or its failure) and move the request's state on."""
        if self._halted is not None:  # `halt` ended every request already
            return
        gen = handle.generation
        if isinstance(outcome, Exception):  # isolated to this request
            log.error("request %s failed", handle.id, exc_info=outcome)
            gen.finish_reason = "failed"
            events = [Event("done", finish_reason="failed",
                            error=f"{type(outcome).__name__}: {outcome}",
                            usage=gen.usage(), timings=gen.timings())]
        else:
            events = outcome
        now = time.time()
        for event in events:
            if event.kind == "token":
                handle.times.setdefault("first_token", now)
                handle.times["last_token"] = now
        if handle.state == "prefill" and not gen.in_prefill:
            handle._enter("decoding")
        if not gen.done:
            for event in events:
                handle._publish(event)
            return
        batch = handle.slot.batch
        if batch is not None and gen in batch:
            batch.leave([gen])
            self._release_padding(handle.slot)
        gen.release()
        state = {"cancelled": "cancelled", "failed": "failed"}.get(gen.finish_reason, "finished")
        with self._wake:
            self._running.remove(handle)
            self._end(handle, state, events)

    def _end(self, handle: RequestHandle, state: RequestState, events: list[Event]) -> None:
        """Under the lock: the request leaves admission (its reservation is released), its last
        events are published."""
        self.budget.release(handle.kv_bytes)
        if handle.slot is not None:
            handle.slot.touch(handle.keep_alive)
        handle.error = events[-1].error if events else None
        handle.finish_reason = events[-1].finish_reason if events else state
        handle._enter(state)
        self.stats.record(state, events[-1].usage if events else handle.usage, handle.times)
        for event in events:
            handle._publish(event)


def _by_slot(running: list[RequestHandle]) -> list[list[RequestHandle]]:
    """The running requests grouped by their model, in order."""
    groups: dict[int, list[RequestHandle]] = {}
    for h in running:
        groups.setdefault(id(h.slot), []).append(h)
    return list(groups.values())


_STOP, _UNLOAD = object(), object()  # the loop's work besides tasks and ticks
