"""The models the API offers (`/v1/models`, `/v1/models/{model}`) and which one a request runs
on: a request naming another local model loads it first, through the model-switch service the
model picker uses too (app/model_jobs.py: one load at a time, after the running requests end),
as Ollama and LM Studio do; a name no local model has is a 404 listing the ones there are."""

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine import Engine, ModelInfo

from ..model_jobs import begin_switch
from ..state import app_state
from .errors import ApiError

# When this server started: the `created` of a model whose files are not on disk.
STARTED = int(time.time())

# Loads one request may wait through before it gives up (other clients keep switching models).
MAX_SWITCHES = 3


def local_models(engine: Engine) -> list[ModelInfo]:
    """Every model a request may name: the loaded one first, then the others `mlxchat models`
    lists and those this server loaded from a folder or GGUF path."""
    found = engine.list_models()
    return sorted(found, key=lambda m: m.name != engine.model_name)


def model_config(model: ModelInfo) -> dict[str, Any]:
    """A model folder's config.json ({} for a GGUF file, a model not fetched, a damaged file)."""
    path = Path(model.path) if model.path else None
    try:
        return json.loads((path / "config.json").read_text()) if path and path.is_dir() else {}
    except (OSError, ValueError):
        return {}


def context_length(model: ModelInfo, engine: Engine | None = None) -> int | None:
    """The longest prompt plus answer `model` takes, in tokens: the loaded model's as the engine
    runs it; another's as its config.json declares it (its text model's, for a vision model);
    None when unknown until it loads (a GGUF file)."""
    if engine is not None and engine.model is not None and model.name == engine.model_name:
        return engine.model.context_length
    config = model_config(model)
    text = config.get("text_config", config)
    found = next((text[k] for k in ("max_position_embeddings", "max_seq_len", "seq_length")
                  if isinstance(text.get(k), int)), None)
    return found


def model_object(model: ModelInfo, engine: Engine | None = None) -> dict[str, Any]:
    """A model as OpenAI's `/v1/models` describes one; `created` is when its files were written.
    Extensions: `context_length` (tokens, where known: coding agents size their sessions and
    compact by it), and for the loaded model what it can do (`capabilities`: completion, tools,
    thinking, embedding — engine.loading.registry.CAPABILITIES)."""
    path = Path(model.path) if model.path else None
    created = int(path.stat().st_mtime) if path is not None and path.exists() else STARTED
    out: dict[str, Any] = {"id": model.name, "object": "model", "created": created,
                           "owned_by": "mlxchat"}
    if (context := context_length(model, engine)) is not None:
        out["context_length"] = context
    if engine is not None and engine.model is not None and model.name == engine.model_name:
        out["capabilities"] = list(engine.model.capabilities)
    return out


def find_model(engine: Engine, name: str) -> ModelInfo:
    """The local model called `name`; else the 404 OpenAI gives for an unknown model."""
    for model in local_models(engine):
        if model.name == name:
            return model
    raise ApiError(404, f"The model '{name}' does not exist", "model", "model_not_found")


async def use_model(request: Request, name: Any) -> None:
    """Make `name` the loaded model (None: whichever is loaded); raises ApiError when no local
    model has that name or it cannot load. A name that is not a string is left to the parser."""
    state = app_state(request)
    engine = state.engine
    switch = state.switch
    if not isinstance(name, str):
        return
    for _ in range(MAX_SWITCHES):
        if switch.loading:  # the picker's or another request's load: wait for it first
            target, task = switch.name, switch.task
            failure = await asyncio.shield(task)  # type: ignore[arg-type]
            if target == name and failure is not None:
                raise _load_failed(name, failure)
            continue
        if name == engine.model_name:
            return
        if name not in {m.name for m in engine.list_models()}:
            available = ", ".join(m.name for m in local_models(engine))
            raise ApiError(404, f"The model '{name}' does not exist here (local models: "
                                f"{available}); `mlxchat pull` downloads one", "model",
                           "model_not_found")
        failure = await asyncio.shield(begin_switch(switch, engine, name))
        if failure is not None:
            raise _load_failed(name, failure)
    raise ApiError(409, f"other requests keep switching the model; '{name}' was not loaded, "
                        "try again", "model", "model_busy", headers={"Retry-After": "5"})


def _load_failed(name: str, exc: Exception) -> ApiError:
    code = getattr(exc, "code", None) or "model_load_failed"
    return ApiError(503, f"Could not load '{name}': {exc}", "model", code, type_="server_error")


async def list_models(request: Request) -> JSONResponse:
    """Every local model, the loaded one first: a request naming any of them loads it."""
    engine = app_state(request).engine
    data = [model_object(m, engine) for m in local_models(engine)]
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
