"""A capture server for recording what a coding agent sends, round after round: it answers Claude
Code (`/v1/messages`) and Codex CLI (`/v1/responses`) with a scripted session (tool calls, then a
short text) and writes every request it gets, as JSON lines, to a file; `trim` turns that into a
recording (bench/data/agents/*.json) that `bench.agents` replays against mlxchat.

    python -m bench.agent_capture serve --out /tmp/claude.jsonl [--port 8399] [--script claude|codex]
    python -m bench.agent_capture trim /tmp/claude.jsonl bench/data/agents/claude-code.json \
        --client "Claude Code 2.1.332" --command "claude -p ..."

Point the client at the server, e.g. `ANTHROPIC_BASE_URL=http://127.0.0.1:8399 claude -p "..."` or
`codex exec -c model_provider=capture -c 'model_providers.capture={name="capture",
base_url="http://127.0.0.1:8399/v1", wire_api="responses"}' "..."`.

The script of tool calls (`SCRIPTS`) drives the client through a few rounds: each round's request
carries everything before it plus the tool's result, as a real session's does. Requests without
tools (a title, a quota check) get a one-word answer. Credentials never reach the file: the
`authorization` and `x-api-key` headers are dropped.

A recording keeps the session's requests (those with tools) exactly, in less room: the fields
every round shares once (`body`), each distinct message or input item once (`items`), and each
round as the list of its items (`rounds`); ids of the machine and the session (`metadata`,
`client_metadata`, `prompt_cache_key`) and all headers but the protocol's are trimmed.
"""

from __future__ import annotations

import argparse
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# Each script: the tool calls of rounds 1, 2, ... (tool name, its input); `{cwd}` is replaced by
# the client's working directory as its system prompt states it. The round after the last call
# answers with text.
SCRIPTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "claude": [("Read", {"file_path": "{cwd}/README.md"}),
               ("Bash", {"command": "ls tides", "description": "List the package"}),
               ("Read", {"file_path": "{cwd}/notes.pdf"})],
    "codex": [("exec_command", {"cmd": "cat README.md"}),
              ("exec_command", {"cmd": "ls tides"}),
              ("exec_command", {"cmd": "cat tides/model.py"})],
}
SECRET_HEADERS = {"authorization", "x-api-key", "cookie"}


def _sse(kind: str | None, payload: dict[str, Any]) -> bytes:
    head = f"event: {kind}\n" if kind else ""
    return f"{head}data: {json.dumps(payload)}\n\n".encode()


def _cwd(body: dict[str, Any]) -> str:
    """The working directory the client's system prompt names ("Primary working directory: ..."
    for Claude Code, `<cwd>` in Codex's environment context)."""
    text = json.dumps(body)
    for marker, end in (("working directory: ", "\\n"), ("<cwd>", "</cwd>")):
        if marker in text:
            return text.split(marker, 1)[1].split(end, 1)[0]
    return "."


def _filled(value: Any, cwd: str) -> Any:
    if isinstance(value, str):
        return value.replace("{cwd}", cwd)
    if isinstance(value, list):
        return [_filled(v, cwd) for v in value]
    return {k: _filled(v, cwd) for k, v in value.items()}


class Capture(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    out: Path
    script: list[tuple[str, dict[str, Any]]]
    lock = threading.Lock()
    seen = 0

    def log_message(self, *args: Any) -> None:
        pass

    def _record(self, body: Any) -> None:
        with Capture.lock:
            Capture.seen += 1
            entry = {"n": Capture.seen, "method": self.command, "path": self.path,
                     "headers": {k.lower(): v for k, v in self.headers.items()
                                 if k.lower() not in SECRET_HEADERS},
                     "body": body}
            with self.out.open("a") as f:
                f.write(json.dumps(entry) + "\n")

    def _json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, chunks: list[bytes]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def do_GET(self) -> None:
        self._record(None)
        if self.path.rstrip("/").endswith("/models"):
            self._json(200, {"object": "list", "data": [{"id": "capture", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not here"}})

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        self._record(body)
        path = self.path.split("?", 1)[0]
        if path.endswith("/count_tokens"):
            self._json(200, {"input_tokens": len(raw) // 4})
        elif path.endswith("/v1/messages"):
            self._messages(body)
        elif path.endswith("/responses"):
            self._responses(body)
        else:
            self._json(404, {"error": {"message": "not here"}})

    def _next_call(self, body: dict[str, Any], rounds: int) -> tuple[str, dict[str, Any]] | None:
        if not body.get("tools") or rounds >= len(self.script):
            return None
        name, args = self.script[rounds]
        return name, _filled(args, _cwd(body))

    def _messages(self, body: dict[str, Any]) -> None:
        rounds = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
        call = self._next_call(body, rounds)
        usage = {"input_tokens": 10, "output_tokens": 5}
        chunks = [_sse("message_start", {"type": "message_start", "message": {
            "id": f"msg_{uuid.uuid4().hex[:20]}", "type": "message", "role": "assistant",
            "model": body.get("model"), "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": usage}})]
        if call is None:
            text = "Done." if body.get("tools") else "Hello"
            chunks += [_sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                    "content_block": {"type": "text", "text": ""}}),
                       _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                    "delta": {"type": "text_delta", "text": text}}),
                       _sse("content_block_stop", {"type": "content_block_stop", "index": 0})]
            stop = "end_turn"
        else:
            block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:20]}", "name": call[0],
                     "input": {}}
            chunks += [_sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                    "content_block": block}),
                       _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                    "delta": {"type": "input_json_delta",
                                                              "partial_json": json.dumps(call[1])}}),
                       _sse("content_block_stop", {"type": "content_block_stop", "index": 0})]
            stop = "tool_use"
        chunks += [_sse("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": stop, "stop_sequence": None}, "usage": usage}),
            _sse("message_stop", {"type": "message_stop"})]
        if body.get("stream"):
            self._stream(chunks)
        else:
            self._json(200, {"id": "msg_capture", "type": "message", "role": "assistant",
                             "model": body.get("model"), "stop_reason": "end_turn",
                             "content": [{"type": "text", "text": "Hello"}], "usage": usage})

    def _responses(self, body: dict[str, Any]) -> None:
        items = body.get("input") if isinstance(body.get("input"), list) else []
        rounds = sum(1 for i in items if isinstance(i, dict) and i.get("type") == "function_call")
        call = self._next_call(body, rounds)
        rid = f"resp_{uuid.uuid4().hex}"
        if call is None:
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Done.", "annotations": []}]}
        else:
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "status": "completed",
                    "call_id": f"call_{uuid.uuid4().hex[:20]}", "name": call[0],
                    "arguments": json.dumps(call[1])}
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": 15}
        response = {"id": rid, "object": "response", "status": "completed", "model": body.get("model"),
                    "output": [item], "usage": usage}
        chunks = [_sse("response.created", {"type": "response.created", "sequence_number": 1,
                                             "response": {**response, "status": "in_progress",
                                                          "output": []}}),
                  _sse("response.output_item.added", {"type": "response.output_item.added",
                                                      "sequence_number": 2, "output_index": 0,
                                                      "item": item}),
                  _sse("response.output_item.done", {"type": "response.output_item.done",
                                                     "sequence_number": 3, "output_index": 0,
                                                     "item": item}),
                  _sse("response.completed", {"type": "response.completed", "sequence_number": 4,
                                              "response": response})]
        self._stream(chunks)


KEPT_HEADERS = ("anthropic-version", "anthropic-beta", "user-agent", "x-app", "originator")
TRIMMED = {"metadata": {"user_id": "trimmed"}, "client_metadata": {}, "prompt_cache_key": "trimmed"}


def trim(raw: Path, client: str, command: str) -> dict[str, Any]:
    """A recording of the session in the capture file `raw` (see the module docstring)."""
    entries = [json.loads(line) for line in raw.read_text().splitlines()]
    main = [e for e in entries if isinstance(e.get("body"), dict) and e["body"].get("tools")]
    key = "messages" if "messages" in main[-1]["body"] else "input"
    items: list[Any] = []
    seen: dict[str, int] = {}
    rounds = []
    for e in main:
        ids = []
        for item in e["body"][key]:
            text = json.dumps(item, sort_keys=True)
            ids.append(seen.setdefault(text, len(items)))
            if ids[-1] == len(items):
                items.append(item)
        rounds.append(ids)
        others = {k: v for k, v in e["body"].items() if k != key}
        if others != {k: v for k, v in main[-1]["body"].items() if k != key}:
            raise ValueError(f"request {e['n']} differs from the last in more than its {key}")
    body = {k: TRIMMED.get(k, v) for k, v in main[-1]["body"].items() if k != key}
    headers = {k: v for k, v in main[-1]["headers"].items() if k in KEPT_HEADERS}
    return {"client": client, "command": command, "path": main[-1]["path"], "headers": headers,
            "key": key, "body": body, "items": items, "rounds": rounds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="action", required=True)
    serve = commands.add_parser("serve", help="capture what a client sends")
    serve.add_argument("--out", type=Path, required=True)
    serve.add_argument("--port", type=int, default=8399)
    serve.add_argument("--script", choices=sorted(SCRIPTS), default="claude")
    trimming = commands.add_parser("trim", help="a capture file as a recording")
    trimming.add_argument("raw", type=Path)
    trimming.add_argument("out", type=Path)
    trimming.add_argument("--client", required=True, help='e.g. "Claude Code 2.1.332"')
    trimming.add_argument("--command", required=True, help="how the client was run")
    args = parser.parse_args(argv)
    if args.action == "trim":
        recording = trim(args.raw, args.client, args.command)
        args.out.write_text(json.dumps(recording, indent=1, ensure_ascii=False) + "\n")
        print(f"{args.out}: {len(recording['rounds'])} rounds, {len(recording['items'])} items")
        return
    Capture.out, Capture.script = args.out, SCRIPTS[args.script]
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Capture)
    print(f"capturing on http://127.0.0.1:{args.port} into {args.out}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
