"""Tiny random-weight speech models installed where the engine looks for local models: a Hugging
Face cache folder (HF_HUB_CACHE) holding `test/whisper-tiny` (speech to text) and
`test/kokoro-tiny` (text to speech), built by bench/speech_shapes.py, plus the spoken test audio.

    with speech_cache(tmp_path): ...       # the engine finds both models by name or as defaults
"""

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from bench.speech_shapes import kokoro_folder, whisper_folder

AUDIO = Path(__file__).resolve().parent / "audio"
QUESTION_WAV = AUDIO / "question.wav"  # espeak-ng: "Hello. What is the capital of France?"
FOX_WAV = AUDIO / "fox.wav"  # espeak-ng: "The quick brown fox jumps over the lazy dog."
WHISPER = "test/whisper-tiny"
KOKORO = "test/kokoro-tiny"


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)


def install(hub: Path, repo: str, folder: Path) -> Path:
    """`folder` as the one snapshot of `repo` in the hub cache `hub` (its files linked where
    they can be)."""
    snapshot = hub / f"models--{repo.replace('/', '--')}" / "snapshots" / "0"
    if not snapshot.exists():
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(folder, snapshot, copy_function=_link_or_copy)
    return snapshot


@contextmanager
def speech_cache(hub: Path, whisper: bool = True, kokoro: bool = True) -> Iterator[Path]:
    """HF_HUB_CACHE set to `hub`, with the tiny speech models installed there (and the bundled
    model's cache untouched: it lives under MLXCHAT_HOME)."""
    if whisper:
        install(hub, WHISPER, whisper_folder())
    if kokoro:
        install(hub, KOKORO, kokoro_folder())
    previous = os.environ.get("HF_HUB_CACHE")
    os.environ["HF_HUB_CACHE"] = str(hub)
    try:
        yield hub
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_CACHE", None)
        else:
            os.environ["HF_HUB_CACHE"] = previous
