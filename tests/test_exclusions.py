"""Request options that exclude each other (engine/decoding/exclusions.py), refused the same way
through the engine's one submit path: each declared pair names its field and both options, before
any work; each option alone still runs. On a tiny random llama whose tokenizer has think markers
(so a thinking budget applies to it); images with speculative decoding need a vision model and
are checked in tests/test_vision_engine.py."""

import pytest

from engine import Engine, InvalidRequest, SamplingParams, SpeculativeOptions, tool_request
from engine.decoding.exclusions import EXCLUSIONS, LABELS, check_exclusions
from test_reasoning import THINKING
from tiny_models import tiny_marker_llama

pytestmark = pytest.mark.fast

ASK = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
DRAFT = SpeculativeOptions("truncated:1")


def options(name: str) -> dict:
    """The submit arguments that turn option `name` on."""
    return {
        "speculative": {"speculative": DRAFT},
        "logprobs": {"params": {"logprobs": 2}},
        "tools": {"tools": tool_request(TOOLS, "auto")},
        "thinking_budget": {"params": {"thinking_budget": 4}},
        "json_schema": {"params": {"json_schema": {"type": "object"}}},
    }[name]


def request(*names: str) -> dict:
    merged: dict = {"params": {"max_tokens": 2}}
    for name in names:
        for key, value in options(name).items():
            merged[key] = {**merged[key], **value} if key == "params" else value
    return {**merged, "params": SamplingParams(**merged["params"])}


@pytest.fixture(scope="module")
def engine():
    lm = tiny_marker_llama(THINKING)
    assert lm.tokenizer.has_thinking
    engine = Engine(lm.name, load=lambda name, **_: lm).start()
    try:
        done = list(engine.submit(ASK, **request("speculative")).events(timeout=120))[-1]
        assert done.finish_reason == "length"  # the draft is resident from here on
        yield engine
    finally:
        engine.stop()


@pytest.mark.parametrize("rule", [r for r in EXCLUSIONS if "images" not in (r.first, r.second)],
                         ids=lambda r: f"{r.first}+{r.second}")
def test_each_declared_pair_is_refused_and_each_option_alone_runs(engine, rule):
    with pytest.raises(InvalidRequest) as err:
        engine.submit(ASK, **request(rule.first, rule.second))
    assert err.value.field == rule.field and err.value.code == "invalid_value"
    assert LABELS[rule.first] in str(err.value) and LABELS[rule.second] in str(err.value)
    for name in (rule.first, rule.second):
        done = list(engine.submit(ASK, **request(name)).events(timeout=120))[-1]
        assert done.finish_reason in ("length", "stop", "tool_calls"), done.error


def test_an_unknown_option_is_a_programming_error():
    with pytest.raises(ValueError, match="images2"):
        check_exclusions(images2=True)
    check_exclusions(speculative=True, logprobs=False)  # one option on: nothing to refuse
