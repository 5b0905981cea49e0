"""Embeddings (issue 28): the engine's vectors against mlx-lm's own forward pass with the pooling
written out from the model cards, batch-independence, scheduling bounds, the dedicated model's
keep-alive, and `/v1/embeddings` through the openai client on a real server.

Tiny random-weight models: a llama as the chat model (mean pooling, as llama.cpp's
`--embeddings`), and a Qwen3-Embedding-shaped qwen3 folder (last-token pooling, its query prompt).
"""

import base64
import functools
import threading
import time

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm import load as mlx_lm_load

from engine import EMBEDDING_MAX_INPUTS, Engine, InvalidRequest, Overloaded, SamplingParams
from live_server import engine_serving, openai_client
from bench.shapes import QWEN3_EMBEDDING_QUERY
from tiny_models import tiny_llama, tiny_qwen3_embedding_folder

pytestmark = pytest.mark.fast

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello", "Embeddings map text to vectors",
         "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]
TOL = 1e-5
CONTEXT = 512  # the tiny chat model's context: small, so that an input can go past it


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


@functools.cache
def _mlx_lm(folder: str):
    """mlx-lm's own load of `folder`, once per folder for the module's references."""
    return mlx_lm_load(folder)


def reference(folder, texts, pooling, prefix="", dimensions=None):
    """mlx-lm's own model, one text at a time (no padding, no batch): the last hidden state
    (`model.model`, after the final norm), pooled as the model cards say: Qwen3-Embedding's
    `last_token_pool` takes the last token's state; llama.cpp's mean pooling averages all of
    them. Then the first `dimensions` components, L2-normalised."""
    model, tokenizer = _mlx_lm(str(folder))
    out = []
    for text in texts:
        ids = tokenizer.encode(prefix + text)
        hidden = np.array(model.model(mx.array([ids])).astype(mx.float32))[0]
        pooled = hidden[-1] if pooling == "last" else hidden.sum(axis=0) / len(ids)
        out.append(_unit(pooled[:dimensions] if dimensions else pooled))
    return np.stack(out)


@pytest.fixture(scope="module")
def chat_lm():
    return tiny_llama(max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def embedder_folder():
    return tiny_qwen3_embedding_folder()


@pytest.fixture(scope="module")
def engine(chat_lm):
    e = Engine(chat_lm.name, load=lambda name, **_: chat_lm).start()
    yield e
    e.stop()


def test_chat_model_mean_pooling_matches_mlx_lm_in_any_batch(engine, chat_lm):
    ref = reference(chat_lm.path, TEXTS, "mean")
    together = engine.embed(TEXTS).result(60)
    assert together.model == chat_lm.name and together.vectors.shape == (len(TEXTS), 64)
    assert np.abs(together.vectors - ref).max() < TOL
    # alone, reversed, and beside a long neighbour that pads every other row
    long = " ".join(["padding"] * 100)
    for batch in ([TEXTS[1]], TEXTS[::-1], [long, TEXTS[2], long]):
        got = engine.embed(batch).result(60).vectors
        for text, vector in zip(batch, got):
            if text in TEXTS:
                assert np.abs(vector - ref[TEXTS.index(text)]).max() < TOL
    assert np.allclose(np.linalg.norm(together.vectors, axis=1), 1.0, atol=1e-6)
    assert engine.model.capabilities[-1] == "embedding"


def test_token_ids_embed_like_their_text(engine, chat_lm):
    ids = chat_lm.tokenizer.encode(TEXTS[0])
    by_ids = engine.embed([ids, ids[:3]]).result(60)
    by_text = engine.embed(TEXTS[0]).result(60)
    assert np.abs(by_ids.vectors[0] - by_text.vectors[0]).max() < TOL
    assert by_ids.prompt_tokens == len(ids) + 3
    assert engine.embed(ids).result(60).vectors.shape == (1, 64)  # one list of ids: one input


def test_dedicated_model_last_token_query_prompt_and_dimensions(engine, embedder_folder):
    name = str(embedder_folder)
    docs = engine.embed(TEXTS, model=name).result(120)
    assert docs.model == embedder_folder.name
    assert np.abs(docs.vectors - reference(embedder_folder, TEXTS, "last")).max() < TOL
    queries = engine.embed(TEXTS[::-1], model=name, query=True, dimensions=16).result(60)
    ref = reference(embedder_folder, TEXTS[::-1], "last", QWEN3_EMBEDDING_QUERY, dimensions=16)
    assert queries.vectors.shape == (len(TEXTS), 16) and np.abs(queries.vectors - ref).max() < TOL
    assert engine.status().embedding_models == (embedder_folder.name,)


def test_bad_input_is_refused_at_once(engine, chat_lm, embedder_folder):
    cases = [([], "empty_input"), ([""], "empty_input"), (5, "invalid_type"),
             ([1.5, 2], "invalid_type"), (["a", 3], "invalid_type"), ([[1, 2], []], "invalid_type"),
             ([49152], "invalid_token"), ([[1, -1]], "invalid_token"),
             (["x"] * (EMBEDDING_MAX_INPUTS + 1), "too_many_inputs"),
             ([[5] * (CONTEXT + 1)], "context_length_exceeded")]
    for inputs, code in cases:
        with pytest.raises(InvalidRequest) as err:
            engine.embed(inputs)
        assert (err.value.field, err.value.code) == ("input", code), inputs
    # truncation on request: the first context-length tokens
    cut = engine.embed([[5] * (CONTEXT + 1)], truncate=True).result(120)
    assert cut.prompt_tokens == CONTEXT
    with pytest.raises(InvalidRequest) as err:  # a chat model's mean pooling is not Matryoshka
        engine.embed("x", dimensions=32)
    assert err.value.field == "dimensions"
    with pytest.raises(InvalidRequest) as err:
        engine.embed("x", model=str(embedder_folder), dimensions=65)
    assert err.value.field == "dimensions"
    with pytest.raises(InvalidRequest) as err:  # a chat model named by path is no embedding model
        engine.embed("x", model=str(chat_lm.path))
    assert (err.value.field, err.value.code) == ("model", "model_not_embedding")


def test_queue_bound_and_one_chunk_between_ticks(engine):
    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:  # the scheduler thread is busy until the gate opens
        entered.set()
        gate.wait(30)

    engine.scheduler.soon(hold)
    assert entered.wait(30)
    try:
        handles = [engine.embed(TEXTS) for _ in range(8)]
        with pytest.raises(Overloaded):
            engine.embed("one too many")
    finally:
        gate.set()
    assert all(h.result(60).vectors.shape == (len(TEXTS), 64) for h in handles)
    # 300 inputs of ~60 padded tokens: several chunks, each run between two scheduler ticks
    chunks = []
    original = engine.embeddings._step
    engine.embeddings._step = lambda job, model: (chunks.append(len(job.rows)), original(job, model))
    try:
        engine.embed([TEXTS[0] * 5] * 300).result(120)
    finally:
        del engine.embeddings._step
    assert len(chunks) > 1


def test_dedicated_model_unloads_after_keep_alive(engine, embedder_folder):
    chat_weights = engine.status().weight_bytes if not engine.status().embedding_models else None
    engine.embed("x", model=str(embedder_folder)).result(120)
    assert engine.status().embedding_models == (embedder_folder.name,)
    loaded = engine.status().weight_bytes
    engine.embed("y", model=str(embedder_folder), keep_alive=0.2).result(60)
    deadline = time.time() + 30
    while engine.status().embedding_models and time.time() < deadline:
        time.sleep(0.1)
    assert engine.status().embedding_models == () and engine.status().weight_bytes < loaded
    assert chat_weights is None or engine.status().weight_bytes == chat_weights
    again = engine.embed(TEXTS[1], model=str(embedder_folder)).result(120)  # loads again
    assert np.abs(again.vectors[0] - reference(embedder_folder, [TEXTS[1]], "last")[0]).max() < TOL


def test_one_memory_budget_holds_chat_requests_and_the_embedding_model(engine, chat_lm,
                                                                        embedder_folder):
    """The chat model's and the dedicated model's weights, the admitted chat requests and the
    prefix cache share one budget: while both models are in memory the prefix cache may hold
    only what is left; a chat request that needs more room than that evicts the idle embedding
    model (a member of the one model pool) and runs."""
    chat = dict(prompt_tokens=list(range(100, 140)), params=SamplingParams(max_tokens=8))
    need = engine.request_bytes(40, 8)
    chat_weights = engine.pool.find(chat_lm.name).weight_bytes
    probe = Engine(chat_lm.name, load=lambda name, **_: chat_lm).start()
    try:
        probe.embed("x", model=str(embedder_folder)).result(120)
        weights = probe.status().weight_bytes - chat_weights  # the embedding model's
    finally:
        probe.stop()
    assert need // 2 < weights
    shared = Engine(chat_lm.name, load=lambda name, **_: chat_lm,
                    memory_budget=chat_weights + weights + need // 2).start()
    try:
        shared.embed("x", model=str(embedder_folder), keep_alive=60).result(120)
        assert shared.status().weight_bytes == chat_weights + weights
        assert shared.prefix_cache.budget == need // 2
        done = list(shared.submit(**chat).events(timeout=60))[-1]
        assert done.finish_reason == "length" and done.usage.completion_tokens == 8
        assert shared.status().embedding_models == ()  # evicted for the request's room
        assert shared.status().weight_bytes == chat_weights
        assert shared.prefix_cache.budget == weights + need // 2
    finally:
        shared.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory, chat_lm):
    with engine_serving(tmp_path_factory.mktemp("embeddings"), chat_lm) as s:
        yield s


def test_openai_client_base64_and_float(server, chat_lm, embedder_folder):
    client = openai_client(server)
    ref = reference(chat_lm.path, TEXTS, "mean")
    got = client.embeddings.create(model=chat_lm.name, input=TEXTS)  # the SDK asks for base64
    assert got.model == chat_lm.name and [d.index for d in got.data] == [0, 1, 2, 3]
    assert np.abs(np.array([d.embedding for d in got.data]) - ref).max() < TOL
    assert got.usage.prompt_tokens == sum(len(chat_lm.tokenizer.encode(t)) for t in TEXTS)
    raw = httpx.post(f"{server.url}/v1/embeddings", timeout=60, json={
        "model": chat_lm.name, "input": TEXTS[0], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(vector - ref[0]).max() < TOL
    floats = client.embeddings.create(model=chat_lm.name, input=TEXTS[1], encoding_format="float")
    assert np.abs(np.array(floats.data[0].embedding) - ref[1]).max() < TOL
    dedicated = client.embeddings.create(model=str(embedder_folder), input=TEXTS, dimensions=8,
                                         extra_body={"input_type": "query"})
    want = reference(embedder_folder, TEXTS, "last", QWEN3_EMBEDDING_QUERY, dimensions=8)
    assert np.abs(np.array([d.embedding for d in dedicated.data]) - want).max() < TOL


@pytest.mark.parametrize("body, status, param", [
    ({"input": []}, 400, "input"),
    ({"input": ["x"] * 10_000}, 400, "input"),
    ({"input": [[1, 99_999_999]]}, 400, "input"),
    ({"input": [{"text": "x"}]}, 400, "input"),
    ({"input": None}, 400, "input"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "dimensions": "8"}, 400, "dimensions"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"input": "x", "colour": "red"}, 400, "colour"),
    ({"input": "x", "model": "no-such-model"}, 404, "model"),
])
def test_bad_requests_get_4xx_in_openai_shape(server, chat_lm, body, status, param):
    body = {"model": chat_lm.name, **body}
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_openai_client_raises_for_bad_input(server, chat_lm):
    with pytest.raises(openai.BadRequestError):
        openai_client(server).embeddings.create(model=chat_lm.name, input=[])


def test_model_alias_names_the_embedding_model(tmp_path, chat_lm, embedder_folder):
    aliases = {"text-embedding-*": str(embedder_folder)}
    with engine_serving(tmp_path, chat_lm, aliases=aliases) as s:
        got = openai_client(s).embeddings.create(model="text-embedding-3-small", input=TEXTS[0])
    assert got.model == embedder_folder.name
    want = reference(embedder_folder, TEXTS[:1], "last")[0]
    assert np.abs(np.array(got.data[0].embedding) - want).max() < TOL


def test_the_loaded_model_lists_its_capabilities(tmp_path):
    """`/v1/models` marks what the loaded model can do, embedding included (mean pooling)."""
    import httpx

    from live_server import engine_serving
    from tiny_models import tiny_llama

    lm = tiny_llama()
    with engine_serving(tmp_path, lm) as s:
        listed = httpx.get(f"{s.url}/v1/models").json()["data"]
        loaded = next(m for m in listed if m["id"] == lm.name)
        assert {"completion", "embedding"} <= set(loaded["capabilities"])
        assert httpx.get(f"{s.url}/v1/models/{lm.name}").json()["capabilities"] == loaded["capabilities"]
