"""Errors the engine raises for bad input or unloadable models; their messages are shown to users.

An error that concerns one input carries that input's name as `field` and a machine-readable
`code`, so callers (the API's `param`, the settings form) never parse the message text.
"""


class EngineError(Exception):
    """Base class: the message is meant for the user, no traceback needed."""

    def __init__(self, message: str, *, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.field = field
        self.code = code


class ModelLoadError(EngineError):
    """A model could not be found, fetched, converted or loaded."""


class UnsupportedArchitecture(ModelLoadError):
    """A GGUF file declares an architecture we cannot map onto an mlx-lm model."""


class InvalidRequest(EngineError):
    """A generation request is malformed: empty prompt, out-of-range sampling value, too long."""


class Overloaded(EngineError):
    """Too many requests running and queued; try again after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message, code="overloaded")
        self.retry_after = retry_after


class NoRoom(Overloaded):
    """A model cannot be loaded now: the memory budget (or `--max-loaded`) is held by models
    with running requests; try again after `retry_after` seconds (a 503, not a 429)."""

    def __init__(self, message: str, retry_after: float = 5.0):
        super().__init__(message, retry_after)
        self.code = "models_busy"


class DownloadError(EngineError):
    """A model could not be downloaded: offline, not found, gated, too big, disk full, bad hash."""


class DownloadCancelled(DownloadError):
    """The user cancelled a download; its complete files are kept for the next attempt."""
