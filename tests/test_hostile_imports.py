"""Issue 24 M1, M2, the import LOW cases and the import/export stalls of M5, over real HTTP against a
real server (tiny random llama, real SQLite): a hostile or malformed upload is a 400 saying why and
stores nothing, the pages keep rendering, and large imports and exports leave `/health` answering."""

import io
import json
import struct
import zipfile

import httpx
import pytest

from live_server import tiny_serving
from loop_probe import STALL_S, health_probe

pytestmark = pytest.mark.fast

FORMAT = "mlxchat.conversation/1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_serving(tmp_path_factory.mktemp("imports")) as s:
        yield s


def upload(server, name: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.url}/import", files={"file": (name, body)}, follow_redirects=False,
                      timeout=120)


def ours(**fields) -> dict:
    return {"format": FORMAT, "title": "x", "messages": [{"role": "user", "content": "q"}], **fields}


def with_message(**fields) -> dict:
    return ours(messages=[{"id": 0, "role": "user", "content": "q", **fields}])


BAD = {
    "settings a string": ours(updated=2e9, settings="abc"),
    "settings a list": ours(settings=[1, 2]),
    "draft attachments a number": ours(settings={"draft": {"content": "", "attachments": 5}}),
    "system prompt an object": ours(settings={"system_prompt": {}}),
    "sampling not sampling": ours(settings={"sampling": {"temperature": "hot"}}),
    "updated far in the future": ours(updated=2e12),
    "error an object": with_message(error={}),
    "created an object": with_message(created={}),
    "model a list": ours(model=[1]),
    "leaf a list": ours(leaf=[0]),
    "id a list": with_message(id=[0]),
    "parent an object": with_message(parent={}),
    "tool_call_id an object": with_message(tool_call_id={}),
    "attachments wrong": with_message(attachments=[{"name": 1}]),
    "plain list, tool_call_id an object": [{"role": "tool", "content": "r", "tool_call_id": {}}],
}


def count(server) -> int:
    return len(server.storage.list_conversations(limit=-1))


@pytest.mark.parametrize("case", BAD)
def test_a_malformed_field_is_refused_and_nothing_breaks(server, case):
    before = count(server)
    r = upload(server, "c.json", json.dumps(BAD[case]).encode())
    assert r.status_code == 400, r.text
    assert "Could not import" in r.text
    assert count(server) == before
    assert httpx.get(f"{server.url}/", follow_redirects=True).status_code == 200


def test_every_message_state_of_an_export_imports(server):
    states = ("done", "failed", "done", "stopped")
    messages = [{"id": i, "parent": i - 1 if i else None, "content": "x", "state": state,
                 "role": "user" if i % 2 == 0 else "assistant"} for i, state in enumerate(states)]
    r = upload(server, "states.json", json.dumps(ours(messages=messages)).encode())
    assert r.status_code == 303, r.text


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


@pytest.mark.parametrize("body", [deep(100_000),
                                  b'{"messages": ' + deep(5_000) + b"}",
                                  json.dumps({"messages": [{"role": "user", "content": "q"}]})
                                  .encode().replace(b'"q"', deep(5_000))])
def test_deep_json_is_refused(server, body):
    r = upload(server, "deep.json", body)
    assert r.status_code == 400, r.text


def zipped(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def patched(raw: bytes, flag: int | None = None, method: int | None = None) -> bytes:
    """`raw` (a zip) with every header's general-purpose flags or compression method replaced."""
    out = bytearray(raw)
    for signature, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        start = out.find(signature)
        while start >= 0:
            if flag is not None:
                out[start + at:start + at + 2] = struct.pack("<H", flag)
            if method is not None:
                out[start + at + 2:start + at + 4] = struct.pack("<H", method)
            start = out.find(signature, start + 4)
    return bytes(out)


def test_a_zip_bomb_is_refused_without_stalling(server):
    title = b"t" * 100_000_000  # inflates past the 64 MiB a member may have
    bomb = zipped({"a.json": b'{"format": "%s", "title": "' % FORMAT.encode() + title
                   + b'", "messages": []}'})
    assert len(bomb) < 1_000_000
    before = count(server)
    with health_probe(server.url) as probe:
        r = upload(server, "bomb.zip", bomb)
    assert r.status_code == 400 and "inflates" in r.text, r.text
    assert count(server) == before
    assert probe.worst < STALL_S, probe.worst


@pytest.mark.parametrize("patch", [{"flag": 1}, {"method": 99}])
def test_an_encrypted_or_unknown_compression_member_is_refused(server, patch):
    raw = patched(zipped({"a.json": json.dumps(ours()).encode()}), **patch)
    r = upload(server, "odd.zip", raw)
    assert r.status_code == 400 and "Could not import" in r.text, r.text


@pytest.mark.slow  # seconds of compute by design: the second tier
def test_ten_thousand_conversations_import_and_export_without_stalling(server):
    members = {f"c{i}.json": json.dumps(ours(title=f"t{i}")).encode() for i in range(10_000)}
    before = count(server)
    with health_probe(server.url) as probe:
        r = upload(server, "many.zip", zipped(members))
    assert r.status_code == 303, r.text
    assert count(server) == before + 10_000
    assert probe.worst < STALL_S, probe.worst
    with health_probe(server.url) as probe:
        r = httpx.get(f"{server.url}/export.zip", timeout=120)
    assert r.status_code == 200
    assert len(zipfile.ZipFile(io.BytesIO(r.content)).namelist()) == count(server)
    assert probe.worst < STALL_S, probe.worst
