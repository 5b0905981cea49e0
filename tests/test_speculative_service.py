"""Speculative decoding as a per-request opt-in of the engine service: drafts named by kind and
loaded once per model, requests decoding speculatively next to plain (batched) ones under the
scheduler, cancellation in the middle of a verification step, failure isolation and recovery, the
prefix cache unaffected, and clear refusals of drafts that cannot work.

"Alone" is the same request through `engine.decoding.generate.generate` with no scheduler and no speculation.
"""

import json
import shutil
import threading

import pytest

from engine.decoding.drafts import SpeculativeOptions
from engine.errors import InvalidRequest
from engine.decoding.generate import build_prompt, generate
from engine.decoding.sampling import SamplingParams
from engine.scheduling.service import Engine
from engine.decoding.speculative import Speculator
from tiny_models import tiny_llama, tiny_qwen3_5

pytestmark = pytest.mark.fast

PROMPTS = [list(range(100, 140)), [5, 17, 900, 31, 4000, 12], list(range(2000, 2600, 7)),
           [7, 7, 7, 300, 301, 302]]


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def alone(lm, params, tokens):
    return [e.token for e in generate(lm, build_prompt(lm, prompt_tokens=tokens), params)
            if e.kind == "token"]


def finish(handle, timeout=120):
    events = list(handle.events(timeout=timeout))
    assert [e.kind for e in events].count("done") == 1 and events[-1].kind == "done"
    return [e.token for e in events if e.kind == "token"], events[-1]


@pytest.mark.slow  # six concurrent streams and their runs alone: seconds by design, the second tier
def test_concurrent_speculative_and_plain_requests_match_running_alone(llama, serve):
    """Four speculative requests (four kinds of draft, one sampled) and two plain ones at once: every
    greedy one gives exactly its tokens alone, the plain ones still batch together, and each
    speculative one reports its statistics."""
    other = tiny_llama(seed=1)  # same tokenizer, unrelated weights: its drafts are all rejected
    engine = serve(llama, max_running=6, prefix_cache=False)
    greedy = SamplingParams(max_tokens=24)
    requests = [
        (PROMPTS[0], greedy, SpeculativeOptions("truncated:3", k=3)),
        (PROMPTS[1], greedy, SpeculativeOptions("self-q4", k=4, adaptive=False)),
        (PROMPTS[2], greedy, SpeculativeOptions(str(other.path), k=2)),
        (PROMPTS[3], SamplingParams(max_tokens=24, temperature=0.8, seed=5),
         SpeculativeOptions("truncated:2")),
        (PROMPTS[0], greedy, None),
        (PROMPTS[2], greedy, None),
    ]
    handles = [engine.submit(prompt_tokens=p, params=params, speculative=spec)
               for p, params, spec in requests]
    for (prompt, params, spec), handle in zip(requests, handles):
        tokens, done = finish(handle)
        if params.greedy:
            assert tokens == alone(llama, params, prompt), spec
        else:
            assert len(tokens) == 24 or done.finish_reason == "stop"
        stats = done.stats.get("speculative")
        if spec is None:
            assert stats is None
            continue
        assert stats["target_steps"] > 0 and stats["drafted"] >= stats["accepted"] >= 0
        assert stats["tokens_per_target_step"] >= 1
    q4 = handles[1].generation.speculator
    assert q4.accepted > 0  # 4-bit weights of the same (random, near-flat) model agree at times
    assert handles[2].generation.speculator.accepted == 0
    # Loaded one after another off the scheduler thread (each request waited in `loading_draft`);
    # the engine keeps only the last one.
    assert engine.status().drafts == ("truncated:2",)
    assert handles[1].transitions[0][0] == "loading_draft"
    again = engine.submit(prompt_tokens=PROMPTS[0], params=greedy,  # the kept draft: queued at once
                          speculative=SpeculativeOptions("truncated:2"))
    assert again.transitions[0][0] == "queued"
    assert finish(again)[0] == alone(llama, greedy, PROMPTS[0])


def test_hybrid_model_under_the_scheduler_keeps_the_prefix_cache_intact(serve):
    """qwen3_5 (recurrent layers, restored rather than trimmed): speculative requests next to plain
    ones give their tokens alone; afterwards plain requests reuse the prefixes they stored."""
    lm = tiny_qwen3_5()
    engine = serve(lm, max_running=4)
    params = SamplingParams(max_tokens=20)
    handles = [engine.submit(prompt_tokens=p, params=params, speculative=SpeculativeOptions(draft))
               for p, draft in zip(PROMPTS, ["self-q4", str(tiny_qwen3_5(seed=1).path)])]
    handles += [engine.submit(prompt_tokens=p, params=params) for p in PROMPTS[2:]]
    expected = [alone(lm, params, p) for p in PROMPTS]
    assert [finish(h)[0] for h in handles] == expected
    for prompt, want in zip(PROMPTS[:2], expected):
        tokens, done = finish(engine.submit(prompt_tokens=prompt, params=params))
        assert tokens == want and done.usage.cached_tokens > 0


def test_cancel_in_the_middle_of_a_verification_step(llama, serve, monkeypatch):
    """Cancel arrives while the scheduler is inside a draft-and-verify round: that round completes,
    the request ends `cancelled` with a prefix of its output, memory and slots are released, and
    the engine then serves speculative and plain requests correctly."""
    engine = serve(llama, max_running=2)
    params = SamplingParams(max_tokens=200)
    spec = SpeculativeOptions("truncated:3", k=3)
    handle = engine.submit(prompt_tokens=PROMPTS[0], params=params, speculative=spec)
    rounds, real_step = [], Speculator.step

    def step(self, *args, **kwargs):
        rounds.append(self)
        if len(rounds) == 3:
            threading.Thread(target=handle.cancel).start()  # from another thread, as a client does
            while not handle.cancel_requested:
                pass
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(Speculator, "step", step)
    tokens, done = finish(handle)
    assert done.finish_reason == "cancelled" and handle.state == "cancelled"
    assert 3 <= len(tokens) < 200 and tokens == alone(llama, params, PROMPTS[0])[:len(tokens)]
    assert done.stats["speculative"]["target_steps"] == 3
    assert (engine.status().running, engine.status().queued) == (0, 0)
    monkeypatch.setattr(Speculator, "step", real_step)
    short = SamplingParams(max_tokens=16)
    again = engine.submit(prompt_tokens=PROMPTS[0], params=short, speculative=spec)
    plain = engine.submit(prompt_tokens=PROMPTS[1], params=short)
    assert finish(again)[0] == alone(llama, short, PROMPTS[0])
    assert finish(plain)[0] == alone(llama, short, PROMPTS[1])


def test_a_failing_verification_fails_only_its_request(llama, serve, monkeypatch):
    engine = serve(llama, max_running=3, prefix_cache=False)
    params = SamplingParams(max_tokens=16)
    real_step = Speculator.step
    broken = []

    def step(self, *args, **kwargs):
        if not broken:
            broken.append(self)
            raise RuntimeError("injected verification fault")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(Speculator, "step", step)
    spec = SpeculativeOptions("truncated:2")
    failing = engine.submit(prompt_tokens=PROMPTS[0], params=params, speculative=spec)
    plain = engine.submit(prompt_tokens=PROMPTS[1], params=params)
    _, done = finish(failing)
    assert done.finish_reason == "failed" and "injected verification fault" in done.error
    assert finish(plain)[0] == alone(llama, params, PROMPTS[1])
    ok = engine.submit(prompt_tokens=PROMPTS[2], params=params, speculative=spec)
    assert finish(ok)[0] == alone(llama, params, PROMPTS[2])


def test_mtp_draft_through_the_engine(serve, tmp_path):
    from tiny_models import QWEN3_5, mtp_folder
    from engine.loading.registry import load_model

    folder, _ = mtp_folder(QWEN3_5, tmp_path, raw_hf=False)
    lm = load_model(str(folder))
    assert "mtp" in [d.draft for d in serve(lm).model.drafts]
    engine = serve(lm, max_running=2, prefix_cache=False)
    params = SamplingParams(max_tokens=16)
    handles = [engine.submit(prompt_tokens=p, params=params, speculative=SpeculativeOptions("mtp", k=2))
               for p in PROMPTS[:2]]
    for prompt, handle in zip(PROMPTS, handles):
        tokens, done = finish(handle)
        assert tokens == alone(lm, params, prompt) and done.stats["speculative"]["drafted"] > 0


def test_drafts_that_cannot_work_are_refused_clearly(llama, serve, tmp_path):
    engine = serve(llama)
    def submit(draft, **kw):
        """As a caller sees a refusal: at once, or (a draft that had to load) from `accepted`."""
        handle = engine.submit(prompt_tokens=PROMPTS[0], speculative=SpeculativeOptions(draft, **kw))
        try:
            handle.wait_accepted(timeout=120)
        except InvalidRequest:
            done = list(handle.events(timeout=60))[-1]
            assert handle.state == "failed" and done.finish_reason == "failed" and done.error
            raise
    with pytest.raises(InvalidRequest, match="unknown draft 'nonsense'"):
        submit("nonsense")
    with pytest.raises(InvalidRequest, match=r"N must be .* in \[1, 3\]"):
        submit("truncated:4")
    with pytest.raises(InvalidRequest, match="N must be"):
        submit("truncated:x")
    with pytest.raises(InvalidRequest, match="no multi-token-prediction head"):
        submit("mtp")
    with pytest.raises(InvalidRequest, match=r"speculative.k must be an integer in \[1, 16\]"):
        submit("self-q4", k=0)
    folder = tmp_path / "other-vocab"
    shutil.copytree(llama.path, folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {f"x{v}": i for v, i in tok["model"]["vocab"].items()}
    tok["model"]["merges"] = []
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(InvalidRequest, match="vocabularies differ"):
        submit(str(folder))
    status = engine.status()
    assert (status.running, status.queued, status.loading_drafts, status.reserved_bytes) == (0, 0, 0, 0)
    assert [d.draft for d in engine.model.drafts] == ["self-q4", "truncated:1"]
    qwen = tiny_qwen3_5()  # 4 layers, the 4th the only full-attention one: none can be dropped
    assert [d.draft for d in serve(qwen).model.drafts] == ["self-q4"]
    with pytest.raises(InvalidRequest, match="none can be dropped"):
        serve(qwen).submit(prompt_tokens=PROMPTS[0], speculative=SpeculativeOptions("truncated:3"))


def test_drafts_are_dropped_with_the_model_they_were_loaded_for(llama):
    qwen = tiny_qwen3_5()
    models = {llama.name: llama, "qwen": qwen}
    engine = Engine(llama.name, load=lambda name, **_: models[name]).start()
    try:
        params = SamplingParams(max_tokens=8)
        spec = SpeculativeOptions("truncated:3")
        assert finish(engine.submit(prompt_tokens=PROMPTS[0], params=params, speculative=spec))[0] \
            == alone(llama, params, PROMPTS[0])
        assert engine.status().drafts == ("truncated:3",)
        engine.switch_model("qwen")
        assert engine.status().drafts == ()
        with pytest.raises(InvalidRequest, match="none can be dropped"):
            engine.submit(prompt_tokens=PROMPTS[0], params=params, speculative=spec)
        q4 = SpeculativeOptions("self-q4")
        assert finish(engine.submit(prompt_tokens=PROMPTS[0], params=params, speculative=q4))[0] \
            == alone(qwen, params, PROMPTS[0])
        assert engine.status().drafts == ("self-q4",) and engine.model.name == qwen.name
    finally:
        engine.stop()
