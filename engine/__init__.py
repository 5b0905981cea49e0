"""mlxchat's engine: language models run in-process on MLX, as a service for the app.

This is the engine's whole public face; the app imports nothing else from it (a test checks).

    engine = Engine(model=None).start()          # the bundled model, loaded on the engine's thread
    handle = engine.submit(messages, SamplingParams(temperature=0.7), speculative=None)
    async for event in handle.stream(): ...      # or `for event in handle.events()` in a thread
"""

from .decoding.drafts import DraftChoice, SpeculativeOptions
from .decoding.sampling import PRESETS, SAMPLING_OPTIONS, SamplingOption, SamplingParams, preset
from .device import DEVICES, blas_preload_env, describe as describe_device
from .device import report as device_report, select_device
from .errors import EngineError, InvalidRequest, ModelLoadError, Overloaded, UnsupportedArchitecture
from .decoding.tools import ToolRequest, tool_request
from .events import (Channel, Event, FinishReason, RequestState, Timings, TokenLogprob, ToolCall,
                     TopLogprob, Usage)
from .loading.bundled import import_wheel as import_bundled_wheel
from .loading.registry import ModelInfo, list_models
from .paths import cache_dir, data_dir
from .scheduling.service import Engine, EngineStatus, ModelDescription, RequestHandle
from .decoding.generate import build_prompt as _build_prompt

__all__ = [
    "DEVICES", "PRESETS", "SAMPLING_OPTIONS", "Channel", "DraftChoice", "Engine", "EngineError",
    "EngineStatus", "Event", "FinishReason", "InvalidRequest", "ModelDescription", "ModelInfo",
    "ModelLoadError", "Overloaded", "RequestHandle", "RequestState", "SamplingOption",
    "SamplingParams", "SpeculativeOptions", "Timings", "TokenLogprob", "ToolCall",
    "ToolRequest", "TopLogprob", "UnsupportedArchitecture", "Usage",
    "blas_preload_env", "cache_dir", "data_dir", "describe_device", "device_report",
    "count_tokens", "import_bundled_wheel", "list_models", "preset", "select_device",
    "tool_request",
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
    return len(_build_prompt(lm, messages=messages, text=text, tools=tools).tokens)
