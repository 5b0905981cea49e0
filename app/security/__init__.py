"""Guards for a server on the user's own machine: the middleware that checks Host, Origin and body
sizes and adds the security headers (guards.py), the API key's guard and login sessions
(api_key.py) over who may use a keyed server (key_access.py), the deadline for a request's
headers (header_timeout.py) and the chat socket's frame limit (socket_limits.py)."""
