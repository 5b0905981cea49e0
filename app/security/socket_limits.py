"""The chat socket's limits, declared once: the server passes the frame size to uvicorn, and the
page reads it (`data-ws-max` on the chat) to refuse a larger message with a notice before sending,
rather than have the socket closed under it (static/app.js)."""

WS_MAX_BYTES = 1024 * 1024  # the largest frame a chat socket accepts
