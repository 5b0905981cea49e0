"""One wrapper around a loaded model for tests that must see or steer its calls.

`WatchedModel` forwards every call to the real model and records the call's input shape
(rows, tokens). Optionally it
- waits for `gate` before every call (open unless a test clears it), so a test can submit all its
  requests before the next model call however slowly its threads run;
- makes the next call over `n` tokens wait until released (`hold(n)`), on the scheduler thread;
- sleeps `delay` seconds in every call, and `prefill_delay` more in calls over more than one token.

    lm = watched(tiny_llama(), prefill_delay=0.2)
    engine = serve(lm)
    ... lm.model.batch_sizes, lm.model.calls ...
"""

import dataclasses
import threading
import time
from collections import Counter

from engine.model_cache import LocalCaches


class WatchedModel:
    """The real model, recording each call's shape; see the module's docstring for the options."""

    def __init__(self, model, delay: float = 0.0, prefill_delay: float = 0.0):
        self.model, self.delay, self.prefill_delay = model, delay, prefill_delay
        self.gate = threading.Event()
        self.gate.set()
        self.holds: dict[int, tuple[threading.Event, threading.Event]] = {}
        self.shapes: list[tuple[int, ...]] = []

    def hold(self, length: int) -> tuple[threading.Event, threading.Event]:
        """Hold the next call over `length` tokens: (set once the call has started, set it to let
        the call go on)."""
        self.holds[length] = threading.Event(), threading.Event()
        return self.holds[length]

    @property
    def batch_sizes(self) -> list[int]:
        """The rows of every call so far."""
        return [shape[0] for shape in self.shapes]

    @property
    def calls(self) -> list[int]:
        """The tokens per row of every call so far."""
        return [shape[1] for shape in self.shapes]

    def __call__(self, inputs, cache=None, **kwargs):
        assert self.gate.wait(timeout=60)
        held = self.holds.pop(inputs.shape[1], None)
        if held is not None:
            held[0].set()
            assert held[1].wait(timeout=60)
        time.sleep(self.delay + (self.prefill_delay if inputs.shape[1] > 1 else 0.0))
        self.shapes.append(tuple(inputs.shape))
        return self.model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def watched(lm, **options):
    """A copy of the loaded model `lm` whose model is a `WatchedModel` with `options`."""
    return dataclasses.replace(lm, model=WatchedModel(lm.model, **options))


def tokens_of(handle) -> list[int]:
    """The tokens of an engine request's handle, after checking it ended with exactly one `done`."""
    events = list(handle.events(timeout=120))
    assert [e.kind for e in events].count("done") == 1 and events[-1].kind == "done"
    return [e.token for e in events if e.kind == "token"]


class RecordingCaches(LocalCaches):
    """The local protocol, counting each call the engine makes through it."""

    def __init__(self):
        self.calls: Counter[str] = Counter()

    def __getattribute__(self, name):
        if name in ("copy", "restore", "merge", "extend", "extract", "filter", "trimmable",
                    "nbytes"):
            object.__getattribute__(self, "calls")[name] += 1
        return object.__getattribute__(self, name)
