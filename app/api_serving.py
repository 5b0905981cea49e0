"""What every protocol adapter shares on its way to the engine: reading the body (parsed and
checked off the event loop when large), choosing the model a client names (with the alias table
for clients that send their own vendor's names), and watching the client so that leaving cancels
the requests. (`Engine.submit(fit_max_tokens=True)` fits `max_tokens` into the context left.)

An adapter (OpenAI chat and completions, Anthropic Messages, Ollama) parses its request into
engine messages + `SamplingParams` + `ToolRequest`, submits through `api.submit_choices`, and
encodes the engine's events in its own wire format; errors in its shape (app/error_shapes.py).
"""

import asyncio
import contextlib
import fnmatch
from typing import Any, AsyncIterator, Sequence

from starlette.requests import Request

from engine import RequestHandle

from .api import INLINE_BODY_BYTES, cancel_on_disconnect, load_body
from .api_choices import tracked
from .api_errors import ApiError
from .api_models import use_model


async def read_body(request: Request) -> Any:
    """The request's JSON body, checked (depth, Unicode); large bodies are parsed in a thread."""
    raw = await request.body()
    return load_body(raw) if len(raw) < INLINE_BODY_BYTES else await asyncio.to_thread(load_body, raw)


def parse_aliases(pairs: Sequence[str]) -> dict[str, str]:
    """`NAME=MODEL` pairs (`--model-alias`) as a table; NAME may hold `*` wildcards
    (`claude-*=qwen3-8b`). Raises ValueError naming a malformed pair."""
    table = {}
    for pair in pairs:
        name, sep, model = pair.partition("=")
        if not sep or not name.strip() or not model.strip():
            raise ValueError(f"--model-alias takes NAME=MODEL, got {pair!r}")
        table[name.strip()] = model.strip()
    return table


def aliased(aliases: dict[str, str], name: str) -> str:
    """The model `name` stands for in the alias table (exact names first, then patterns)."""
    if name in aliases:
        return aliases[name]
    return next((m for pattern, m in aliases.items() if fnmatch.fnmatchcase(name, pattern)), name)


async def use_named_model(request: Request, name: Any) -> str:
    """Load the model a lenient client names and return the name that serves it: an alias
    (`--model-alias`), or a local model's own name, loads that model; any other name (Claude Code's
    `claude-*`, Codex's `gpt-*`) runs on the loaded model. Raises ApiError (503) while none is
    loaded."""
    engine = request.app.state.engine
    if isinstance(name, str):
        target = aliased(getattr(request.app.state, "aliases", {}), name)
        if target != engine.model_name and target in {m.name for m in engine.list_models()}:
            await use_model(request, target)
    if engine.model_name is None:
        raise ApiError(503, "a model is loading; try again shortly", "server_error",
                       "model_loading", headers={"Retry-After": "5"})
    return engine.model_name


@contextlib.asynccontextmanager
async def watched(request: Request, handles: list[RequestHandle]) -> AsyncIterator[None]:
    """While the block runs: the requests count in `/health`, and a client that leaves cancels
    them (as does leaving the block early)."""
    with tracked(request.app.state.runs, handles):
        watcher = asyncio.create_task(cancel_on_disconnect(request, handles))
        try:
            yield
        finally:
            watcher.cancel()
