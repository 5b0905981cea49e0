"""Rerank requests: a query and documents scored by a model's `rerank` method (engine/loading/
rerank_recipe.py), queued and run on the embedding queue (engine/scheduling/embedding_queue.py),
so a reranker loads, counts in the memory budget and unloads like a dedicated embedding model,
and its chunks run between scheduler ticks beside chat.

    ranking = engine.rerank("what is MLX?", ["MLX is ...", "Paris is ..."]).result()
    ranking.scores   # one per document, in document order
"""

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..decoding.rerank import cosine_scores, yes_no_scores
from ..errors import EngineError, InvalidRequest
from ..loading.rerank_recipe import RerankRecipe, rerank_recipe
from .embedding_queue import MAX_INPUTS, EmbeddingHandle, Embeddings

if TYPE_CHECKING:
    from .embedding_queue import EmbeddingQueue, _Model


@dataclass(frozen=True)
class Ranking:
    """A rerank request's answer: each document's relevance, in document order (`yes_no`: a
    probability in [0, 1]; `cosine`: a similarity in [-1, 1])."""

    scores: tuple[float, ...]
    prompt_tokens: int
    model: str
    method: str


@dataclass(eq=False)
class RerankHandle:
    """A submitted rerank request; its result is readable from any thread or loop."""

    _embedding: EmbeddingHandle
    _finish: Callable[[Embeddings], Ranking]

    def result(self, timeout: float | None = None) -> Ranking:
        """Block for the scores; raises the EngineError that failed the request."""
        return self._finish(self._embedding.result(timeout))

    async def wait(self) -> Ranking:
        return self._finish(await self._embedding.wait())


def submit_rerank(queue: "EmbeddingQueue", query: Any, documents: Any, *, model: str | None,
                  instruction: str | None = None, truncate: bool = True,
                  keep_alive: float | str | None = None) -> RerankHandle:
    """Validate and queue; raises InvalidRequest (with `field`) or Overloaded at once.
    `truncate`: cut a document that does not fit the model's context (as Cohere and Jina do)
    instead of refusing it."""
    target = queue.target(model, reranker=True)
    recipe = rerank_recipe(target.folder)
    if recipe is None:
        raise InvalidRequest(f"{target.name} cannot rerank: name a reranker (such as "
                             "Qwen3-Reranker) or an embedding model (such as Qwen3-Embedding) "
                             "in 'model'", field="model", code="model_not_reranker")
    if not isinstance(query, str) or not query.strip():
        raise InvalidRequest("query must be a non-empty string", field="query",
                             code="invalid_value")
    if not isinstance(documents, (list, tuple)) or not documents or \
            not all(isinstance(d, str) for d in documents):
        raise InvalidRequest("documents must be a non-empty array of strings", field="documents",
                             code="invalid_value")
    if len(documents) > MAX_INPUTS:
        raise InvalidRequest(f"{len(documents)} documents in one request; the maximum is "
                             f"{MAX_INPUTS}", field="documents", code="too_many_inputs")
    if instruction is not None and not isinstance(instruction, str):
        raise InvalidRequest("instruction must be a string", field="instruction",
                             code="invalid_type")
    if recipe.method == "yes_no":
        return _yes_no(queue, target, recipe, query, documents, instruction, truncate, keep_alive)
    rows = queue.tokenize(target, [query], truncate, True, field="query") + \
        queue.tokenize(target, list(documents), truncate, False, field="documents")

    def finish(result: Embeddings) -> Ranking:
        scores = cosine_scores(result.vectors)
        return Ranking(tuple(float(s) for s in scores), result.prompt_tokens, result.model,
                       "cosine")
    return RerankHandle(queue.queue(target, rows, keep_alive=keep_alive), finish)


def _yes_no(queue: "EmbeddingQueue", target: "_Model", recipe: RerankRecipe, query: str,
            documents: Sequence[str], instruction: str | None, truncate: bool,
            keep_alive: float | str | None) -> RerankHandle:
    prompt = recipe.prompt
    assert prompt is not None
    encode = _encoder(target.tokenizer)
    yes, no = _single(target, prompt.yes), _single(target, prompt.no)
    head, tail = encode(prompt.head), encode(prompt.tail)
    room = target.context_length - len(head) - len(tail)
    rows = []
    for i, document in enumerate(documents):
        body = encode(prompt.body.format(instruction=instruction or prompt.instruction,
                                         query=query, document=document))
        if len(body) > room:
            if not truncate:
                size = len(head) + len(body) + len(tail)
                raise InvalidRequest(f"documents[{i}] makes a prompt of {size} tokens, over "
                                     f"{target.name}'s context of {target.context_length}",
                                     field="documents", code="context_length_exceeded")
            body = body[:max(room, 0)]
        rows.append(head + body + tail)

    def finish(result: Embeddings) -> Ranking:
        return Ranking(tuple(float(s) for s in result.vectors[:, 0]), result.prompt_tokens,
                       result.model, "yes_no")
    run = functools.partial(yes_no_scores, yes=yes, no=no)
    return RerankHandle(queue.queue(target, rows, keep_alive=keep_alive, run=run), finish)


def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """Text to ids without special tokens, as the model card tokenises the prompt's parts."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    return lambda text: list(inner.encode(text, add_special_tokens=False))


def _single(target: "_Model", text: str) -> int:
    """The id of `text`, one token of the reranker's vocabulary."""
    inner = getattr(target.tokenizer, "_tokenizer", target.tokenizer)
    ids = inner.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise EngineError(f"{target.name} has no single token for {text!r}: it cannot score "
                          "relevance as a yes/no reranker")
    return int(ids[0])


