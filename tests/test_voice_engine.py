"""Voice (issue 53) below the API: the engine's speech thread (memory budget, keep-alive, chat
streams going on beside speech), the checks a request meets before it queues, Kokoro's vocoder
convolutions as matrix products (engine/kernels/conv.py) against MLX's own, and the audio codec
(app/api/audio_codec.py) on every format it reads and writes. Tiny random-weight models."""

import io
import time

import av
import mlx.core as mx
import numpy as np
import pytest

from app.api.audio_codec import SPEECH_FORMATS, AudioError, Encoder, decode
from engine import Engine, InvalidRequest, SamplingParams
from engine.kernels.conv import conv1d, conv_transpose1d
from tiny_models import tiny_llama
from voice_models import KOKORO, QUESTION_WAV, WHISPER, speech_cache

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    lm = tiny_llama()
    with speech_cache(tmp_path_factory.mktemp("hub")):
        engine = Engine(lm.name, load=lambda name, **_: lm).start()
        yield engine
        engine.stop()


def test_convolutions_as_products_equal_mlx():
    mx.random.seed(0)
    for taps, dilation, stride, padding in [(3, 3, 1, 3), (7, 5, 1, 15), (11, 1, 2, 5),
                                            (3, 2, 2, 2)]:
        x, w = mx.random.normal((2, 61, 8)), mx.random.normal((5, taps, 8))
        ours = conv1d(x, w, stride=stride, padding=padding, dilation=dilation)
        theirs = mx.conv1d(x, w, stride=stride, padding=padding, dilation=dilation)
        assert ours.shape == theirs.shape and mx.allclose(ours, theirs, atol=1e-4)
    for taps, stride, padding in [(20, 10, 5), (12, 6, 3), (4, 2, 1), (3, 2, 1), (5, 2, 0)]:
        x, w = mx.random.normal((2, 17, 6)), mx.random.normal((4, taps, 6))
        ours = conv_transpose1d(x, w, stride=stride, padding=padding)
        theirs = mx.conv_transpose1d(x, w, stride=stride, padding=padding)
        assert ours.shape == theirs.shape and mx.allclose(ours, theirs, atol=1e-4)
    x, w = mx.random.normal((1, 21, 16)), mx.random.normal((16, 3, 1))  # one group a channel
    assert mx.allclose(conv_transpose1d(x, w, stride=2, padding=1, groups=16),
                       mx.conv_transpose1d(x, w, stride=2, padding=1, groups=16), atol=1e-5)


def test_every_speech_format_decodes_back():
    wave = (np.sin(np.arange(24000) / 24000 * 2 * np.pi * 440) * 0.5).astype(np.float32)
    for fmt in SPEECH_FORMATS:
        encoder = Encoder(fmt, 24000)
        data = encoder.encode(wave[:12000]) + encoder.encode(wave[12000:]) + encoder.finish()
        if fmt == "pcm":
            back = np.frombuffer(data, "<i2").astype(np.float32) / 32767
        else:
            back = decode(data, 24000)
        assert abs(back.size - wave.size) < 2400, fmt  # codecs pad a frame or so
        if fmt in ("wav", "pcm", "flac"):  # lossless but for 16-bit rounding
            assert np.abs(back[:24000] - wave).max() < 1e-3, fmt


def test_decoder_reads_what_ffmpeg_writes_and_refuses_the_rest():
    speech = decode(QUESTION_WAV.read_bytes(), 16000)
    for muxer, codec in [("mp3", "libmp3lame"), ("ogg", "libopus"), ("webm", "libopus"),
                         ("flac", "flac"), ("ipod", "aac")]:
        out = io.BytesIO()
        with av.open(out, "w", format=muxer) as container:
            stream = container.add_stream(codec, rate=48000 if "opus" in codec else 16000,
                                          layout="mono")
            frame = av.AudioFrame.from_ndarray(speech[None], format="flt", layout="mono")
            frame.sample_rate = 16000
            resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono",
                                          rate=stream.codec_context.sample_rate)
            for part in resampler.resample(frame):
                for packet in stream.encode(part):
                    container.mux(packet)
            for packet in stream.encode(None):
                container.mux(packet)
        back = decode(out.getvalue(), 16000, name=muxer)
        assert abs(back.size - speech.size) < 16000 * 0.1, muxer
    with pytest.raises(AudioError, match="longer than the limit of 1 s"):
        decode(QUESTION_WAV.read_bytes(), 16000, max_seconds=1)
    with pytest.raises(AudioError, match="no audio stream"):
        decode((QUESTION_WAV.parent.parent.parent / "static" / "favicon.svg").read_bytes(), 16000)


def test_requests_are_checked_before_they_queue(engine):
    samples = decode(QUESTION_WAV.read_bytes(), 16000)
    for call, field in [(lambda: engine.transcribe(samples, language="klingon"), "language"),
                        (lambda: engine.transcribe(samples, temperature=2), "temperature"),
                        (lambda: engine.transcribe(np.zeros(0), model=WHISPER), "file"),
                        (lambda: engine.transcribe(samples, model=KOKORO), "model"),
                        (lambda: engine.speak("hi", voice="xx_nobody"), "voice"),
                        (lambda: engine.speak("hi", speed=0.1), "speed"),
                        (lambda: engine.speak("  "), "input"),
                        (lambda: engine.speak("hi", model=WHISPER), "model")]:
        with pytest.raises(InvalidRequest) as caught:
            call()
        assert caught.value.field == field
    assert engine.speech_voices() == ("af_heart", "am_echo", "bf_emma")
    assert engine.speech_models("transcription") == [WHISPER]


def test_speech_models_count_in_the_memory_budget_until_their_keep_alive(engine):
    before = engine.budget.reserved  # (the status's reserved_bytes are requests' caches)
    list(engine.speak("Hello.", keep_alive=0.5))
    assert KOKORO in engine.status().speech_models
    assert engine.budget.reserved - before > 50 << 20  # its float32 weights
    deadline = time.time() + 10
    while KOKORO in engine.status().speech_models and time.time() < deadline:
        time.sleep(0.1)
    assert KOKORO not in engine.status().speech_models and engine.budget.reserved == before


@pytest.mark.slow
def test_a_chat_stream_goes_on_while_speech_is_made(engine):
    """Speech runs on its own thread: a chat request submitted while a long text is spoken ends
    long before the speech does (on the scheduler thread it would wait for every sentence)."""
    list(engine.speak("Warm up."))  # the voice model loaded
    stream = engine.speak(" ".join(f"Sentence number {i}." for i in range(5)))
    waves = iter(stream)
    next(waves)  # speech is being made
    handle = engine.submit([{"role": "user", "content": "Hi"}],
                           SamplingParams(max_tokens=16, temperature=0.0))
    events = list(handle.events())
    assert events[-1].kind == "done" and events[-1].usage.completion_tokens == 16
    left = sum(1 for _ in waves)
    assert left >= 2, "the chat request waited for the speech"
