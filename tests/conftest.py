"""Shared fixtures: one model cache for the whole session, the real bundled model loaded once."""

import hashlib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The bundled model is fetched once per machine into this (git-ignored) folder and reused.
MODEL_HOME = Path(os.environ.get("MLXCHAT_TEST_HOME", REPO / ".mlxchat-home"))
os.environ["MLXCHAT_HOME"] = str(MODEL_HOME)


def _hypothesis_profiles() -> None:
    """Hypothesis examples per property: few in CI, where each example of a server fuzzer is a
    real HTTP request; MLXCHAT_HYPOTHESIS=nightly runs many more. A test that names its own
    `max_examples` (a cheap pure function) keeps it. No example database: CI starts from nothing."""
    from hypothesis import settings

    settings.register_profile("ci", max_examples=10, deadline=None, database=None)
    settings.register_profile("nightly", max_examples=300, deadline=None, database=None)
    settings.load_profile(os.environ.get("MLXCHAT_HYPOTHESIS", "ci"))


# What of a model folder's `config.json` decides its tokenizer: transformers' AutoTokenizer class
# (`tokenizer_class`, `auto_map`, else by `model_type`) and mlx-lm's TOKENIZER_DEFAULTS (by the
# model class its `model_type` names).
TOKENIZER_KEYS = ("model_type", "tokenizer_class", "auto_map", "architectures")


def _share_tokenizers() -> None:
    """Each test process loads a tokenizer once and shares it.

    A tiny model's weights load in milliseconds, but its tokenizer (the bundled SmolLM2 one, 49,152
    entries, which mlx-lm wraps and scans for tool and think markers) takes ~0.7 s, and the suite
    loads the same few tokenizers hundreds of times (each test's own engine, drafts, reloads; tiny
    models of other seeds, or built in a test's own folder, with the same files). The wrapper is
    read-only after loading (nothing in engine/, app/ or the tests assigns to it), so
    `mlx_lm.utils.load_tokenizer` is memoised per content of the files it reads (the folder's
    JSON, Jinja, text and tokenizer-model files) and per arguments: a test that rewrites one loads
    it anew. Of `config.json` only what picks the tokenizer counts (`TOKENIZER_KEYS`: mlx-lm's
    defaults and transformers' class follow the model type), so the tiny models of one type share
    one tokenizer whatever their sizes. Everything else in a load (weights, config, layouts) still
    runs every time; a tokenizer's first load, and every failure, is mlx-lm's own."""
    import json

    import mlx_lm.utils

    load = mlx_lm.utils.load_tokenizer
    loaded: dict = {}
    digests: dict = {}  # (folder, its files' names, sizes and times) -> digest of what they hold

    def content(f: Path) -> bytes:
        if f.name != "config.json":
            return f.read_bytes()
        try:
            config = json.loads(f.read_bytes())
        except ValueError:
            return f.read_bytes()
        return json.dumps({k: config.get(k) for k in TOKENIZER_KEYS}, sort_keys=True).encode()

    def load_tokenizer(model_path, tokenizer_config_extra=None, eos_token_ids=None):
        folder = Path(model_path)
        if not folder.is_dir():
            return load(model_path, tokenizer_config_extra, eos_token_ids=eos_token_ids)
        files = [f for f in sorted(folder.iterdir())
                 if f.is_file() and f.suffix in (".json", ".jinja", ".txt", ".model", ".tiktoken")]
        stats = (str(folder.resolve()), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
        if stats not in digests:
            digest = hashlib.sha256()
            for f in files:
                data = content(f)
                digest.update(f"{f.name}\0{len(data)}\0".encode() + data)
            digests[stats] = digest.hexdigest()
        key = (digests[stats], repr(tokenizer_config_extra), repr(eos_token_ids))
        if key not in loaded:
            loaded[key] = load(model_path, tokenizer_config_extra, eos_token_ids=eos_token_ids)
        return loaded[key]

    mlx_lm.utils.load_tokenizer = load_tokenizer


def _share_vocabularies() -> None:
    """A loaded tokenizer builds its vocabulary dict once per process, not at every ask.

    transformers' `get_vocab()` (and the `vocab` property, which calls it) converts the Rust
    tokenizer's whole vocabulary into a new Python dict each time: ~30 ms for the bundled 49,152
    entries, and the engine asks at every model load (`capabilities` -> `fim_tokens`, the prompt
    size check's longest entry) and at every embedding request (the longest entry again): ~900
    times in the fast tier, 25 s of its 280 s of CPU in one process. The tokenizers are shared and
    read-only once loaded (`_share_tokenizers`), so each keeps the dict it built, keyed by its
    size with added tokens (a tokenizer given more tokens builds it anew), and every caller gets
    a copy of it (~0.4 ms), equal to what `get_vocab()` returns, free to change it."""
    import weakref

    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    get_vocab = TokenizersBackend.get_vocab
    built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def shared_get_vocab(self) -> dict[str, int]:
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        found = built.get(self)
        if found is None or found[0] != size:
            found = built[self] = (size, get_vocab(self))
        return dict(found[1])

    TokenizersBackend.get_vocab = shared_get_vocab


def _share_ssl_context() -> None:
    """Every httpx client of a test process gets one default SSL context.

    httpx builds a new default context for each client (`ssl.create_default_context` on certifi's
    bundle, or on the bundle SSL_CERT_FILE / the folder SSL_CERT_DIR names), and `httpx.get(...)`
    makes a client per call: reading a bundle is ~20-70 ms of CPU, 25 times the request itself on
    127.0.0.1, and the suite makes thousands (the key-guessing and protocol fuzzers, the SDK
    clients, the app's own clients). No test speaks TLS (every server is http://127.0.0.1), so
    the default context (verify on, no client certificate) is built once per value of the
    variables that pick its certificates (this VM sets SSL_CERT_FILE and SSL_CERT_DIR: a memo
    that skipped them built a context for every client, 39 s of the fast tier's 280 s of CPU in
    one process) and shared; any other argument is httpx's own path. The same for `httpx2`, the
    fork the OpenAI and Anthropic SDKs build their clients on."""
    import importlib

    for package in ("httpx", "httpx2"):
        try:
            transport = importlib.import_module(f"{package}._transports.default")
        except ImportError:
            continue
        create = transport.create_ssl_context
        shared: dict = {}

        def create_ssl_context(verify=True, cert=None, trust_env=True, create=create, shared=shared):
            if verify is not True or cert:
                return create(verify=verify, cert=cert, trust_env=trust_env)
            key = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")) if trust_env else None
            if key not in shared:
                shared[key] = create(verify=verify, cert=cert, trust_env=trust_env)
            return shared[key]

        transport.create_ssl_context = create_ssl_context


def pytest_configure(config):
    """What a process that runs tests needs; xdist's controller process runs none, so it skips
    these imports (mlx-lm with transformers, hypothesis: ~2 s before the workers start)."""
    if not _runs_tests(config):
        return
    _hypothesis_profiles()
    _share_tokenizers()
    _share_vocabularies()
    _share_ssl_context()


def _runs_tests(config) -> bool:
    """False in xdist's controller process, which collects and runs no test."""
    return getattr(config.option, "dist", "no") == "no" or hasattr(config, "workerinput")


def _freeze_what_is_held() -> None:
    """Collect what is garbage now, then move everything still alive into the garbage collector's
    permanent generation (`gc.freeze()`), which no later collection scans.

    A test process holds ~270,000 tracked objects once it has collected the suite (every test
    module imported, and with them the engine, mlx-lm, transformers and hypothesis) and more as
    the tokenizers and models it shares pile up; every full collection scanned them all, ~0.3 s:
    the engine collects at each model unload (`ModelSlot.unload`) and Python runs one by itself
    as objects accumulate. Frozen at collection and after each test module (once its module
    fixtures are torn down), a full collection scans only what the module running now made: the
    full collections took 22 s of the fast tier's CPU over its three workers and 46 s of the
    real-model tier's, 5 s and 18 s frozen. A frozen object that is still freed by its reference
    count is freed as before; only a reference cycle that dies after a freeze stays in memory."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    if _runs_tests(session.config):
        _freeze_what_is_held()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (its module fixtures torn down): `_freeze_what_is_held`."""
    yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        _freeze_what_is_held()


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(config, items):
    """Longest modules first (tests/durations.py), so that xdist's workers end together; tests
    marked `extended` (another variant of a path a default test already proves) skipped unless
    `-m` names them."""
    from durations import longest_modules_first

    if "extended" not in (config.getoption("markexpr") or ""):
        skip = pytest.mark.skip(reason="opt-in: pytest -m extended")
        for item in items:
            if item.get_closest_marker("extended"):
                item.add_marker(skip)
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
