"""The Settings page (`/settings`): what is set for the whole app rather than for one chat — the
model and how it runs (switching, int8 activations, the KV cache's format, downloads), importing
and exporting chats, MCP servers, the API key, the theme. A chat's own settings (sampling, system
prompt, its tools) stay in that chat's panels; the sidebar holds only the chats."""

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from ..state import app_state
from .picker import models_context
from .tools_panel import servers_context
from .views import render


async def settings_page(request: Request) -> Response:
    state = app_state(request)
    latest = state.storage.list_conversations(limit=1)
    html = render("settings.html", api_key=bool(state.api_key), logout=bool(state.api_key),
                  back=f"/c/{latest[0].id}" if latest else "/", remote=not state.mcp_edit,
                  **models_context(request, settings_of=request.query_params.get("model")),
                  **servers_context(request))
    return HTMLResponse(html)


routes = [Route("/settings", settings_page)]
