"""Fill-in-the-middle (issue 50): each family's FIM tokens found in a tokenizer built offline with
them (and a GGUF's `tokenizer.ggml.fim_*_token_id` keys), the prompt laid out as llama.cpp's
`format_infill` lays it, and a real server on 127.0.0.1 answering llama.cpp's own `/infill` cases
(tools/server/tests/unit/test_infill.py), `suffix` on `/v1/completions` (openai SDK) and Ollama's
`/api/generate` (ollama client); the second completion in the same file reads >= 90% of its prompt
from the prefix cache; a model without FIM tokens is refused with 400 naming the field; no body
gets a 5xx."""

import json

import gguf
import httpx
import numpy as np
import ollama
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine import Infill, InvalidRequest
from engine.decoding.fim import render_infill
from engine.loading.fim_tokens import FAMILIES, fim_tokens
from live_server import openai_client, tiny_serving
from tiny_models import tiny_fim_llama, tiny_llama

pytestmark = pytest.mark.fast

CONTEXT = 1024  # the served model's context: room for a file of ~600 tokens
SHORT = 96  # the other server's: a completion without a limit ends within it
PREFIX = "#include <cstdio>\n#include \"llama.h\"\n\nint main() {\n"  # llama.cpp's own cases
PROMPT = "    int n_threads = llama_"
SUFFIX = "}\n"
EXTRA = [{"filename": "llama.h", "text": "LLAMA_API int32_t llama_n_threads();\n"}]


def _ids(lm, text):
    return list(lm.tokenizer._tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_each_family_lays_out_its_prompt_as_llama_cpp(family):
    lm = tiny_fim_llama(family)
    spec = next(f for f in FAMILIES if f.name == family)
    fim = fim_tokens(lm.tokenizer, lm.path)
    assert fim.source == family and lm.tokenizer.convert_ids_to_tokens(fim.prefix) == spec.prefix
    pre, suf = [fim.prefix, *_ids(lm, PREFIX)], [fim.suffix, *_ids(lm, SUFFIX)]
    mid = [fim.middle] if spec.middle else []
    plain = render_infill(lm, Infill(PREFIX, SUFFIX))
    assert plain.tokens == (pre + suf + mid if spec.order == "psm" else suf + pre)
    assert plain.checkpoints == [len(plain.tokens)] and plain.continued
    files = render_infill(lm, Infill(PREFIX, SUFFIX, (("llama.h", EXTRA[0]["text"]),)))
    if spec.file_sep:  # <repo>myproject\n <sep>llama.h\n TEXT <sep>filename\n, then the prompt
        extra = [fim.repo, *_ids(lm, "myproject\n"), fim.file_sep, *_ids(lm, "llama.h\n"),
                 *_ids(lm, EXTRA[0]["text"]), fim.file_sep, *_ids(lm, "filename\n")]
    else:
        extra = _ids(lm, "\n\n--- snippet ---\n\n") + _ids(lm, EXTRA[0]["text"])
    assert files.tokens == extra + plain.tokens and files.checkpoints == [len(extra),
                                                                           len(files.tokens)]
    assert (fim.end in files.stop_tokens) == (spec.end is not None)


def test_capabilities_and_a_model_without_fim():
    assert "insert" in _capabilities(tiny_fim_llama("starcoder"))
    plain = tiny_llama()  # the bundled SmolLM2 tokenizer: <repo_name> and <file_sep>, no FIM
    assert fim_tokens(plain.tokenizer, plain.path) is None and "insert" not in _capabilities(plain)
    with pytest.raises(InvalidRequest) as err:
        render_infill(plain, Infill("def f():", "\n"))
    assert err.value.field == "suffix" and err.value.code == "fim_not_supported"
    assert "no FIM tokens" in str(err.value)


def _capabilities(lm):
    from engine.loading.registry import capabilities

    return capabilities(lm)


def test_a_ggufs_fim_keys_come_first(tmp_path):
    """A converted GGUF's folder names its file in source.json; its fim_* keys give the ids."""
    path = tmp_path / "coder.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("fim_pre", 7), ("fim_suf", 8), ("fim_mid", 9), ("fim_pad", 10)):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "source.json").write_text(json.dumps({"gguf": str(path)}))
    lm = tiny_llama()
    found = fim_tokens(lm.tokenizer, folder)
    assert (found.source, found.prefix, found.suffix, found.middle, found.end) == \
        ("gguf", 7, 8, 9, 10)


# --- a real server ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    lm = tiny_fim_llama("qwen2.5-coder", max_position_embeddings=CONTEXT)
    with tiny_serving(tmp_path_factory.mktemp("fim"), lm) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """A client of a server whose model's context is SHORT tokens: llama.cpp's cases and the
    fuzzer ask for no limit (n_predict -1), which ends there."""
    lm = tiny_fim_llama("qwen2.5-coder", max_position_embeddings=SHORT)
    with tiny_serving(tmp_path_factory.mktemp("fim-short"), lm) as s:
        with httpx.Client(base_url=s.url, timeout=120) as client:
            yield client


def test_llama_cpp_infill_cases(short):
    http = short
    for extra in (None, EXTRA):
        body = {"input_prefix": PREFIX, "prompt": PROMPT, "input_suffix": SUFFIX}
        if extra:
            body["input_extra"] = extra
        r = http.post("/infill", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert isinstance(out["content"], str) and out["stop"] is True
        assert out["stop_type"] in ("eos", "limit") and out["tokens_predicted"] >= 1
        assert out["tokens_evaluated"] > 10
        assert out["timings"]["predicted_n"] == out["tokens_predicted"]
    for bad in ({}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                {"filename": 123, "text": 456}):
        r = http.post("/infill", json={"input_extra": [bad], "input_prefix": PREFIX,
                                       "prompt": PROMPT, "input_suffix": SUFFIX})
        assert r.status_code == 400 and "error" in r.json(), bad


def test_infill_streams_llama_cpp_lines(http):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 6, "temperature": 0,
            "stream": True}
    with http.stream("POST", "/infill", json=body) as r:
        lines = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1]["stop"] is True and all(not x["stop"] for x in lines[:-1])
    whole = http.post("/infill", json={**body, "stream": False}).json()
    assert "".join(x["content"] for x in lines) == whole["content"]
    assert lines[-1]["tokens_predicted"] == whole["tokens_predicted"] <= 6


def test_the_second_completion_in_a_file_reads_its_prefix_from_the_cache(http):
    """Typing on at the cursor: everything before it is reused (>= 90% of the prompt)."""
    code = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(40))
    first = http.post("/infill", json={"input_prefix": code, "input_suffix": "\nprint(f1(2))\n",
                                       "n_predict": 4, "temperature": 0}).json()
    second = http.post("/infill", json={"input_prefix": code + "def g(", "n_predict": 4,
                                        "input_suffix": "\nprint(f1(2))\n",
                                        "temperature": 0}).json()
    assert first["tokens_evaluated"] > 500
    assert second["tokens_cached"] >= 0.9 * second["tokens_evaluated"], second


def test_suffix_on_completions_and_ollama_generate(server, http):
    client = openai_client(server)
    r = client.completions.create(model=server.model, prompt="def add(a, b):\n    return ",
                                  suffix="\n\nprint(add(1, 2))\n", max_tokens=5, temperature=0)
    ours = r.choices[0].text
    again = client.completions.create(model=server.model, prompt="def add(a, b):\n    return ",
                                      suffix="\n\nprint(add(1, 2))\n", max_tokens=5, temperature=0)
    assert again.choices[0].text == ours and again.usage.prompt_tokens_details.cached_tokens > 0
    infill = http.post("/infill", json={"input_prefix": "def add(a, b):\n    return ",
                                        "input_suffix": "\n\nprint(add(1, 2))\n", "n_predict": 5,
                                        "temperature": 0}).json()
    assert infill["content"] == ours  # one engine request, whichever protocol asks
    generated = ollama.Client(host=server.url, timeout=120).generate(
        model=server.model, prompt="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))\n",
        options={"temperature": 0, "num_predict": 5})
    assert generated.response == ours
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model, prompt=[1, 2, 3], suffix="x", max_tokens=1)
    assert err.value.body["param"] == "suffix"


def test_a_model_without_fim_is_refused_on_every_protocol(tmp_path):
    with tiny_serving(tmp_path) as s:  # the bundled tokenizer: no FIM tokens
        with pytest.raises(openai.BadRequestError) as err:
            openai_client(s).completions.create(model=s.model, prompt="def f():", suffix="\n",
                                                max_tokens=1)
        assert err.value.body["param"] == "suffix" and err.value.body["code"] == "fim_not_supported"
        r = httpx.post(f"{s.url}/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_suffix"
        assert "FIM" in r.json()["error"]["message"]
        with pytest.raises(ollama.ResponseError) as refused:
            ollama.Client(host=s.url).generate(model=s.model, prompt="a", suffix="b")
        assert refused.value.status_code == 400 and "FIM" in str(refused.value)
        # an empty suffix is no suffix: an ordinary completion
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "a", "suffix": "",
                                                        "max_tokens": 1})
        assert r.status_code == 200


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                    st.floats(allow_nan=False), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)
FIELDS = ["input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "temperature",
          "top_k", "top_p", "min_p", "seed", "stop", "stream", "repeat_penalty", "repeat_last_n",
          "model"]


@st.composite
def infill_bodies(draw):
    body = {"input_prefix": "x = ", "input_suffix": "\n", "n_predict": 2}
    body[draw(st.sampled_from(FIELDS))] = draw(values)
    return body


@st.composite
def completion_bodies(draw):
    body = {"prompt": "x = ", "suffix": "\n", "max_tokens": 2}
    field = draw(st.sampled_from(["prompt", "suffix", "max_tokens", "stream", "n", "logprobs"]))
    body[field] = draw(values)
    return body


@pytest.mark.timeout(240)
def test_no_body_gets_a_5xx(short):
    http = short
    @settings(deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.one_of(values, infill_bodies(), completion_bodies()))
    def check(body):
        infill = not isinstance(body, dict) or "input_prefix" in body
        completion = not isinstance(body, dict) or "suffix" in body
        for path in ["/infill"] * infill + ["/v1/completions", "/api/generate"] * completion:
            r = http.post(path, content=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"})
            assert r.status_code < 500, (path, body, r.status_code, r.text)
            if r.status_code >= 400:
                assert "error" in r.json()
    check()
