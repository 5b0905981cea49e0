"""The chat UI: server-rendered pages and htmx fragments (pages.py), the model picker (picker.py)
and a WebSocket per open conversation (chat_socket.py)."""

from . import chat_socket, pages, picker
from .picker import ModelSwitch

routes = [*pages.routes, *picker.routes, *chat_socket.routes]

__all__ = ["ModelSwitch", "routes"]
