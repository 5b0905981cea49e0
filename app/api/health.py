"""`/health`: whether the engine serves (ok; loading, with the load's stage; failed: 503 with
the reason; stalled: the scheduler has been in one tick or one embedding chunk for more than
STALLED_S, with `scheduler_busy_s`), which model, how many requests are generating, the device,
and a sharded model's cluster. `/metrics`: Prometheus' text format (app/metrics.py)."""

import asyncio
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import device_report

from ..model_jobs import ModelSwitch
from ..state import app_state

STALLED_S = 30.0  # one tick or chunk of the scheduler longer than this: /health says "stalled"


async def health(request: Request) -> JSONResponse:
    state = app_state(request)
    engine = state.engine
    switch = state.switch
    error = engine.halted or (switch.error if engine.model_name is None and not switch.loading
                              else None)
    busy = engine.busy_s
    status = "failed" if error else "loading" if not engine.model_name else \
        "stalled" if busy > STALLED_S else "ok"
    cluster = state.cluster  # a sharded model (engine/distributed/)
    # The device's compute path is read once a model is loaded: before, asking for it could
    # build the CPU kernels here, on the event loop, while the load builds them too.
    device = device_report(int8=engine.int8_activations) if engine.model_name else None
    return JSONResponse({"status": status, "model": engine.model_name,
                         "generating": len(state.runs), "device": device,
                         **({"loading": _loading(switch)} if status == "loading" else {}),
                         **({"error": error} if error else {}),
                         **({"scheduler_busy_s": round(busy, 1)} if status == "stalled" else {}),
                         **({"distributed": cluster.health()} if cluster else {})},
                        status_code=503 if error else 200)


def _loading(switch: ModelSwitch) -> dict[str, Any]:
    """The load in progress: the model, its stage (engine.LOAD_STAGES; None before the first is
    reported), the stages passed, and the bytes while downloading."""
    p = switch.progress
    download = p.download if p is not None else None
    return {"model": switch.name, "stage": switch.stage, "stages": list(switch.passed),
            **({"done_bytes": download.done_bytes, "total_bytes": download.total_bytes}
               if download else {})}


async def metrics(request: Request) -> Response:
    """The exposition, collected in a worker thread (the engine's reading takes its lock)."""
    body = await asyncio.to_thread(app_state(request).metrics.exposition)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


routes = [Route("/health", health), Route("/metrics", metrics, methods=["GET"])]
