"""Which kind of embedding model a folder holds, read from its own files (sentence-transformers'
`modules.json`, the Pooling module's `config.json`, `config_sentence_transformers.json`); how the
vectors are computed from it: engine/decoding/pooling.py."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Pooling = Literal["last", "mean"]

# sentence-transformers' Pooling config keys, as our pooling names
_POOLING_KEYS: dict[str, Pooling] = {"pooling_mode_lasttoken": "last",
                                     "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class EmbeddingRecipe:
    """How one model turns tokens into a vector."""

    pooling: Pooling
    dedicated: bool  # an embedding model (sentence-transformers files), not a chat model's states
    query_prompt: str = ""  # prefixed to inputs embedded as search queries
    document_prompt: str = ""  # prefixed to the others (documents)

    @property
    def truncatable(self) -> bool:
        """Whether `dimensions` may cut the vector short: the decoder embedding models that ship
        sentence-transformers files (Qwen3-Embedding) are Matryoshka-trained; a chat model's
        pooled hidden state is not, so only its full width means anything."""
        return self.dedicated

    def prompt(self, query: bool) -> str:
        return self.query_prompt if query else self.document_prompt


CHAT_RECIPE = EmbeddingRecipe(pooling="mean", dedicated=False)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def embedding_recipe(folder: Path) -> EmbeddingRecipe:
    """The recipe of the model in `folder`: a dedicated one when its sentence-transformers files
    name a pooling we run (last token, mean), else a chat model's mean pooling."""
    modules = _read_json(folder / "modules.json")
    pooling: Pooling | None = None
    if isinstance(modules, list):
        for module in modules:
            if isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
                config = _read_json(folder / str(module.get("path", "")) / "config.json") or {}
                pooling = next((name for key, name in _POOLING_KEYS.items() if config.get(key)),
                               None)
    if pooling is None:
        return CHAT_RECIPE
    settings = _read_json(folder / "config_sentence_transformers.json") or {}
    prompts = settings.get("prompts") if isinstance(settings, dict) else None
    prompts = prompts if isinstance(prompts, dict) else {}
    return EmbeddingRecipe(pooling=pooling, dedicated=True,
                           query_prompt=str(prompts.get("query") or ""),
                           document_prompt=str(prompts.get("document") or ""))
