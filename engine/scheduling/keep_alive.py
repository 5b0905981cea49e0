"""How long a model stays loaded after its last request, written as Ollama's `keep_alive` is:
seconds as a number, or a duration such as "90s", "30m", "1h"; a negative value keeps it loaded.
Anything longer than `MAX_KEEP_ALIVE_S` (one year) is clamped to it: a timer that long is "forever"
for a chat app, and the scheduler's waits stay within what the platform's clock can represent."""

import math
import re

from ..errors import InvalidRequest

DEFAULT_KEEP_ALIVE_S = 30 * 60.0
MAX_KEEP_ALIVE_S = 365 * 24 * 3600.0  # longer values are clamped to this
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)?")
_MAX_DURATION_CHARS = 64


def keep_alive_seconds(value: float | str | None, default: float | None = None) -> float | None:
    """Seconds to stay loaded (None: until told otherwise); `value` None gives `default`."""
    if value is None:
        return default
    if isinstance(value, bool):
        seconds = math.nan
    elif isinstance(value, int):  # an int too large for a float is clamped all the same
        seconds = float(value) if abs(value) < 2**1023 else (math.inf if value > 0 else -math.inf)
    elif isinstance(value, float):
        seconds = value
    elif isinstance(value, str) and len(value) <= _MAX_DURATION_CHARS and \
            (match := _DURATION.fullmatch(value.strip())):
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    else:
        seconds = math.nan
    if math.isnan(seconds):
        raise InvalidRequest(f"keep_alive must be a number of seconds or a duration such as "
                             f"\"30m\" (negative: keep loaded), got {repr(value)[:80]}",
                             field="keep_alive", code="invalid_value")
    return None if seconds < 0 else min(seconds, MAX_KEEP_ALIVE_S)
