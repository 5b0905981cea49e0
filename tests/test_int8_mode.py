"""The int8-activation mode as a load-time choice: `Engine.switch_model(int8_activations=...)`
reloads a model on the CPU kernels with it on or off (the layers, the active path and the answers
follow; an idle reload keeps it; a failed switch leaves it as it was), the prefix cache never
shares snapshots between the two modes, and the model picker's checkbox does it over HTTP on a
real server. On a tiny random llama quantized to 4 bits by mlx-lm's own `convert`, loaded
through the real registry (tests/tiny_models.py)."""

import re
import time

import httpx
import pytest

from engine import Engine, ModelLoadError, SamplingParams, compute_path
from engine.prefix_cache import snapshot_files
from engine.prefix_cache.store import model_key
from engine.kernels.layout import KernelEmbedding, KernelLinear, KernelLlamaBlock
from engine.loading.registry import load_model
from chats import long_chat, persisted_apart
from live_server import serving
from tiny_models import tiny_quantized_llama_folder

pytestmark = pytest.mark.fast

QUESTION = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def folder():
    return tiny_quantized_llama_folder()


def int8_layers(model) -> set[bool]:
    """The `int8_activations` of every kernel-backed layer (one value when they agree)."""
    return {m.int8_activations for _, m in model.named_modules()
            if type(m) in (KernelLinear, KernelEmbedding, KernelLlamaBlock)}


def answer(engine: Engine, **options) -> list[int]:
    handle = engine.submit(QUESTION, SamplingParams(max_tokens=6, temperature=0.0), **options)
    return [e.token for e in handle.events(timeout=120) if e.kind == "token"]


def test_switching_int8_on_then_off_reloads_the_layers_and_the_answers_still_come(folder):
    engine = Engine(str(folder), int8_activations=False).start()
    try:
        name = engine.model_name
        assert engine.int8_activations is False and int8_layers(engine.lm.model) == {False}
        exact = answer(engine)
        assert len(exact) == 6

        engine.switch_model(name, int8_activations=True)
        assert engine.model_name == name and engine.int8_activations is True
        assert int8_layers(engine.lm.model) == {True}
        assert compute_path(engine.int8_activations).endswith("int8 activations)")
        assert len(answer(engine)) == 6

        answer(engine, keep_alive="0s")  # unloaded after it; the next request reloads the weights
        deadline = time.time() + 30
        while engine.status().resident:
            assert time.time() < deadline, "not unloaded"
            time.sleep(0.05)
        assert len(answer(engine)) == 6 and engine.status().resident
        assert int8_layers(engine.lm.model) == {True}  # the idle reload kept the choice

        with pytest.raises(ModelLoadError):  # a failed switch: the model as it was
            engine.switch_model(str(folder / "missing"), int8_activations=False)
        assert engine.model_name == name and int8_layers(engine.lm.model) == {True}

        engine.switch_model(name)  # no choice given: as the current model
        assert int8_layers(engine.lm.model) == {True}

        engine.switch_model(name, int8_activations=False)
        assert engine.int8_activations is False and int8_layers(engine.lm.model) == {False}
        assert "int8" not in compute_path(engine.int8_activations)
        assert answer(engine) == exact  # the exact path again, token for token
    finally:
        engine.stop()


def test_snapshots_of_one_mode_are_never_read_under_the_other(folder, tmp_path):
    """Each mode keeps its own snapshot folder (model_key) and identity: a persisted prefix made
    under one is recomputed under the other, answering as without a cache; a file of the other
    mode in its folder is refused."""
    exact, int8 = (load_model(str(folder), int8_activations=on) for on in (False, True))
    assert model_key(exact) != model_key(int8)
    assert "activations" not in snapshot_files.identity(exact)  # files from before int8 stay good
    assert snapshot_files.identity(exact)["compute"] == "cpu-kernels"  # recorded at load
    assert snapshot_files.identity(int8)["activations"] == "int8"
    chat, params = long_chat(2), SamplingParams(max_tokens=4)
    for writer, reader in ((exact, int8), (int8, exact)):
        persist = tmp_path / ("int8" if writer is int8 else "exact")
        written, _ = persisted_apart(writer, reader, persist, chat, params)
        with pytest.raises(snapshot_files.BadSnapshot, match="activations"):
            snapshot_files.read_header(written[0], snapshot_files.identity(reader))


# -- the model picker's checkbox, over HTTP on a real server ---------------------------------------

@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    engine = Engine(str(folder), int8_activations=False).start()
    with serving(engine, tmp_path_factory.mktemp("int8ui") / "db.sqlite") as server:
        server.engine = engine
        yield server


def compute(http: httpx.Client) -> str:
    health = http.get("/health").json()
    assert health["status"] == "ok", health
    return health["device"]["compute_path"]


def path_named(settings: str) -> str:
    """The compute path Settings › Model names."""
    return re.search(r'<p class="compute-path">(.*?)</p>', settings, re.S).group(1)


def switched(http: httpx.Client) -> str:
    """The picker once the model switch in progress is done: the `done` event of its progress
    stream, as the page reads it."""
    with http.stream("GET", "/models/progress") as events:
        lines = iter(events.iter_lines())
        for line in lines:
            if line == "event: done":
                return "\n".join(l.removeprefix("data: ") for l in lines if l.startswith("data: "))
    raise AssertionError("no done event")


def test_the_checkbox_reloads_the_model_into_the_int8_path_and_back(server, http):
    page = http.get("/settings").text  # Settings › Model
    assert 'name="int8_activations"' in page and "Faster answers on this CPU (int8 activations)" in page
    assert 'id="int8-activations" checked' not in page
    assert "runs on quantized CPU kernels (" in path_named(page)
    assert "int8 activations)" not in path_named(page)
    assert "int8" not in compute(http)

    for on in (True, False):
        r = http.post("/models/options", data={"int8_activations": "on"} if on else {})
        assert r.status_code == 200 and 'class="progress"' in r.text  # loading, as a switch shows
        assert 'id="load-status"' in switched(http)  # the load status, swapped as it ends
        picker = http.get("/settings").text
        assert ('id="int8-activations" checked' in picker) is on
        assert ("int8 activations)" in path_named(picker)) is on  # the path the page names
        assert compute(http).startswith("quantized CPU kernels") and \
            ("int8 activations" in compute(http)) is on
        assert int8_layers(server.engine.lm.model) == {on}
        reply = http.post("/v1/chat/completions", json={
            "model": server.engine.model_name, "messages": QUESTION, "max_tokens": 3})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


def test_the_option_posts_only_from_our_own_origin_and_changes_nothing_else(server, http):
    """The security middleware guards it as every other form post; posting the current value
    reloads nothing."""
    r = http.post("/models/options", data={"int8_activations": "on"},
                  headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    r = http.post("/models/options", data={}, headers={"Origin": server.url})
    assert r.status_code == 200 and 'class="progress"' not in r.text
    assert 'name="int8_activations"' in r.text and "int8" not in compute(http)


def test_a_model_off_the_kernels_shows_no_option_and_ignores_the_post(tiny_engine, tmp_path):
    """The dense tiny llama runs the fp32 layout, not our kernels: no checkbox, the path named,
    and a post reloads nothing."""
    from live_server import app_serving

    assert tiny_engine.int8_activations is None
    with app_serving(tiny_engine, tmp_path / "db.sqlite") as dense, \
            httpx.Client(base_url=dense.url, timeout=60) as client:
        assert 'id="models"' in client.get("/", follow_redirects=True).text  # the model menu
        page = client.get("/settings").text
        assert 'id="models"' in page and 'name="int8_activations"' not in page
        assert " runs on " in page
        r = client.post("/models/options", data={"int8_activations": "on"})
        assert r.status_code == 200 and 'class="progress"' not in r.text
        assert tiny_engine.int8_activations is None
