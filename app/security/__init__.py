"""Guards for a server on the user's own machine: the middleware that checks Host, Origin, the API
key and body sizes (guards.py), who may use a keyed server (key_access.py), the deadline for a
request's headers (header_timeout.py) and the chat socket's frame limit (socket_limits.py)."""
