"""The engine's model pool (issue 49, engine/scheduling/pool.py): several models loaded at once
under the one memory budget, each with its own rows of the one scheduler thread; loads once
however many ask; the least recently used idle model leaves memory when the budget needs room, a
busy or pinned one never, and with every model busy a load is refused (NoRoom) rather than
crashing; idle models leave after their keep-alive; each model's settings (models.json) apply on
every load, a load by a request naming it included. On tiny random-weight models
(tests/tiny_models.py), through the real registry where the settings are load options."""

import threading
import time

import pytest

from engine import (Engine, InvalidRequest, ModelSettings, ModelSettingsFile, NoRoom,
                    SamplingParams, SpeculativeOptions)
from engine.decoding.generate import Generation, build_prompt
from engine.kernels.layout import KernelLinear
from engine.loading.registry import load_model
from engine.scheduling.pool import weight_bytes
from tiny_models import tiny_llama, tiny_quantized_llama_folder, tiny_qwen3_5
from tiny_models import build_folder, LLAMA

pytestmark = pytest.mark.fast

PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def models():
    """Three tiny models of the same size (A, B, C) and a hybrid one (Q), by name."""
    found = {name: lm for name, lm in
             zip("ABC", (tiny_llama(seed) for seed in (0, 1, 2)))}
    found["Q"] = tiny_qwen3_5()
    for name, lm in found.items():
        lm.name = name  # the pool names a model as its loader does
    return found


def counting(models, loads: list[str]):
    def load(name, **_):
        loads.append(name)
        return models[name]
    return load


def tokens(handle) -> list[int]:
    return [e.token for e in handle.events(timeout=120) if e.kind == "token"]


def alone(lm, params: SamplingParams, prompt: list[int]) -> list[int]:
    gen = Generation(lm, build_prompt(lm, prompt_tokens=prompt), params)
    out = []
    while not gen.done:
        out += [e.token for e in gen.step() if e.kind == "token"]
    return out


def test_two_models_answer_at_the_same_time_each_as_it_would_alone(models):
    engine = Engine("A", load=lambda name, **_: models[name]).start()
    try:
        q = engine.use("Q")
        params = SamplingParams(max_tokens=40, temperature=0.0)
        a, b = engine.submit(prompt_tokens=PROMPT, params=params), \
            q.submit(prompt_tokens=PROMPT, params=params)
        assert tokens(a) == alone(models["A"], params, PROMPT)
        assert tokens(b) == alone(models["Q"], params, PROMPT)
        # interleaved: each model's stream was decoding while the other one's was
        first, last = (lambda h: h.times["first_token"]), (lambda h: h.times["last_token"])
        assert first(a) < last(b) and first(b) < last(a)
        assert set(engine.status().loaded) == {"A", "Q"} and engine.model_name == "A"
        assert q.model_name == "Q" and q.model.family == "qwen3_5"
    finally:
        engine.stop()


def test_concurrent_first_requests_load_a_model_once(models):
    loads: list[str] = []
    engine = Engine("A", load=counting(models, loads)).start()
    try:
        barrier = threading.Barrier(16)
        views, errors = [], []

        def first_request() -> None:
            barrier.wait()
            try:
                view = engine.use("B")
                views.append(tokens(view.submit(prompt_tokens=PROMPT,
                                                params=SamplingParams(max_tokens=4))))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=first_request) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == [] and len(views) == 16 and all(len(v) == 4 for v in views)
        assert loads == ["A", "B"]
        assert engine.stats().totals.model_loads == {("A", "loaded"): 1, ("B", "loaded"): 1}
    finally:
        engine.stop()


def budget_for(models, *names: str, room: int = 0) -> int:
    return sum(weight_bytes(models[n]) for n in names) + room


def test_the_budget_evicts_the_least_recently_used_idle_model(models):
    loads: list[str] = []
    engine = Engine("A", load=counting(models, loads),
                    memory_budget=budget_for(models, "A", "B", room=2**20)).start()
    try:
        params = SamplingParams(max_tokens=4)
        b = engine.use("B")
        tokens(b.submit(prompt_tokens=PROMPT, params=params))
        tokens(engine.submit(prompt_tokens=PROMPT, params=params))  # A used last
        c = engine.use("C")  # no room for a third: B, the least recently used, leaves
        assert tokens(c.submit(prompt_tokens=PROMPT, params=params)) == \
            alone(models["C"], params, PROMPT)
        assert set(engine.status().loaded) == {"A", "C"}
        assert engine.budget.reserved == budget_for(models, "A", "C")
        again = engine.use("B")  # now A is the least recently used
        assert set(engine.status().loaded) == {"B", "C"} and loads == ["A", "B", "C", "B"]
        # a request for the evicted model waits while it loads again, then answers
        assert tokens(engine.submit(prompt_tokens=PROMPT, params=params)) == \
            alone(models["A"], params, PROMPT)
        assert again.model_name == "B" and "A" in engine.status().loaded
    finally:
        engine.stop()


def test_busy_and_pinned_models_stay_and_a_load_without_room_is_refused(models):
    loads: list[str] = []
    engine = Engine("A", load=counting(models, loads), pinned=("A",),
                    memory_budget=budget_for(models, "A", "B", room=4 * 2**20)).start()
    try:
        b = engine.use("B")
        running = b.submit(prompt_tokens=PROMPT, params=SamplingParams(max_tokens=100_000 // 40))
        while running.state not in ("decoding", "finished"):
            time.sleep(0.001)
        with pytest.raises(NoRoom) as refused:  # A is pinned, B is busy: nothing can leave
            engine.use("C")
        assert refused.value.retry_after > 0 and "C" in str(refused.value)
        assert set(engine.status().loaded) == {"A", "B"}
        assert engine.budget.reserved == budget_for(models, "A", "B") + running.kv_bytes
        running.cancel()
        tokens(running)
        assert engine.use("C").model_name == "C"  # B, idle now, left for it
        assert set(engine.status().loaded) == {"A", "C"}
        assert [m.pinned for m in engine.loaded_models() if m.name == "A"] == [True]
    finally:
        engine.stop()


def test_room_for_something_besides_the_models_evicts_an_idle_one(models):
    """The seam other engine parts use (a speech model's weights): `pool.reserve`."""
    engine = Engine("A", load=lambda name, **_: models[name],
                    memory_budget=budget_for(models, "A", "B", room=2**20)).start()
    try:
        engine.use("B")
        w = weight_bytes(models["A"])
        engine.pool.reserve(w, "a speech model")
        assert engine.status().loaded == ("B",)  # A, the least recently used, left
        assert engine.budget.reserved == 2 * w
        engine.budget.release(w)
    finally:
        engine.stop()


def test_pinned_models_load_at_start_and_serve_takes_them(models, monkeypatch):
    engine = Engine("A", load=lambda name, **_: models[name], pinned=("A", "B")).start()
    try:
        assert {(m.name, m.pinned, m.expires_at) for m in engine.loaded_models()} == \
            {("A", True, None), ("B", True, None)}  # never evicted, no idle unload
        assert engine.model_name == "A"
    finally:
        engine.stop()
    from click.testing import CliRunner

    import app.server
    from app.cli.commands import cli

    seen: dict = {}
    monkeypatch.setattr(app.server, "serve", lambda **options: seen.update(options))
    r = CliRunner().invoke(cli, ["serve", "-m", "a", "--model", "b", "--max-loaded", "2",
                                 "--no-browser"])
    assert r.exit_code == 0, r.output
    assert (seen["model"], seen["pinned"], seen["max_loaded"]) == ("a", ("a", "b"), 2)
    assert CliRunner().invoke(cli, ["serve", "--max-loaded", "0"]).exit_code == 2


def test_max_loaded_caps_the_models_in_memory(models):
    engine = Engine("A", load=lambda name, **_: models[name], max_loaded=2).start()
    try:
        engine.use("B")
        engine.use("C")
        assert len(engine.status().loaded) == 2 and "C" in engine.status().loaded
    finally:
        engine.stop()


def test_an_idle_model_leaves_after_its_keep_alive_and_a_zero_unloads_at_once(models):
    engine = Engine("A", load=lambda name, **_: models[name]).start()
    try:
        b = engine.use("B")
        start = time.monotonic()
        tokens(b.submit(prompt_tokens=PROMPT, params=SamplingParams(max_tokens=2),
                        keep_alive="500ms"))
        expires = [m.expires_at for m in engine.loaded_models() if m.name == "B"][0]
        assert expires is not None and 0 < expires - time.time() <= 0.55
        while "B" in engine.status().loaded:
            assert time.monotonic() - start < 30, "B was not unloaded"
            time.sleep(0.02)
        assert 0.45 < time.monotonic() - start
        assert engine.status().loaded == ("A",)
        assert engine.unload_model("A") and engine.status().loaded == ()
        assert not engine.unload_model("A")  # not in memory any more
        # the next request loads it again
        assert len(tokens(engine.submit(prompt_tokens=PROMPT,
                                        params=SamplingParams(max_tokens=2)))) == 2
    finally:
        engine.stop()


def test_a_model_never_loaded_has_no_view(models):
    engine = Engine("A", load=lambda name, **_: models[name]).start()
    try:
        with pytest.raises(InvalidRequest) as err:
            engine.on("B")
        assert err.value.code == "model_not_loaded"
        assert engine.status().loaded == ("A",)
    finally:
        engine.stop()


# --- per-model settings, applied on every load -----------------------------------------------

@pytest.fixture(scope="module")
def folders():
    """Two tiny llama folders loaded through the real registry, and the 4-bit one that runs on
    our CPU kernels."""
    wide = {**LLAMA, "head_dim": 32}  # the 8-bit KV cache takes heads of 32 and more
    return build_folder(LLAMA, seed=5), build_folder(wide, seed=6), tiny_quantized_llama_folder()


@pytest.mark.slow  # four loads through the registry, and a speculative request
def test_each_setting_applies_when_a_request_loads_the_model(folders, tmp_path):
    default, other, quantized = folders
    table = ModelSettingsFile(tmp_path / "models.json")
    table.put(other.name, ModelSettings.parse({
        "preset": "greedy", "sampling": {"top_k": 7}, "context_length": 256, "kv_bits": 8,
        "draft": "truncated:2", "keep_alive": "2s"}))
    table.put(quantized.name, ModelSettings.parse({"int8_activations": True}))
    engine = Engine(str(default), model_settings=table, int8_activations=False).start()
    try:
        plain = engine.model
        assert plain.context_length == 8192 and plain.kv_format == "full"
        assert plain.defaults["temperature"].source != "settings"

        jit = engine.use(str(other))  # loaded by a request naming it
        d = jit.model
        assert d.context_length == 256 and jit.lm.context_length == 256
        assert d.kv_format != "full"  # the 8-bit KV cache
        assert (d.defaults["temperature"].value, d.defaults["temperature"].source) == \
            (0.0, "settings")
        assert (d.defaults["top_k"].value, d.defaults["top_k"].source) == (7, "settings")
        with pytest.raises(InvalidRequest) as err:  # past its context
            jit.submit(prompt_tokens=list(range(100, 300)), params=SamplingParams(max_tokens=100))
        assert err.value.code == "context_length_exceeded"
        short = {"max_tokens": 16}
        done = list(jit.submit(prompt_tokens=PROMPT, params=jit.params(short))
                    .events(timeout=120))[-1]
        assert "speculative" in done.stats  # its draft, with no request asking for one
        done = list(jit.submit(prompt_tokens=PROMPT, params=jit.params({**short, "logprobs": 1}))
                    .events(timeout=120))[-1]
        assert done.finish_reason == "length" and "speculative" not in done.stats  # plain
        left = [m.expires_at for m in engine.loaded_models() if m.name == other.name][0] - time.time()
        assert 0 < left <= 2.1  # its own keep-alive

        q = engine.use(str(quantized))
        layers = {m.int8_activations for _, m in q.lm.model.named_modules()
                  if isinstance(m, KernelLinear)}
        assert layers == {True} and q.int8_activations is True
        # the same settings again after an unload (its 2 s keep-alive may have unloaded it
        # already on a busy machine): the reload takes them too
        engine.unload_model(other.name)
        assert other.name not in {m.name for m in engine.loaded_models()}
        again = engine.use(str(other))
        assert again.model.context_length == 256 and again.model.kv_format == d.kv_format
    finally:
        engine.stop()


def test_a_settings_file_that_cannot_be_used_is_said_and_ignored(tmp_path):
    path = tmp_path / "models.json"
    path.write_text('{"models": {"x": {"context_length": "long"}}}')
    table = ModelSettingsFile(path)
    assert table.get("x") == ModelSettings() and "context_length" in table.error
    with pytest.raises(InvalidRequest):
        table.put("x", ModelSettings(context_length=512))
    path.write_text('{"models": {"x": {"context_length": 512, "keep_alive": -1}}}')
    assert table.get("x").context_length == 512 and table.error is None
    assert table.get("x").idle_keep(60.0) is None  # kept loaded
    table.put("y", ModelSettings.parse({"int8_activations": False, "kv_bits": 16}))
    assert ModelSettingsFile(path).all()["y"] == ModelSettings(int8_activations=False, kv_bits=16)
    for bad in ({"kv_bits": 4}, {"preset": "hot"}, {"sampling": {"temperature": -1}},
                {"colour": "red"}, {"keep_alive": "soon"}):
        with pytest.raises(InvalidRequest) as err:
            ModelSettings.parse(bad, "models.z")
        assert err.value.field.startswith("models.z.")
