"""MCP messages kept bounded on their way in: a tool that answers 50 MB never reaches the app
whole. (The SDK's stdio reader joins a long line chunk by chunk on the event loop, quadratic in
its length, and then validates it whole.)

- `JsonPruner` streams one JSON text through, structure kept: a string keeps its first
  `string_chars` characters and a notice of how many more there were (`[… truncated: N more
  characters]`, which app/mcp/servers.py `capped` reads); an array stops taking elements once
  `budget` characters have been written; past `hard_limit` the message is replaced by a JSON-RPC
  error for its `id`. Memory is bounded by the output, whatever the input's size.
- `LinePruner` splits newline-delimited JSON (stdio, and server-sent events' `data:` lines): a line
  up to `LINE_CHARS` passes as it is, a longer one goes through a `JsonPruner`;
  `DocumentPruner` prunes one JSON document (an HTTP response's body).
- `python relay.py -- COMMAND ARGS...` runs a stdio MCP server behind a `LinePruner`: the app
  starts this (stdlib only, so it starts in a few tens of milliseconds) in place of the server's
  command; stdin and stderr pass through, the exit status is the server's.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import subprocess
import sys
import threading
from typing import Callable

STRING_CHARS = 16_000  # app/mcp/servers.py MAX_RESULT_CHARS: what a result may show
BUDGET_CHARS = 256 * 1024  # arrays stop taking elements past this much output
HARD_LIMIT_CHARS = 4 * 1024 * 1024  # past this, the message becomes an error for its id
LINE_CHARS = 1024 * 1024  # lines up to this size pass unparsed

_STRING_SPECIAL = re.compile(r'["\\]')
_REST_OF_STRING = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)
_STRUCTURE = re.compile(r'[\[\]{}",:]')


def notice(more: int) -> str:
    return f"\n[… truncated: {more} more characters]"


class JsonPruner:
    """One JSON text, fed in pieces (`feed`), bounded as the module docstring says; `result()`
    once it has all been fed."""

    def __init__(self, string_chars: int = STRING_CHARS, budget: int = BUDGET_CHARS,
                 hard_limit: int = HARD_LIMIT_CHARS):
        self.string_chars, self.budget, self.hard_limit = string_chars, budget, hard_limit
        self.out: list[str] = []
        self.size = 0
        self.overflow = False
        self.pending = ""  # an escape split between pieces
        self.in_string = False
        self.kept = self.skipped = 0  # of the current string
        self.stack: list[list] = []  # per open container: [kind, skipping?, depth-at-start]
        self.skip_depth = 0  # > 0: inside containers dropped from the output
        self.top_key: str | None = None  # the top-level object's current key, and its id
        self.key_text: list[str] | None = None
        self.expect_key = False
        self.id_text: list[str] | None = None
        self.found_id: str | None = None

    # --- output -------------------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        if self.id_text is not None:
            self.id_text.append(text)
        if self.key_text is not None:
            self.key_text.append(text)
        if self.skip_depth or self.overflow or not text:
            return
        self.size += len(text)
        if self.size > self.hard_limit:
            self.overflow, self.out = True, []
            return
        self.out.append(text)

    def result(self) -> str:
        """The pruned JSON text (or an error response for the message's id)."""
        if self.overflow:
            message = f"the MCP message was larger than {self.hard_limit} characters"
            return json.dumps({"jsonrpc": "2.0", "id": json.loads(self.found_id or "null"),
                               "error": {"code": -32603, "message": message}})
        return "".join(self.out)

    # --- input --------------------------------------------------------------------------------

    def feed(self, text: str) -> None:
        text, self.pending = self.pending + text, ""
        pos, end = 0, len(text)
        while pos < end:
            pos = self._string(text, pos) if self.in_string else self._structure(text, pos)
            if pos < 0:  # an escape cut by the piece's end: wait for the rest
                self.pending = text[-pos - 1:]
                return

    def _string(self, text: str, pos: int) -> int:
        """Inside a string: up to its closing quote (or the piece's end)."""
        while True:
            if self.kept >= self.string_chars:  # past what is kept: only find where it ends
                end = _REST_OF_STRING.match(text, pos).end()
                self.skipped += end - pos - text.count("\\", pos, end)
                if end == len(text):
                    return end
                if text[end] == "\\":  # an escape cut by the piece's end
                    return -end - 1
                pos = end  # the closing quote
            match = _STRING_SPECIAL.search(text, pos)
            stop = match.start() if match else len(text)
            self._chars(text[pos:stop])
            if match is None:
                return len(text)
            if text[stop] == '"':
                if self.skipped:
                    self._emit(json.dumps(notice(self.skipped))[1:-1])
                self._emit('"')
                self._end_string()
                return stop + 1
            size = 6 if text[stop + 1:stop + 2] == "u" else 2
            if stop + size > len(text):
                return -stop - 1
            self._chars(text[stop:stop + size], escape=True)
            pos = stop + size

    def _chars(self, chunk: str, escape: bool = False) -> None:
        """Characters of the current string: kept up to `string_chars`, else counted."""
        if escape:
            if self.kept < self.string_chars:
                self.kept += 1
                self._emit(chunk)
            else:
                self.skipped += 1
            return
        room = max(self.string_chars - self.kept, 0)
        self.kept += min(room, len(chunk))
        self._emit(chunk[:room])
        self.skipped += max(len(chunk) - room, 0)

    def _end_string(self) -> None:
        self.in_string = False
        if self.key_text is not None:
            self.top_key, self.key_text = "".join(self.key_text), None
        self.kept = self.skipped = 0

    def _structure(self, text: str, pos: int) -> int:
        """Outside strings: up to the next structural character, handled."""
        match = _STRUCTURE.search(text, pos)
        stop = match.start() if match else len(text)
        self._emit(text[pos:stop])  # whitespace, numbers, true/false/null
        if match is None:
            return len(text)
        char = text[stop]
        if char == '"':
            self._quote()
        elif char in "[{":
            self._emit(char)
            self.stack.append([char, False])
            self.expect_key = char == "{"
        elif char in "]}":
            self._close_id(len(self.stack))
            _, skipping = self.stack.pop() if self.stack else ("", False)
            self.skip_depth -= skipping
            self._emit(char)
        elif char == ",":
            self._comma()
        else:  # ":"
            self._emit(":")
            self.expect_key = False
            if len(self.stack) == 1 and self.top_key == '"id"' and self.found_id is None:
                self.id_text = []
        return stop + 1

    def _quote(self) -> None:
        """A string starts (a top-level key is noted)."""
        if len(self.stack) == 1 and self.expect_key and self.stack[0][0] == "{":
            self.key_text = []
        self._emit('"')
        self.in_string = True

    def _comma(self) -> None:
        """The next element or member: an array past the budget leaves out the rest."""
        self._close_id(len(self.stack))
        top = self.stack[-1] if self.stack else None
        if top is not None and top[0] == "[" and not top[1] and self.size > self.budget:
            top[1] = True  # the array's remaining elements are left out
            self.skip_depth += 1
        else:
            self._emit(",")
        self.expect_key = top is not None and top[0] == "{"

    def _close_id(self, depth: int) -> None:
        """At the end of a top-level member's value: keep the `id` seen."""
        if depth == 1 and self.id_text is not None:
            self.found_id = "".join(self.id_text).strip() or None
            self.id_text = None


class LinePruner:
    """Newline-delimited JSON fed in byte pieces (`feed`), handed on line by line (`write`): a long
    line through a `JsonPruner`; `prefix` (e.g. "data:") marks the lines that hold JSON (others,
    and short lines, pass as they are)."""

    def __init__(self, write: Callable[[str], None], prefix: str = "",
                 line_chars: int = LINE_CHARS):
        self.write, self.prefix, self.line_chars = write, prefix, line_chars
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.line: list[str] = []
        self.size = 0
        self.pruner: JsonPruner | None = None
        self.whole = False  # a long line that is not JSON (with a prefix): passes as it is

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self.decoder.decode(data, final)
        pos = 0
        while pos < len(text):
            newline = text.find("\n", pos)
            piece = text[pos:newline + 1 if newline >= 0 else len(text)]
            self._add(piece.rstrip("\n") if newline >= 0 else piece)
            if newline < 0:
                break
            self._end_line()
            pos = newline + 1
        if final and (self.line or self.pruner is not None):
            self._end_line(newline=False)

    def _add(self, piece: str) -> None:
        if self.pruner is not None:
            self.pruner.feed(piece)
            return
        self.line.append(piece)
        self.size += len(piece)
        if self.size > self.line_chars and not self.whole:
            line = "".join(self.line)
            head = self.prefix if self.prefix and line.startswith(self.prefix) else ""
            if self.prefix and not head:
                self.whole = True  # not a JSON line: passes whole (a comment, an event name)
                return
            self.pruner, self.line = JsonPruner(), [head]
            self.pruner.feed(line[len(head):])

    def _end_line(self, newline: bool = True) -> None:
        if self.pruner is not None:
            self.line.append(self.pruner.result())
        self.write("".join(self.line) + ("\n" if newline else ""))
        self.line, self.size, self.pruner, self.whole = [], 0, None, False


class DocumentPruner:
    """One JSON document fed in byte pieces (newlines and all), handed on pruned at its end."""

    def __init__(self, write: Callable[[str], None]):
        self.write, self.pruner = write, JsonPruner()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes, final: bool = False) -> None:
        self.pruner.feed(self.decoder.decode(data, final))
        if final:
            self.write(self.pruner.result())


def relay(command: list[str]) -> int:
    """Run `command` (a stdio MCP server) with its output pruned; its exit status."""
    try:
        child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    except OSError as exc:
        print(f"cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        return 127

    def forward_stdin() -> None:
        try:
            while data := os.read(0, 65536):
                child.stdin.write(data)
                child.stdin.flush()
        except OSError:
            pass
        finally:
            try:
                child.stdin.close()
            except OSError:
                pass

    threading.Thread(target=forward_stdin, daemon=True).start()
    out = sys.stdout.buffer

    def write(line: str) -> None:
        out.write(line.encode("utf-8"))
        out.flush()

    lines = LinePruner(write)
    try:
        while data := os.read(child.stdout.fileno(), 65536):
            lines.feed(data)
        lines.feed(b"", final=True)
    except (BrokenPipeError, OSError):
        child.kill()
    return child.wait()


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.exit("usage: relay.py -- COMMAND [ARGS...]")
    sys.exit(relay(args))
