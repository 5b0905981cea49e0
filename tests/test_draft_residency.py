"""Issue 14, case 8: a draft model is one draft whatever its spelling, the engine keeps at most one,
and loading it never stalls the requests already decoding."""

import gc
import os
import shutil
import threading
import time
import weakref

import pytest

from engine.decoding.drafts import SpeculativeOptions
from engine.decoding.generate import build_prompt, generate
from engine.decoding.sampling import SamplingParams
from tiny_models import tiny_llama

pytestmark = pytest.mark.fast

PROMPT = list(range(100, 140))
GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def finish(handle):
    events = list(handle.events(timeout=120))
    assert events[-1].kind == "done" and events[-1].finish_reason in ("length", "stop"), events[-1]
    return [e.token for e in events if e.kind == "token"]


def alone(lm, tokens, params=GREEDY):
    return [e.token for e in generate(lm, build_prompt(lm, prompt_tokens=tokens), params)
            if e.kind == "token"]


def drafted(engine, draft):
    """Run one greedy speculative request with `draft`; its draft model object and tokens."""
    handle = engine.submit(prompt_tokens=PROMPT, params=GREEDY, speculative=SpeculativeOptions(draft))
    tokens = finish(handle)
    return handle.generation.speculator.drafter.model, tokens


def test_every_spelling_of_a_draft_loads_it_once(llama, serve, tmp_path, monkeypatch):
    folder = tiny_llama(seed=1).path
    link = tmp_path / "draft-link"
    link.symlink_to(folder, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    spellings = [str(folder), str(folder) + "/", os.path.relpath(folder),
                 str(folder.parent / ".." / folder.parent.name / folder.name), str(link)]
    engine = serve(llama, prefix_cache=False)
    first, tokens = drafted(engine, spellings[0])
    assert tokens == alone(llama, PROMPT)
    for spelling in spellings[1:]:
        model, tokens = drafted(engine, spelling)
        assert model is first, spelling  # the same weights, not another copy
        assert tokens == alone(llama, PROMPT)
    assert engine.status().drafts == (os.path.realpath(folder),)


def test_another_draft_replaces_the_resident_one(llama, serve):
    engine = serve(llama, prefix_cache=False)
    first, _ = drafted(engine, str(tiny_llama(seed=1).path))
    released = weakref.ref(first)
    del first
    second_path = tiny_llama(seed=2).path
    second, tokens = drafted(engine, str(second_path))
    assert tokens == alone(llama, PROMPT)
    assert engine.status().drafts == (os.path.realpath(second_path),)
    gc.collect()
    assert released() is None  # the engine let go of the first draft's weights
    assert drafted(engine, "truncated:2")[1] == alone(llama, PROMPT)
    assert engine.status().drafts == ("truncated:2",)


def test_requests_keep_decoding_while_a_draft_loads(llama, serve, tmp_path):
    """The draft's config.json is a FIFO: its load blocks until the test writes it, so the draft
    is certainly loading while the test counts the other request's tokens."""
    folder = tmp_path / "slow-draft"
    shutil.copytree(tiny_llama(seed=1).path, folder)
    config = (folder / "config.json").read_text()
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")
    engine = serve(llama, prefix_cache=False)
    plain = engine.submit(prompt_tokens=PROMPT, params=SamplingParams(max_tokens=200))
    events = plain.events(timeout=60)
    assert next(e for e in events if e.kind == "token")
    spec = engine.submit(prompt_tokens=PROMPT, params=GREEDY,
                         speculative=SpeculativeOptions(str(folder)))
    released = threading.Event()

    def release() -> None:  # once the loader opens the FIFO: a plain file for later readers
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                fd = os.open(folder / "config.json", os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:  # no reader yet
                time.sleep(0.01)
        else:
            return
        (folder / "config.tmp").write_text(config)
        os.replace(folder / "config.tmp", folder / "config.json")
        os.write(fd, config.encode())
        os.close(fd)
        released.set()

    try:
        during = 0
        for event in events:
            assert spec.state == "loading_draft"
            if event.kind == "token":
                during += 1
            if during == 10:
                break
        assert during == 10  # tokens kept coming while the draft was loading
    finally:
        writer = threading.Thread(target=release, daemon=True)
        writer.start()
        writer.join(130)
    assert released.is_set()
    assert finish(spec) == alone(llama, PROMPT)
    plain.cancel()
    assert list(events)[-1].kind == "done"
    assert engine.status().drafts == (os.path.realpath(folder),)
