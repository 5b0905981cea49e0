"""Speculative decoding: greedy output identical to plain decoding (dense, hybrid and MTP models, the
bundled model), the target's distribution under sampling (chi-square), MTP loading, and behaviour
under interleaving, cancellation, stop strings and limits."""

import json
import math
import shutil
from collections import Counter

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engine.errors import InvalidRequest, ModelLoadError
from engine.decoding.generate import Generation, build_prompt, generate
from engine.decoding.mtp import MtpDrafter, load_mtp_head
from engine.loading.registry import load_model
from engine.decoding.sampling import SamplingParams, TokenSampler
from engine.decoding.speculative import (ModelDrafter, SpecConfig, Speculator, dequantize, model_speculator,
                                sampling_probs, split_model, truncated)
from tiny_models import QWEN3_5, QWEN3_NEXT, mtp_folder, tiny_llama, tiny_qwen3_5, tiny_qwen3_next

PROMPTS = [list(range(100, 140)), [5, 17, 900, 31, 4000, 12], list(range(2000, 2600, 7))]
CONFIGS = [SpecConfig(k_max=1, adaptive=False), SpecConfig(k_max=4, adaptive=False), SpecConfig(k_max=6)]


def tokens_of(events):
    return [e.token for e in events if e.kind == "token"]


def noisy_copy(lm, scale, seed=1):
    """The target's own weights plus noise: a draft that agrees often but not always."""
    draft = load_model(str(lm.path)).model
    mx.random.seed(seed)
    draft.update(tree_map(lambda p: p + scale * p.std() * mx.random.normal(p.shape), draft.parameters()))
    mx.eval(draft.parameters())
    return draft


def check_identity(lm, drafts, configs=CONFIGS, max_tokens=20):
    """Every draft, every k, every prompt: the same tokens as plain greedy decoding."""
    rates = {}
    for tokens in PROMPTS[:2]:
        prompt = build_prompt(lm, prompt_tokens=tokens)
        params = SamplingParams(max_tokens=max_tokens)
        baseline = tokens_of(generate(lm, prompt, params))
        for name, make in drafts.items():
            for config in configs:
                events = list(generate(lm, prompt, params, speculator=make(config)))
                assert tokens_of(events) == baseline, (name, config, tokens)
                stats = events[-1].stats["speculative"]
                rates.setdefault(name, []).append((stats["accepted"], stats["drafted"]))
    return {name: sum(a for a, _ in v) / max(sum(d for _, d in v), 1) for name, v in rates.items()}


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3_5, tiny_qwen3_next])
def test_greedy_identity_tiny_pairs(make):
    lm = make()
    noisy = noisy_copy(lm, 0.03)
    rates = check_identity(lm, {
        "self": lambda c: Speculator(lm.model, ModelDrafter(lm.model), c),
        "noisy": lambda c: Speculator(lm.model, ModelDrafter(noisy), c),
    })
    assert rates["self"] == 1.0
    assert 0.0 < rates["noisy"] < 1.0  # both the accept and the reject/rollback paths ran


# -- MTP ------------------------------------------------------------------------------------------
MOE = dict(num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=64,
           moe_intermediate_size=32)


@pytest.mark.parametrize("config,raw_hf", [(QWEN3_5, False), ({**QWEN3_NEXT, **MOE}, True)],
                         ids=["qwen3_5", "qwen3_next-moe-raw"])
def test_mtp_loads_and_keeps_greedy_identity(config, raw_hf, tmp_path):
    folder, original = mtp_folder(config, tmp_path, raw_hf)
    lm = load_model(str(folder))
    head = load_mtp_head(lm)
    loaded = dict(tree_flatten(head.parameters()))
    for key, value in tree_flatten(original.parameters()):
        assert mx.allclose(loaded[key], value, atol=1e-6).item(), key
    rates = check_identity(lm, {"mtp": lambda c: Speculator(lm.model, MtpDrafter(lm.model, head), c)},
                           configs=CONFIGS[1:])
    assert 0.0 <= rates["mtp"] < 1.0


class RecordingMtpDrafter(MtpDrafter):
    """Records (sequence length, first draft) for every proposal."""

    def __init__(self, *args):
        super().__init__(*args)
        self.proposals = []

    def propose(self, seq, k, pick):
        drafts, probs = super().propose(seq, k, pick)
        self.proposals.append((len(seq), drafts[0]))
        return drafts, probs


def test_mtp_drafts_align_with_the_reference_head(tmp_path):
    """Each first draft equals the head applied to (embedding of token j+1, target hidden state at
    j) over the whole sequence at once, at j = the position before the last token: the drafter
    pairs hidden states, tokens and positions as the head was trained."""
    folder, _ = mtp_folder(QWEN3_5, tmp_path, raw_hf=False)
    lm = load_model(str(folder))
    head = load_mtp_head(lm)
    prompt = build_prompt(lm, prompt_tokens=PROMPTS[0])
    drafter = RecordingMtpDrafter(lm.model, head)
    spec = Speculator(lm.model, drafter, SpecConfig(k_max=2, adaptive=False))
    seq = prompt.tokens + tokens_of(generate(lm, prompt, SamplingParams(max_tokens=16), speculator=spec))
    body, lm_head = split_model(lm.model)
    hidden = body(mx.array(seq)[None])
    reference = head(body.embed_tokens(mx.array(seq[1:])[None]), hidden[:, :-1], KVCache())
    expected = mx.argmax(lm_head(reference)[0], axis=-1).tolist()
    assert len(drafter.proposals) >= 4
    for length, draft in drafter.proposals:
        assert draft.item() == expected[length - 2], length


def test_mtp_missing_weights_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="no MTP head"):
        load_mtp_head(tiny_qwen3_5())
    with pytest.raises(ModelLoadError, match="no MTP head"):
        load_mtp_head(tiny_llama())


# -- sampling -------------------------------------------------------------------------------------
V = 8


def small_vocab_model(seed):
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=V, tie_word_embeddings=True)
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def chi_square(observed: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic with cells of expected count < 5 pooled; returns (statistic, dof)."""
    stat, small_obs, small_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in expected.items():
        e = n * p
        if e < 5:
            small_obs, small_exp = small_obs + observed[cell], small_exp + e
        else:
            stat, cells = stat + (observed[cell] - e) ** 2 / e, cells + 1
    if small_exp > 0:
        stat, cells = stat + (small_obs - small_exp) ** 2 / small_exp, cells + 1
    return stat, cells - 1


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty approximation)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def joint_two(model, prompt, params):
    """P(t1, t2 | prompt) under `params` from plain forward passes."""
    def dist(tokens):
        logits = model(mx.array(tokens)[None])[0, -1:]
        return sampling_probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), params)[0].tolist()
    first = dist(prompt)
    return {(a, b): first[a] * pb for a in range(V) for b, pb in enumerate(dist(prompt + [a]))}


def test_sampling_follows_the_target_distribution():
    """The first two emitted tokens after a fixed prompt, over many seeded runs with k = 2 (both
    drafts can be accepted or rejected), match the target's joint distribution; the draft's own
    distribution is far from it, so a rule that accepted drafts blindly would fail."""
    target, draft = small_vocab_model(0), small_vocab_model(1)
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=8)
    prompt = [1, 5, 3, 7]
    expected = joint_two(target, prompt, params)
    n, counts = 1000, Counter()
    for seed in range(n):
        sampler = TokenSampler(params.with_(seed=seed))
        cache = make_prompt_cache(target)
        spec = Speculator(target, ModelDrafter(draft), SpecConfig(k_max=2, adaptive=False))
        spec.prefill(mx.array(prompt[:-1]), cache, 0)
        seq, held = list(prompt), len(prompt) - 1
        while len(seq) < len(prompt) + 2:
            new, held = spec.step(seq, cache, held, 4, sampler, set())
            seq += new
        counts[tuple(seq[len(prompt):len(prompt) + 2])] += 1
    stat, dof = chi_square(counts, expected, n)
    assert stat < chi2_critical(dof), (stat, dof)
    draft_joint = joint_two(draft, prompt, params)
    blind = Counter({cell: n * p for cell, p in draft_joint.items()})
    assert dof >= 20
    assert chi_square(blind, expected, n)[0] > 10 * chi2_critical(dof)


# -- the bundled model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp32_target():
    return load_model(None, transform=dequantize(mx.float32))


def test_bundled_greedy_identity(lm, fp32_target):
    """fp32 dequantized SmolLM2 as target; its own Q4 weights and a 20-layer truncation as drafts."""
    target = fp32_target
    params = SamplingParams(max_tokens=16)
    rates = {}
    for question in ("What is the capital of France?",):
        prompt = build_prompt(target, messages=[{"role": "user", "content": question}])
        baseline = tokens_of(generate(target, prompt, params))
        for name, make in {"q4": lambda: model_speculator(target, lm, SpecConfig(k_max=4)),
                           "trunc20": lambda: model_speculator(target, truncated(target.model, 20),
                                                               SpecConfig(k_max=3))}.items():
            events = list(generate(target, prompt, params, speculator=make()))
            assert tokens_of(events) == baseline, (name, question)
            rates[name] = events[-1].stats["speculative"]["acceptance_rate"]
    assert rates["q4"] > 0.5


# -- generation behaviour -------------------------------------------------------------------------
def test_incompatible_vocabulary_is_refused(tmp_path):
    lm = tiny_llama()
    folder = tmp_path / "other-vocab"
    shutil.copytree(lm.path, folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {f"x{v}": i for v, i in tok["model"]["vocab"].items()}
    tok["model"]["merges"] = []
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(InvalidRequest, match="vocabularies differ"):
        model_speculator(lm, load_model(str(folder)))


def test_interleaved_requests_cancel_stop_and_limit():
    """Two speculative requests stepped alternately (as the scheduler does) give their solo output;
    a third is cancelled mid-decode; stop strings and max_tokens end a multi-token step exactly."""
    lm = tiny_qwen3_5()
    noisy = noisy_copy(lm, 0.03)
    spec = lambda: Speculator(lm.model, ModelDrafter(noisy), SpecConfig(k_max=4))
    params = SamplingParams(max_tokens=20)
    prompts = [build_prompt(lm, prompt_tokens=p) for p in PROMPTS[:2]]
    solo = [tokens_of(generate(lm, p, params)) for p in prompts]
    gens = [Generation(lm, p, params, speculator=spec()) for p in prompts]
    cancelled = Generation(lm, build_prompt(lm, prompt_tokens=PROMPTS[2]), params, speculator=spec())
    out = [[], []]
    steps = 0
    while not all(g.done for g in gens):
        for i, g in enumerate(gens):
            out[i] += tokens_of(g.step())
        cancelled.step()
        steps += 1
        if steps == 4:
            cancelled.cancel()
    assert out == solo
    assert cancelled.finish_reason == "cancelled" and 0 < len(cancelled.generated) < 20
    for max_tokens in (1, 2, 7):
        limited = SamplingParams(max_tokens=max_tokens)
        events = list(generate(lm, prompts[0], limited, speculator=spec()))
        assert tokens_of(events) == solo[0][:max_tokens]
        assert events[-1].finish_reason == "length"
    text = lm.tokenizer.decode(solo[0][:6])
    stop = text[-3:]
    baseline = list(generate(lm, prompts[0], params.with_(stop=(stop,))))
    specd = list(generate(lm, prompts[0], params.with_(stop=(stop,)), speculator=spec()))
    assert "".join(e.text for e in specd) == "".join(e.text for e in baseline)
    assert specd[-1].finish_reason == baseline[-1].finish_reason == "stop"


def test_adaptive_k_falls_back_to_plain_steps_when_drafts_fail():
    config = SpecConfig(k_max=4)
    assert config.best_k(0.9) >= 3
    assert config.best_k(0.05) == 0
    lm = tiny_llama()
    spec = Speculator(lm.model, ModelDrafter(tiny_llama(seed=1).model), config)
    list(generate(lm, build_prompt(lm, prompt_tokens=PROMPTS[0]), SamplingParams(max_tokens=40),
                  speculator=spec))
    assert spec.accepted == 0
    # k = 0 is decoded by plain pipelined steps (no target steps of their own), and speculation
    # that keeps failing steps aside within a few rounds
    assert spec.steps <= config.trial_rounds + 1
    assert spec.stats()["plain_tokens_per_s"] is not None
