"""Per-model sampling defaults: resolved from the model's own files, then mlxchat's table of known
models, then the global default; explicit values win; temperature 0 stays plain greedy."""

import json
import shutil

import pytest

from engine import Engine, InvalidRequest
from engine.decoding.defaults import resolve_defaults
from live_server import openai_client, serving
from tiny_models import LLAMA, build_folder

BUNDLED = "smollm2-135m-instruct"


def _folder_with(tmp_path, generation_config=None, name="tiny"):
    folder = tmp_path / name
    shutil.copytree(build_folder(LLAMA, seed=0), folder)
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


@pytest.mark.fast
def test_a_folders_generation_config_gives_its_values(tmp_path):
    folder = _folder_with(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 40,
                                     "repetition_penalty": 1.2, "bos_token_id": 1})
    d = resolve_defaults("tiny", folder, "llama")
    for name, value in (("temperature", 0.6), ("top_p", 0.95), ("top_k", 40),
                        ("repetition_penalty", 1.2)):
        assert (d[name].value, d[name].source) == (value, "generation_config")
    assert d["min_p"].source == "global" and d["min_p"].value == 0.0
    assert d["temperature"].source_text == "from the model's generation_config.json"


@pytest.mark.fast
def test_files_beat_the_table_and_bad_values_fall_through(tmp_path):
    folder = _folder_with(tmp_path, {"temperature": 0.3, "top_p": 7}, name="SmolLM2-tiny")
    d = resolve_defaults("SmolLM2-tiny", folder, "llama")
    assert (d["temperature"].value, d["temperature"].source) == (0.3, "generation_config")
    assert (d["top_p"].value, d["top_p"].source) == (0.9, "table")  # 7 is out of range
    assert (d["repetition_penalty"].value, d["repetition_penalty"].source) == (1.1, "table")
    greedy = resolve_defaults("x", _folder_with(tmp_path, {"do_sample": False, "temperature": 0.9},
                                                name="greedy"), "llama")
    assert greedy["temperature"].value == 0.0


@pytest.mark.fast
def test_explicit_values_win_and_temperature_zero_is_plain_greedy(tmp_path):
    d = resolve_defaults("SmolLM2-x", None, "llama")
    assert d.params({}).repetition_penalty == 1.1
    assert d.params({"temperature": 1.3, "top_p": 0.5}).temperature == 1.3
    assert d.params({"top_p": 0.5}).top_p == 0.5
    greedy = d.params({"temperature": 0})
    assert greedy.greedy and greedy.repetition_penalty == 1.0  # no penalty from the defaults
    assert d.params({"temperature": 0, "repetition_penalty": 1.3}).repetition_penalty == 1.3
    with pytest.raises(InvalidRequest) as err:
        d.params({"top_p": 2})
    assert err.value.field == "top_p"


def test_the_bundled_model_gets_its_table_entry():
    engine = Engine(None).start()
    try:
        d = engine.defaults
        expected = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1,
                    "repetition_context_size": 64}
        assert {k: d[k].value for k in expected} == expected
        assert {d[k].source for k in expected} == {"table"}
        assert d["temperature"].source_text == "mlxchat's preset for this model"
    finally:
        engine.stop()


def test_an_api_request_without_sampling_fields_gets_the_resolved_defaults(tmp_path, lm):
    """Same seed: omitting the fields equals sending the bundled model's resolved values, and
    differs from sending other values (so the defaults really are applied)."""
    engine = Engine(lm.name, load=lambda name, **_: lm).start()
    with serving(engine, tmp_path / "db.sqlite") as server:
        client = openai_client(server)
        ask = lambda **kw: client.chat.completions.create(
            model=BUNDLED, messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=24, seed=5, **kw).choices[0].message.content
        omitted = ask()
        explicit = ask(temperature=0.2, top_p=0.9, extra_body={
            "repetition_penalty": 1.1, "repetition_context_size": 64})
        hot = ask(temperature=1.5, top_p=1.0)
    assert omitted == explicit
    assert hot != omitted
