"""`GET /metrics` (issue 50): prometheus_client's own parser reads the exposition of a real server
on 127.0.0.1; its counters move with traffic (requests by protocol and outcome, tokens, time to
first token, prefix-cache reads and writes, model loads); the API key guards it while `/health`
stays open; two apps in one process keep their own registries."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import app_serving, openai_client

pytestmark = pytest.mark.fast

KEY = "sesame"


def scrape(server, key: str | None = KEY) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, parsed by prometheus_client: {(name, labels): value}."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{server.url}/metrics", headers=headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    with app_serving(engine, tmp_path_factory.mktemp("metrics") / "db.sqlite", api_key=KEY) as s:
        yield s


def test_counters_move_with_traffic(server, engine):
    before = scrape(server)
    loads = value(before, "mlxchat_model_loads_total", model=engine.model_name, outcome="loaded")
    assert loads == 1
    assert value(before, "mlxchat_model_weights_bytes", model=engine.model_name) > 0
    client = openai_client(server)
    client.api_key = KEY
    ask = [{"role": "user", "content": "Tell me a story about the sea."}]
    first = client.chat.completions.create(model=engine.model_name, messages=ask, max_tokens=5,
                                           temperature=0)
    again = client.chat.completions.create(model=engine.model_name, messages=ask, max_tokens=5,
                                           temperature=0)
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []},
                     headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400
    after = scrape(server)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("mlxchat_http_requests_total", protocol="openai_chat", outcome="ok") == 2
    assert moved("mlxchat_http_requests_total", protocol="openai_chat",
                 outcome="client_error") == 1
    assert moved("mlxchat_requests_ended_total", state="finished") == 2
    assert moved("mlxchat_prompt_tokens_total") == 2 * first.usage.prompt_tokens
    assert moved("mlxchat_cached_prompt_tokens_total") == \
        again.usage.prompt_tokens_details.cached_tokens > 0
    assert moved("mlxchat_generated_tokens_total") == 10
    assert moved("mlxchat_time_to_first_token_seconds_count") == 2
    assert moved("mlxchat_time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert moved("mlxchat_time_per_output_token_seconds_count") == 2
    assert moved("mlxchat_prefix_cache_lookups_total", model=engine.model_name, outcome="hit") >= 1
    assert moved("mlxchat_snapshot_writes_total", model=engine.model_name, target="memory") >= 1
    assert value(after, "mlxchat_prefix_cache_bytes", model=engine.model_name) > 0
    assert value(after, "mlxchat_requests_running") == 0 == value(after, "mlxchat_requests_waiting")
    assert value(after, "mlxchat_memory_budget_bytes") == engine.memory_budget


def test_the_key_guards_metrics_and_health_stays_open(server):
    refused = httpx.get(f"{server.url}/metrics")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/metrics", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_each_app_counts_its_own_requests(server, engine, tmp_path):
    with app_serving(engine, tmp_path / "db.sqlite") as other:  # a second app, no key
        httpx.get(f"{other.url}/v1/models")
        mine = scrape(other, key=None)
        assert value(mine, "mlxchat_http_requests_total", protocol="openai", outcome="ok") == 1
    theirs = scrape(server)
    assert value(theirs, "mlxchat_http_requests_total", protocol="openai", outcome="ok") == 0
