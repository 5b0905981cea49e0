"""The chat UI: server-rendered pages and htmx fragments (pages.py), the model picker (picker.py)
a WebSocket per open conversation (chat_socket.py) and export/import (exports.py)."""

from . import chat_socket, exports, pages, picker
from .picker import ModelSwitch

routes = [*pages.routes, *exports.routes, *picker.routes, *chat_socket.routes]

__all__ = ["ModelSwitch", "routes"]
