"""mlxchat's app: the Starlette application around a started engine, which it reaches only through
the engine's public API (`engine/__init__.py`).

- `server.py` builds the app (`create_app`: routes, the security middleware, the `AppState`) and
  runs it (`serve`); `cli/` is the `mlxchat` command.
- `state.py`: `AppState`, everything the routes share, read through `app_state(request)`.
- `api/`: the programmatic APIs (OpenAI, Anthropic, Responses, Ollama), each an adapter over one
  serving core; `ui/`: the chat UI's pages, fragments and WebSocket.
- `storage/`: the database; `uploads/` and `doc_index/`: attached files and the document index;
  `mcp/`: MCP tools in the chat; `security/`: the guards of a server on the user's machine.
- Shared by the API and the UI: `submission.py` (submitting an engine request), `runs.py` (the
  generations in flight), `model_jobs.py` (the one model switch or download), `context_window.py`
  (fitting a conversation into the context), `sse.py` (server-sent events).
"""
