"""Server-sent events framing, for the API's streamed completions and the model picker."""


def sse(data: str, event: str | None = None) -> str:
    """One event: each line of `data` as a `data:` field (an empty `data` still sends one)."""
    lines = "".join(f"data: {line}\n" for line in data.splitlines() or [""])
    return (f"event: {event}\n" if event else "") + lines + "\n"
