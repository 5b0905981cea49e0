"""Shared fixtures: one model cache for the whole session, the real bundled model loaded once."""

import os
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parent.parent
# The bundled model is fetched once per machine into this (git-ignored) folder and reused.
MODEL_HOME = Path(os.environ.get("MLXCHAT_TEST_HOME", REPO / ".mlxchat-home"))
os.environ["MLXCHAT_HOME"] = str(MODEL_HOME)

# Hypothesis examples per property: few in CI, where each example of a server fuzzer is a real
# HTTP request; MLXCHAT_HYPOTHESIS=nightly runs many more. A test that names its own
# `max_examples` (a cheap pure function) keeps it. No example database: CI starts from nothing.
settings.register_profile("ci", max_examples=10, deadline=None, database=None)
settings.register_profile("nightly", max_examples=300, deadline=None, database=None)
settings.load_profile(os.environ.get("MLXCHAT_HYPOTHESIS", "ci"))


def _share_tokenizers() -> None:
    """Each test process loads a model folder's tokenizer once and shares it.

    A tiny model's weights load in milliseconds, but its tokenizer (the bundled SmolLM2 one, 49,152
    entries, which mlx-lm wraps and scans for tool and think markers) takes ~0.7 s, and the suite
    loads the same few folders hundreds of times (each test's own engine, drafts, reloads). The
    wrapper is read-only after loading (nothing in engine/, app/ or the tests assigns to it), so
    `mlx_lm.utils.load_tokenizer` is memoised per folder, keyed also by its tokenizer files'
    sizes and times (a test that rewrites one loads it anew) and by the arguments. Everything
    else in a load (weights, config, layouts) still runs every time; a folder's first load, and
    every failure, is mlx-lm's own."""
    import mlx_lm.utils

    load = mlx_lm.utils.load_tokenizer
    loaded: dict = {}

    def load_tokenizer(model_path, tokenizer_config_extra=None, eos_token_ids=None):
        folder = Path(model_path)
        if not folder.is_dir():
            return load(model_path, tokenizer_config_extra, eos_token_ids=eos_token_ids)
        files = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                      for f in sorted(folder.iterdir())
                      if f.is_file() and f.suffix in (".json", ".jinja", ".txt", ".model", ".tiktoken"))
        key = (str(folder.resolve()), files, repr(tokenizer_config_extra), repr(eos_token_ids))
        if key not in loaded:
            loaded[key] = load(model_path, tokenizer_config_extra, eos_token_ids=eos_token_ids)
        return loaded[key]

    mlx_lm.utils.load_tokenizer = load_tokenizer


_share_tokenizers()


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(items):
    """Longest modules first (tests/durations.py), so that xdist's workers end together."""
    from durations import longest_modules_first

    longest_modules_first(items)


@pytest.fixture(scope="session")
def lm():
    """The real bundled SmolLM2-135M-Instruct model, loaded through our registry."""
    from engine.loading.registry import load_model

    return load_model(None)


@pytest.fixture
def fresh_home(tmp_path, monkeypatch):
    """An empty MLXCHAT_HOME for tests that must not see the shared model cache."""
    monkeypatch.setenv("MLXCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def serve():
    """Start engines on already-loaded models; every one is stopped at the end of the test."""
    from engine.scheduling.service import Engine

    engines = []

    def start(lm, **options):
        engine = Engine(lm.name, load=lambda name, **_: lm, **options).start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        engine.stop()


@pytest.fixture(scope="module")
def tiny_engine():
    """A started engine on a tiny random llama (tests/tiny_models.py), for a module whose servers
    share one (`live_server.app_serving`); stopped at the end of the module."""
    from engine.scheduling.service import Engine
    from tiny_models import tiny_llama

    lm = tiny_llama()
    engine = Engine(lm.name, load=lambda name, **_: lm).start()
    yield engine
    engine.stop()


@pytest.fixture
def storage(tmp_path):
    """A real SQLite database in a fresh folder, closed at the end of the test."""
    from app.storage import Storage

    s = Storage(tmp_path / "db.sqlite")
    yield s
    s.close()


@pytest.fixture
def http(server):
    """An HTTP client for the module's `server` fixture (a real server on 127.0.0.1)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


# The CPU kernels (engine/kernels): tests/test_kernels.py, test_kv8.py

@pytest.fixture(scope="module")
def kern():
    """The built extension: CI installs the toolchain (scripts/setup), so it must load."""
    from engine.kernels import native

    module = native.kernels()
    assert module is not None, native.status().reason
    return module


@pytest.fixture(params=["avx512-vnni", "avx512", "avx2", "generic"])
def isa(kern, request):
    """Each instruction-set unit this CPU can run, in turn."""
    if request.param not in kern.isas():
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    default = kern.isa()
    kern.set_isa(request.param)
    yield request.param
    kern.set_isa(default)
