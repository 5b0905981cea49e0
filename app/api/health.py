"""`/health`: whether the engine serves (ok, loading, failed: 503), which model, how many requests
are generating, the device, and a sharded model's cluster. `/metrics`: Prometheus' text format
(app/metrics.py)."""

import asyncio

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import device_report

from ..state import app_state


async def health(request: Request) -> JSONResponse:
    state = app_state(request)
    engine = state.engine
    status = "failed" if engine.halted else "ok" if engine.model_name else "loading"
    cluster = state.cluster  # a sharded model (engine/distributed/)
    return JSONResponse({"status": status, "model": engine.model_name,
                         "generating": len(state.runs),
                         "device": device_report(int8=engine.int8_activations),
                         **({"error": engine.halted} if engine.halted else {}),
                         **({"distributed": cluster.health()} if cluster else {})},
                        status_code=503 if engine.halted else 200)


async def metrics(request: Request) -> Response:
    """The exposition, collected in a worker thread (the engine's reading takes its lock)."""
    body = await asyncio.to_thread(app_state(request).metrics.exposition)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


routes = [Route("/health", health), Route("/metrics", metrics, methods=["GET"])]
