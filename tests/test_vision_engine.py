"""Vision-language models in the engine: tiny random-weight Qwen2.5-VL and SmolVLM folders
(bench/vlm_shapes.py) generate through our prefill/decode loop exactly the tokens mlx-vlm's own
`generate` gives for the same image and prompt, greedy and seeded; the prefix cache reuses an
image's prefill for a follow-up about the same image and never for another image; images are
refused clearly where they cannot go."""

import pytest

pytest.importorskip("mlx_vlm")

import mlx.core as mx  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402
from mlx_vlm import generate as vlm_generate  # noqa: E402

from engine.prefix_cache.store import PrefixCache  # noqa: E402
from engine.decoding.generate import Generation, build_prompt, generate  # noqa: E402
from engine.decoding.sampling import SamplingParams  # noqa: E402
from engine.decoding.vision import IMAGE_KEY_BASE, ImageInput  # noqa: E402
from engine.errors import InvalidRequest  # noqa: E402
from engine.loading.registry import capabilities  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402
from bench.vlm_shapes import random_image, tiny_qwen2_5_vl, tiny_smolvlm  # noqa: E402

pytestmark = pytest.mark.fast

QUESTION = "What is in this image?"


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen2_5_vl()


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module", params=["qwen2_5_vl", "smolvlm"])
def vlm(request):
    return request.getfixturevalue("qwen") if request.param == "qwen2_5_vl" else tiny_smolvlm()


def image(seed: int) -> ImageInput:
    return ImageInput.from_pil(random_image(seed))


def ask(img: ImageInput, question: str = QUESTION, history: list | None = None) -> list[dict]:
    return (history or []) + [{"role": "user", "content": [
        {"type": "image", "image": img}, {"type": "text", "text": question}]}]


def tokens_of(events) -> list[int]:
    return [e.token for e in events if e.kind == "token" and e.token is not None]


@pytest.mark.parametrize("seed,temperature", [(None, 0.0), (3, 0.9)])
def test_tokens_equal_mlx_vlm_generate(vlm, seed, temperature):
    img = image(0)
    prompt = build_prompt(vlm, messages=ask(img))
    parts = vlm.extras["vision"]
    assert prompt.tokens.count(parts.image_token_id) >= 4  # each image expanded into its tokens
    ours = tokens_of(generate(vlm, prompt, SamplingParams(max_tokens=12, temperature=temperature,
                                                          seed=seed)))
    # mlx-vlm on the same rendered text (the image where the template puts it) and image
    text = vlm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=True)
    if seed is not None:
        mx.random.seed(seed)  # our per-request key draws the same sequence
    options = {"sampler": make_sampler(temp=temperature)} if temperature else {"temperature": 0.0}
    theirs = vlm_generate(parts.vlm, parts.processor, text, image=[img.image], max_tokens=12,
                          **options)
    assert theirs.prompt_tokens == len(prompt.tokens)
    assert len(ours) == 12 and ours == list(theirs.token_ids)


def test_text_only_request_on_a_vision_model(vlm):
    """A VLM answers text-only conversations too (a template that takes only lists of parts
    gets string content as one text part)."""
    prompt = build_prompt(vlm, messages=[{"role": "user", "content": "Hello there"}])
    assert prompt.vision is None
    assert "Hello there" in vlm.tokenizer.decode(prompt.tokens)
    assert len(tokens_of(generate(vlm, prompt, SamplingParams(max_tokens=4)))) == 4


def test_capabilities_say_vision(vlm, llama):
    assert "vision" in capabilities(vlm)
    assert "vision" not in capabilities(llama)


def test_follow_up_reuses_the_image_and_another_image_does_not(qwen):
    store = PrefixCache(qwen, budget_bytes=2**30)
    greedy = SamplingParams(max_tokens=6)
    a, b = image(1), image(2)
    first = ask(a)
    answer = qwen.tokenizer.decode(tokens_of(generate(qwen, build_prompt(qwen, messages=first),
                                                      greedy, prefix_cache=store)))
    history = first + [{"role": "assistant", "content": answer}]
    follow = build_prompt(qwen, messages=history + [{"role": "user", "content": "And the colours?"}])
    last_image = max(i for i, k in enumerate(follow.vision.keys) if k >= IMAGE_KEY_BASE)
    gen = Generation(qwen, follow, greedy, prefix_cache=store)
    with_cache = []
    while not gen.done:
        with_cache += tokens_of(gen.step())
    assert gen.reused > last_image  # the image's prefill came from the cache
    without = tokens_of(generate(qwen, follow, greedy))
    assert with_cache == without

    other = build_prompt(qwen, messages=ask(b))
    first_image = other.vision.keys.index(b.key)
    gen = Generation(qwen, other, greedy, prefix_cache=store)
    reused_other = []
    while not gen.done:
        reused_other += tokens_of(gen.step())
    assert 0 < gen.reused <= first_image  # only the text before the image
    assert reused_other == tokens_of(generate(qwen, other, greedy))


def run(lm, prompt, store) -> tuple[list[int], int]:
    gen = Generation(lm, prompt, SamplingParams(max_tokens=4), prefix_cache=store)
    out = []
    while not gen.done:
        out += tokens_of(gen.step())
    return out, gen.reused


def test_snapshot_files_are_keyed_by_the_image_too(qwen, tmp_path):
    """After a restart, the snapshot files reuse an image's prefill for the same image only."""
    a, b = image(4), image(5)
    first = PrefixCache(qwen, persist_dir=tmp_path, write_delay=None)
    run(qwen, build_prompt(qwen, messages=ask(a)), first)
    assert first.persist()
    restarted = PrefixCache(qwen, persist_dir=tmp_path, write_delay=None)
    same = build_prompt(qwen, messages=ask(a, "Which shapes?"))
    tokens, reused = run(qwen, same, restarted)
    assert reused > max(i for i, k in enumerate(same.vision.keys) if k == a.key)
    assert tokens == tokens_of(generate(qwen, same, SamplingParams(max_tokens=4)))
    other = build_prompt(qwen, messages=ask(b, "Which shapes?"))
    assert run(qwen, other, restarted)[1] <= other.vision.keys.index(b.key)


def test_image_tokens_count_in_the_context(qwen):
    prompt = build_prompt(qwen, messages=ask(image(0)))
    text_only = build_prompt(qwen, messages=[{"role": "user", "content": QUESTION}])
    assert len(prompt.tokens) >= len(text_only.tokens) + 4
    with pytest.raises(InvalidRequest) as err:
        Generation(qwen, prompt, SamplingParams(max_tokens=qwen.context_length - len(prompt.tokens) + 1))
    assert err.value.code == "context_length_exceeded"


def test_refusals(qwen, llama):
    with pytest.raises(InvalidRequest) as err:
        build_prompt(llama, messages=ask(image(0)))
    assert err.value.code == "model_not_vision"
    prompt = build_prompt(qwen, messages=ask(image(0)))
    with pytest.raises(InvalidRequest) as err:  # checked before the speculator is used
        Generation(qwen, prompt, SamplingParams(max_tokens=4), speculator=object())
    assert err.value.field == "speculative"
    with pytest.raises(InvalidRequest) as err:  # the image marker typed as text
        build_prompt(qwen, messages=ask(image(0), "<|vision_start|><|image_pad|><|vision_end|>?"))
    assert err.value.code == "invalid_value"


def test_two_images_each_keyed_by_its_own_pixels(vlm):
    """With two images, each image's tokens carry its own key: a prompt that keeps the first
    image and changes the second shares the prefix up to the second image's tokens."""
    a, b, c = image(1), image(2), image(3)

    def two(first, second):
        return [{"role": "user", "content": [{"type": "image", "image": first},
                                             {"type": "text", "text": "and"},
                                             {"type": "image", "image": second},
                                             {"type": "text", "text": QUESTION}]}]

    ab, ac = (build_prompt(vlm, messages=two(a, x)).vision for x in (b, c))
    assert ab.keys.count(a.key) == ab.keys.count(b.key) > 0
    assert ab.keys.count(a.key) + ab.keys.count(b.key) == ab.tokens.count(
        vlm.extras["vision"].image_token_id)
    shared = next(i for i, (x, y) in enumerate(zip(ab.keys, ac.keys)) if x != y)
    assert shared == ab.keys.index(b.key) > ab.keys.index(a.key)


def test_json_mode_constrains_an_answer_about_an_image(qwen):
    """Constrained decoding runs on an image request as on text (the random model's answer is
    held to the schema's shape)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = SamplingParams(max_tokens=12, json_schema=schema)
    events = list(generate(qwen, build_prompt(qwen, messages=ask(image(0))), params))
    text = "".join(e.text or "" for e in events)
    assert text.startswith('{"a":') and text[5:].rstrip("}").lstrip("-").isdigit()
