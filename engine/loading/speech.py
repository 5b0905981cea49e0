"""Speech models through mlx-audio: which model folders are speech models, and how one loads.

Two kinds, each with the families served so far:

- `transcription` (speech to text): Whisper (`whisper`; MLX's layout or transformers' own, such
  as openai/whisper-large-v3-turbo, with its tokenizer and feature extractor files).
- `speech` (text to speech): Kokoro (`kokoro`; config.json with `istftnet` and `plbert`, the
  weights, and voice packs under voices/).

mlx-audio (the `mlxchat[voice]` extra) supplies the model code; the engine loads a speech model
the way it loads a chat model (`load_speech` checks that it fits in memory first), keeps its
weights in float32 on the CPU (MLX's CPU backend computes half precision several times slower)
and in the checkpoint's precision elsewhere, and counts them in its memory budget while loaded
(engine/scheduling/speech.py). On the CPU, Kokoro's vocoder convolutions run as matrix products
(engine/kernels/conv.py).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from mlx.utils import tree_reduce

from ..errors import ModelLoadError
from ..kernels.conv import fast_convolutions
from .memory import shortfall, weight_files_bytes

Kind = Literal["transcription", "speech"]
KINDS: tuple[Kind, ...] = ("transcription", "speech")
FAMILIES: dict[str, Kind] = {"whisper": "transcription", "kokoro": "speech"}
# What to pull when none is installed (the UI and the API's 404 say so).
SUGGESTED: dict[Kind, str] = {"transcription": "openai/whisper-large-v3-turbo",
                              "speech": "mlx-community/Kokoro-82M-bf16"}
INPUT_RATE = 16_000  # the sample rate a transcription model takes (Whisper's)
VOICES_FOLDER = "voices"


def speech_family(folder: Path) -> str | None:
    """The speech family of a model folder (a FAMILIES key) from its config.json, or None."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if config.get("model_type") == "whisper":
        return "whisper"
    if config.get("model_type") in (None, "kokoro") and "istftnet" in config and "plbert" in config:
        return "kokoro"
    return None


def speech_kind(folder: Path) -> Kind | None:
    """"transcription" or "speech" for a speech model's folder, None for any other folder."""
    family = speech_family(folder)
    return FAMILIES[family] if family else None


def refuse_speech_as_chat(display: str, folder: Path) -> None:
    """Raise ModelLoadError when `folder` holds a speech model (asked for as a chat model)."""
    kind = speech_kind(folder)
    if kind:
        raise ModelLoadError(f"{display} is a {kind} model: it serves /v1/audio/*, not chat "
                             f"(docs/voice.md)", code="model_not_chat")


def missing_packages() -> str | None:
    """Why speech models cannot run here (the packages to install), or None when they can."""
    wanted = {"mlx_audio": "mlx-audio", "av": "av", "misaki": "misaki",
              "phonemizer": "phonemizer-fork", "espeakng_loader": "espeakng-loader"}
    absent = [pip for module, pip in wanted.items() if importlib.util.find_spec(module) is None]
    if not absent:
        return None
    return (f"speech needs the voice extra ({', '.join(absent)} missing): "
            f"pip install 'mlxchat[voice]'")


@dataclass(eq=False)
class SpeechModel:
    """A loaded speech model: mlx-audio's module and what serving it needs."""

    name: str
    kind: Kind
    family: str
    path: Path
    config: dict[str, Any]
    model: Any  # mlx-audio's Model
    weight_bytes: int  # its parameters as loaded
    sample_rate: int  # the rate it takes (transcription) or makes (speech)
    voices: tuple[str, ...] = ()  # a speech model's voice packs, by name
    extras: dict[str, Any] = field(default_factory=dict)

    def voice_file(self, voice: str) -> Path:
        return self.path / VOICES_FOLDER / f"{voice}.safetensors"


def _voices(folder: Path) -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in (folder / VOICES_FOLDER).glob("*.safetensors")))


def load_speech(display: str, folder: Path) -> SpeechModel:
    """Load the speech model in `folder` (named `display`); raises ModelLoadError."""
    family = _loadable_family(display, folder)
    kind = FAMILIES[family]
    voices = _voices(folder) if kind == "speech" else ()
    if kind == "speech" and not voices:
        raise ModelLoadError(f"{display} has no voice packs ({VOICES_FOLDER}/*.safetensors)",
                             code="model_not_speech")
    model = _mlx_audio_model(display, folder, family)
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)  # floating parameters only
        if hasattr(model, "dtype"):  # Whisper casts its inputs to this
            model.dtype = mx.float32
        if family == "kokoro":  # its vocoder's convolutions as matrix products
            fast_convolutions(model)
    # materialised here, on the thread that runs it (MLX's lazy arrays belong to a thread)
    mx.eval(model.parameters())
    weight_bytes = tree_reduce(lambda n, x: n + x.nbytes if isinstance(x, mx.array) else n,
                               model.parameters(), 0)
    rate = INPUT_RATE if kind == "transcription" else int(model.sample_rate)
    config = json.loads((folder / "config.json").read_text())
    return SpeechModel(display, kind, family, folder, config, model, weight_bytes, rate, voices)


def _loadable_family(display: str, folder: Path) -> str:
    """The family of the speech model in `folder`, once it can load here; raises
    ModelLoadError (not a speech model, the voice extra missing, too big for memory)."""
    family = speech_family(folder)
    if family is None:
        raise ModelLoadError(f"{display} is not a speech model mlxchat serves (families: "
                             f"{', '.join(FAMILIES)})", code="model_not_speech")
    why = missing_packages()
    if why:
        raise ModelLoadError(why, code="voice_extra_missing")
    why = shortfall(display, weight_files_bytes(folder.glob("*")))
    if why:
        raise ModelLoadError(f"not loading: {why}", code="insufficient_memory")
    return family


def _mlx_audio_model(display: str, folder: Path, family: str) -> Any:
    """mlx-audio's model for `folder`; raises ModelLoadError."""
    try:
        if FAMILIES[family] == "transcription":
            from mlx_audio.stt import load

            model = load(folder, model_type=family)
            model.get_tokenizer()  # Whisper's tokenizer files: mlx-audio only warns without them
        else:
            from mlx_audio.tts import load

            model = load(folder, model_type=family)
    except Exception as exc:  # mlx-audio raises ValueError/KeyError/FileNotFoundError...
        raise ModelLoadError(f"cannot load speech model {display!r} from {folder}: {exc}") from exc
    return model
