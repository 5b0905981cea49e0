"""`/health`: whether the engine serves (ok, loading, failed: 503; stalled: the scheduler has been
in one tick or one embedding chunk for more than STALLED_S, with `scheduler_busy_s`), which model,
how many requests are generating, the device, and a sharded model's cluster. `/metrics`: Prometheus' text format
(app/metrics.py)."""

import asyncio

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import device_report

from ..state import app_state

STALLED_S = 30.0  # one tick or chunk of the scheduler longer than this: /health says "stalled"


async def health(request: Request) -> JSONResponse:
    state = app_state(request)
    engine = state.engine
    busy = engine.busy_s
    status = "failed" if engine.halted else "loading" if not engine.model_name else \
        "stalled" if busy > STALLED_S else "ok"
    cluster = state.cluster  # a sharded model (engine/distributed/)
    return JSONResponse({"status": status, "model": engine.model_name,
                         "generating": len(state.runs),
                         "device": device_report(int8=engine.int8_activations),
                         **({"error": engine.halted} if engine.halted else {}),
                         **({"scheduler_busy_s": round(busy, 1)} if status == "stalled" else {}),
                         **({"distributed": cluster.health()} if cluster else {})},
                        status_code=503 if engine.halted else 200)


async def metrics(request: Request) -> Response:
    """The exposition, collected in a worker thread (the engine's reading takes its lock)."""
    body = await asyncio.to_thread(app_state(request).metrics.exposition)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


routes = [Route("/health", health), Route("/metrics", metrics, methods=["GET"])]
