"""Voice (issue 53): real-time factor of speech-to-text and text-to-speech on random-weight speech
models of tiny and full size, and word error rate of a real speech-to-text model on sentences
spoken by espeak-ng when one is in the local Hugging Face cache.

    python -m bench.voice [--shapes tiny,full] [--reps 3] [--no-wer] [--out FILE]

Real-time factor (RTF): seconds of compute per second of audio (below 1: faster than real time).

- Whisper (`whisper-tiny`: tests' tiny shape; `whisper-large-v3-turbo`: the model the docs
  suggest): Whisper pads every input to 30-second windows, so a window's cost is its encoder pass
  plus one decoder step per token. Measured: the encoder on one window, and greedy decoding of a
  fixed number of tokens (random weights never stop by themselves); reported as the RTF of a
  30-second window holding WINDOW_TOKENS tokens (~2.5 words a second of speech), both parts in the
  row's notes. The models run as the engine loads them (float32 on the CPU).
- Kokoro (`kokoro-tiny`; `kokoro-82m`: Kokoro-82M's shape): `synthesize` on SENTENCES, RTF over the
  audio made; against the same model on MLX's own convolutions (without engine/kernels/conv.py's
  matrix products) as the baseline: ratio = ours / MLX's.
- WER: every local speech-to-text model (the engine's `transcribe`, greedy) on WER_SENTENCES
  spoken by espeak-ng (installed by scripts/setup where apt exists); skipped, with the reason, when
  there is no such model or no espeak-ng.

Median of `--reps` runs with the spread; a busy machine's figures are not valid (say so).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import (RESULTS_DIR, Row, median, print_table, run_meta, skipped, spread,
                          write_json)
from bench.speech_shapes import (KOKORO_82M, KOKORO_TINY, WHISPER_LARGE_V3_TURBO, WHISPER_TINY,
                                 kokoro_folder, whisper_folder)

WINDOW_S = 30
WINDOW_TOKENS = 100
SENTENCES = ("The weather today is mild, with a light breeze from the west. "
             "Please remember to water the plants before you leave. "
             "We will meet again on Thursday at noon.")
WER_SENTENCES = ("The quick brown fox jumps over the lazy dog.",
                 "Please call Stella and ask her to bring these things with her from the store.",
                 "What is the capital of France?",
                 "A local chat application keeps every conversation on your own computer.",
                 "She sells sea shells by the sea shore.")
WHISPER_SHAPES = {"tiny": ("whisper-tiny", WHISPER_TINY),
                  "full": ("whisper-large-v3-turbo", WHISPER_LARGE_V3_TURBO)}
KOKORO_SHAPES = {"tiny": ("kokoro-tiny", KOKORO_TINY), "full": ("kokoro-82m", KOKORO_82M)}


def _timed(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def whisper_rows(name: str, config: dict, reps: int) -> list[Row]:
    import mlx.core as mx
    from mlx_audio.stt.models.whisper.audio import N_FRAMES, log_mel_spectrogram, pad_or_trim
    from mlx_audio.stt.models.whisper.decoding import DecodingOptions

    from engine.loading.speech import load_speech

    sm = load_speech(name, whisper_folder(config))
    model = sm.model
    noise = (np.random.RandomState(0).randn(WINDOW_S * sm.sample_rate) * 0.1).astype(np.float32)
    mel = pad_or_trim(log_mel_spectrogram(mx.array(noise), n_mels=model.dims.n_mels),
                      N_FRAMES, axis=-2).astype(model.dtype)
    mx.eval(mel)

    def encode() -> None:
        mx.eval(model.encoder(mel[None]))

    tokens = min(WINDOW_TOKENS, model.dims.n_text_ctx // 2)
    options = DecodingOptions(language="en", without_timestamps=True, sample_len=tokens,
                              fp16=model.dtype == mx.float16)
    decoded: list[int] = []

    def decode() -> None:
        decoded.append(len(model.decode(mel, options).tokens))

    encode(), decode()  # warm up
    enc = _timed(encode, reps)
    dec = _timed(decode, reps)
    steps = median(decoded[1:]) or 1
    step_s = [t / steps for t in dec]
    rtfs = [(e + WINDOW_TOKENS * s) / WINDOW_S for e, s in zip(enc, step_s)]
    notes = (f"encoder {median(enc):.3f} s/window ({spread(enc)}), {1 / median(step_s):.1f} "
             f"decoder tok/s over {steps:.0f} greedy steps; {WINDOW_TOKENS} tokens a "
             f"{WINDOW_S} s window")
    return [Row("voice", name, "stt_rtf", "s/s", median(rtfs), 1.0, "real time", "<= 1.0",
                notes, {"encoder_s": enc, "decode_step_s": step_s, "rtf": rtfs,
                        "weights_mib": sm.weight_bytes >> 20})]


def kokoro_rows(name: str, config: dict, reps: int) -> list[Row]:
    import engine.loading.speech as loading
    from engine.decoding.speech import synthesize

    folder = kokoro_folder(config)
    ours = loading.load_speech(name, folder)
    fast = loading.fast_convolutions
    loading.fast_convolutions = lambda model: 0  # the baseline: MLX's own convolutions
    try:
        theirs = loading.load_speech(name, folder)
    finally:
        loading.fast_convolutions = fast

    def rtf(sm, text: str) -> float:
        start = time.perf_counter()
        samples = sum(w.size for w in synthesize(sm, text, voice=sm.voices[0]))
        return (time.perf_counter() - start) / (samples / sm.sample_rate)

    rtf(ours, "Warm up."), rtf(theirs, "Warm up.")
    first = SENTENCES.split(". ")[0] + "."  # MLX's own convolutions are slow: one sentence
    mine = [rtf(ours, SENTENCES) for _ in range(reps)]
    base = [rtf(theirs, first) for _ in range(max(1, reps // 2))]
    notes = (f"ours {spread(mine)} over {len(SENTENCES.split('. '))} sentences; MLX's own "
             f"convolutions {spread(base)} on the first")
    return [Row("voice", name, "tts_rtf", "s/s", median(mine), median(base),
                "mlx-audio on MLX's convolutions", "<= 1.0", notes,
                {"rtf": mine, "baseline_rtf": base, "weights_mib": ours.weight_bytes >> 20})]


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level edit distance over the reference's word count (case and punctuation ignored)."""
    ref, hyp = (re.findall(r"[a-z0-9']+", s.lower()) for s in (reference, hypothesis))
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(len(ref), 1)


def espeak(text: str, folder: Path) -> bytes:
    path = folder / "speech.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(path), text], check=True)
    return path.read_bytes()


def wer_rows() -> list[Row]:
    from app.api.audio_codec import decode
    from engine import SPEECH_INPUT_RATE, SPEECH_SUGGESTED, list_models
    from engine.decoding.speech import transcribe
    from engine.loading.registry import resolve
    from engine.loading.speech import load_speech

    models = [m.name for m in list_models() if m.speech == "transcription"]
    if not models:
        return [skipped("voice", "wer", "no speech-to-text model in the local Hugging Face cache "
                                        f"(`mlxchat pull {SPEECH_SUGGESTED['transcription']}`)")]
    if shutil.which("espeak-ng") is None:
        return [skipped("voice", "wer", "espeak-ng is not installed (scripts/setup installs it)")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        audio = [decode(espeak(s, Path(tmp)), SPEECH_INPUT_RATE) for s in WER_SENTENCES]
    for name in models:
        sm = load_speech(*resolve(name))
        errors, words, seconds = 0.0, 0, 0.0
        for sentence, samples in zip(WER_SENTENCES, audio):
            start = time.perf_counter()
            text = transcribe(sm, samples, language="en", fallback=False).text
            seconds += time.perf_counter() - start
            n = len(sentence.split())
            errors += word_error_rate(sentence, text) * n
            words += n
        rows.append(Row("voice", name, "wer", "%", 100 * errors / words, None, "", "",
                        f"{len(WER_SENTENCES)} espeak-ng sentences, {words} words, greedy; "
                        f"{seconds:.1f} s"))
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,full", help="tiny, full or both")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-wer", action="store_true")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default: bench/results/voice-cpu.json)")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    meta = run_meta(sys.argv)
    out = args.out or RESULTS_DIR / "voice-cpu.json"
    for shape in args.shapes.split(","):
        for build in ((whisper_rows, *WHISPER_SHAPES[shape]), (kokoro_rows, *KOKORO_SHAPES[shape])):
            rows += build[0](build[1], build[2], args.reps)
            print_table(rows[-1:])
            write_json(out, meta, rows)
    if not args.no_wer:
        rows += wer_rows()
    print_table(rows, "voice: real-time factor (s of compute per s of audio) and WER")
    write_json(out, meta, rows)
    return rows


if __name__ == "__main__":
    from engine import restart_with_blas

    restart_with_blas("bench.voice")
    main()
