"""Issue 24 LOW: sampling values out of range for MLX or for the model are a 400 naming the field
(never a 500 quoting mlx-lm); a real server on 127.0.0.1 with a tiny random llama (vocabulary
49,152)."""

import httpx
import pytest

from live_server import tiny_serving
from tiny_models import VOCAB

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_serving(tmp_path_factory.mktemp("ranges")) as s:
        yield s


def chat(server, **fields) -> httpx.Response:
    body = {"model": server.model, "max_tokens": 2, "temperature": 0.7,
            "messages": [{"role": "user", "content": "hi"}], **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("field, value", [("top_k", VOCAB + 1), ("top_k", 2**63), ("top_k", 1e30),
                                          ("repetition_context_size", 2**63),
                                          ("repetition_context_size", 1e20)])
def test_out_of_range_is_a_400_naming_the_field(server, field, value):
    r = chat(server, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_top_k_of_the_whole_vocabulary_is_accepted(server):
    assert chat(server, top_k=VOCAB).status_code == 200

