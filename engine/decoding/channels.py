"""Split an answer's text into channels at the model's markers: `content`, `reasoning` (between
think markers) and `tool` (from a tool-call opener on), for requests that ask for them apart.

Text arrives in pieces (one per token); a piece that ends in what may be the start of a marker is
held back until the next piece settles it, as stop strings are (engine/decoding/stops.py), so a
marker never reaches a client half-written. Markers themselves are dropped, except inside the
tool channel, whose raw text goes to the family's parser (engine/decoding/tools.py).
"""

from dataclasses import dataclass

from ..events import Channel


@dataclass(frozen=True)
class Markers:
    think: tuple[str, str] | None  # (start, end), None: no reasoning split
    tool_open: str | None  # None: no tool calls in free text


class ChannelSplitter:
    def __init__(self, markers: Markers, start: Channel = "content"):
        self.markers = markers
        self.channel: Channel = start
        self._held = ""

    def _watched(self) -> list[tuple[str, Channel]]:
        """The markers that switch away from the current channel, and where each leads."""
        think, tool = self.markers.think, self.markers.tool_open
        if self.channel == "reasoning":
            return [(think[1], "content")] if think else []
        if self.channel == "content":
            out: list[tuple[str, Channel]] = []
            if think:
                out.append((think[0], "reasoning"))
            if tool:
                out.append((tool, "tool"))
            return out
        return []  # the tool channel runs to the end

    def feed(self, text: str) -> list[tuple[Channel, str]]:
        """The settled pieces of `text` (plus any held back before), by channel, in order."""
        out: list[tuple[Channel, str]] = []
        buf = self._held + text
        while True:
            watched = self._watched()
            hits = [(buf.find(m), m, to) for m, to in watched if m and m in buf]
            if not hits:
                break
            at, marker, to = min(hits)
            if at:
                out.append((self.channel, buf[:at]))
            keep = marker if to == "tool" else ""  # a parser needs the opener
            buf = keep + buf[at + len(marker):]
            self.channel = to
        hold = max((n for m, _ in self._watched()
                    for n in range(min(len(m) - 1, len(buf)), 0, -1) if buf.endswith(m[:n])),
                   default=0)
        self._held = buf[len(buf) - hold:] if hold else ""
        settled = buf[: len(buf) - hold]
        if settled:
            out.append((self.channel, settled))
        return out

    def flush(self) -> list[tuple[Channel, str]]:
        """What is still held back (the answer ended inside a possible marker)."""
        held, self._held = self._held, ""
        return [(self.channel, held)] if held else []
