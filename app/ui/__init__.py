"""The chat UI: server-rendered pages and htmx fragments (pages.py), the model picker (picker.py),
a WebSocket per open conversation (chat_socket.py) whose turns run in chat_turn.py, the notice
for conversations longer than the context (context_notice.py), the MCP tools panel
(tools_panel.py), the microphone and read-aloud buttons' routes (voice.py). Export/import (app/exports.py) and
attachments (app/attachments.py) are pages of the UI too, built on its views."""

from . import chat_socket, context_notice, pages, picker, tools_panel, voice

routes = [*pages.routes, *context_notice.routes, *picker.routes, *chat_socket.routes,
          *tools_panel.routes, *voice.routes]
