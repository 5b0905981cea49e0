"""mlxchat's engine: language models run in-process on MLX, as a service for the app.

This is the engine's whole public face; the app imports nothing else from it (a test checks).

    engine = Engine(model=None).start()          # the bundled model, loaded on the engine's thread
    handle = engine.submit(messages, SamplingParams(temperature=0.7), speculative=None)
    async for event in handle.stream(): ...      # or `for event in handle.events()` in a thread
"""

from .decoding.chat import ROLES as MESSAGE_ROLES
from .decoding.defaults import (DEFAULTABLE, PRESETS, SOURCES as DEFAULT_SOURCES, Default,
                                ModelDefaults, preset)
from .decoding.drafts import DraftChoice, SpeculativeOptions
from .decoding.sampling import SAMPLING_OPTIONS, SamplingOption, SamplingParams
from .distributed.cluster import Cluster
from .device import DEVICES, restart_with_blas, select_device
from .kernels import active_path as compute_path, describe_device, device_report
from .kernels.kv8 import ENV as KV_BITS_ENV
from .kernels.native import ENV as KERNELS_ENV
from .errors import (DownloadCancelled, DownloadError, EngineError, InvalidRequest, ModelLoadError,
                     NoRoom, Overloaded, UnsupportedArchitecture)
from .decoding.thinking import EFFORT_BUDGETS, effort_budget
from .decoding.tools import ToolRequest, tool_request
from .events import (Channel, Event, FinishReason, RequestState, Timings, TokenLogprob, ToolCall,
                     TopLogprob, Usage)
from .loading.bundled import BUNDLED_NAME as BUNDLED_MODEL, import_wheel as import_bundled_wheel
from .loading.hub import parse_spec as parse_pull_spec, pull as pull_model
from .loading.hub import remove as remove_model
from .loading.progress import LOAD_STAGES, DownloadProgress, LoadProgress, LoadStage
from .loading.registry import ModelInfo, list_models
from .paths import cache_dir, data_dir
from .scheduling.embedding_queue import (MAX_INPUTS as EMBEDDING_MAX_INPUTS, EmbeddingHandle,
                                         Embeddings)
from .scheduling.keep_alive import DEFAULT_KEEP_ALIVE_S, keep_alive_seconds
from .scheduling.model_settings import FILE_NAME as MODEL_SETTINGS_FILE, ModelSettings, ModelSettingsFile
from .scheduling.pool import ResidentModel
from .scheduling.requests import RequestHandle
from .scheduling.speech import MAX_TEXT as SPEECH_MAX_TEXT, SpeechHandle, SpeechStream
from .loading.speech import INPUT_RATE as SPEECH_INPUT_RATE, SUGGESTED as SPEECH_SUGGESTED
from .decoding.speech import Segment as TranscriptSegment, Transcript, Word as TranscriptWord
from .scheduling.rerank import Ranking, RerankHandle
from .scheduling.stats import EngineStats, Histogram
from .scheduling.service import Engine, EngineStatus
from .scheduling.slot import ModelDescription
from .decoding.generate import build_prompt as _build_prompt
from .decoding.vision import ImageInput
from .decoding.fim import Infill

__all__ = [
    "BUNDLED_MODEL", "Cluster", "DEFAULTABLE", "DEFAULT_KEEP_ALIVE_S", "DEFAULT_SOURCES",
    "DEVICES", "KERNELS_ENV", "KV_BITS_ENV", "MESSAGE_ROLES", "MODEL_SETTINGS_FILE", "PRESETS",
    "SAMPLING_OPTIONS",
    "EMBEDDING_MAX_INPUTS", "EmbeddingHandle", "Embeddings",
    "SPEECH_INPUT_RATE", "SPEECH_MAX_TEXT", "SPEECH_SUGGESTED", "SpeechHandle", "SpeechStream",
    "Transcript", "TranscriptSegment", "TranscriptWord",
    "Channel", "Default", "DownloadCancelled", "DownloadError", "DownloadProgress", "DraftChoice",
    "Engine", "EngineError", "EngineStats", "EngineStatus", "Event", "FinishReason", "Histogram",
    "InvalidRequest", "LOAD_STAGES", "LoadProgress", "LoadStage",
    "ImageInput", "Infill", "ModelDefaults", "ModelDescription", "ModelInfo", "ModelLoadError",
    "ModelSettings", "ModelSettingsFile", "NoRoom", "Overloaded", "ResidentModel", "Ranking",
    "RequestHandle", "RequestState", "RerankHandle", "SamplingOption",
    "SamplingParams", "SpeculativeOptions",
    "Timings", "TokenLogprob", "ToolCall", "ToolRequest", "TopLogprob", "UnsupportedArchitecture",
    "Usage",
    "EFFORT_BUDGETS", "cache_dir", "compute_path", "data_dir", "describe_device", "device_report",
    "effort_budget",
    "count_tokens", "import_bundled_wheel", "keep_alive_seconds", "list_models", "parse_pull_spec",
    "preset", "pull_model", "remove_model", "restart_with_blas", "select_device", "tool_request",
]


def count_tokens(engine: Engine, *, text: str | None = None, messages: list[dict] | None = None,
                 tools: ToolRequest | None = None) -> int:
    """How many tokens the loaded model's tokenizer makes of `text` (raw) or of `messages` as a
    prompt (through the chat template, `tools` offered), exactly as a request would be counted."""
    lm = engine.lm
    if lm is None:
        raise EngineError("no model is loaded yet")
    if text is not None and not text.strip():
        return 0
    return len(_build_prompt(lm, messages=messages, text=text, tools=tools,
                             with_checkpoints=False).tokens)
