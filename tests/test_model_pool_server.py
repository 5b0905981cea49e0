"""Several models at once on a real server (issue 49): requests alternating between the bundled
model, a tiny llama and a tiny vision model never reload one; 16 concurrent first requests for a
model load it once; the real `ollama` client's `ps()` shows what is in memory, and its
`keep_alive: 0` unloads; two conversations of the chat UI on two models answer at the same time,
and switching one's model keeps the other loaded; with every model busy a request for another
gets 503 with Retry-After and the server stays up. The tiny models sit in a stand-in of the
Hugging Face cache, so that requests name them as users name downloaded models."""

import shutil
import threading
import time

import httpx
import ollama
import pytest

from bench.vlm_shapes import tiny_smolvlm_folder
from live_server import new_conversation, serving, turn
from tiny_models import LLAMA, QWEN3_5, build_folder

MODEL = "smollm2-135m-instruct"
LLAMA_ID, VLM_ID, QWEN_ID = "test/pool-llama", "test/pool-vlm", "test/pool-qwen"
HELLO = [{"role": "user", "content": "Say hello."}]


def _cache_repo(hub, name: str, source) -> None:
    """`source`'s files as a snapshot of `name` in huggingface_hub's cache layout."""
    folder = hub / f"models--{name.replace('/', '--')}" / "snapshots" / ("0" * 40)
    folder.mkdir(parents=True)
    for f in source.iterdir():
        shutil.copy(f, folder / f.name)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = tmp_path_factory.mktemp("hub")
    _cache_repo(hub, LLAMA_ID, build_folder(LLAMA, seed=7))
    _cache_repo(hub, VLM_ID, tiny_smolvlm_folder())
    _cache_repo(hub, QWEN_ID, build_folder(QWEN3_5, seed=7))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(hub))
        yield hub


@pytest.fixture(scope="module")
def server(hub, tmp_path_factory):
    from engine import Engine, ModelSettingsFile

    folder = tmp_path_factory.mktemp("db")
    engine = Engine(model_settings=ModelSettingsFile(folder / "models.json"))
    with serving(engine.start(), folder / "db.sqlite") as s:
        yield s


def chat(server, model: str | None, max_tokens: int = 2, **fields) -> httpx.Response:
    body = {"messages": HELLO, "max_tokens": max_tokens, "temperature": 0, **fields}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)


def loaded(server) -> dict[str, dict]:
    """The `loaded` object of each model in memory (`/v1/models`), by id."""
    return {m["id"]: m["loaded"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]
            if "loaded" in m}


def loads(server) -> dict[str, int]:
    """Model loads so far by model (the engine's counter)."""
    totals = server.app.state.engine.stats().totals.model_loads
    return {model: n for (model, outcome), n in totals.items() if outcome == "loaded"}


def test_alternating_between_three_models_never_reloads_one(server):
    for _ in range(2):
        for model in (MODEL, LLAMA_ID, VLM_ID):
            r = chat(server, model)
            assert r.status_code == 200 and r.json()["model"] == model, r.text
    assert loads(server) == {MODEL: 1, LLAMA_ID: 1, VLM_ID: 1}
    shown = loaded(server)
    assert set(shown) == {MODEL, LLAMA_ID, VLM_ID}
    assert all(m["memory_bytes"] > 0 and m["expires_at"] for m in shown.values())
    assert httpx.get(f"{server.url}/health").json()["model"] == MODEL  # still the default


def test_sixteen_concurrent_first_requests_load_a_model_once(server):
    assert QWEN_ID not in loaded(server)
    replies: list[httpx.Response] = []
    barrier = threading.Barrier(16)

    def first() -> None:
        barrier.wait()
        replies.append(chat(server, QWEN_ID))

    threads = [threading.Thread(target=first) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [r.status_code for r in replies] == [200] * 16, replies[0].text
    assert loads(server)[QWEN_ID] == 1 and QWEN_ID in loaded(server)


def test_ollama_ps_shows_the_loaded_set_and_keep_alive_zero_unloads(server):
    client = ollama.Client(host=server.url, timeout=120)
    chat(server, LLAMA_ID)
    shown = {m.model: m for m in client.ps().models}
    assert {f"{MODEL}:latest", f"{LLAMA_ID}:latest"} <= set(shown)
    assert shown[f"{LLAMA_ID}:latest"].size > 0 and shown[f"{LLAMA_ID}:latest"].expires_at
    r = client.generate(model=LLAMA_ID, prompt="", keep_alive=0)
    assert r.done_reason == "unload"
    assert f"{LLAMA_ID}:latest" not in {m.model for m in client.ps().models}
    r = client.generate(model=LLAMA_ID, prompt="", keep_alive="2s")  # loads it, for 2 s
    assert r.done_reason == "load"
    entry = next(m for m in client.ps().models if m.model == f"{LLAMA_ID}:latest")
    assert 0 < entry.expires_at.timestamp() - time.time() <= 2.1
    deadline = time.monotonic() + 30
    while f"{LLAMA_ID}:latest" in {m.model for m in client.ps().models}:
        assert time.monotonic() < deadline, "not unloaded after its keep-alive"
        time.sleep(0.1)


def test_two_conversations_on_two_models_answer_at_the_same_time(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        def pick(cid: int, model: str) -> None:
            r = http.post("/models/switch", data={"name": model, "conversation": str(cid)})
            assert r.status_code == 200 and server.storage.get_conversation(cid).model == model

        def answer(cid: int, done: dict[int, float]) -> None:
            turn(server, cid, action="send", content="Count to twenty.")
            done[cid] = time.monotonic()

        second = new_conversation(http)
        pick(second, LLAMA_ID)
        answer(second, {})
        first = new_conversation(http, max_tokens=48)
        pick(first, MODEL)  # switching back keeps the tiny llama loaded
        assert {MODEL, LLAMA_ID} <= set(loaded(server))
        done: dict[int, float] = {}
        slow = threading.Thread(target=answer, args=(first, done))
        slow.start()
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/health").json()["generating"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        answer(second, done)
        slow.join(300)
        assert done[second] < done[first]  # it did not wait for the bundled model's answer
        by = {cid: {m.model for m in server.storage.active_path(cid) if m.role == "assistant"}
              for cid in (first, second)}
        assert by == {first: {MODEL}, second: {LLAMA_ID}}
        page = http.get(f"/c/{second}").text  # its model menu marks its model
        assert f'class="model current"' in page and \
            page.split('class="model current"', 1)[1].split("</button>", 1)[0].count(LLAMA_ID)
        page = http.get("/settings").text  # Settings › Model: both models in memory
        listed = page.split("In memory", 1)[1].split("</ul>", 1)[0]
        assert MODEL in listed and LLAMA_ID in listed


def test_the_panel_saves_a_models_settings_and_its_next_load_takes_them(server):
    chat(server, LLAMA_ID)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/models/settings", data={"name": LLAMA_ID, "model_context_length": "256",
                                                "model_preset": "greedy"})
        assert r.status_code == 200 and "Saved" in r.text and 'value="256"' in r.text
        r = http.post("/models/settings", data={"name": LLAMA_ID, "model_kv_bits": "4"})
        assert 'role="alert"' in r.text and "kv_bits" in r.text  # refused, nothing saved
    settings = server.app.state.engine.model_settings
    assert settings.get(LLAMA_ID).context_length == 256 and settings.get(LLAMA_ID).preset == "greedy"
    assert LLAMA_ID not in loaded(server)  # idle: unloaded, to load with them next time
    assert chat(server, LLAMA_ID).status_code == 200
    assert loaded(server)[LLAMA_ID]["context_length"] == 256
    r = chat(server, LLAMA_ID, max_tokens=300)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_with_every_model_busy_a_load_is_a_503_with_retry_after(hub, tmp_path):
    from engine import Engine

    with serving(Engine(LLAMA_ID, max_loaded=1).start(), tmp_path / "db.sqlite") as s:
        with httpx.Client(timeout=300) as http, http.stream(
                "POST", f"{s.url}/v1/chat/completions",
                json={"model": LLAMA_ID, "messages": HELLO, "max_tokens": 8000,
                      "stream": True}) as running:
            lines = running.iter_lines()  # held: a closed iterator closes the stream
            next(lines)  # it runs
            r = chat(s, QWEN_ID)
            assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
            assert r.json()["error"]["code"] == "models_busy"
            assert httpx.get(f"{s.url}/health").json()["status"] == "ok"
        # the client left: its request is cancelled, the model idle, and the load succeeds
        deadline = time.monotonic() + 60
        while (r := chat(s, QWEN_ID)).status_code == 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert r.status_code == 200 and set(loaded(s)) == {QWEN_ID}
