"""OpenAI's audio endpoints over the engine's speech models (`Engine.transcribe`, `Engine.speak`).

    POST /v1/audio/transcriptions   multipart: file, model, language, prompt, response_format
                                    (json | text | srt | vtt | verbose_json), temperature,
                                    timestamp_granularities[] (segment | word)
    POST /v1/audio/translations     the same without language and granularities: into English
    POST /v1/audio/speech           JSON: model, input, voice, response_format (mp3 | opus | aac |
                                    flac | wav | pcm), speed, stream_format (audio | sse)

`model` names a local speech model (after the `--model-alias` table); OpenAI's own names
(`whisper-1`, `gpt-4o-transcribe`, `tts-1`, `gpt-4o-mini-tts`, ...) and none at all mean the first
installed model of the kind; with none installed the answer is a 404 that says what to pull. The
uploaded file is decoded by app/api/audio_codec.py (any format FFmpeg reads, at most
MAX_AUDIO_BYTES and MAX_AUDIO_SECONDS; bad audio is a 400 naming `file`). Speech streams as it is
made, a sentence at a time, in the asked format; OpenAI's voice names stand for the Kokoro voices
in VOICES when the model has them. Extensions: `temperature_inc` 0 turns off Whisper's fallback to
higher temperatures (whisper.cpp's server option; then `temperature` is used alone), and
`keep_alive` as in chat requests.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
from typing import Any, AsyncIterator

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import (SPEECH_INPUT_RATE, Engine, EngineError, SpeechStream, Transcript, TranscriptSegment)

from .audio_codec import MAX_AUDIO_BYTES, SPEECH_FORMATS, AudioError, Encoder, decode
from ..state import app_state
from .errors import ApiError, check_fields
from .openai_request import one_of, typed
from .serving import aliased, engine_refusal, read_body

TRANSCRIPTION_PATH, TRANSLATION_PATH, SPEECH_PATH = (
    "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/speech")
TEXT_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("segment", "word")
# OpenAI's model names: each stands for the first installed local model of its kind.
OPENAI_MODELS = {"whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe",
                 "gpt-4o-transcribe-diarize", "tts-1", "tts-1-hd", "gpt-4o-mini-tts"}
# OpenAI's voices as Kokoro's (used where the model has that voice; a model's own names work too).
VOICES = {"alloy": "af_alloy", "ash": "am_adam", "ballad": "bm_george", "coral": "af_heart",
          "echo": "am_echo", "fable": "bm_fable", "nova": "af_nova", "onyx": "am_onyx",
          "sage": "af_sarah", "shimmer": "af_bella", "verse": "am_michael"}
_TRANSCRIBE_FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature",
                      "timestamp_granularities[]", "timestamp_granularities", "stream",
                      "temperature_inc", "keep_alive"}
_TRANSLATE_FIELDS = {"file", "model", "prompt", "response_format", "temperature",
                     "temperature_inc", "keep_alive"}
_SPEECH_FIELDS = {"model", "input", "voice", "response_format", "speed", "instructions",
                  "stream_format", "keep_alive"}
# The multipart body: the file plus a form's worth of fields.
MAX_AUDIO_BODY_BYTES = MAX_AUDIO_BYTES + 1024 * 1024


def body_limit(path: str) -> int | None:
    """The body limit of `path` when it is an upload of audio (else None)."""
    return MAX_AUDIO_BODY_BYTES if path in (TRANSCRIPTION_PATH, TRANSLATION_PATH) else None


def _model(request: Request, value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ApiError(400, "'model' must be a string", "model", "invalid_type")
    value = aliased(app_state(request).aliases, value)
    return None if value in OPENAI_MODELS else value


# --- speech to text -------------------------------------------------------------------------------

async def transcriptions(request: Request) -> Response:
    return await _speech_to_text(request, "transcribe")


async def translations(request: Request) -> Response:
    return await _speech_to_text(request, "translate")


async def _speech_to_text(request: Request, task: str) -> Response:
    engine = app_state(request).engine
    try:
        fields, upload = await _form(request, _TRANSCRIBE_FIELDS if task == "transcribe"
                                     else _TRANSLATE_FIELDS)
        fmt = one_of(fields, "response_format", TEXT_FORMATS, "json")
        if fields.get("stream") not in (None, "", "false", "False"):
            raise ApiError(400, "streamed transcription is not supported: send stream=false",
                           "stream", "unsupported_value")
        granularities = _granularities(fields, fmt)
        temperature = _number(fields, "temperature", 0.0, 1.0)
        no_fallback = _number(fields, "temperature_inc", 0.0, 1.0) == 0.0
        data = await upload.read()
        name = f"the file {upload.filename!r}" if upload.filename else "the file"
        try:
            samples = await asyncio.to_thread(decode, data, SPEECH_INPUT_RATE, name=name)
        except AudioError as exc:
            raise ApiError(400, str(exc), "file", "invalid_audio") from None
        try:
            handle = await asyncio.to_thread(
                engine.transcribe, samples, model=_model(request, fields.get("model")),
                task=task, language=fields.get("language") or None,
                prompt=fields.get("prompt") or None,
                temperature=temperature, fallback=not no_fallback,
                word_timestamps="word" in granularities,
                keep_alive=fields.get("keep_alive"))
            transcript = await handle.wait()
        except EngineError as exc:
            raise engine_refusal(exc) from None
    except ApiError as err:
        return err.response(request.url.path)
    return _transcript_response(transcript, fmt, granularities)


async def _form(request: Request, allowed: set[str]) -> tuple[dict[str, str], UploadFile]:
    """The multipart form's text fields and its `file`; raises ApiError."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(400, "send the audio as multipart/form-data with the file in 'file'",
                       "file", "invalid_content_type")
    try:
        form = await request.form(max_files=1, max_fields=32)
    except Exception as exc:  # python-multipart's parse errors, Starlette's limits
        raise ApiError(400, f"the multipart body cannot be read ({exc})") from None
    fields: dict[str, str] = {}
    upload = None
    for key, value in form.multi_items():
        if key not in allowed:
            raise ApiError(400, f"Unrecognized request argument supplied: {key}", key,
                           "unknown_parameter")
        if isinstance(value, UploadFile):
            if key != "file":
                raise ApiError(400, f"'{key}' must be a text field", key, "invalid_type")
            upload = value
        elif key == "file":
            raise ApiError(400, "'file' must be a file upload", "file", "invalid_type")
        elif key.startswith("timestamp_granularities"):
            fields[key] = f"{fields[key]},{value}" if key in fields else value
        else:
            fields[key] = value
    if upload is None:
        raise ApiError(400, "'file' is required", "file", "missing_required_parameter")
    return fields, upload


def _granularities(fields: dict[str, str], fmt: str) -> set[str]:
    given = fields.get("timestamp_granularities[]") or fields.get("timestamp_granularities") or ""
    chosen = {g.strip() for g in given.split(",") if g.strip()}
    bad = chosen - set(GRANULARITIES)
    if bad:
        raise ApiError(400, f"'timestamp_granularities' takes {' and '.join(GRANULARITIES)}",
                       "timestamp_granularities", "invalid_value")
    if chosen and fmt != "verbose_json":
        raise ApiError(400, "'timestamp_granularities' needs response_format verbose_json",
                       "timestamp_granularities", "invalid_value")
    return chosen or {"segment"}


def _number(fields: dict[str, str], name: str, low: float, high: float) -> float | None:
    text = fields.get(name)
    if text in (None, ""):
        return None
    try:
        value = float(text)
    except ValueError:
        raise ApiError(400, f"'{name}' must be a number", name, "invalid_type") from None
    if not (math.isfinite(value) and low <= value <= high):
        raise ApiError(400, f"'{name}' must be between {low:g} and {high:g}", name,
                       "invalid_value")
    return value


def _transcript_response(t: Transcript, fmt: str, granularities: set[str]) -> Response:
    usage = {"type": "duration", "seconds": math.ceil(t.duration)}
    if fmt == "text":
        return PlainTextResponse(t.text + "\n")
    if fmt == "srt":
        return PlainTextResponse(_subtitles(t.segments, srt=True), media_type="application/x-subrip")
    if fmt == "vtt":
        return PlainTextResponse("WEBVTT\n\n" + _subtitles(t.segments, srt=False),
                                 media_type="text/vtt")
    if fmt == "json":
        return JSONResponse({"text": t.text, "usage": usage})
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    body: dict[str, Any] = {"task": t.task, "language": LANGUAGES.get(t.language, t.language),
                            "duration": round(t.duration, 3), "text": t.text}
    if "segment" in granularities:
        body["segments"] = [{"id": s.id, "seek": s.seek, "start": s.start, "end": s.end,
                             "text": s.text, "tokens": list(s.tokens),
                             "temperature": s.temperature, "avg_logprob": _finite(s.avg_logprob),
                             "compression_ratio": _finite(s.compression_ratio),
                             "no_speech_prob": _finite(s.no_speech_prob)} for s in t.segments]
    if "word" in granularities:
        body["words"] = [{"word": w.word.strip(), "start": w.start, "end": w.end}
                         for w in t.words]
    body["usage"] = usage
    return JSONResponse(body)


def _finite(value: float) -> float | None:
    """JSON has no infinities nor NaN (an average over a window that decoded nothing): null."""
    return value if math.isfinite(value) else None


def _timestamp(seconds: float, srt: bool) -> str:
    ms = round(max(seconds, 0.0) * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{',' if srt else '.'}{ms:03d}"


def _subtitles(segments: tuple[TranscriptSegment, ...], srt: bool) -> str:
    cues = [s for s in segments if s.text.strip()]
    return "".join((f"{i}\n" if srt else "") + f"{_timestamp(s.start, srt)} --> "
                   f"{_timestamp(max(s.end, s.start), srt)}\n{s.text.strip()}\n\n"
                   for i, s in enumerate(cues, start=1))


# --- text to speech -------------------------------------------------------------------------------

async def speech(request: Request) -> Response:
    engine = app_state(request).engine
    try:
        body = check_fields(await read_body(request), _SPEECH_FIELDS)
        text = typed(body, "input", str)
        if text is None:
            raise ApiError(400, "'input' is required", "input", "missing_required_parameter")
        fmt = one_of(body, "response_format", SPEECH_FORMATS, "mp3")
        stream_format = one_of(body, "stream_format", ("audio", "sse"), "audio")
        if typed(body, "instructions", str):
            raise ApiError(400, "'instructions' (a voice's style) is not supported by the local "
                                "speech models", "instructions", "unsupported_parameter")
        speed = typed(body, "speed", float)
        stream = await start_speech(engine, text, model=_model(request, body.get("model")),
                                    voice=typed(body, "voice", str),
                                    speed=1.0 if speed is None else speed,
                                    keep_alive=body.get("keep_alive"))
        waves = await first_wave(stream)
    except ApiError as err:
        return err.response(request.url.path)
    encoder = Encoder(fmt, stream.sample_rate)
    if stream_format == "sse":
        return StreamingResponse(_sse(waves, encoder), media_type="text/event-stream")
    return StreamingResponse(encoded(waves, encoder), media_type=encoder.content_type)


async def start_speech(engine: Engine, text: str, *, model: str | None, voice: str | None,
                       speed: float, keep_alive: Any = None) -> SpeechStream:
    """A speech stream for `text` (OpenAI voice names mapped where the model has them); the
    engine's refusals as ApiErrors (for the API here and the page's read-aloud button)."""
    try:
        if voice in VOICES:
            voices = await asyncio.to_thread(_voices_of, engine, model)
            voice = VOICES[voice] if VOICES[voice] in voices else None  # None: its default
        return await asyncio.to_thread(engine.speak, text, model=model, voice=voice, speed=speed,
                                       keep_alive=keep_alive)
    except EngineError as exc:
        raise engine_refusal(exc) from None


def _voices_of(engine: Engine, model: str | None) -> tuple[str, ...]:
    return engine.speech_voices(model)


async def first_wave(stream: SpeechStream) -> AsyncIterator[Any]:
    """The stream's waveforms, its first one already made, so that a model that fails to load
    answers with an error status rather than an empty 200; leaving the iteration early (the
    client went away) stops the stream."""
    chunks = stream.chunks()
    try:
        first = await anext(chunks, None)
    except EngineError as exc:
        stream.cancel()
        raise engine_refusal(exc) from None

    async def waves() -> AsyncIterator[Any]:
        try:
            if first is not None:
                yield first
            async for wave in chunks:
                yield wave
        except EngineError:  # after the first sentence there is no status to change: it ends
            pass
        finally:
            stream.cancel()

    return waves()


async def encoded(waves: AsyncIterator[Any], encoder: Encoder) -> AsyncIterator[bytes]:
    """The waveforms as `encoder`'s format, piece by piece."""
    async for wave in waves:
        if data := encoder.encode(wave):
            yield data
    if data := encoder.finish():
        yield data


async def _sse(waves: AsyncIterator[Any], encoder: Encoder) -> AsyncIterator[bytes]:
    """OpenAI's speech events: `speech.audio.delta` (base64 audio) as it comes, then
    `speech.audio.done`."""
    async for data in encoded(waves, encoder):
        delta = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
        yield f"data: {json.dumps(delta)}\n\n".encode()
    yield f"data: {json.dumps({'type': 'speech.audio.done'})}\n\n".encode()


routes = [Route(TRANSCRIPTION_PATH, transcriptions, methods=["POST"]),
          Route(TRANSLATION_PATH, translations, methods=["POST"]),
          Route(SPEECH_PATH, speech, methods=["POST"])]
