"""Audio in and out of the voice API, through PyAV (FFmpeg's libraries).

`decode` reads any file FFmpeg reads (WAV, MP3, FLAC, Ogg/Opus, WebM/Opus as browsers record it,
M4A/AAC, ...) into mono float32 samples at the rate a model takes, under limits: at most
MAX_AUDIO_BYTES of file and MAX_AUDIO_SECONDS of sound, counted while decoding (what a header
declares is never trusted: a header that claims hours costs nothing, and a file that holds more
sound than the limit stops being decoded there). A file FFmpeg cannot read, one with no audio
stream, no sound, or less sound than its header declares (cut short) is refused with `AudioError`,
whose message says which.

`Encoder` turns waveforms into one of SPEECH_FORMATS as they come, each call returning the bytes
ready to send: a streamed answer starts playing before the last sentence is made. WAV is written
with the unknown-length header streamed WAV uses (sizes 0xFFFFFFFF), PCM is raw 16-bit samples.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np

MAX_AUDIO_BYTES = 25 * 1024 * 1024  # OpenAI's limit for an uploaded file
MAX_AUDIO_SECONDS = 600.0
# A file is cut short when it holds less sound than it declares by more than this (seconds).
TRUNCATION_SLACK_S = 0.5
# response_format -> (FFmpeg muxer, codec, content type); "pcm" and "wav" are written here.
SPEECH_FORMATS: dict[str, tuple[str | None, str | None, str]] = {
    "mp3": ("mp3", "libmp3lame", "audio/mpeg"),
    "opus": ("ogg", "libopus", "audio/ogg; codecs=opus"),
    "aac": ("adts", "aac", "audio/aac"),
    "flac": ("flac", "flac", "audio/flac"),
    "wav": (None, None, "audio/wav"),
    "pcm": (None, None, "audio/pcm"),
}


class AudioError(ValueError):
    """Audio that cannot be used, with why (for the user)."""


def decode(data: bytes, rate: int, *, max_seconds: float = MAX_AUDIO_SECONDS,
           name: str = "the file") -> np.ndarray:
    """The sound in `data` as mono float32 samples at `rate`; raises AudioError."""
    import av

    if not data:
        raise AudioError(f"{name} is empty (0 bytes)")
    if len(data) > MAX_AUDIO_BYTES:
        raise AudioError(f"{name} is {len(data)} bytes; the limit is {MAX_AUDIO_BYTES} bytes")
    limit = int(max_seconds * rate)
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise AudioError(f"{name} holds no audio stream")
            stream = container.streams.audio[0]
            declared = _wav_declared_seconds(data) or _declared_seconds(container, stream)
            samples = _decoded(container, stream, rate, limit, max_seconds, name)
    except AudioError:
        raise
    except (av.FFmpegError, UnicodeDecodeError, ValueError) as exc:
        raise AudioError(f"{name} is not audio that can be read ({_reason(exc)})") from None
    if not samples.size:
        raise AudioError(f"{name} holds no sound (it may be cut short)")
    held = samples.size / rate
    if declared is not None and declared - held > max(TRUNCATION_SLACK_S, 0.05 * held):
        raise AudioError(f"{name} is cut short: it declares {declared:.1f} s of sound but holds "
                         f"{held:.1f} s")
    return samples


def _decoded(container: Any, stream: Any, rate: int, limit: int, max_seconds: float,
             name: str) -> np.ndarray:
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    parts: list[np.ndarray] = []
    count = 0
    try:
        frames = container.decode(stream)
        for frame in frames:
            frame.pts = None  # resample by the samples themselves, not a header's clock
            for out in resampler.resample(frame):
                part = out.to_ndarray().reshape(-1)
                parts.append(part)
                count += part.size
            if count > limit:
                raise AudioError(f"{name} is longer than the limit of {max_seconds:.0f} s")
    except av.FFmpegError as exc:
        if not count:
            raise
        raise AudioError(f"{name} is damaged or cut short after {count / rate:.1f} s "
                         f"({_reason(exc)})") from None
    for out in resampler.resample(None):
        parts.append(out.to_ndarray().reshape(-1))
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


def _declared_seconds(container: Any, stream: Any) -> float | None:
    """The length a file's headers declare, when they do."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000
    return None


def _wav_declared_seconds(data: bytes) -> float | None:
    """The length a WAV file's `data` chunk declares (FFmpeg measures the file instead), or None
    for another file or a streamed WAV's unknown size."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    at, byte_rate = 12, 0
    while at + 8 <= len(data):
        tag, size = data[at:at + 4], struct.unpack_from("<I", data, at + 4)[0]
        if tag == b"fmt " and at + 16 <= len(data):
            byte_rate = struct.unpack_from("<I", data, at + 16)[0]
        if tag == b"data":
            if not byte_rate or size in (0, 0xFFFFFFFF):
                return None
            return size / byte_rate
        at += 8 + size + (size & 1)
    return None


def _reason(exc: Exception) -> str:
    return str(getattr(exc, "strerror", None) or exc).strip().rstrip(".") or type(exc).__name__


class _Sink:
    """A write-only file for FFmpeg's muxers (not seekable: they write as a stream)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


class Encoder:
    """Mono float32 waveforms at `rate` to `fmt` (a SPEECH_FORMATS key), a piece at a time."""

    def __init__(self, fmt: str, rate: int):
        self.fmt, self.rate = fmt, rate
        self.content_type = SPEECH_FORMATS[fmt][2]
        self._container: Any = None
        self._started = False
        muxer, codec, _ = SPEECH_FORMATS[fmt]
        if muxer is not None:
            import av

            self._sink = _Sink()
            self._container = av.open(self._sink, mode="w", format=muxer)
            self._stream = self._container.add_stream(codec, rate=rate, layout="mono")

    def encode(self, wave: np.ndarray) -> bytes:
        """The bytes of `wave` (samples in [-1, 1]) that are ready to send."""
        wave = np.ascontiguousarray(np.clip(wave, -1.0, 1.0), dtype=np.float32).reshape(-1)
        if self._container is None:
            head = b"" if self._started or self.fmt == "pcm" else _wav_header(self.rate)
            self._started = True
            return head + (wave * 32767.0).astype("<i2").tobytes()
        import av

        frame = av.AudioFrame.from_ndarray(wave[None], format="flt", layout="mono")
        frame.sample_rate = self.rate
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        """The last bytes (the encoder's delayed frames, the container's end)."""
        if self._container is None:
            return b"" if self._started or self.fmt == "pcm" else _wav_header(self.rate)
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._sink.take()


def _wav_header(rate: int) -> bytes:
    """A 16-bit mono WAV header whose sizes say "unknown" (0xFFFFFFFF): the streamed form."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", unknown))
