"""The UI's speculative decoding opt-in over real HTTP and WebSocket (no browser), on a tiny model:
the settings panel's toggle and draft choice persist, and an answer generated with it on shows its
acceptance and tokens per step in the stats line; with it off (the default) nothing changes."""

import re

import pytest

from live_server import new_conversation, tiny_serving, turn

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_serving(tmp_path_factory.mktemp("ui-spec")) as s:
        yield s


def test_toggling_speculative_decoding_shows_acceptance_under_the_answer(http, server):
    plain = new_conversation(http, max_tokens=8)
    page = http.get(f"/c/{plain}").text
    assert 'name="speculative"' in page and 'value="self-q4"' in page
    assert not re.search(r'name="speculative" value="on" checked', page)  # off by default
    assert server.storage.get_conversation(plain).settings.get("speculative") is None
    baseline = turn(server, plain, action="send", content="Count to five.")[-1]
    assert 'data-state="done"' in baseline and "speculative" not in baseline.split('class="stats"')[1]

    cid = new_conversation(http, max_tokens=8)
    r = http.post(f"/c/{cid}/settings", data={"temperature": "0", "max_tokens": "8",
                                              "speculative": "on", "draft": "self-q4"})
    assert "Saved." in r.text and 'name="speculative" value="on" checked' in r.text
    assert server.storage.get_conversation(cid).settings["speculative"] == {"draft": "self-q4"}
    assert 'value="self-q4" selected' in http.get(f"/c/{cid}").text  # persisted

    final = turn(server, cid, action="send", content="Count to five.")[-1]
    assert 'data-state="done"' in final
    stats = re.search(r"speculative: (\d+)% of (\d+) drafts accepted · ([\d.]+) tokens/step", final)
    assert stats, final
    answer = server.storage.active_path(cid)[-1]
    assert answer.speculative["drafted"] == int(stats.group(2)) > 0
    assert float(stats.group(3)) >= 1
    # Greedy: the same answer as with speculative decoding off.
    assert answer.content == server.storage.active_path(plain)[-1].content

    r = http.post(f"/c/{cid}/settings", data={"speculative": "on", "draft": ""})
    assert "Choose a draft" in r.text
    r = http.post(f"/c/{cid}/settings", data={"max_tokens": "8"})  # unticked: off again
    assert server.storage.get_conversation(cid).settings["speculative"] is None
