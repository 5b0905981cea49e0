"""How long a model stays loaded after its last request, written as Ollama's `keep_alive` is:
seconds as a number, or a duration such as "90s", "30m", "1h"; a negative value keeps it loaded."""

import math
import re

from ..errors import InvalidRequest

DEFAULT_KEEP_ALIVE_S = 30 * 60.0
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)?")


def keep_alive_seconds(value: float | str | None, default: float | None = None) -> float | None:
    """Seconds to stay loaded (None: until told otherwise); `value` None gives `default`."""
    if value is None:
        return default
    if isinstance(value, bool):
        seconds = math.nan
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value.strip())):
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    else:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise InvalidRequest(f"keep_alive must be a number of seconds or a duration such as "
                             f"\"30m\" (negative: keep loaded), got {value!r}",
                             field="keep_alive", code="invalid_value")
    return None if seconds < 0 else seconds
