"""OpenAI's `POST /v1/embeddings` over the engine's embedding requests (`Engine.embed`).

    {"model": "...", "input": "text" | ["text", ...] | [ids] | [[ids], ...],
     "encoding_format": "float" | "base64", "dimensions": 256}

`model` names the loaded chat model (its mean-pooled last hidden state) or a dedicated embedding
model (Qwen3-Embedding, loaded beside the chat model), after the `--model-alias` table. `base64` is the vector's little-endian
float32 bytes, which the openai SDK asks for by default. Extensions: `input_type` "query" puts a
dedicated model's query instruction before each input ("document", the default, its document
prompt); `truncate: true` cuts inputs longer than the model's context instead of refusing them;
`keep_alive` as in chat requests. At most EMBEDDING_MAX_INPUTS inputs a request. Bad input is a
400 naming its `param`, an unknown model a 404, a full queue a 429.

An adapter on the serving core (app/api/serving.py): the body through `read_body`, the model
through the alias table, the engine's refusals through `engine_refusal`; it answers whole (an
embedding request does not stream).
"""

import asyncio
import base64
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import Embeddings, Engine, EngineError

from ..state import app_state
from .errors import ApiError, check_fields
from .openai_request import one_of, typed
from .serving import (aliased, cancel_on_disconnect, engine_refusal, model_loading, read_body,
                      wait_for_model)

ENCODINGS = ("float", "base64")
INPUT_TYPES = ("query", "document")
_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "input_type", "truncate",
           "keep_alive"}


async def embed(engine: Engine, inputs: Any, *, model: str | None, dimensions: int | None = None,
                truncate: bool = False, query: bool = False,
                keep_alive: Any = None, request: Request | None = None) -> Embeddings:
    """The vectors of `inputs`, engine refusals and failures as ApiErrors (for every API that
    embeds: OpenAI's here, Ollama's /api/embed). A client that leaves (`request`) cancels the
    request: the engine runs none of its chunks after that."""
    if engine.model_name is None:
        raise model_loading()
    try:
        # tokenising a few thousand inputs (or naming a model not yet seen) takes a while
        handle = await asyncio.to_thread(engine.embed, inputs, model=model, dimensions=dimensions,
                                         truncate=truncate, query=query, keep_alive=keep_alive)
        if request is None:
            return await handle.wait()
        watcher = asyncio.create_task(cancel_on_disconnect(request, [handle]))
        try:
            return await handle.wait()
        finally:
            watcher.cancel()
    except EngineError as exc:
        raise engine_refusal(exc) from None


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def embeddings(request: Request) -> Response:
    state = app_state(request)
    engine = state.engine
    try:
        body = check_fields(await read_body(request), _FIELDS)
        if body.get("input") is None:
            raise ApiError(400, "'input' is required", "input", "missing_required_parameter")
        encoding = one_of(body, "encoding_format", ENCODINGS, "float")
        input_type = one_of(body, "input_type", INPUT_TYPES, "document")
        model = typed(body, "model", str)
        if model is not None:  # `--model-alias text-embedding-*=...` for clients' own names
            model = aliased(state.aliases, model)
        await wait_for_model(request)  # a model that is loading: wait for it a while
        result = await embed(engine, body["input"], model=model,
                             dimensions=typed(body, "dimensions", int),
                             truncate=bool(typed(body, "truncate", bool)),
                             query=input_type == "query", keep_alive=body.get("keep_alive"),
                             request=request)
    except ApiError as err:
        return err.response()
    return JSONResponse({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding)}
                 for i, v in enumerate(result.vectors)],
        "model": result.model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    })


routes = [Route("/v1/embeddings", embeddings, methods=["POST"])]
