"""mlxchat's engine: language models run in-process on MLX, as a service for the app.

This is the engine's whole public face; the app imports nothing else from it (a test checks).

    engine = Engine(model=None).start()          # the bundled model, loaded on the engine's thread
    handle = engine.submit(messages, SamplingParams(temperature=0.7), speculative=None)
    async for event in handle.stream(): ...      # or `for event in handle.events()` in a thread

Each public name loads with its module on first use (PEP 562): `import engine` and
`from engine import restart_with_blas` stay cheap, so the `mlxchat` command decides on OpenBLAS
(which must be preloaded before MLX starts) before MLX and mlx-lm are imported
(app/cli/__main__.py).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .decoding.tools import ToolRequest
    from .scheduling.service import Engine

# Each public name: the module under engine/ that defines it, and its name there.
_PUBLIC: dict[str, tuple[str, str]] = {
    "MESSAGE_ROLES": ("decoding.chat", "ROLES"),
    "DEFAULTABLE": ("decoding.defaults", "DEFAULTABLE"),
    "PRESETS": ("decoding.defaults", "PRESETS"),
    "DEFAULT_SOURCES": ("decoding.defaults", "SOURCES"),
    "Default": ("decoding.defaults", "Default"),
    "ModelDefaults": ("decoding.defaults", "ModelDefaults"),
    "preset": ("decoding.defaults", "preset"),
    "DraftChoice": ("decoding.drafts", "DraftChoice"),
    "SpeculativeOptions": ("decoding.drafts", "SpeculativeOptions"),
    "SAMPLING_OPTIONS": ("decoding.sampling", "SAMPLING_OPTIONS"),
    "SamplingOption": ("decoding.sampling", "SamplingOption"),
    "SamplingParams": ("decoding.sampling", "SamplingParams"),
    "Cluster": ("distributed.cluster", "Cluster"),
    "DEVICES": ("device", "DEVICES"),
    "restart_with_blas": ("device", "restart_with_blas"),
    "select_device": ("device", "select_device"),
    "compute_path": ("kernels", "active_path"),
    "describe_device": ("kernels", "describe_device"),
    "device_report": ("kernels", "device_report"),
    "KV_BITS_ENV": ("kernels.kv8", "ENV"),
    "KERNELS_ENV": ("kernels.native", "ENV"),
    "DownloadCancelled": ("errors", "DownloadCancelled"),
    "DownloadError": ("errors", "DownloadError"),
    "EngineError": ("errors", "EngineError"),
    "InvalidRequest": ("errors", "InvalidRequest"),
    "ModelLoadError": ("errors", "ModelLoadError"),
    "NoRoom": ("errors", "NoRoom"),
    "Overloaded": ("errors", "Overloaded"),
    "UnsupportedArchitecture": ("errors", "UnsupportedArchitecture"),
    "EFFORT_BUDGETS": ("decoding.thinking", "EFFORT_BUDGETS"),
    "effort_budget": ("decoding.thinking", "effort_budget"),
    "ToolRequest": ("decoding.tools", "ToolRequest"),
    "tool_request": ("decoding.tools", "tool_request"),
    "Channel": ("events", "Channel"),
    "Event": ("events", "Event"),
    "FinishReason": ("events", "FinishReason"),
    "RequestState": ("events", "RequestState"),
    "Timings": ("events", "Timings"),
    "TokenLogprob": ("events", "TokenLogprob"),
    "ToolCall": ("events", "ToolCall"),
    "TopLogprob": ("events", "TopLogprob"),
    "Usage": ("events", "Usage"),
    "BUNDLED_MODEL": ("loading.bundled", "BUNDLED_NAME"),
    "import_bundled_wheel": ("loading.bundled", "import_wheel"),
    "parse_pull_spec": ("loading.hub", "parse_spec"),
    "pull_model": ("loading.hub", "pull"),
    "remove_model": ("loading.hub", "remove"),
    "LOAD_STAGES": ("loading.progress", "LOAD_STAGES"),
    "DownloadProgress": ("loading.progress", "DownloadProgress"),
    "LoadProgress": ("loading.progress", "LoadProgress"),
    "LoadStage": ("loading.progress", "LoadStage"),
    "ModelInfo": ("loading.registry", "ModelInfo"),
    "list_models": ("loading.registry", "list_models"),
    "cache_dir": ("paths", "cache_dir"),
    "data_dir": ("paths", "data_dir"),
    "EMBEDDING_MAX_INPUTS": ("scheduling.embedding_queue", "MAX_INPUTS"),
    "EmbeddingHandle": ("scheduling.embedding_queue", "EmbeddingHandle"),
    "Embeddings": ("scheduling.embedding_queue", "Embeddings"),
    "DEFAULT_KEEP_ALIVE_S": ("scheduling.keep_alive", "DEFAULT_KEEP_ALIVE_S"),
    "keep_alive_seconds": ("scheduling.keep_alive", "keep_alive_seconds"),
    "MODEL_SETTINGS_FILE": ("scheduling.model_settings", "FILE_NAME"),
    "ModelSettings": ("scheduling.model_settings", "ModelSettings"),
    "ModelSettingsFile": ("scheduling.model_settings", "ModelSettingsFile"),
    "ResidentModel": ("scheduling.pool", "ResidentModel"),
    "RequestHandle": ("scheduling.requests", "RequestHandle"),
    "SPEECH_MAX_TEXT": ("scheduling.speech", "MAX_TEXT"),
    "SpeechHandle": ("scheduling.speech", "SpeechHandle"),
    "SpeechStream": ("scheduling.speech", "SpeechStream"),
    "SPEECH_INPUT_RATE": ("loading.speech", "INPUT_RATE"),
    "SPEECH_SUGGESTED": ("loading.speech", "SUGGESTED"),
    "TranscriptSegment": ("decoding.speech", "Segment"),
    "Transcript": ("decoding.speech", "Transcript"),
    "TranscriptWord": ("decoding.speech", "Word"),
    "Ranking": ("scheduling.rerank", "Ranking"),
    "RerankHandle": ("scheduling.rerank", "RerankHandle"),
    "EngineStats": ("scheduling.stats", "EngineStats"),
    "Histogram": ("scheduling.stats", "Histogram"),
    "Engine": ("scheduling.service", "Engine"),
    "EngineStatus": ("scheduling.service", "EngineStatus"),
    "ModelDescription": ("scheduling.slot", "ModelDescription"),
    "ImageInput": ("decoding.vision", "ImageInput"),
    "Infill": ("decoding.fim", "Infill"),
}

__all__ = [*_PUBLIC, "count_tokens"]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'engine' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), attr)
    globals()[name] = value  # the next lookup is a plain global
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def count_tokens(engine: "Engine", *, text: str | None = None, messages: list[dict] | None = None,
                 tools: "ToolRequest | None" = None) -> int:
    """How many tokens the loaded model's tokenizer makes of `text` (raw) or of `messages` as a
    prompt (through the chat template, `tools` offered), exactly as a request would be counted."""
    from .decoding.generate import build_prompt
    from .errors import EngineError

    lm = engine.lm
    if lm is None:
        raise EngineError("no model is loaded yet")
    if text is not None and not text.strip():
        return 0
    return len(build_prompt(lm, messages=messages, text=text, tools=tools,
                            with_checkpoints=False).tokens)
