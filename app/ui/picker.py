"""The model picker: switch the loaded model, reload it with other load-time options (int8
activations on the CPU kernels), download one from a hub and delete a downloaded one, with
progress sent as server-sent events."""

import asyncio
import copy
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import (DownloadCancelled, DownloadProgress, EngineError, compute_path, list_models,
                    pull_model, remove_model)

from ..model_jobs import ModelDownload, begin_switch
from ..sse import sse
from ..state import app_state
from .views import read_form, render


async def switch_model(request: Request) -> Response:
    state = app_state(request)
    engine = state.engine
    switch = state.switch
    name = str((await read_form(request)).get("name", ""))
    if not switch.loading and name != engine.model_name:
        if name not in {m.name for m in engine.list_models()}:
            switch.error = f"Unknown model {name!r}."
        else:
            begin_switch(switch, engine, name)
    return HTMLResponse(render("_models.html", **models_context(request)))


async def load_options(request: Request) -> Response:
    """The picker's load-time options: "int8_activations" ("on" or absent) reloads the current
    model on the CPU kernels' int8-activation path or the exact one, through the one model
    switch; nothing happens where the model does not run on the kernels or nothing changes."""
    state = app_state(request)
    engine = state.engine
    switch = state.switch
    wanted = (await read_form(request)).get("int8_activations") == "on"
    current = engine.int8_activations
    if not switch.loading and current is not None and wanted != current:
        begin_switch(switch, engine, engine.model_name, int8_activations=wanted)
    return HTMLResponse(render("_models.html", **models_context(request)))


async def model_progress(request: Request) -> Response:
    """Server-sent events while a model loads: `progress` text, then `done` with the new picker."""
    switch = app_state(request).switch
    return _progress(request, lambda: switch.loading, switch.describe)


def _progress(request: Request, busy: Callable[[], bool], describe: Callable[[], str]) -> Response:
    """Server-sent events while `busy()`: `describe()` as `progress` every half second, then
    `done` with the picker as it is then."""
    async def events() -> AsyncIterator[str]:
        while busy():
            yield sse(describe(), "progress")
            await asyncio.sleep(0.5)
        yield sse(render("_models.html", **models_context(request)), "done")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def start_download(request: Request) -> Response:
    state = app_state(request)
    download = state.download
    spec = str((await read_form(request)).get("spec", "")).strip()
    if not download.active and spec:
        fresh = ModelDownload(spec=spec)
        state.download = fresh

        def progress(p: DownloadProgress) -> None:
            fresh.progress = p

        async def run() -> None:
            try:
                name, _ = await asyncio.to_thread(pull_model, spec, progress, fresh.cancel)
                fresh.finished = f"Downloaded {name}."
            except DownloadCancelled:
                fresh.error = "Download cancelled; downloading again fetches only what is missing."
            except EngineError as exc:
                fresh.error = str(exc)

        fresh.task = asyncio.create_task(run())
    return HTMLResponse(render("_models.html", **models_context(request)))


async def cancel_download(request: Request) -> Response:
    download = app_state(request).download
    download.cancel.set()
    if download.task is not None:
        await asyncio.wait([download.task], timeout=30)
    return HTMLResponse(render("_models.html", **models_context(request)))


async def download_progress(request: Request) -> Response:
    """Server-sent events while a download runs: `progress` text, then `done` with the picker."""
    download = app_state(request).download
    return _progress(request, lambda: download.active, download.describe)


async def delete_model(request: Request) -> Response:
    """Delete a downloaded model (the page asked for confirmation); never the loaded one."""
    state = app_state(request)
    engine = state.engine
    download = state.download
    name = str((await read_form(request)).get("name", ""))
    found = next((m for m in list_models() if m.name == name), None)
    download.finished = None
    if found is None or found.source != "hf-cache":
        download.error = f"{name} is not a downloaded model."
    elif name == engine.model_name:
        download.error = f"{name} is in use: switch to another model before deleting it."
    else:
        try:
            await asyncio.to_thread(remove_model, name)
            download.error, download.finished = None, f"Deleted {name}."
        except EngineError as exc:
            download.error = str(exc)
    return HTMLResponse(render("_models.html", **models_context(request)))


def _shown_once(download: ModelDownload) -> ModelDownload:
    """The download as this render shows it; its finished or error notice is then cleared, so a
    notice ("Deleted x.", "Downloaded x.", an error) shows once and never again on later renders."""
    if download.active:
        return download
    shown = copy.copy(download)
    download.error = download.finished = None
    return shown


def models_context(request: Request) -> dict[str, Any]:
    state = app_state(request)
    engine = state.engine
    cluster = state.cluster  # a sharded model (engine/distributed/)
    return {"models": engine.list_models(), "current_model": engine.model_name,
            "switch": state.switch, "download": _shown_once(state.download),
            "resident": engine.status().resident,
            # None where the model does not run on the CPU kernels: the option is not shown
            "int8_activations": engine.int8_activations,
            "compute_path": compute_path(engine.int8_activations),
            "sharded_over": cluster.health()["world_size"] if cluster else None}


routes = [
    Route("/models/switch", switch_model, methods=["POST"]),
    Route("/models/options", load_options, methods=["POST"]),
    Route("/models/progress", model_progress),
    Route("/models/download", start_download, methods=["POST"]),
    Route("/models/download/cancel", cancel_download, methods=["POST"]),
    Route("/models/download/progress", download_progress),
    Route("/models/delete", delete_model, methods=["POST"]),
]
