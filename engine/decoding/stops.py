"""Stop strings on streamed text: emit text as soon as it cannot be the start of a stop string.

Each stop string runs a Knuth-Morris-Pratt automaton over the streamed text. Its state is the
length of the longest suffix of the text so far that is a prefix of the stop string, so a new
character costs amortised constant work per stop string whatever their lengths, and the text held
back is exactly the longest suffix that could still become a stop string. Counting and length
limits keep one request from holding back or scanning more than a small window.
"""

from collections.abc import Sequence

from ..errors import InvalidRequest

# OpenAI's API takes up to 4 stop strings; llama.cpp's server sets no limit. These bound the work
# and the held-back text per request while leaving room for long multi-line markers.
MAX_STOPS = 16
MAX_STOP_CHARS = 512


def check_stops(stops: Sequence[object]) -> None:
    """Raise InvalidRequest (naming the field `stop`) unless `stops` are few, short, non-empty strings."""
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(f"stop may hold at most {MAX_STOPS} strings, got {len(stops)}",
                             field="stop", code="invalid_value")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise InvalidRequest("stop strings must be non-empty strings", field="stop",
                                 code="invalid_value")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"stop strings may be at most {MAX_STOP_CHARS} characters long, "
                                 f"got one of {len(s)}", field="stop", code="invalid_value")


def _failure(s: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of s[:i + 1]."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.pending = ""
        self._fail = [_failure(s) for s in stops]
        self._state = [0] * len(stops)
        self.steps = 0  # automaton transitions so far: the matcher's work, linear in the text fed
        self.hit: str | None = None  # the stop string that ended the text, once one has

    def feed(self, text: str) -> tuple[str, bool]:
        """Add streamed text; return (text safe to emit now, whether a stop string was hit).

        On a hit the text before the earliest-starting stop string is returned and the rest is
        dropped."""
        if not self.stops:
            return text, False
        base = len(self.pending)
        self.pending += text
        first_start: int | None = None
        first_stop: str | None = None
        for j, (s, fail) in enumerate(zip(self.stops, self._fail)):
            k, steps = self._state[j], 0
            for i, ch in enumerate(text):
                while k and ch != s[k]:
                    k = fail[k - 1]
                    steps += 1
                steps += 1
                if ch == s[k]:
                    k += 1
                if k == len(s):  # this stop's first occurrence ends here
                    start = base + i + 1 - len(s)
                    if first_start is None or start < first_start:
                        first_start, first_stop = start, s
                    break
            self.steps += steps
            self._state[j] = k
        if first_start is not None:
            self.hit = first_stop
            out, self.pending = self.pending[:first_start], ""
            self._state = [0] * len(self.stops)
            return out, True
        cut = len(self.pending) - max(self._state)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        self._state = [0] * len(self.stops)
        return out
