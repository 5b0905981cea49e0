"""Persisted prefix-cache snapshots: a damaged or foreign file is never trusted (it is deleted with
one warning and the answer equals a cold run), and write-behind puts snapshots on disk soon after
they are made, within a disk budget, so a killed process keeps its cache.

Real files on disk, real tiny random-weight models (a dense llama, a hybrid qwen3_5).
"""

import json
import logging
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.prefix_cache import snapshot_files as files
from engine.prefix_cache.store import PrefixCache
from engine.decoding.generate import build_prompt
from engine.decoding.sampling import SamplingParams
from chats import ask, long_chat, same_without_cache, user
from tiny_models import tiny_llama, tiny_qwen3_5

pytestmark = pytest.mark.fast

PARAMS = SamplingParams(max_tokens=4)
CHAT = long_chat(2)
WAIT_S = 60  # bound for background writes to show up on a busy machine


@pytest.fixture(scope="module")
def dense():
    return tiny_llama()


@pytest.fixture(scope="module")
def hybrid():
    return tiny_qwen3_5()


@pytest.fixture(scope="module")
def other():
    """Same shapes as `dense`, other weights."""
    return tiny_llama(seed=1)


def persisted(lm, folder: Path) -> list[Path]:
    cache = PrefixCache(lm, persist_dir=folder, write_delay=None)
    ask(lm, CHAT, PARAMS, cache)
    return cache.persist()


def wait_for(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (found := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return found


def longest(cache: PrefixCache) -> list[int]:
    """The tokens of the longest snapshot (shorter ones on its path may linger on disk until its
    file is written)."""
    return max(cache.snapshots(), key=lambda item: item[1].length)[0]


def ours(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("engine.prefix_cache")]


def split(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(path: Path, table: dict, body: bytes) -> None:
    header = json.dumps(table).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)


# -- damage, one way each -------------------------------------------------------------------------

def flip_one_data_byte(path: Path, _) -> None:
    table, body = split(path)
    middle = len(body) // 2
    join(path, table, body[:middle] + bytes([body[middle] ^ 0x01]) + body[middle + 1:])


def random_data_behind_an_intact_header(path: Path, _) -> None:
    table, body = split(path)
    join(path, table, os.urandom(len(body)))


def truncate(path: Path, _) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def another_mlx_version(path: Path, _) -> None:
    table, body = split(path)
    identity = json.loads(table["__metadata__"]["identity"])
    table["__metadata__"]["identity"] = json.dumps({**identity, "mlx": "0.1.0"})
    join(path, table, body)


def fewer_tokens_than_the_arrays_hold(path: Path, _) -> None:
    """A consistent-looking file (name, checksum) that claims one token less than it holds."""
    table, body = split(path)
    tokens = json.loads(table["__metadata__"]["tokens"])[:-1]
    table["__metadata__"]["tokens"] = json.dumps(tokens)
    path.unlink()
    join(path.with_name(files.file_name(tokens)), table, body)


def mlx_lm_prompt_cache_with_offset_none(path: Path, _) -> None:
    """mlx-lm's own prompt-cache format, whose loader accepted an offset of None."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, save_prompt_cache

    table, _ = split(path)
    arrays = mx.load(str(path))
    layers = len(json.loads(table["__metadata__"]["layers"]))
    cache = [KVCache.from_state((arrays[f"{i}.0"], arrays[f"{i}.1"], None)) for i in range(layers)]
    path.unlink()
    save_prompt_cache(str(path), cache, {"tokens": table["__metadata__"]["tokens"]})


def from_another_model(path: Path, other) -> None:
    """Replace the file by the same conversation's snapshot made with other weights."""
    (theirs,) = persisted(other, path.parent.parent / "other-model")
    path.unlink()
    theirs.rename(path.with_name(theirs.name))


DAMAGE = [flip_one_data_byte, random_data_behind_an_intact_header, truncate, another_mlx_version,
          fewer_tokens_than_the_arrays_hold, mlx_lm_prompt_cache_with_offset_none,
          from_another_model]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_a_damaged_file_is_deleted_with_one_warning_and_the_answer_equals_cold(
        damage, dense, other, tmp_path, caplog):
    (path,) = persisted(dense, tmp_path)
    damage(path, other)
    (bad,) = path.parent.iterdir()

    with caplog.at_level(logging.WARNING, logger="engine.prefix_cache.store"):
        restarted = PrefixCache(dense, persist_dir=tmp_path, write_delay=None)
        reply = same_without_cache(dense, CHAT, PARAMS, restarted)
    assert reply.cached == 0
    assert not bad.exists()
    warnings = [r.getMessage() for r in ours(caplog) if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and bad.name in warnings[0]


def test_an_intact_file_is_reused_silently(dense, tmp_path, caplog):
    """The control for the damage tests: the same steps without damage reuse the file."""
    (path,) = persisted(dense, tmp_path)
    with caplog.at_level(logging.WARNING, logger="engine.prefix_cache.store"):
        restarted = PrefixCache(dense, persist_dir=tmp_path, write_delay=None)
        reply = same_without_cache(dense, CHAT, PARAMS, restarted)
    assert reply.cached == len(build_prompt(dense, messages=CHAT).tokens) - 1
    assert path.exists() and not ours(caplog)


def test_damaged_hybrid_snapshots_are_all_refused(hybrid, tmp_path, caplog):
    """Linear-attention state (ArraysCache) is checked as closely as attention keys and values."""
    paths = persisted(hybrid, tmp_path)
    assert len(paths) >= 2
    for path in paths:
        flip_one_data_byte(path, None)
    with caplog.at_level(logging.WARNING, logger="engine.prefix_cache.store"):
        restarted = PrefixCache(hybrid, persist_dir=tmp_path, write_delay=None)
        for tokens, _ in restarted.snapshots():  # each file, the answer's end included
            assert restarted.fetch(tokens + [0])[1] == 0
        reply = same_without_cache(hybrid, CHAT, PARAMS, restarted)
    assert reply.cached == 0
    assert not any(p.exists() for p in paths)
    assert sum("checksum" in r.getMessage() for r in ours(caplog)) == len(paths)


def test_a_temporary_file_left_by_a_dead_writer_is_removed(dense, tmp_path):
    (path,) = persisted(dense, tmp_path)
    stale = path.with_name(f".{path.name}.999999999-1{files.TMP_SUFFIX}")
    stale.write_bytes(path.read_bytes()[:50])
    PrefixCache(dense, persist_dir=tmp_path, write_delay=None)
    assert not stale.exists() and path.exists()


# -- write-behind ---------------------------------------------------------------------------------

def test_write_behind_persists_without_shutdown_and_keeps_one_file_per_dense_conversation(
        dense, tmp_path):
    cache = PrefixCache(dense, persist_dir=tmp_path, write_delay=0.05)
    first = ask(dense, CHAT, PARAMS, cache)
    tokens = longest(cache)
    wait_for(lambda: (cache.dir / files.file_name(tokens)).exists(), "the first snapshot's file")

    # The conversation goes on: its longer snapshot replaces the shorter one, on disk too.
    longer = CHAT + [{"role": "assistant", "content": first.text}, user("Go on.")]
    ask(dense, longer, PARAMS, cache)
    tokens = longest(cache)
    wait_for(lambda: [p.name for p in cache.dir.iterdir()] == [files.file_name(tokens)],
             "only the longer snapshot's file")
    assert [tokens] == [t for t, _ in cache.snapshots()]

    restarted = PrefixCache(dense, persist_dir=tmp_path, write_delay=None)  # no persist() ran
    reply = same_without_cache(dense, longer, PARAMS, restarted)
    assert reply.cached == len(build_prompt(dense, messages=longer).tokens) - 1


def test_the_memory_copy_wins_over_the_file(dense, tmp_path, caplog):
    cache = PrefixCache(dense, persist_dir=tmp_path, write_delay=0.05)
    ask(dense, CHAT, PARAMS, cache)
    tokens = longest(cache)
    path = wait_for(lambda: next(cache.dir.glob(files.file_name(tokens)), None), "the file")
    random_data_behind_an_intact_header(path, None)
    with caplog.at_level(logging.WARNING, logger="engine.prefix_cache.store"):
        reply = same_without_cache(dense, CHAT, PARAMS, cache)
    assert reply.cached == len(build_prompt(dense, messages=CHAT).tokens) - 1
    assert not ours(caplog)  # the file was never read


def test_write_behind_keeps_the_most_recent_files_within_the_disk_budget(dense, tmp_path):
    chats = [[CHAT[0], user(f"Question {i}: " + "tell me about rivers. " * 40)] for i in range(4)]
    probe = PrefixCache(dense)
    ask(dense, chats[0], PARAMS, probe)
    (_, snap), = probe.snapshots()
    budget = int(2.5 * snap.nbytes)  # two conversations' files, not three

    cache = PrefixCache(dense, persist_dir=tmp_path, write_delay=0.05, disk_budget_bytes=budget)
    newest = []
    for chat in chats:
        ask(dense, chat, PARAMS, cache)
        newest.append(files.file_name(max(cache.snapshots(), key=lambda s: s[1].last_used)[0]))
        wait_for(lambda: (cache.dir / newest[-1]).exists()
                 and sum(p.stat().st_size for p in cache.dir.iterdir()) <= budget,
                 "the newest file, within the budget")
    assert sorted(p.name for p in cache.dir.iterdir()) == sorted(newest[-2:])
    assert cache.stats().entries == len(chats)  # memory keeps what the disk budget let go


KILLED_CHILD = """
import sys, time
from pathlib import Path
sys.path.insert(0, "tests")
from engine.prefix_cache import snapshot_files as files
from engine.prefix_cache.store import PrefixCache
from chats import ask, long_chat
from engine.decoding.sampling import SamplingParams
from tiny_models import tiny_llama
lm = tiny_llama()
cache = PrefixCache(lm, persist_dir=Path(sys.argv[1]), write_delay=0.05)
ask(lm, long_chat(2), SamplingParams(max_tokens=4), cache)
tokens = max(cache.snapshots(), key=lambda item: item[1].length)[0]
print(cache.dir / files.file_name(tokens), flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(300)
@pytest.mark.slow  # a child process loading a tiny model, killed: the second tier
def test_a_killed_process_keeps_what_write_behind_wrote(dense, tmp_path):
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    try:
        newest = Path(child.stdout.readline().strip())
        assert newest.parent.parent == tmp_path
        wait_for(newest.exists, "the child's newest snapshot on disk")
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        child.kill()
    restarted = PrefixCache(dense, persist_dir=tmp_path, write_delay=None)
    reply = same_without_cache(dense, CHAT, PARAMS, restarted)
    assert reply.cached == len(build_prompt(dense, messages=CHAT).tokens) - 1
