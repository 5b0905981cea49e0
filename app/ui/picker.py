"""The model picker: pick the open conversation's model (the model menu, `_models.html`; loaded
into the engine's model pool beside the others and made the default for new conversations and
requests that name none), reload it with other load-time options (int8 activations on the CPU
kernels), see the models in memory and edit a model's own settings (app/ui/model_pool.py),
download one from a hub and delete a downloaded one (Settings › Model, `_model_settings.html`). A load in progress (the
server's first, or a switch) shows above the conversation (`_load_status.html`); a load's and a
download's progress go out as server-sent events, each in the one progress element
(`_progress.html`, `progress_view`)."""

import asyncio
import copy
import os
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import (KV_BITS_ENV, LOAD_STAGES, DownloadCancelled, DownloadProgress, EngineError,
                    LoadStage, compute_path, list_models, pull_model, remove_model)

from ..model_jobs import ModelDownload, ModelSwitch, begin_switch
from .model_pool import pool_context, save_settings
from ..sse import sse
from ..state import app_state
from .views import read_form, render

# How often a progress stream looks for news (it sends only what changed).
PROGRESS_POLL_S = 0.25
STAGE_LABELS: dict[LoadStage, str] = {
    "downloading": "Download", "converting": "Convert to MLX", "building kernels":
    "Build the CPU kernels (first time only)", "loading": "Load the weights",
    "warming up": "Warm up", "ready": "Ready"}


@dataclass(frozen=True)
class StageView:
    stage: LoadStage
    label: str
    state: str  # "done", "current" or "pending"


@dataclass(frozen=True)
class ProgressView:
    """What the progress element shows: text, a fraction for the bar (None: unknown), stages."""

    text: str
    label: str  # the bar's accessible name
    fraction: float | None = None
    stages: tuple[StageView, ...] = ()


def load_view(switch: ModelSwitch) -> ProgressView:
    """A model load as the progress element shows it: its stages in order, each done, current
    or still to come (those a later stage skipped, having nothing to do, left out); the bytes
    while downloading."""
    current = switch.stage
    reached = max((LOAD_STAGES.index(s) for s in switch.passed), default=-1)
    stages = []
    for i, stage in enumerate(LOAD_STAGES[:-1]):  # "ready" ends the load: the element goes
        if stage not in switch.passed and i < reached:
            continue
        state = "current" if stage == current else "done" if stage in switch.passed else "pending"
        stages.append(StageView(stage, STAGE_LABELS[stage], state))
    download = switch.progress.download if switch.progress is not None else None
    fraction = (download.done_bytes / download.total_bytes
                if download is not None and current == "downloading" and download.total_bytes
                else None)
    text = (f"{switch.name} is ready (loaded in {switch.took:.0f} s)." if current == "ready"
            else switch.describe())
    return ProgressView(text, f"Loading {switch.name}", fraction, tuple(stages))


def download_view(download: ModelDownload) -> ProgressView:
    p = download.progress
    fraction = p.done_bytes / p.total_bytes if p is not None and p.total_bytes else None
    return ProgressView(download.describe(), f"Downloading {download.spec}", fraction)


async def switch_model(request: Request) -> Response:
    """Pick `name` for the conversation `conversation` (when given) and load it, the other models
    staying loaded while the memory budget allows."""
    state = app_state(request)
    engine = state.engine
    switch = state.switch
    form = await read_form(request)
    name, cid = str(form.get("name", "")), _conversation_id(form.get("conversation"))
    # a listed model, or the last load's own name again (Try again: it may be a path)
    known = name in {m.name for m in engine.list_models()} or name == switch.name
    if known and cid is not None and state.storage.get_conversation(cid) is not None:
        state.storage.update_conversation(cid, model=name)
    if not switch.loading and name != engine.model_name:
        if not known:
            switch.error = f"Unknown model {name!r}."
        else:
            begin_switch(switch, engine, name)
    return _with_status(request, "_models.html", cid)


async def model_settings(request: Request) -> Response:
    """Save a model's own settings (app/ui/model_pool.py); Settings › Model shows them."""
    form = await read_form(request)
    notice, failure = save_settings(app_state(request).engine, form)
    return HTMLResponse(render("_model_settings.html", **models_context(
        request, settings_of=form.get("name") or None), settings_notice=notice,
        settings_failure=failure))


def _conversation_id(value: object) -> int | None:
    return int(value) if isinstance(value, str) and value.isdigit() else None


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
    return _with_status(request, "_model_settings.html")


def _with_status(request: Request, template: str,
                 conversation: int | None = None) -> HTMLResponse:
    """`template` as the picker is now, and the load status (out of band): a load just began."""
    context = models_context(request, conversation)
    return HTMLResponse(render(template, **context) + _status(context))


def _status(context: dict[str, Any]) -> str:
    """The load status and the model's name, out of band."""
    return (render("_load_status.html", oob=True, **context)
            + render("_model_name.html", oob=True, **context))


async def model_progress(request: Request) -> Response:
    """Server-sent events while a model loads: its progress element at each change, then `done`
    with the load status as it ends (and the model menu, out of band)."""
    switch = app_state(request).switch

    def done() -> str:
        context = models_context(request)
        return (render("_load_status.html", just_loaded=True, **context)
                + render("_models.html", oob=True, **context)
                + render("_model_name.html", oob=True, **context)
                + (render("_model_settings.html", oob=True, **context)
                   if context["on_settings"] else ""))
    return _progress(lambda: switch.loading, lambda: load_view(switch), done)


def _progress(busy: Callable[[], bool], view: Callable[[], ProgressView],
              done: Callable[[], str]) -> Response:
    """Server-sent events while `busy()`: the progress element each time it changes (looked at
    every PROGRESS_POLL_S, so a stage is sent as it begins), then `done()` as `done`."""
    async def events() -> AsyncIterator[str]:
        shown = None
        while busy():
            html = render("_progress.html", view=view())
            if html != shown:
                yield sse(html, "progress")
                shown = html
            await asyncio.sleep(PROGRESS_POLL_S)
        yield sse(done(), "done")

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
    return HTMLResponse(render("_model_settings.html", **models_context(request)))


async def cancel_download(request: Request) -> Response:
    download = app_state(request).download
    download.cancel.set()
    if download.task is not None:
        await asyncio.wait([download.task], timeout=30)
    return HTMLResponse(render("_model_settings.html", **models_context(request)))


async def download_progress(request: Request) -> Response:
    """Server-sent events while a download runs: its progress element, then `done` with
    Settings › Model as it is then."""
    download = app_state(request).download
    return _progress(lambda: download.active, lambda: download_view(download),
                     lambda: render("_model_settings.html", **models_context(request)))


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
    return HTMLResponse(render("_model_settings.html", **models_context(request)))


def _shown_once(download: ModelDownload) -> ModelDownload:
    """The download as this render shows it; its finished or error notice is then cleared, so a
    notice ("Deleted x.", "Downloaded x.", an error) shows once and never again on later renders."""
    if download.active:
        return download
    shown = copy.copy(download)
    download.error = download.finished = None
    return shown


def models_context(request: Request, conversation: int | None = None,
                   settings_of: str | None = None) -> dict[str, Any]:
    """The picker's context; with a `conversation`, its model is the one shown as picked; the
    model settings shown are `settings_of`'s (default: the picked model's)."""
    state = app_state(request)
    engine = state.engine
    cluster = state.cluster  # a sharded model (engine/distributed/)
    loaded = engine.model_name is not None
    download = _shown_once(state.download)
    # asked from (or for) the Settings page, whose Model section a load's end renders anew too
    on_settings = (request.url.path == "/settings" or request.query_params.get("page") == "settings"
                   or urlsplit(request.headers.get("hx-current-url", "")).path == "/settings")
    models = engine.list_models()
    conv = state.storage.get_conversation(conversation) if conversation is not None else None
    current = conv.model if conv is not None and conv.model in {m.name for m in models} \
        else engine.model_name
    return {"models": models, "current_model": current, "conversation_id": conversation,
            **pool_context(engine, settings_of or current),
            "switch": state.switch, "load_view": load_view(state.switch),
            "download": download, "download_view": download_view(download),
            "resident": engine.status().resident,
            # None where the model does not run on the CPU kernels: the option is not shown
            "int8_activations": engine.int8_activations,
            # read once a model is loaded: before, it could build the CPU kernels right here
            "compute_path": compute_path(engine.int8_activations) if loaded else None,
            "kv_bits": os.environ.get(KV_BITS_ENV) or None,
            "sharded_over": cluster.health()["world_size"] if cluster else None,
            "on_settings": on_settings}


routes = [
    Route("/models/switch", switch_model, methods=["POST"]),
    Route("/models/settings", model_settings, methods=["POST"]),
    Route("/models/options", load_options, methods=["POST"]),
    Route("/models/progress", model_progress),
    Route("/models/download", start_download, methods=["POST"]),
    Route("/models/download/cancel", cancel_download, methods=["POST"]),
    Route("/models/download/progress", download_progress),
    Route("/models/delete", delete_model, methods=["POST"]),
]
