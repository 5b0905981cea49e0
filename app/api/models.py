"""The models the API offers (`/v1/models`, `/v1/models/{model}`) and which one a request runs
on: a request naming another local model loads it into the engine's model pool beside the others
(`use_model`; once however many ask at the same time, idle models evicted where the memory budget
needs room), as Ollama and LM Studio do; a name no local model has is a 404 listing the ones
there are, and a model that cannot get room now is a 503 with Retry-After.

`/v1/models` lists every local model, those in memory first, each of them with a `loaded` object
(an extension): the bytes of its weights, its context length, when it unloads if still idle and
whether it is pinned."""

import asyncio
import json
import math
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine import (Engine, EngineError, InvalidRequest, ModelDescription, ModelInfo,
                    ModelLoadError, NoRoom, ResidentModel)

from ..state import app_state
from .errors import ApiError

# When this server started: the `created` of a model whose files are not on disk.
STARTED = int(time.time())


def local_models(engine: Engine) -> list[ModelInfo]:
    """Every model a request may name: the default one first, then those in memory, then the
    others `mlxchat models` lists and those this server loaded from a folder or GGUF path."""
    loaded = [m.name for m in engine.loaded_models()]
    found = engine.list_models()
    return sorted(found, key=lambda m: (m.name != engine.model_name,
                                        loaded.index(m.name) if m.name in loaded else len(loaded)))


def iso_time(at: float | None) -> str | None:
    """A time.time() as ISO 8601 in UTC (None stays None)."""
    if at is None:
        return None
    return datetime.fromtimestamp(at, timezone.utc).isoformat().replace("+00:00", "Z")


def loaded_object(m: ResidentModel) -> dict[str, Any]:
    """A model in memory as `/v1/models` describes it (`loaded`, an extension)."""
    return {"memory_bytes": m.weight_bytes, "context_length": m.context_length,
            "expires_at": iso_time(m.expires_at), "pinned": m.pinned, "busy": m.busy,
            "kv_format": m.kv_format}


def model_config(model: ModelInfo) -> dict[str, Any]:
    """A model folder's config.json ({} for a GGUF file, a model not fetched, a damaged file)."""
    path = Path(model.path) if model.path else None
    try:
        return json.loads((path / "config.json").read_text()) if path and path.is_dir() else {}
    except (OSError, ValueError):
        return {}


def described(engine: Engine, name: str) -> ModelDescription | None:
    """The description of `name` as the engine runs it, once it has been loaded (else None)."""
    try:
        return engine.on(name).model
    except InvalidRequest:
        return None


def context_length(model: ModelInfo, engine: Engine | None = None) -> int | None:
    """The longest prompt plus answer `model` takes, in tokens: a loaded model's as the engine
    runs it (its settings may shorten it); another's as its config.json declares it (its text
    model's, for a vision model); None when unknown until it loads (a GGUF file)."""
    known = described(engine, model.name) if engine is not None else None
    if known is not None:
        return known.context_length
    config = model_config(model)
    text = config.get("text_config", config)
    found = next((text[k] for k in ("max_position_embeddings", "max_seq_len", "seq_length")
                  if isinstance(text.get(k), int)), None)
    return found


def model_object(model: ModelInfo, engine: Engine | None = None,
                 loaded: dict[str, ResidentModel] | None = None) -> dict[str, Any]:
    """A model as OpenAI's `/v1/models` describes one; `created` is when its files were written.
    Extensions: `context_length` (tokens, where known: coding agents size their sessions and
    compact by it); for a model in memory what it can do (`capabilities`: completion, tools,
    thinking, embedding — engine.loading.registry.CAPABILITIES) and its `loaded` object."""
    path = Path(model.path) if model.path else None
    created = int(path.stat().st_mtime) if path is not None and path.exists() else STARTED
    out: dict[str, Any] = {"id": model.name, "object": "model", "created": created,
                           "owned_by": "mlxchat"}
    if (context := context_length(model, engine)) is not None:
        out["context_length"] = context
    if engine is None:
        return out
    if loaded is None:
        loaded = {m.name: m for m in engine.loaded_models()}
    resident = loaded.get(model.name)
    if resident is not None:
        out["capabilities"] = list(resident.capabilities)
        out["loaded"] = loaded_object(resident)
    elif engine.model is not None and model.name == engine.model_name:
        out["capabilities"] = list(engine.model.capabilities)
    return out


def find_model(engine: Engine, name: str) -> ModelInfo:
    """The local model called `name`; else the 404 OpenAI gives for an unknown model."""
    for model in local_models(engine):
        if model.name == name:
            return model
    raise ApiError(404, f"The model '{name}' does not exist", "model", "model_not_found")


async def use_model(request: Request, name: Any) -> None:
    """Have `name` in memory (loaded into the engine's pool if it is not, the other models kept
    while the memory budget allows); raises ApiError when no local model has that name (404), it
    cannot load (503) or every model holding the memory is busy (503 with Retry-After). A name
    that is not a string is left to the parser."""
    engine = app_state(request).engine
    if not isinstance(name, str):
        return
    if name not in {m.name for m in engine.list_models()}:
        available = ", ".join(m.name for m in local_models(engine))
        raise ApiError(404, f"The model '{name}' does not exist here (local models: "
                            f"{available}); `mlxchat pull` downloads one", "model",
                       "model_not_found")
    try:
        await asyncio.to_thread(engine.use, name)
    except EngineError as exc:
        raise load_refusal(name, exc) from None


def load_refusal(name: str, exc: EngineError) -> ApiError:
    """A model that could not be brought into memory, as the client's error: 503, with
    Retry-After when it may fit later (every model holding the memory was busy)."""
    if isinstance(exc, NoRoom):
        return ApiError(503, str(exc), "model", "models_busy", type_="server_error",
                        headers={"Retry-After": str(math.ceil(exc.retry_after))})
    if isinstance(exc, ModelLoadError) and exc.code == "model_not_found":
        return ApiError(404, str(exc), "model", "model_not_found")
    code = getattr(exc, "code", None) or "model_load_failed"
    return ApiError(503, f"Could not load '{name}': {exc}", "model", code, type_="server_error")


async def list_models(request: Request) -> JSONResponse:
    """Every local model, the default and those in memory first: a request naming any of them
    loads it."""
    engine = app_state(request).engine
    loaded = {m.name: m for m in engine.loaded_models()}
    data = [model_object(m, engine, loaded) for m in local_models(engine)]
    return JSONResponse({"object": "list", "data": data})


async def retrieve_model(request: Request) -> JSONResponse:
    """One local model, as OpenAI's `models.retrieve` asks for it."""
    engine = app_state(request).engine
    try:
        model = find_model(engine, request.path_params["model"])
    except ApiError as exc:
        return exc.response(request.url.path)
    return JSONResponse(model_object(model, engine))


routes = [
    Route("/v1/models", list_models),
    Route("/v1/models/{model:path}", retrieve_model),
]
