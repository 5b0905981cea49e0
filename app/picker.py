"""The model picker: switch the loaded model, with progress sent as server-sent events."""

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import EngineError

from .sse import sse
from .views import models_context, read_form, render

@dataclass
class ModelSwitch:
    """The one model load that may be in progress, shown in the model picker."""

    name: str | None = None
    stage: str = ""
    started: float = 0.0
    error: str | None = None
    task: asyncio.Task | None = None

    @property
    def loading(self) -> bool:
        return self.task is not None and not self.task.done()

    def describe(self) -> str:
        return f"{self.stage.capitalize() or 'Loading'} {self.name}… {time.time() - self.started:.0f} s"


async def switch_model(request: Request) -> Response:
    engine = request.app.state.engine
    switch: ModelSwitch = request.app.state.switch
    name = str((await read_form(request)).get("name", ""))
    if not switch.loading and name != engine.model_name:
        if name not in {m.name for m in engine.list_models()}:
            switch.error = f"Unknown model {name!r}."
        else:
            switch.name, switch.stage, switch.started, switch.error = name, "", time.time(), None

            def progress(stage: str) -> None:
                switch.stage = stage

            async def load() -> None:
                try:
                    await asyncio.to_thread(engine.switch_model, name, progress=progress)
                except EngineError as exc:
                    switch.error = f"Could not load {name}: {exc}"

            switch.task = asyncio.create_task(load())
    return HTMLResponse(render("_models.html", **models_context(request)))


async def model_progress(request: Request) -> Response:
    """Server-sent events while a model loads: `progress` text, then `done` with the new picker."""
    switch: ModelSwitch = request.app.state.switch

    async def events() -> AsyncIterator[str]:
        while switch.loading:
            yield sse(switch.describe(), "progress")
            await asyncio.sleep(0.5)
        yield sse(render("_models.html", **models_context(request)), "done")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


routes = [
    Route("/models/switch", switch_model, methods=["POST"]),
    Route("/models/progress", model_progress),
]
