"""Issue 14, case 6 (leftover): a JSON schema whose `$ref` loops back to the same value through
allOf/anyOf/... is a 400 in OpenAI's error shape through the real API; recursion that descends
into properties or items stays allowed."""

import httpx
import pytest

from live_server import tiny_serving

pytestmark = pytest.mark.fast

LOOPS = {
    "allOf": {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
    "anyOf at the root": {"anyOf": [{"$ref": "#"}]},
    "oneOf then allOf": {"definitions": {"a": {"oneOf": [{"allOf": [{"$ref": "#/definitions/b"}]}]},
                                         "b": {"$ref": "#/definitions/a"}},
                         "$ref": "#/definitions/a"},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_serving(tmp_path_factory.mktemp("schema")) as s:
        yield s


def ask(server, schema):
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": server.model, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})


@pytest.mark.parametrize("name", LOOPS)
def test_ref_loops_through_any_keyword_are_400(server, name):
    r = ask(server, LOOPS[name])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "response_format" and error["code"] == "invalid_value"
    assert "refers to itself" in error["message"] and "<state>" not in error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_recursion_into_properties_is_still_served(server):
    tree = {"type": "object", "properties": {"child": {"$ref": "#"}}}
    r = ask(server, tree)
    assert r.status_code == 200, r.text
