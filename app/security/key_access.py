"""Who may use a server started with `--api-key`: the key's comparison, a limit on failed attempts
(per client address, and in all), and the browser's sessions.

- Failed attempts (a wrong key as `Authorization: Bearer`, `x-api-key` or in the login form) are
  counted over a sliding window: past `PER_CLIENT` from one address, or `IN_ALL` from everyone
  (guessers may use many addresses), further attempts get 429 with Retry-After until the window
  has room, whether or not the key they carry is right. A missing key is not an attempt.
- A login gets a random session token kept here, sent as the cookie; logging out revokes it. Tokens
  live in memory: a restart logs everyone out.
"""

import collections
import hmac
import secrets
import threading
import time
from typing import Callable

WINDOW_S = 60.0
PER_CLIENT = 10
IN_ALL = 100
MAX_SESSIONS = 1_000  # the oldest is revoked beyond this


class KeyAccess:
    def __init__(self, api_key: str | None, clock: Callable[[], float] = time.monotonic):
        self.api_key = api_key
        self._key = api_key.encode() if api_key else b""
        self._clock = clock
        self._failures: dict[str, collections.deque[float]] = {}
        self._all: collections.deque[float] = collections.deque()
        self._sessions: dict[str, None] = {}  # insertion-ordered: the oldest first
        self._lock = threading.Lock()

    def matches(self, given: bytes) -> bool:
        """Constant-time comparison with the key's UTF-8 bytes (the bytes a client sent)."""
        return bool(self._key) and hmac.compare_digest(given, self._key)

    def _expire(self, now: float) -> None:
        while self._all and self._all[0] <= now - WINDOW_S:
            self._all.popleft()
        for client in [c for c, d in self._failures.items() if d[-1] <= now - WINDOW_S]:
            del self._failures[client]

    def retry_after(self, client: str) -> float | None:
        """Seconds until `client` may try a key again, or None when it may now."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            mine = self._failures.get(client, ())
            waits = [d[0] + WINDOW_S - now for d, limit in ((mine, PER_CLIENT), (self._all, IN_ALL))
                     if len(d) >= limit]
            return max(waits) if waits else None

    def failed(self, client: str) -> None:
        with self._lock:
            now = self._clock()
            mine = self._failures.setdefault(client, collections.deque())
            mine.append(now)
            self._all.append(now)
            while len(mine) > PER_CLIENT:  # only the newest matter for the limit
                mine.popleft()
            while len(self._all) > IN_ALL:
                self._all.popleft()

    def new_session(self) -> str:
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._sessions[token] = None
            while len(self._sessions) > MAX_SESSIONS:
                del self._sessions[next(iter(self._sessions))]
        return token

    def session_valid(self, token: str) -> bool:
        with self._lock:
            return bool(token) and token in self._sessions

    def revoke(self, token: str) -> None:
        with self._lock:
            self._sessions.pop(token, None)
