"""mlxchat's engine: language models run in-process on MLX, as a service for the app.

This is the engine's whole public face; the app imports nothing else from it (a test checks).

    engine = Engine(model=None).start()          # the bundled model, loaded on the engine's thread
    handle = engine.submit(messages, SamplingParams(temperature=0.7), speculative=None)
    async for event in handle.stream(): ...      # or `for event in handle.events()` in a thread
"""

from .decoding.drafts import DraftChoice, SpeculativeOptions
from .decoding.sampling import PRESETS, SAMPLING_OPTIONS, SamplingOption, SamplingParams, preset
from .distributed.cluster import Cluster
from .device import DEVICES, blas_preload_env, describe as describe_device
from .device import report as device_report, select_device
from .errors import EngineError, InvalidRequest, ModelLoadError, Overloaded, UnsupportedArchitecture
from .events import Event, FinishReason, RequestState, Timings, Usage
from .loading.bundled import import_wheel as import_bundled_wheel
from .loading.registry import ModelInfo, list_models
from .paths import cache_dir, data_dir
from .scheduling.service import Engine, EngineStatus, ModelDescription, RequestHandle

__all__ = [
    "Cluster", "DEVICES", "PRESETS", "SAMPLING_OPTIONS", "DraftChoice", "Engine", "EngineError",
    "EngineStatus", "Event", "FinishReason", "InvalidRequest", "ModelDescription", "ModelInfo",
    "ModelLoadError", "Overloaded", "RequestHandle", "RequestState", "SamplingOption",
    "SamplingParams", "SpeculativeOptions", "Timings", "UnsupportedArchitecture", "Usage",
    "blas_preload_env", "cache_dir", "data_dir", "describe_device", "device_report",
    "import_bundled_wheel", "list_models", "preset", "select_device",
]
