"""Reranking (issue 50): an LLM reranker's yes/no relevance against mlx-lm's own model scored
the way Qwen3-Reranker's model card does it, an embedding model's cosine against its own vectors,
and a real server on 127.0.0.1 answering llama.cpp's own `/rerank` cases
(tools/server/tests/unit/test_rerank.py: the Jina shape, the TEI shape, top_n, bad documents,
usage) on tiny random models; random weights cannot order documents, so the order is checked only
where a real reranker is in the local Hugging Face cache. No body gets a 5xx."""

import functools
import json
import math

import httpx
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from mlx_lm import load as mlx_lm_load

from engine import InvalidRequest
from engine.loading.hub import hub_cache_dir
from engine.loading.registry import capabilities, load_model
from engine.loading.rerank_recipe import QWEN3_RERANKER
from live_server import tiny_serving
from tiny_models import tiny_llama, tiny_qwen3_embedding_folder, tiny_reranker_folder

pytestmark = pytest.mark.fast

TOL = 1e-5
QUERY = "Machine learning is"
DOCUMENTS = [  # llama.cpp's test_rerank.py documents
    "A machine is a physical system that uses power to apply forces and control movement to "
    "perform an action. The term is commonly applied to artificial devices, such as those "
    "employing engines or motors, but also to natural biological macromolecules, such as "
    "molecular machines.",
    "Learning is the process of acquiring new understanding, knowledge, behaviors, skills, "
    "values, attitudes, and preferences. The ability to learn is possessed by humans, non-human "
    "animals, and some machines; there is also evidence for some kind of learning in certain "
    "plants.",
    "Machine learning is a field of study in artificial intelligence concerned with the "
    "development and study of statistical algorithms that can learn from data and generalize to "
    "unseen data, and thus perform tasks without explicit instructions.",
    "Paris, capitale de la France, est une grande ville européenne et un centre mondial de l'art, "
    "de la mode, de la gastronomie et de la culture. Son paysage urbain du XIXe siècle est "
    "traversé par de larges boulevards et la Seine.",
]


@functools.cache
def _mlx_lm(folder: str):
    return mlx_lm_load(folder)


def card_scores(folder, query, documents, instruction=None):
    """Qwen3-Reranker's model card, on mlx-lm's own model: prefix, pair and suffix tokenised
    apart and joined, one pair at a time; softmax over the "no" and "yes" logits of the last
    position."""
    model, tokenizer = _mlx_lm(str(folder))
    encode = functools.partial(tokenizer._tokenizer.encode, add_special_tokens=False)
    yes, no = encode("yes")[0], encode("no")[0]
    out = []
    for doc in documents:
        body = QWEN3_RERANKER.body.format(instruction=instruction or QWEN3_RERANKER.instruction,
                                          query=query, document=doc)
        ids = encode(QWEN3_RERANKER.head) + encode(body) + encode(QWEN3_RERANKER.tail)
        logits = np.array(model(mx.array([ids]))[0, -1].astype(mx.float32))
        out.append(1 / (1 + math.exp(logits[no] - logits[yes])))
    return np.array(out)


@pytest.fixture(scope="module")
def reranker():
    return tiny_reranker_folder()


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


def test_yes_no_scores_equal_the_model_cards(engine, reranker):
    ranking = engine.rerank(QUERY, DOCUMENTS, model=str(reranker)).result(120)
    assert ranking.method == "yes_no" and ranking.model == reranker.name
    assert np.abs(np.array(ranking.scores) - card_scores(reranker, QUERY, DOCUMENTS)).max() < TOL
    alone = engine.rerank(QUERY, DOCUMENTS[2:3], model=str(reranker),
                          instruction="Find the definition").result(60)
    ref = card_scores(reranker, QUERY, DOCUMENTS[2:3], "Find the definition")
    assert abs(alone.scores[0] - ref[0]) < TOL  # batch-independent, and the instruction counts
    assert capabilities(load_model(str(reranker))) == ("rerank",)


def test_cosine_on_an_embedding_model(engine):
    folder = str(tiny_qwen3_embedding_folder())
    ranking = engine.rerank(QUERY, DOCUMENTS, model=folder).result(120)
    query = engine.embed(QUERY, model=folder, query=True).result(60).vectors[0]
    docs = engine.embed(DOCUMENTS, model=folder).result(60).vectors
    assert ranking.method == "cosine"
    assert np.abs(np.array(ranking.scores) - docs @ query).max() < TOL


def test_refusals(engine, reranker):
    cases = [({"model": None}, "model", "model_not_reranker"),  # the chat model cannot rank
             ({"documents": []}, "documents", "invalid_value"),
             ({"documents": [1, 2]}, "documents", "invalid_value"),
             ({"query": ""}, "query", "invalid_value")]
    for change, field, code in cases:
        args = {"query": QUERY, "documents": DOCUMENTS, "model": str(reranker), **change}
        with pytest.raises(InvalidRequest) as err:
            engine.rerank(args.pop("query"), args.pop("documents"), **args)
        assert (err.value.field, err.value.code) == (field, code), change
    long = " ".join(["word"] * 600)  # over the tiny reranker's 512-token context
    with pytest.raises(InvalidRequest) as err:
        engine.rerank(QUERY, [long], model=str(reranker), truncate=False)
    assert err.value.code == "context_length_exceeded"
    assert len(engine.rerank(QUERY, [long], model=str(reranker)).result(60).scores) == 1


# --- a real server ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http(tmp_path_factory, reranker):
    """The tiny reranker as the loaded model, as llama.cpp's tests serve theirs."""
    with tiny_serving(tmp_path_factory.mktemp("rerank"), load_model(str(reranker))) as s:
        with httpx.Client(base_url=s.url, timeout=120) as client:
            yield client


def test_llama_cpp_rerank_cases(http):
    res = http.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    assert res.status_code == 200
    results = res.json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)  # best first
    assert all(r["document"]["text"] == DOCUMENTS[r["index"]] for r in results)
    tei = http.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS, "return_text": True})
    assert [(r["index"], r["score"]) for r in tei.json()] == \
        [(r["index"], r["relevance_score"]) for r in results]
    assert all(r["text"] == DOCUMENTS[r["index"]] for r in tei.json())
    for documents in ([], None, 123, [1, 2, 3]):
        bad = http.post("/rerank", json={"query": QUERY, "documents": documents})
        assert bad.status_code == 400 and "error" in bad.json(), documents
    for top_n, expected in ((None, 4), (2, 2), (4, 4), (99, 4)):
        for shape in ("documents", "texts"):
            body = {"query": QUERY, shape: DOCUMENTS, **({"top_n": top_n} if top_n else {})}
            out = http.post("/rerank", json=body).json()
            assert len(out["results"] if shape == "documents" else out) == expected


def test_usage_paths_and_models(http, reranker):
    for path in ("/v1/rerank", "/rerank", "/reranking", "/v1/reranking"):
        out = http.post(path, json={"query": "Which city?", "documents": [
            "Machine learning is ", {"text": "Paris, capitale de la"}],
            "return_documents": False}).json()
        assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] > 0, path
        assert "document" not in out["results"][0] and out["model"] == reranker.name
    card = card_scores(reranker, "Which city?", ["Machine learning is ", "Paris, capitale de la"])
    assert np.abs(np.array(sorted(r["relevance_score"] for r in out["results"]))
                  - np.sort(card)).max() < TOL
    embedder = str(tiny_qwen3_embedding_folder())
    out = http.post("/v1/rerank", json={"model": embedder, "query": QUERY, "documents": DOCUMENTS})
    assert out.status_code == 200 and len(out.json()["results"]) == 4
    chat = http.post("/v1/rerank", json={"model": str(tiny_llama().path), "query": QUERY,
                                         "documents": DOCUMENTS})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"
    missing = http.post("/v1/rerank", json={"model": "no-such-model", "query": QUERY,
                                            "documents": DOCUMENTS})
    assert missing.status_code == 404


REAL = ("Qwen/Qwen3-Reranker-0.6B", "mlx-community/Qwen3-Reranker-0.6B-mlx")


@pytest.mark.slow
@pytest.mark.skipif(not any((hub_cache_dir() / f"models--{r.replace('/', '--')}").exists()
                            for r in REAL), reason="no real Qwen3-Reranker in the local HF cache")
def test_a_real_reranker_orders_llama_cpps_documents(engine):
    name = next(r for r in REAL if (hub_cache_dir() / f"models--{r.replace('/', '--')}").exists())
    scores = engine.rerank(QUERY, DOCUMENTS, model=name).result(600).scores
    assert int(np.argmax(scores)) == 2 and int(np.argmin(scores)) == 3


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                    st.floats(allow_nan=False), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)
FIELDS = ["model", "query", "documents", "texts", "top_n", "return_documents", "return_text",
          "truncate", "instruction", "keep_alive"]


@st.composite
def near_valid(draw):
    body = {"query": "q", "documents": ["a", "b"]}
    body[draw(st.sampled_from(FIELDS))] = draw(values)
    return body


@pytest.mark.timeout(240)
def test_no_body_gets_a_5xx(http):
    @settings(deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.one_of(values, near_valid()))
    def check(body):
        r = http.post("/v1/rerank", content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (body, r.status_code, r.text)
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    check()
