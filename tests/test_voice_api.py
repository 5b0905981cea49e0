"""Voice (issue 53) through the real `openai` SDK on a real server: `/v1/audio/transcriptions`,
`/translations` and `/speech` on tiny random-weight speech models (tests/voice_models.py) and
speech spoken by espeak-ng (tests/audio/).

The transcription's tokens equal mlx-audio's own Whisper `generate` on the same model and file
(greedy: `temperature_inc` 0 turns Whisper's temperature fallback off, which would draw random
tokens from a random model), and the samples our decoder (PyAV) reads equal mlx-audio's reader's.
"""

import io
import struct
import wave

import av
import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from app.api.audio_codec import MAX_AUDIO_BYTES, decode
from engine import SPEECH_SUGGESTED
from live_server import openai_client, tiny_serving
from voice_models import FOX_WAV, KOKORO, QUESTION_WAV, WHISPER, speech_cache

pytestmark = pytest.mark.fast
GREEDY = {"temperature_inc": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("voice")
    with speech_cache(folder / "hub"), tiny_serving(folder) as server:
        server.client = openai_client(server)
        yield server


def transcribe(server, path=QUESTION_WAV, **options):
    with open(path, "rb") as f:
        return server.client.audio.transcriptions.create(model="whisper-1", file=f, **options)


def test_transcription_tokens_equal_mlx_audio_generate(server):
    """verbose_json's segment tokens are mlx-audio's Whisper `generate` on the same folder and
    file, read by mlx-audio's own audio reader (greedy, English, float32 on the CPU as we run it)."""
    from mlx_audio.stt import load

    ours = transcribe(server, response_format="verbose_json", language="en", extra_body=GREEDY)
    folder = server.app.state.engine.speech._target("transcription", WHISPER).folder
    model = load(folder)
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
        model.dtype = mx.float32
    theirs = model.generate(str(QUESTION_WAV), language="en", temperature=0.0,
                            fp16=model.dtype == mx.float16)
    assert [s.tokens for s in ours.segments] == [s["tokens"] for s in theirs.segments]
    assert sum(len(s.tokens) for s in ours.segments) > 0
    assert ours.text == theirs.text.strip()
    assert ours.language == "english" and ours.duration == pytest.approx(3.066, abs=0.01)
    assert ours.usage.seconds == 4


def test_our_decoder_reads_the_samples_mlx_audio_reads():
    from mlx_audio.stt.utils import load_audio

    ours = decode(QUESTION_WAV.read_bytes(), 16000)
    assert np.array_equal(ours, np.array(load_audio(str(QUESTION_WAV))))


@pytest.mark.slow
def test_response_formats_and_translation(server):
    text = transcribe(server, response_format="text", language="en", extra_body=GREEDY)
    assert isinstance(text, str) and text.endswith("\n") and text.strip()
    words = transcribe(server, response_format="verbose_json", language="en", extra_body=GREEDY,
                       timestamp_granularities=["word", "segment"])
    assert words.words and words.segments and all(w.end >= w.start for w in words.words)
    with open(FOX_WAV, "rb") as f:
        english = server.client.audio.translations.create(model="whisper-1", file=f,
                                                          response_format="verbose_json",
                                                          extra_body=GREEDY)
    assert english.task == "translate" and english.text


def test_subtitles():
    from app.api.audio import _transcript_response
    from engine import Transcript, TranscriptSegment

    segments = tuple(TranscriptSegment(i, 0, start, end, text, (1, 2), 0.0, -0.5, 1.2, 0.01)
                     for i, (start, end, text) in enumerate([(0.0, 1.5, " Hello."), (1.5, 1.5, " "),
                                                             (61.25, 3725.5, " Bye.")]))
    t = Transcript("Hello. Bye.", "en", 3730.0, segments, "m")
    srt = _transcript_response(t, "srt", {"segment"}).body.decode()
    assert srt == ("1\n00:00:00,000 --> 00:00:01,500\nHello.\n\n"
                   "2\n00:01:01,250 --> 01:02:05,500\nBye.\n\n")
    vtt = _transcript_response(t, "vtt", {"segment"}).body.decode()
    assert vtt == ("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello.\n\n"
                   "00:01:01.250 --> 01:02:05.500\nBye.\n\n")


@pytest.mark.slow
def test_speech_streams_each_format(server):
    for fmt in ("mp3", "opus", "wav"):
        with server.client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="alloy", input="Hello there.",
                response_format=fmt) as response:
            pieces = list(response.iter_bytes())
            assert response.headers["content-type"].startswith(("audio/", "audio/ogg"))
        data = b"".join(pieces)
        # sound that decodes: the tiny random-weight model's clip of two words is sometimes only
        # a few hundred samples long (a CI run: 676 for opus)
        assert decode(data, 24000).size > 0, fmt
    # a sentence at a time: the first reaches the client before the last is made
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60,
                      json={"model": KOKORO, "voice": "am_echo", "response_format": "pcm",
                            "input": "One. Two."}) as response:
        chunks = [c for c in response.iter_raw() if c]
    assert len(chunks) >= 2 and sum(map(len, chunks)) % 2 == 0


def test_speech_events_and_refusals(server):
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60,
                      json={"model": "tts-1", "voice": "af_heart", "input": "Hi.",
                            "stream_format": "sse"}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert '"speech.audio.delta"' in lines[0] and lines[-1] == 'data: {"type": "speech.audio.done"}'
    for body, param in [({"input": "hi", "voice": "nobody"}, "voice"),
                        ({"input": "", "voice": "alloy"}, "input"),
                        ({"input": "x" * 5000}, "input"),
                        ({"input": "hi", "speed": 9}, "speed"),
                        ({"input": "hi", "response_format": "ogg"}, "response_format")]:
        r = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "tts-1", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, body


def _wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return out.getvalue()


def _webm(samples: np.ndarray, rate: int = 16000) -> bytes:
    """`samples` as browsers record: Opus in WebM."""
    out = io.BytesIO()
    with av.open(out, "w", format="webm") as container:
        stream = container.add_stream("libopus", rate=48000, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None].astype(np.float32), format="flt",
                                           layout="mono")
        frame.sample_rate = rate
        for resampled in av.AudioResampler(format="s16", layout="mono", rate=48000).resample(frame):
            for packet in stream.encode(resampled):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def test_bad_audio_is_a_400_naming_the_file(server):
    speech = QUESTION_WAV.read_bytes()
    hostile = bytearray(speech[:4000])  # a header that declares five hours over 0.1 s
    struct.pack_into("<I", hostile, 40, 16000 * 2 * 3600 * 5)
    webm = _webm(decode(speech, 16000))
    cases = {"empty": b"", "not audio": b"this is not audio " * 100,
             "truncated": speech[:len(speech) // 3], "hostile header": bytes(hostile),
             "truncated webm": webm[:len(webm) // 2],
             "too long": _wav(np.zeros(16000 * 601, np.float32))}
    for name, data in cases.items():
        r = httpx.post(f"{server.url}/v1/audio/transcriptions", timeout=60,
                       files={"file": ("a.wav", data)}, data={"model": "whisper-1"})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "file", (name, error)
    assert "cut short" in httpx.post(f"{server.url}/v1/audio/transcriptions",
                                     files={"file": ("a.wav", bytes(hostile))}).text
    # the browser's own recording format is read
    r = httpx.post(f"{server.url}/v1/audio/transcriptions", timeout=60,
                   files={"file": ("speech.webm", webm)},
                   data={"temperature_inc": "0", "language": "en"})
    assert r.status_code == 200 and r.json()["text"]


def test_oversized_uploads_and_bad_fields(server):
    def chunks():
        for _ in range(MAX_AUDIO_BYTES // (1 << 20) + 3):
            yield b"\0" * (1 << 20)

    r = httpx.post(f"{server.url}/v1/audio/transcriptions", content=chunks(),
                   headers={"content-type": "multipart/form-data; boundary=x"})
    assert r.status_code == 413
    speech = ("a.wav", QUESTION_WAV.read_bytes())
    for data, param in [({"response_format": "xml"}, "response_format"),
                        ({"temperature": "3"}, "temperature"), ({"language": "xx"}, "language"),
                        ({"colour": "blue"}, "colour"),
                        ({"timestamp_granularities[]": "word"}, "timestamp_granularities")]:
        r = httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": speech}, data=data)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, data
    r = httpx.post(f"{server.url}/v1/audio/transcriptions", json={"file": "x"})
    assert r.status_code == 400
    r = httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": speech},
                   data={"model": "smollm2-135m-instruct"})
    assert r.status_code == 404 and "not a speech-to-text model" in r.json()["error"]["message"]


def test_without_a_speech_model_the_answer_says_what_to_pull(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(openai.NotFoundError) as caught:
        transcribe(server)
    assert f"mlxchat pull {SPEECH_SUGGESTED['transcription']}" in str(caught.value)
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"input": "hi", "voice": "alloy"})
    assert r.status_code == 404 and f"mlxchat pull {SPEECH_SUGGESTED['speech']}" in r.text
