"""The chat UI: server-rendered pages and htmx fragments (pages.py), the model picker (picker.py),
a WebSocket per open conversation (chat_socket.py), export/import (exports.py), attachments
(attachments.py) and the notice for conversations longer than the context (overflow.py)."""

from . import attachments, chat_socket, exports, overflow, pages, picker
from .model_switch import ModelSwitch

routes = [*pages.routes, *exports.routes, *attachments.routes, *overflow.routes, *picker.routes,
          *chat_socket.routes]

__all__ = ["ModelSwitch", "routes"]
