"""Errors the engine raises for bad input or unloadable models; their messages are shown to users."""


class EngineError(Exception):
    """Base class: the message is meant for the user, no traceback needed."""


class ModelLoadError(EngineError):
    """A model could not be found, fetched, converted or loaded."""


class UnsupportedArchitecture(ModelLoadError):
    """A GGUF file declares an architecture we cannot map onto an mlx-lm model."""


class InvalidRequest(EngineError):
    """A generation request is malformed: empty prompt, out-of-range sampling value, too long."""
