"""The prefix cache is an optimisation only: with it, every request yields exactly the tokens it
yields without it, while reusing the longest prefix that token equality allows.

Models: the real bundled SmolLM2 (dense, trimmable KVCache), a tiny random qwen3_5 (hybrid:
ArraysCache linear attention + KVCache) and a tiny random llama for the fast structural tests.
"""

import logging
import mlx.core as mx
import numpy as np
import pytest

from engine.decoding.generate import build_prompt
from mlx_lm.models.cache import KVCache
from engine.prefix_cache.store import PrefixCache
from engine.decoding.defaults import preset
from engine.decoding.sampling import SamplingParams
from chats import SYSTEM, ask, assistant, long_chat, same_without_cache, user
from tiny_models import tiny_llama, tiny_qwen3_5

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hybrid():
    return tiny_qwen3_5()


@pytest.fixture(scope="module")
def dense():
    return tiny_llama()


BASE = [SYSTEM, user("Name the three primary colours."), assistant("Red, yellow and blue."),
        user("And the secondary ones?")]


def snapshot_arrays(snapshot) -> list[np.ndarray]:
    out = []
    for layer in snapshot.cache:
        arrays = (layer.keys, layer.values) if type(layer) is KVCache else layer.cache
        out += [np.array(a) for a in arrays if a is not None]
    return out


def all_snapshot_arrays(cache: PrefixCache) -> list[np.ndarray]:
    return [a for _, snap in cache.snapshots() if snap.cache for a in snapshot_arrays(snap)]


# -- token identity -------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", ["greedy", "recommended"])
@pytest.mark.parametrize("model", ["lm", "hybrid"])
def test_cache_on_equals_cache_off_through_a_conversation(model, sampling, request):
    lm = request.getfixturevalue(model)
    params = preset(sampling, lm.family, max_tokens=MAX_TOKENS, seed=7)
    cache = PrefixCache(lm)

    first = same_without_cache(lm, BASE, params, cache)
    assert first.cached == 0

    repeated = same_without_cache(lm, BASE, params, cache)
    assert repeated.cached == len(build_prompt(lm, messages=BASE).tokens) - 1

    # At least the whole earlier prompt; the answer too where its text re-tokenizes to the same
    # tokens (a random model's output often does not).
    continued = BASE + [assistant(first.text), user("Which of them is warmest?")]
    assert same_without_cache(lm, continued, params, cache).cached >= len(build_prompt(
        lm, messages=BASE).tokens)

    edited = BASE[:-1] + [user("And the tertiary ones?")]
    edit = same_without_cache(lm, edited, params, cache)
    assert edit.cached >= build_prompt(lm, messages=edited).checkpoints[-2]

    regenerated = same_without_cache(lm, edited, params, cache)  # regenerate the last answer
    assert regenerated.cached == len(build_prompt(lm, messages=edited).tokens) - 1

    branch = BASE[:2]  # back to the first turn, answered anew
    back = same_without_cache(lm, branch, params, cache)
    assert back.cached >= build_prompt(lm, messages=branch).checkpoints[-2]

    other = [SYSTEM, user("Name four animals.")]  # the first user message edited
    assert same_without_cache(lm, other, params, cache).cached >= build_prompt(
        lm, messages=other).checkpoints[0]

    stats = cache.stats()
    assert (stats.hits, stats.misses) == (6, 1)
    assert stats.bytes == sum(a.nbytes for a in all_snapshot_arrays(cache))


# -- reuse coverage -------------------------------------------------------------------------------

def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("model, expected", [("lm", (2253, 2234, 2237)),
                                             ("hybrid", (2253, 2234, 2234))])
def test_editing_the_last_message_of_a_long_chat_reuses_every_earlier_message(model, expected, request):
    """expected = (tokens of the edited prompt, tokens of all earlier messages, tokens reused)."""
    lm = request.getfixturevalue(model)
    cache = PrefixCache(lm)
    params = SamplingParams(max_tokens=1)
    chat = long_chat()
    ask(lm, chat, params, cache)

    edited = chat[:-1] + [user("Actually, tell me about owls in one line.")]
    prompt = build_prompt(lm, messages=edited)
    earlier = prompt.checkpoints[-2]  # the end of the last assistant message
    reply = ask(lm, edited, params, cache)

    if cache.trimmable:  # dense: everything equal, including the start of the edited message
        assert reply.cached == common_prefix(prompt.tokens, build_prompt(lm, messages=chat).tokens)
    else:  # hybrid: up to the checkpoint at the end of the previous message
        assert reply.cached == earlier
    assert (len(prompt.tokens), earlier, reply.cached) == expected
    assert reply.cached >= earlier >= 2000


def test_long_chat_edit_on_the_hybrid_model_matches_cache_off(hybrid):
    cache = PrefixCache(hybrid)
    params = preset("recommended", hybrid.family, max_tokens=MAX_TOKENS, seed=3)
    chat = long_chat()
    same_without_cache(hybrid, chat, params, cache)
    edited = chat[:-1] + [user("Actually, tell me about owls in one line.")]
    assert same_without_cache(hybrid, edited, params, cache).cached >= 2000


# -- memory budget and eviction -------------------------------------------------------------------

def test_snapshot_sizes_are_exact(dense):
    cache = PrefixCache(dense)
    ask(dense, BASE, SamplingParams(max_tokens=4), cache)
    cfg = dense.config
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    sizes = [(len(tokens), snap.nbytes) for tokens, snap in cache.snapshots()]
    assert sizes and all(size == n * per_token for n, size in sizes)
    assert cache.stats().bytes == sum(size for _, size in sizes)


def test_covered_snapshots_are_dropped_at_once_on_a_dense_model(dense):
    """A dense cache trims to any prefix, so a longer snapshot replaces the shorter ones on its
    path as soon as it is saved: one conversation holds one snapshot, not one per message."""
    cache = PrefixCache(dense)
    ask(dense, BASE, SamplingParams(max_tokens=4), cache)
    (tokens, only), = cache.snapshots()
    assert cache.stats().bytes == only.nbytes and cache.stats().evictions == 0
    assert len(tokens) > len(dense.tokenizer.apply_chat_template(BASE, add_generation_prompt=True))
    # ...and it still serves every earlier checkpoint by trimming.
    assert ask(dense, BASE[:2], SamplingParams(max_tokens=4), cache).cached > 0


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_small_budget_stays_under_budget_and_changes_no_output(model, request):
    lm = request.getfixturevalue(model)
    probe = PrefixCache(lm)
    ask(lm, long_chat(3), SamplingParams(max_tokens=1), probe)
    budget = 2 * max(snap.nbytes for _, snap in probe.snapshots())

    cache = PrefixCache(lm, budget_bytes=budget)
    params = preset("recommended", lm.family, max_tokens=MAX_TOKENS, seed=11)
    conversations = [long_chat(n) for n in (3, 4, 2)] + [BASE, long_chat(3)[:-1] + [user("Hi")]]
    for messages in conversations:
        same_without_cache(lm, messages, params, cache)
        stats = cache.stats()
        assert stats.bytes <= budget
        assert stats.bytes == sum(a.nbytes for a in all_snapshot_arrays(cache))
    assert cache.stats().evictions > 0


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_a_request_never_mutates_the_snapshot_it_started_from(model, request):
    lm = request.getfixturevalue(model)
    cache = PrefixCache(lm)
    ask(lm, BASE, SamplingParams(max_tokens=6), cache)
    before = {len(tokens): snapshot_arrays(snap) for tokens, snap in cache.snapshots()}

    # A shorter prefix (trimmed, on dense models) continued with different tokens...
    edited = BASE[:-1] + [user("And the tertiary ones, please?")]
    assert ask(lm, edited, SamplingParams(max_tokens=6), cache).cached > 0
    # ...and a whole snapshot extended in place by the model.
    tokens = build_prompt(lm, messages=BASE).tokens
    private, n = cache.fetch(tokens + [42, 43])
    assert n == len(tokens)
    lm.model(mx.array([[42, 43]]), cache=private)
    mx.eval([c.state for c in private])

    after = {len(tokens): snapshot_arrays(snap) for tokens, snap in cache.snapshots()}
    for length, arrays in before.items():
        assert all(np.array_equal(a, b) for a, b in zip(arrays, after[length], strict=True))


# -- persistence ----------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_persisted_snapshots_survive_a_restart(model, request, tmp_path):
    lm = request.getfixturevalue(model)
    params = preset("recommended", lm.family, max_tokens=MAX_TOKENS, seed=5)
    chat = long_chat(3)
    first = PrefixCache(lm, persist_dir=tmp_path)
    ask(lm, chat, params, first)
    files = first.persist()
    assert files and all(f.parent.parent == tmp_path for f in files)

    restarted = PrefixCache(lm, persist_dir=tmp_path)
    assert restarted.stats().entries == 0 and restarted.stats().disk_entries == len(files)
    edited = chat[:-1] + [user("Something else entirely.")]
    reply = same_without_cache(lm, edited, params, restarted)
    assert reply.cached >= build_prompt(lm, messages=edited).checkpoints[-2]
    assert restarted.stats().entries >= 1


def test_corrupt_and_stale_files_are_skipped_with_a_log_line(hybrid, tmp_path, caplog):
    params = SamplingParams(max_tokens=4)
    chat = long_chat(2)
    first = PrefixCache(hybrid, persist_dir=tmp_path)
    ask(hybrid, chat, params, first)
    files = sorted(first.persist(), key=lambda f: f.stat().st_size)
    assert len(files) >= 2
    files[0].write_bytes(b"not a safetensors file")  # unreadable header
    data = files[1].read_bytes()
    files[1].write_bytes(data[: len(data) // 2])  # header fine, arrays cut short
    (files[0].parent / "zzz.safetensors").write_bytes(b"\x00" * 16)

    with caplog.at_level(logging.WARNING, logger="engine.prefix_cache.store"):
        restarted = PrefixCache(hybrid, persist_dir=tmp_path)
        reply = same_without_cache(hybrid, chat, params, restarted)
    skipped = [r for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) >= 3
    assert reply.tokens  # and the request simply recomputed what it could not reuse
