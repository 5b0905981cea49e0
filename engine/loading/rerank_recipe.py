"""How a model reranks documents against a query, read from its own files; the scoring itself
is engine/decoding/rerank.py.

- `yes_no`: an LLM reranker (the Qwen3-Reranker family: a qwen3 causal LM whose folder or hub
  repository is named `*Reranker*`). Each (query, document) pair is written in its prompt format
  (`QWEN3_RERANKER`) and its relevance is the probability of "yes" against "no" at the end of it,
  as the model card computes it.
- `cosine`: a dedicated embedding model (sentence-transformers files, engine/loading/
  embedding_recipe.py): the cosine similarity of the query's vector (with its query prompt) and
  each document's.

A chat model has neither: its mean-pooled hidden states are not trained to rank, so it is not
offered as a reranker. Cross-encoders (BERT-family `*ForSequenceClassification` rerankers) are
not run: no well-kept MLX port of them serves on both the CPU and CUDA (mlx-embeddings runs their
encoders for embeddings only; mlx-raclate's classifiers are macOS-only).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .embedding_recipe import _read_json, embedding_recipe

Method = Literal["yes_no", "cosine"]


@dataclass(frozen=True)
class PairPrompt:
    """An LLM reranker's prompt around one (instruction, query, document)."""

    head: str  # before the pair: the system turn and the opening of the user turn
    body: str  # `{instruction}`, `{query}` and `{document}` filled in
    tail: str  # after it: the end of the user turn and the opening of the answer
    instruction: str  # the default task instruction
    yes: str = "yes"
    no: str = "no"

    def text(self, query: str, document: str, instruction: str | None = None) -> str:
        body = self.body.format(instruction=instruction or self.instruction, query=query,
                                document=document)
        return f"{self.head}{body}{self.tail}"


# Qwen3-Reranker's format, as its model card writes it.
QWEN3_RERANKER = PairPrompt(
    head="<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
         "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\"."
         "<|im_end|>\n<|im_start|>user\n",
    body="<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    tail="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    instruction="Given a web search query, retrieve relevant passages that answer the query",
)

# LLM reranker families: (model_type, a fragment of the folder's or repository's name, format).
LLM_RERANKERS = (("qwen3", "reranker", QWEN3_RERANKER),)


@dataclass(frozen=True)
class RerankRecipe:
    method: Method
    prompt: PairPrompt | None = None  # `yes_no` only


def rerank_recipe(folder: Path) -> RerankRecipe | None:
    """How the model in `folder` reranks, or None when it does not."""
    config = _read_json(folder / "config.json") or {}
    names = " ".join(_names(Path(folder)) + _names(Path(folder).resolve())).lower()
    for model_type, fragment, prompt in LLM_RERANKERS:
        if config.get("model_type") == model_type and fragment in names:
            return RerankRecipe("yes_no", prompt)
    if embedding_recipe(folder).dedicated:
        return RerankRecipe("cosine")
    return None


def _names(folder: Path) -> list[str]:
    """The names a model folder goes by: its own, and its repository's for a hub snapshot
    (`models--Qwen--Qwen3-Reranker-0.6B/snapshots/<commit>`)."""
    if folder.parent.name == "snapshots":
        return [folder.name, folder.parent.parent.name]
    return [folder.name]
