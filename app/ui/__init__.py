"""The chat UI: server-rendered pages and htmx fragments (pages.py), the model picker (picker.py),
a WebSocket per open conversation (chat_socket.py) whose turns run in chat_turn.py, the notice
for conversations longer than the context (context_notice.py), the MCP tools panel
(tools_panel.py) and a turn's tool rounds on the page (tool_rounds.py), export and import
(exports.py), the composer's uploads (uploads.py) and attachments (attachments.py), the login
page (login.py), the microphone and read-aloud buttons (voice.py); model text becomes safe HTML
in markdown.py. routes.py gathers their routes."""
