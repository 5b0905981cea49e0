"""Speech requests (transcriptions, translations, speech synthesis), run one at a time on the
engine's speech thread, beside the scheduler thread that serves chat.

`Engine.transcribe` and `Engine.speak` (service.py) hand a request to `SpeechQueue`, which checks
it at once in the caller's thread against the model's files (InvalidRequest for an unknown model,
a language or a voice it does not have; Overloaded past MAX_PENDING requests) and queues it. The
speech thread takes requests in arrival order; a request's work (a Whisper window, a Kokoro
sentence) is mlx-audio's and does not return to the scheduler between steps, so it runs on its own
thread, never on the event loop nor on the scheduler thread, where it would hold every chat stream
for its whole length. On Linux the speech thread runs at a lower CPU priority (niceness NICE) than
the scheduler, so that chat streams keep their pace on a busy machine.

Models: a request names a speech model (a local model's name or folder) or none (the first local
model of its kind, by name). One model of each kind is resident at a time; it loads on the speech
thread when the first request for it comes, its weights count in the engine's one memory budget
while it is loaded, and it unloads after its keep-alive like a chat model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import numpy as np

from ..decoding import speech as voice
from ..errors import EngineError, InvalidRequest, ModelLoadError, Overloaded
from ..loading.memory import needed_bytes, weight_files_bytes
from .budget import MemoryBudget, mib
from ..loading.registry import list_models, resolve
from ..loading.speech import (FAMILIES, INPUT_RATE, SUGGESTED, Kind, SpeechModel, load_speech,
                              missing_packages, speech_family)
from .keep_alive import keep_alive_seconds

log = logging.getLogger(__name__)

MAX_PENDING = 8  # speech requests admitted at once; past it, Overloaded (HTTP 429)
NICE = 10  # the speech thread's niceness on Linux (the scheduler's stays 0)
MAX_TEXT = 4096  # characters a speech request may read out (OpenAI's limit)
SPEEDS = (0.25, 4.0)
TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class _Target:
    """A speech model as a request names it, known from its files before it loads."""

    name: str
    folder: Path
    kind: Kind
    family: str
    config: dict[str, Any]
    voices: tuple[str, ...] = ()

    @property
    def multilingual(self) -> bool:  # Whisper: its languages and the translate task
        return len(voice.whisper_languages(self.config)) > 1

    @property
    def output_rate(self) -> int:
        return int(self.config.get("sample_rate", 24000))


@dataclass(eq=False)
class SpeechHandle:
    """A queued transcription; its result is readable from any thread or loop."""

    id: str
    _future: "concurrent.futures.Future[voice.Transcript]" = field(
        default_factory=concurrent.futures.Future)

    def result(self, timeout: float | None = None) -> voice.Transcript:
        """Block for the transcript; raises the EngineError that failed the request."""
        return self._future.result(timeout)

    async def wait(self) -> voice.Transcript:
        return await asyncio.wrap_future(self._future)


_END = object()


@dataclass(eq=False)
class SpeechStream:
    """Speech being made: float32 waveforms at `sample_rate`, one a sentence, readable as they
    come from a thread (`__iter__`) or a loop (`chunks`). `cancel()` stops it before its next
    sentence (a client that left)."""

    id: str
    sample_rate: int
    voice: str
    model: str
    _chunks: "queue.SimpleQueue[Any]" = field(default_factory=queue.SimpleQueue)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _next(self) -> Any:
        item = self._chunks.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator[np.ndarray]:
        while (item := self._next()) is not _END:
            yield item

    async def chunks(self) -> AsyncIterator[np.ndarray]:
        """The waveforms as they are made; raises the EngineError that ended the stream."""
        while (item := await asyncio.to_thread(self._next)) is not _END:
            yield item


@dataclass(eq=False)
class _Job:
    target: _Target
    keep_alive: float | None
    run: Callable[[SpeechModel], None]
    fail: Callable[[BaseException], None]


@dataclass(eq=False)
class _Resident:
    model: SpeechModel
    reserved: int
    idle_since: float = 0.0
    keep_alive: float | None = None


class SpeechQueue:
    """The engine's speech requests and speech models (see the module's doc)."""

    def __init__(self, budget: MemoryBudget, keep_alive: float | None,
                 halted: Callable[[], str | None] = lambda: None,
                 reserve: Callable[[int, str], None] | None = None):
        """Speech models' weights reserve in `budget` while loaded, through `reserve(nbytes,
        what)` where given (the engine's model pool: idle chat models leave memory for them,
        engine/scheduling/pool.py; it raises Overloaded when nothing can); `keep_alive`: the
        default for requests that give none (seconds; None: no unload); `halted()`: why the
        engine stopped serving, if it did (new requests are refused with it)."""
        self._budget = budget
        self._reserve = reserve or budget.reserve
        self._keep_alive = keep_alive
        self._halted = halted
        self._lock = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._resident: dict[Kind, _Resident] = {}
        self._ids = 0
        self._thread: threading.Thread | None = None
        self._closing = False

    # -- any thread ------------------------------------------------------------------------------
    def installed(self, kind: Kind) -> list[str]:
        """The local models of `kind` ("transcription" or "speech"), by name."""
        return sorted(m.name for m in list_models() if m.speech == kind)

    def transcribe(self, samples: np.ndarray, *, model: str | None = None,
                   task: str = "transcribe", language: str | None = None,
                   prompt: str | None = None, temperature: float | None = None,
                   fallback: bool = True, word_timestamps: bool = False,
                   keep_alive: float | str | None = None) -> SpeechHandle:
        """Queue a transcription (task "transcribe") or a translation into English ("translate")
        of `samples` (float32 mono at INPUT_RATE); raises InvalidRequest or Overloaded at once."""
        if task not in TASKS:
            raise InvalidRequest(f"task must be one of {', '.join(TASKS)}", field="task",
                                 code="invalid_value")
        target = self._target("transcription", model)
        if task == "translate" and not target.multilingual:
            raise InvalidRequest(f"{target.name} is an English-only model: it cannot translate",
                                 field="model", code="translation_unsupported")
        voice.language_code(target.name, voice.whisper_languages(target.config), language)
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if not samples.size:
            raise InvalidRequest("the audio holds no samples", field="file", code="empty_audio")
        if temperature is not None and not 0.0 <= float(temperature) <= 1.0:
            raise InvalidRequest("temperature must be between 0 and 1", field="temperature",
                                 code="invalid_value")
        handle = SpeechHandle(id=self._next_id("stt"))

        def run(sm: SpeechModel) -> None:
            if not handle._future.set_running_or_notify_cancel():
                return
            handle._future.set_result(voice.transcribe(
                sm, samples, task=task, language=language, prompt=prompt,
                temperature=temperature, fallback=fallback, word_timestamps=word_timestamps))

        def fail(exc: BaseException) -> None:
            if not handle._future.done():
                handle._future.set_exception(exc)

        self._queue(_Job(target, keep_alive_seconds(keep_alive, self._keep_alive), run, fail))
        return handle

    def speak(self, text: str, *, model: str | None = None, voice_name: str | None = None,
              speed: float = 1.0, keep_alive: float | str | None = None) -> SpeechStream:
        """Queue speech for `text` in a voice of the model (None: DEFAULT_VOICE, else its first);
        raises
        InvalidRequest or Overloaded at once."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequest("input is empty: give the text to speak", field="input",
                                 code="empty_input")
        if len(text) > MAX_TEXT:
            raise InvalidRequest(f"input is {len(text)} characters; the maximum is {MAX_TEXT}",
                                 field="input", code="string_above_max_length")
        if isinstance(speed, bool) or not SPEEDS[0] <= float(speed) <= SPEEDS[1]:
            raise InvalidRequest(f"speed must be between {SPEEDS[0]} and {SPEEDS[1]}",
                                 field="speed", code="invalid_value")
        target = self._target("speech", model)
        chosen = voice_name or (voice.DEFAULT_VOICE if voice.DEFAULT_VOICE in target.voices
                                else target.voices[0])
        voice.voice_language(target.name, target.voices, chosen)
        stream = SpeechStream(id=self._next_id("tts"), sample_rate=target.output_rate,
                              voice=chosen, model=target.name)

        def run(sm: SpeechModel) -> None:
            for wave in voice.synthesize(sm, text, voice=chosen, speed=float(speed),
                                         stop=lambda: stream.cancelled):
                stream._chunks.put(wave)
            stream._chunks.put(_END)

        self._queue(_Job(target, keep_alive_seconds(keep_alive, self._keep_alive), run,
                         stream._chunks.put))
        return stream

    def voices(self, model: str | None = None) -> tuple[str, ...]:
        """The voices of a text-to-speech model (None: the first installed)."""
        return self._target("speech", model).voices

    def resident_models(self) -> list[str]:
        """The speech models whose weights are loaded now (only the speech thread changes
        them; read without the lock, which the engine's own lock never waits for)."""
        return [r.model.name for r in list(self._resident.values())]

    def reserved(self) -> int:
        """Bytes the resident speech models reserve in the memory budget."""
        return sum(r.reserved for r in list(self._resident.values()))

    def resident_weights(self) -> list[tuple[str, int]]:
        """(name, bytes of weights) of each speech model loaded now."""
        return [(r.model.name, r.reserved) for r in list(self._resident.values())]

    def pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def fail(self, reason: str) -> None:
        """End every queued request with `reason` (the engine halted)."""
        with self._lock:
            jobs, self._jobs = list(self._jobs), deque()
        for job in jobs:
            job.fail(EngineError(reason))

    def close(self) -> None:
        """The engine stops: queued requests fail, the speech thread ends once its request does."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self.fail("the server is shutting down")
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _next_id(self, prefix: str) -> str:
        with self._lock:
            self._ids += 1
            return f"{prefix}-{self._ids}"

    def _target(self, kind: Kind, name: str | None) -> _Target:
        why = missing_packages()
        if why:
            raise ModelLoadError(why, code="voice_extra_missing")
        if name in (None, "", "default"):
            found = self.installed(kind)
            if not found:
                what = "speech-to-text" if kind == "transcription" else "text-to-speech"
                raise InvalidRequest(f"no {what} model is installed: `mlxchat pull "
                                     f"{SUGGESTED[kind]}` downloads one", field="model",
                                     code="model_not_found")
            name = found[0]
        try:
            display, folder = resolve(name)
        except ModelLoadError as exc:
            raise InvalidRequest(str(exc), field="model", code=exc.code or "model_not_found") from exc
        family = speech_family(folder)
        if family is None or FAMILIES[family] != kind:
            what = "speech-to-text" if kind == "transcription" else "text-to-speech"
            raise InvalidRequest(f"{display} is not a {what} model (those installed: "
                                 f"{', '.join(self.installed(kind)) or 'none'})", field="model",
                                 code="model_not_found")
        config = json.loads((folder / "config.json").read_text())
        voices = tuple(sorted(p.stem for p in (folder / "voices").glob("*.safetensors")))
        if kind == "speech" and not voices:
            raise InvalidRequest(f"{display} has no voice packs (voices/*.safetensors)",
                                 field="model", code="model_not_found")
        return _Target(display, folder.resolve(), kind, family, config, voices)

    def _queue(self, job: _Job) -> None:
        with self._lock:
            if self._halted() is not None:
                raise EngineError(self._halted() or "")
            if self._closing:
                raise EngineError("the server is shutting down")
            if len(self._jobs) >= MAX_PENDING:
                raise Overloaded(f"server busy: {len(self._jobs)} speech requests queued (limit "
                                 f"{MAX_PENDING})", retry_after=2.0)
            self._jobs.append(job)
            self._spawn()
            self._lock.notify_all()

    def _spawn(self) -> None:
        """Under the lock: a speech thread for the queued requests, unless one is serving."""
        if self._thread is None and self._jobs and not self._closing:
            self._thread = threading.Thread(target=self._serve, name="mlxchat-speech",
                                            daemon=True)
            self._thread.start()

    # -- the speech thread -----------------------------------------------------------------------
    def _serve(self) -> None:
        """A speech thread: requests in order until the engine stops, or until it unloads a
        model: a model loaded on a thread after another was freed there crashes MLX 0.32.4 (a
        read of freed memory in its next gather, seen with Kokoro reloaded after its keep-alive;
        the main thread is spared), so a fresh thread serves from then on."""
        _lower_priority()
        try:
            while (job := self._take()) is not None:
                if self._needs_unload(job.target):
                    self._unload(job.target.kind)
                    with self._lock:
                        self._jobs.appendleft(job)
                    return
                self._run(job)
        finally:
            with self._lock:
                self._thread = None
                self._spawn()

    def _run(self, job: _Job) -> None:
        try:
            job.run(self._load(job.target))
        except Exception as exc:  # this request fails alone; the queue goes on
            log.error("speech request failed", exc_info=exc)
            job.fail(exc if isinstance(exc, EngineError)
                     else EngineError(f"{type(exc).__name__}: {exc}"))
        finally:
            resident = self._resident.get(job.target.kind)
            if resident is not None:
                resident.idle_since, resident.keep_alive = time.monotonic(), job.keep_alive

    def _needs_unload(self, target: _Target) -> bool:
        """Whether `target` replaces a resident model of its kind (another folder)."""
        resident = self._resident.get(target.kind)
        return resident is not None and resident.model.path != target.folder

    def _take(self) -> _Job | None:
        """The next request; None when the engine stops or when this thread unloaded the models
        idle past their keep-alive while it waited (its successor takes the next request)."""
        with self._lock:
            while True:
                if self._closing:
                    return None
                if self._jobs:
                    return self._jobs.popleft()
                now = time.monotonic()
                expired = [k for k, r in self._resident.items() if r.keep_alive is not None
                           and now - r.idle_since >= r.keep_alive]
                if expired:
                    break
                waits = [r.idle_since + r.keep_alive - now for r in self._resident.values()
                         if r.keep_alive is not None]
                self._lock.wait(min(waits) if waits else None)
        for kind in expired:
            self._unload(kind)
        return None

    def _load(self, target: _Target) -> SpeechModel:
        """On the speech thread: `target` as loaded, now or before."""
        resident = self._resident.get(target.kind)
        if resident is not None:  # (another model of its kind was unloaded by the last thread)
            return resident.model
        guess = needed_bytes(weight_files_bytes(target.folder.glob("*")))
        if not self._budget.fits(guess):
            raise ModelLoadError(f"{target.name} needs about {mib(guess)}, over the memory "
                                 f"budget of {mib(self._budget.total)}", code="insufficient_memory")
        self._reserve(guess, f"loading {target.name}")
        try:
            sm = load_speech(target.name, target.folder)
        except BaseException:
            self._budget.release(guess)
            raise
        # the weights as loaded (float32 on the CPU) replace the guess
        if sm.weight_bytes < guess:
            self._budget.release(guess - sm.weight_bytes)
        elif sm.weight_bytes > guess:
            try:
                self._reserve(sm.weight_bytes - guess, f"{target.name} as loaded")
            except Overloaded:
                self._budget.release(guess)
                raise
        log.info("speech model %s loaded (%d MiB)", sm.name, sm.weight_bytes >> 20)
        with self._lock:
            self._resident[target.kind] = _Resident(sm, sm.weight_bytes, time.monotonic())
        return sm

    def _unload(self, kind: Kind) -> None:
        """On the speech thread, which then ends (see `_serve`): drop the resident model of
        `kind` and its memory reservation."""
        with self._lock:  # the model leaves the listing and the budget together (its lock is innermost)
            resident = self._resident.pop(kind)
            self._budget.release(resident.reserved)
        log.info("unloading speech model %s", resident.model.name)
        del resident
        gc.collect()  # (MLX's buffer cache is kept: emptying it here crashes MLX 0.32.4, see
        # engine/decoding/speech.py's _keep_buffer_cache)


def _lower_priority() -> None:
    """Run this thread (and the MLX stream threads it starts) at niceness NICE, where the OS
    allows it (Linux sets a niceness per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed
        pass


__all__ = ["INPUT_RATE", "MAX_PENDING", "SpeechHandle", "SpeechQueue", "SpeechStream"]
