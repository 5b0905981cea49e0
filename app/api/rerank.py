"""Reranking for RAG front-ends (Open WebUI, LibreChat, Dify): `POST /v1/rerank`, also under
llama.cpp's `/rerank`, `/reranking` and `/v1/reranking`, over the engine's rerank requests
(`Engine.rerank`: an LLM reranker's yes/no relevance, or an embedding model's cosine
similarity; engine/loading/rerank_recipe.py).

    {"model": "...", "query": "...", "documents": ["...", {"text": "..."}], "top_n": 3,
     "return_documents": true, "instruction": "..."}
    -> {"model", "object": "list", "usage": {"prompt_tokens", "total_tokens"},
        "results": [{"index", "relevance_score", "document": {"text"}}]}   # best first

The Jina/Cohere shape, as llama.cpp answers it; with `texts` instead of `documents` it is the
text-embeddings-inference shape llama.cpp also takes: a bare array of `{"index", "score"}`
(`"text"` too with `return_text`). `model` names a reranker or embedding model (loaded beside the
chat model, after the `--model-alias` table) or is absent (the loaded model, which must be one).
`top_n` keeps the best n (all when absent or larger); `return_documents` (default true, as Jina)
echoes each document; `truncate` (default true, as Cohere and Jina) cuts a document that does not
fit the model's context; `instruction` replaces an LLM reranker's default task instruction.
"""

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import Engine, EngineError, Ranking

from ..state import app_state
from .errors import ApiError
from .openai_request import typed
from .serving import aliased, engine_refusal, model_loading, read_body, wait_for_model


def _documents(body: dict[str, Any], name: str) -> list[str]:
    """The documents as texts: strings, or objects with a `text` string (Cohere's and Jina's)."""
    value = body.get(name)
    if not isinstance(value, list) or not value:
        raise ApiError(400, f"'{name}' must be a non-empty array of strings", name,
                       "invalid_value")
    texts = []
    for i, doc in enumerate(value):
        if isinstance(doc, dict) and isinstance(doc.get("text"), str):
            doc = doc["text"]
        if not isinstance(doc, str):
            raise ApiError(400, f"'{name}[{i}]' must be a string or an object with a 'text' "
                                "string", name, "invalid_type")
        texts.append(doc)
    return texts


def parse(body: Any) -> tuple[str, list[str], dict[str, Any], bool]:
    """(query, documents, the rerank options, whether it is the TEI shape) of a body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    tei = "texts" in body and "documents" not in body
    documents = _documents(body, "texts" if tei else "documents")
    query = typed(body, "query", str)
    if query is None or not query.strip():
        raise ApiError(400, "'query' must be a non-empty string", "query", "invalid_value")
    truncate = typed(body, "truncate", bool)
    options = {"model": typed(body, "model", str), "instruction": typed(body, "instruction", str),
               "truncate": True if truncate is None else truncate,
               "keep_alive": body.get("keep_alive")}
    return query, documents, options, tei


def _top_n(body: dict[str, Any], count: int) -> int:
    top_n = typed(body, "top_n", int)
    if top_n is not None and top_n < 1:
        raise ApiError(400, "'top_n' must be a positive integer", "top_n", "invalid_value")
    return min(top_n or count, count)


async def rank(engine: Engine, query: str, documents: list[str], **options: Any) -> Ranking:
    """The engine's ranking, its refusals and failures as ApiErrors."""
    if engine.model_name is None:
        raise model_loading()
    try:
        # tokenising many documents (or naming a model not yet seen) takes a while
        handle = await asyncio.to_thread(engine.rerank, query, documents, **options)
        return await handle.wait()
    except EngineError as exc:
        raise engine_refusal(exc) from None


async def rerank(request: Request) -> Response:
    state = app_state(request)
    engine = state.engine
    try:
        body = await read_body(request)
        query, documents, options, tei = parse(body)
        top_n = _top_n(body, len(documents))
        echo = typed(body, "return_text" if tei else "return_documents", bool)
        echo = (not tei) if echo is None else echo
        if options["model"] is not None:  # `--model-alias` for clients' own names
            options["model"] = aliased(state.aliases, options["model"])
        await wait_for_model(request)  # a model that is loading: wait for it a while
        ranking = await rank(engine, query, documents, **options)
    except ApiError as err:
        return err.response(request.url.path)
    order = sorted(range(len(documents)), key=lambda i: -ranking.scores[i])[:top_n]
    if tei:
        return JSONResponse([{"index": i, "score": ranking.scores[i],
                              **({"text": documents[i]} if echo else {})} for i in order])
    return JSONResponse({
        "model": ranking.model, "object": "list",
        "usage": {"prompt_tokens": ranking.prompt_tokens, "total_tokens": ranking.prompt_tokens},
        "results": [{"index": i, "relevance_score": ranking.scores[i],
                     **({"document": {"text": documents[i]}} if echo else {})} for i in order]})


routes = [Route(path, rerank, methods=["POST"])
          for path in ("/v1/rerank", "/rerank", "/reranking", "/v1/reranking")]
