"""One pipeline: the same conversation asked through every protocol on the bundled model gives
the same greedy answer, token for token (the adapters translate; they never generate on their
own), and each protocol reports the second turn's prefix reuse in its own field."""

import ollama
import pytest

from live_server import anthropic_client, engine_serving, openai_client

SYSTEM = "You are a helpful assistant who answers in one short sentence."
ASK = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with engine_serving(tmp_path_factory.mktemp("agree")) as s:
        yield s


def test_every_protocol_gives_the_same_greedy_answer(server):
    chat = openai_client(server).chat.completions.create(
        model="smollm2-135m-instruct", temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    expected = chat.choices[0].message.content
    assert "Paris" in expected

    claude = anthropic_client(server).messages.create(
        model="claude-sonnet-4-5", max_tokens=24, system=SYSTEM, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": ASK}])
    assert claude.content[0].text == expected

    codex = openai_client(server).responses.create(
        model="gpt-5", instructions=SYSTEM, input=ASK, max_output_tokens=24, temperature=0)
    assert codex.output_text == expected

    llama = ollama.Client(host=server.url).chat(
        model="smollm2-135m-instruct", options={"temperature": 0, "num_predict": 24},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    assert llama.message.content == expected

    # The second turn reuses the first from the prefix cache, whichever protocol asks.
    follow = [{"role": "user", "content": ASK}, {"role": "assistant", "content": expected},
              {"role": "user", "content": "And of Italy?"}]
    again = anthropic_client(server).messages.create(
        model="claude-x", max_tokens=8, system=SYSTEM, messages=follow,
        extra_body={"temperature": 0})
    assert again.usage.cache_read_input_tokens > 20
    turn = ollama.Client(host=server.url).chat(
        model="smollm2-135m-instruct", options={"temperature": 0, "num_predict": 8},
        messages=[{"role": "system", "content": SYSTEM}, *follow])
    assert turn.prompt_eval_count < again.usage.input_tokens + again.usage.cache_read_input_tokens
