"""`ConversationPages`: which pages (chat sockets) show each conversation, and the one turn
running in it."""

from typing import Awaitable, Callable

Send = Callable[[str], Awaitable[None]]


class ConversationPages:
    """Per conversation: the pages (sockets) that show it, and the turn running in it.

    One turn at a time per conversation, whichever page asked for it: a second page's message
    would otherwise land under the first's still-empty answer. Every page of the conversation
    sees the running turn, and any of them can stop it."""

    def __init__(self) -> None:
        self._pages: dict[int, dict[int, Send]] = {}
        self._turns: dict[int, object] = {}

    def join(self, cid: int, key: int, send: Send) -> None:
        self._pages.setdefault(cid, {})[key] = send

    def leave(self, cid: int, key: int) -> int:
        """Forget a page; returns how many pages still show the conversation."""
        pages = self._pages.get(cid, {})
        pages.pop(key, None)
        if not pages:
            self._pages.pop(cid, None)
        return len(pages)

    def watched(self, cid: int) -> bool:
        """Whether any page shows the conversation."""
        return bool(self._pages.get(cid))

    async def send(self, cid: int, html: str) -> None:
        """`html` to every page of the conversation; a page that has gone is forgotten."""
        for key, send in list(self._pages.get(cid, {}).items()):
            try:
                await send(html)
            except Exception:  # noqa: BLE001 - a closed socket, whatever the server says
                self.leave(cid, key)

    def claim(self, cid: int, turn: object) -> bool:
        """Make `turn` the conversation's running turn, unless one is running already."""
        if cid in self._turns:
            return False
        self._turns[cid] = turn
        return True

    def running(self, cid: int) -> object | None:
        return self._turns.get(cid)

    def release(self, cid: int, turn: object) -> None:
        if self._turns.get(cid) is turn:
            del self._turns[cid]
