"""Stored answers of the OpenAI Responses API (`store`, `previous_response_id`): the response as
sent and the whole conversation it ends (engine messages, JSON), for a follow-up to continue.

Bounded: a stored response expires `ttl_s` after it was made (`mlxchat serve --responses-ttl`,
30 days by default, as OpenAI keeps them), and the store holds at most `max_bytes` (the oldest
go first). Images are kept once each, as the client sent them (`response_images`, by the sha256 of
their bytes; a message refers to one as `image_ref(sha256)`), so a follow-up decodes the same
pixels and passes the same limits; an image goes with the last response that holds it.
"""

import base64
import json
import time
from dataclasses import dataclass
from typing import Any

from .store import Storage

DEFAULT_TTL_DAYS = 30.0
MAX_STORE_BYTES = 1024 * 1024 * 1024
IMAGE_REF = "stored-image:"


def image_ref(sha256: str) -> str:
    """How a stored message's `image_url` part refers to one of `response_images`."""
    return IMAGE_REF + sha256


@dataclass(frozen=True)
class StoredImage:
    media_type: str
    data: bytes


class StoredResponses:
    """The `responses` rows of `storage`'s database and the images they hold."""

    def __init__(self, storage: Storage, ttl_s: float = DEFAULT_TTL_DAYS * 86400,
                 max_bytes: int = MAX_STORE_BYTES):
        self.storage = storage
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes

    def save(self, rid: str, body: dict[str, Any], messages: list[dict[str, Any]],
             images: dict[str, StoredImage]) -> None:
        """Store a response; `messages` refer to `images` by `image_ref`. Expired responses, and
        the oldest past the cap, go first."""
        body_json, messages_json = json.dumps(body), json.dumps(messages)
        with self.storage._transaction() as db:
            db.execute("INSERT OR REPLACE INTO responses (id, created, body, messages, size) "
                       "VALUES (?,?,?,?,?)", (rid, time.time(), body_json, messages_json,
                                              len(body_json) + len(messages_json)))
            for sha, image in images.items():
                db.execute("INSERT OR IGNORE INTO response_images (sha256, media_type, data) "
                           "VALUES (?,?,?)", (sha, image.media_type, image.data))
                db.execute("INSERT OR IGNORE INTO response_image_refs (response_id, sha256) "
                           "VALUES (?,?)", (rid, sha))
        self.expire(keep=rid)

    def get(self, rid: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the response as sent, the conversation it ends with its images as data URLs), or
        None (unknown or expired)."""
        rows = self.storage._query("SELECT body, messages FROM responses WHERE id = ? AND "
                                   "created >= ?", (rid, time.time() - self.ttl_s))
        if not rows:
            return None
        messages = json.loads(rows[0]["messages"])
        refs = {r["sha256"]: StoredImage(r["media_type"], r["data"]) for r in self.storage._query(
            "SELECT i.sha256, i.media_type, i.data FROM response_image_refs r "
            "JOIN response_images i ON i.sha256 = r.sha256 WHERE r.response_id = ?", (rid,))}
        for m in messages:
            for part in m.get("content") if isinstance(m.get("content"), list) else ():
                url = (part.get("image_url") or {}).get("url") if isinstance(part, dict) else None
                if isinstance(url, str) and url.startswith(IMAGE_REF) and url[len(IMAGE_REF):] in refs:
                    image = refs[url[len(IMAGE_REF):]]
                    part["image_url"] = {"url": f"data:{image.media_type};base64,"
                                                + base64.b64encode(image.data).decode("ascii")}
        return json.loads(rows[0]["body"]), messages

    def delete(self, rid: str) -> bool:
        with self.storage._transaction() as db:
            return db.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0

    def stored_bytes(self) -> int:
        """What the store holds: the responses' JSON and their images, each image once."""
        row = self.storage._query(
            "SELECT (SELECT coalesce(sum(size), 0) FROM responses) + "
            "(SELECT coalesce(sum(length(data)), 0) FROM response_images)")[0]
        return int(row[0])

    def expire(self, keep: str | None = None) -> int:
        """Delete the responses older than the TTL, then the oldest while the store is over its
        cap (never `keep`, the one just saved); how many went."""
        gone = 0
        with self.storage._transaction() as db:
            gone += db.execute("DELETE FROM responses WHERE created < ?",
                               (time.time() - self.ttl_s,)).rowcount
        while self.stored_bytes() > self.max_bytes:
            with self.storage._transaction() as db:
                oldest = [r[0] for r in db.execute(
                    "SELECT id FROM responses WHERE id != ? ORDER BY created LIMIT 16",
                    (keep or "",)).fetchall()]
                if not oldest:
                    break
                gone += db.execute(f"DELETE FROM responses WHERE id IN "
                                   f"({','.join('?' * len(oldest))})", oldest).rowcount
        return gone
