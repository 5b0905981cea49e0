"""An API request naming another local model loads it beside the default one (as Ollama and LM
Studio do), and both answer at the same time; an unknown name is a 404 listing the local models. Against a real server on
127.0.0.1 with two local models: the bundled one and a tiny random-weight model in the hub cache."""

import json
import shutil
import threading
import time

import httpx
import pytest

from live_server import serving
from tiny_models import LLAMA, build_folder

MODEL = "smollm2-135m-instruct"
TINY = "test/tiny-llama"
HUGE = "test/huge"  # a model whose weights cannot fit in memory
HELLO = [{"role": "user", "content": "Say hello."}]


def _cache_repo(hub, name: str):
    """A snapshot folder of `name` in huggingface_hub's cache layout."""
    folder = hub / f"models--{name.replace('/', '--')}" / "snapshots" / ("0" * 40)
    folder.mkdir(parents=True)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from engine.scheduling.service import Engine

    hub = tmp_path_factory.mktemp("hub")
    tiny = _cache_repo(hub, TINY)
    for f in build_folder(LLAMA, seed=3).iterdir():
        shutil.copy(f, tiny / f.name)
    huge = _cache_repo(hub, HUGE)
    (huge / "config.json").write_text(json.dumps(LLAMA))
    with open(huge / "model.safetensors", "wb") as f:
        f.truncate(1 << 40)  # sparse: 1 TiB as its size says, nothing on disk
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(hub))
        engine = Engine(max_running=2, max_queued=2).start()
        with serving(engine, tmp_path_factory.mktemp("db") / "db.sqlite") as s:
            yield s


def chat(server, model: str | None, **fields) -> httpx.Response:
    body = {"messages": HELLO, "max_tokens": 4, "temperature": 0, **fields}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)


def loaded(server) -> str:
    return httpx.get(f"{server.url}/health").json()["model"]


def test_a_model_id_with_a_slash_is_retrieved(server):
    r = httpx.get(f"{server.url}/v1/models/{TINY}")
    assert r.status_code == 200 and r.json()["id"] == TINY and r.json()["created"] > 0


def models(server) -> list[str]:
    return [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]


def loaded_models(server) -> dict[str, dict]:
    """The `loaded` object of each model in memory, by id (`/v1/models`)."""
    return {m["id"]: m["loaded"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]
            if "loaded" in m}


def test_a_request_loads_another_local_model_beside_the_default(server):
    assert models(server)[0] == MODEL and {TINY, HUGE} <= set(models(server))
    before = chat(server, MODEL).json()["choices"][0]["message"]["content"]

    r = chat(server, TINY)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == TINY and loaded(server) == MODEL  # the default stays
    assert set(loaded_models(server)) == {MODEL, TINY}
    assert loaded_models(server)[TINY]["memory_bytes"] > 0
    # The legacy endpoint runs on it too; the bundled model's answer is unchanged beside it.
    r = httpx.post(f"{server.url}/v1/completions", timeout=300,
                   json={"model": TINY, "prompt": "Once", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == TINY
    r = chat(server, MODEL)
    assert r.status_code == 200 and r.json()["model"] == MODEL and loaded(server) == MODEL
    assert r.json()["choices"][0]["message"]["content"] == before


def test_an_unknown_model_is_a_404_listing_the_local_ones(server):
    for path, body in (("/v1/chat/completions", {"messages": HELLO}),
                       ("/v1/completions", {"prompt": "Hi"})):
        r = httpx.post(f"{server.url}{path}", timeout=60, json={"model": "gpt-4o", **body})
        error = r.json()["error"]
        assert r.status_code == 404 and error["code"] == "model_not_found", r.text
        assert error["param"] == "model" and TINY in error["message"]
    assert loaded(server) == MODEL


def test_a_model_that_cannot_fit_is_refused_and_the_loaded_one_stays(server):
    r = chat(server, HUGE)
    error = r.json()["error"]
    assert r.status_code == 503 and error["code"] == "insufficient_memory", r.text
    assert "memory" in error["message"]
    assert loaded(server) == MODEL
    assert chat(server, None).status_code == 200


def test_a_bad_request_naming_another_model_loads_nothing(server):
    r = chat(server, TINY, temperature="hot")
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert loaded(server) == MODEL


def test_a_request_for_another_model_runs_beside_the_running_one(server):
    """Two models answer at the same time: a request for the tiny model does not wait for the
    long answer running on the bundled one."""
    finished: dict[str, float] = {}
    replies: dict[str, httpx.Response] = {}

    def long_answer() -> None:
        replies["long"] = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 64, "temperature": 0})
        finished["long"] = time.monotonic()

    runner = threading.Thread(target=long_answer)
    runner.start()
    deadline = time.monotonic() + 60
    while httpx.get(f"{server.url}/health", timeout=60).json()["generating"] == 0:
        assert time.monotonic() < deadline and "long" not in replies
        time.sleep(0.02)
    r = chat(server, TINY)
    finished["other"] = time.monotonic()
    runner.join(300)
    assert r.status_code == 200 and r.json()["model"] == TINY
    long = replies["long"]
    assert long.status_code == 200 and long.json()["model"] == MODEL
    assert long.json()["choices"][0]["finish_reason"] == "length"  # it counts on
    assert finished["other"] < finished["long"]


@pytest.mark.fast
def test_a_model_opened_from_a_folder_can_be_named_again_after_a_switch(tmp_path, monkeypatch):
    """The server started on a model folder (not in the hub cache): after a request switched to
    another model, the folder's model is still local, listed, and a request switches back."""
    from engine.scheduling.service import Engine

    hub = tmp_path / "hub"
    tiny = _cache_repo(hub, TINY)
    for f in build_folder(LLAMA, seed=3).iterdir():
        shutil.copy(f, tiny / f.name)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    folder = build_folder(LLAMA, seed=4)
    with serving(Engine(str(folder)).start(), tmp_path / "db.sqlite") as server:
        assert loaded(server) == folder.name and models(server)[:1] == [folder.name]
        assert chat(server, TINY).json()["model"] == TINY
        assert folder.name in models(server)
        r = chat(server, folder.name)
        assert r.status_code == 200 and r.json()["model"] == folder.name == loaded(server)
