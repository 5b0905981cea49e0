"""Running speech models: a transcription of 16 kHz samples, and speech synthesised from text in
pieces that can be played while the next is made.

Transcription is mlx-audio's own Whisper `generate` (its 30-second windows, temperature fallback,
timestamps and language detection), with the request's options mapped onto it; synthesis is
Kokoro's own step (`KokoroPipeline.infer`: phonemes and a voice pack to a waveform) on phonemes
from espeak-ng through misaki, one sentence (at most KOKORO_PHONEMES phonemes) at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..errors import InvalidRequest
from ..loading.speech import SpeechModel

# Whisper's fallback: each retry of a window that decoded badly is this much hotter (0, 0.2, ... 1).
FALLBACK_STEP = 0.2
MULTILINGUAL_VOCAB = 51865  # a Whisper vocabulary this large holds 99 languages (100 from 51866)
KOKORO_PHONEMES = 510  # Kokoro's context, less its two pads
DEFAULT_VOICE = "af_heart"  # Kokoro's own default, where a model has it
# Kokoro voices' first letter: the language of their speaker, as espeak-ng names it.
VOICE_LANGUAGES = {"a": "en-us", "b": "en-gb", "e": "es", "f": "fr-fr", "h": "hi", "i": "it",
                   "p": "pt-br"}


@dataclass(frozen=True)
class Word:
    word: str
    start: float
    end: float


@dataclass(frozen=True)
class Segment:
    id: int
    seek: int  # the window's first mel frame (10 ms each)
    start: float
    end: float
    text: str
    tokens: tuple[int, ...]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: tuple[Word, ...] = ()


@dataclass(frozen=True)
class Transcript:
    """What a transcription (or a translation into English) found in the audio."""

    text: str
    language: str  # the language code Whisper decoded with (given or detected)
    duration: float  # seconds of audio
    segments: tuple[Segment, ...]
    model: str
    task: str = "transcribe"

    @property
    def words(self) -> tuple[Word, ...]:
        return tuple(w for s in self.segments for w in s.words)


def whisper_languages(config: dict[str, Any]) -> tuple[str, ...]:
    """The language codes a Whisper model with this config.json takes (its vocabulary tells:
    English alone for an English-only model)."""
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    vocab = int(config.get("n_vocab", config.get("vocab_size", 0)))
    if vocab < MULTILINGUAL_VOCAB:
        return ("en",)
    return tuple(list(LANGUAGES)[:vocab - MULTILINGUAL_VOCAB + 99])


def language_code(name: str, languages: Sequence[str], language: str | None) -> str | None:
    """A request's `language` (a code or an English name) as one of `languages` (those of model
    `name`), None to detect it; raises InvalidRequest."""
    from mlx_audio.stt.models.whisper.tokenizer import TO_LANGUAGE_CODE

    if language is None or not language.strip():
        return None
    code = language.strip().lower()
    code = TO_LANGUAGE_CODE.get(code, code)
    if code not in languages:
        shown = ", ".join(languages[:12]) + (" …" if len(languages) > 12 else "")
        raise InvalidRequest(f"language {language!r} is not one {name} knows (ISO-639-1 codes: "
                             f"{shown})", field="language", code="invalid_language")
    return code


def transcribe(sm: SpeechModel, samples: np.ndarray, *, task: str = "transcribe",
               language: str | None = None, prompt: str | None = None,
               temperature: float | None = None, fallback: bool = True,
               word_timestamps: bool = False) -> Transcript:
    """Whisper on `samples` (float32 mono at sm.sample_rate): the text, its segments with their
    tokens and times, and the words' times when asked. With `fallback`, a window that decodes
    badly (too repetitive, or too unlikely) is decoded again at a temperature FALLBACK_STEP
    higher, up to 1 (from 0 when `temperature` is None: Whisper's own schedule); without it,
    `temperature` (0: greedy) is used alone."""
    import mlx.core as mx

    _keep_buffer_cache()
    model = sm.model
    code = language_code(sm.name, whisper_languages(sm.config), language)
    start = float(temperature or 0.0)
    temperatures: float | tuple[float, ...] = start
    if fallback:
        temperatures = tuple(round(start + i * FALLBACK_STEP, 6)
                             for i in range(int((1.0 - start) / FALLBACK_STEP + 1e-6) + 1))
    result = model.generate(mx.array(samples, dtype=mx.float32), task=task, language=code,
                            initial_prompt=prompt or None, temperature=temperatures,
                            word_timestamps=word_timestamps, verbose=None,
                            fp16=model.dtype == mx.float16)
    segments = tuple(_segment(s) for s in result.segments)
    return Transcript(text=result.text.strip(), language=result.language or code or "en",
                      duration=len(samples) / sm.sample_rate, segments=segments, model=sm.name,
                      task=task)


class _WithoutClearCache:
    """`mlx.core` as mlx-audio's Whisper module sees it, less `clear_cache`."""

    def __init__(self, mx: Any):
        self._mx = mx

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mx, name)

    @staticmethod
    def clear_cache() -> None:
        pass


def _keep_buffer_cache() -> None:
    """mlx-audio's Whisper empties MLX's buffer cache after each transcription; done on a thread
    other than the main one (the engine's speech thread) with MLX 0.32.4, the next model run there
    crashes the process (a segmentation fault, seen with Kokoro after Whisper). Its module gets
    `mlx.core` without `clear_cache`: MLX keeps the freed buffers for the next run instead."""
    from mlx_audio.stt.models.whisper import whisper

    if not isinstance(whisper.mx, _WithoutClearCache):
        whisper.mx = _WithoutClearCache(whisper.mx)


def _segment(s: dict[str, Any]) -> Segment:
    words = tuple(Word(w["word"], float(w["start"]), float(w["end"])) for w in s.get("words") or ())
    return Segment(id=int(s["id"]), seek=int(s["seek"]), start=float(s["start"]), end=float(s["end"]),
                   text=s["text"], tokens=tuple(int(t) for t in s["tokens"]),
                   temperature=float(s["temperature"]), avg_logprob=float(s["avg_logprob"]),
                   compression_ratio=float(s["compression_ratio"]),
                   no_speech_prob=float(s["no_speech_prob"]), words=words)


# -- speech ---------------------------------------------------------------------------------------

def voice_language(name: str, voices: Sequence[str], voice: str) -> str:
    """The espeak-ng language of `voice`, one of model `name`'s `voices`; raises
    InvalidRequest."""
    if voice not in voices:
        shown = ", ".join(voices[:16]) + (" …" if len(voices) > 16 else "")
        raise InvalidRequest(f"{name} has no voice {voice!r} (its voices: {shown})",
                             field="voice", code="invalid_voice")
    language = VOICE_LANGUAGES.get(voice[:1])
    if language is None:
        raise InvalidRequest(f"voice {voice!r} speaks a language mlxchat cannot phonemize yet "
                             f"(it reads {', '.join(VOICE_LANGUAGES.values())})", field="voice",
                             code="invalid_voice")
    return language


_G2P: dict[str, Any] = {}


def phonemizer(language: str) -> Callable[[str], str]:
    """Text to Kokoro's phonemes for an espeak-ng `language` (misaki's espeak-ng front end)."""
    g2p = _G2P.get(language)
    if g2p is None:
        from misaki import espeak

        g2p = _G2P[language] = espeak.EspeakG2P(language=language)
    return lambda text: g2p(text)[0]


_SENTENCE_END = re.compile(r"(?<=[.!?;:…])\s+|\n+")


def sentences(text: str) -> list[str]:
    """`text` cut after each sentence's end (and at line breaks), blank pieces dropped."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def phoneme_pieces(phonemes: str, limit: int = KOKORO_PHONEMES) -> list[str]:
    """`phonemes` in pieces of at most `limit`, cut at the last space before the limit where one
    is (else mid-word)."""
    pieces = []
    rest = phonemes.strip()
    while len(rest) > limit:
        cut = rest.rfind(" ", 0, limit + 1)
        cut = cut if cut > 0 else limit
        pieces.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    if rest:
        pieces.append(rest)
    return pieces


def synthesize(sm: SpeechModel, text: str, *, voice: str, speed: float = 1.0,
               stop: Callable[[], bool] = lambda: False) -> Iterator[np.ndarray]:
    """Kokoro's speech for `text` in `voice`: one float32 waveform at sm.sample_rate per
    sentence (several for a sentence of more than KOKORO_PHONEMES phonemes), each in [-1, 1];
    `stop()` is asked before each."""
    import mlx.core as mx
    from mlx_audio.tts.models.kokoro.pipeline import KokoroPipeline
    from mlx_audio.tts.models.kokoro.voice import load_voice_tensor

    to_phonemes = phonemizer(voice_language(sm.name, sm.voices, voice))
    pack = sm.extras.get(("voice", voice))
    if pack is None:  # evaluated here: a later speech thread may use it (see scheduling/speech.py)
        pack = load_voice_tensor(str(sm.voice_file(voice))).astype(mx.float32)
        mx.eval(pack)
        sm.extras[("voice", voice)] = pack
    for sentence in sentences(text):
        for piece in phoneme_pieces(to_phonemes(sentence)):
            if stop():
                return
            out = KokoroPipeline.infer(sm.model, piece, pack, speed)
            yield clean(np.array(out.audio, dtype=np.float32).reshape(-1))


def clean(wave: np.ndarray) -> np.ndarray:
    """Samples a sound card can play: not-a-numbers silenced, the rest clipped to [-1, 1]."""
    return np.clip(np.nan_to_num(wave, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)
