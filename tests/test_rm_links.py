"""Issue 24 LOW: `mlxchat rm` (the real CLI, in a child process) deletes links and blobs only inside
the hub cache; a snapshot link pointing out of it loses the link, never its target. The cache is
laid out as huggingface_hub lays it out (models--owner--name/snapshots/<rev>/, blobs/)."""

import os
import subprocess
import sys

import pytest

# The real CLI in a child process (~2 s importing mlx-lm): a fast test in the second tier.
pytestmark = [pytest.mark.fast, pytest.mark.slow]


def cache_with_outside_link(tmp_path, second: bool):
    outside = tmp_path / "precious.gguf"
    outside.write_bytes(b"GGUF" + b"\0" * 64)
    repo = tmp_path / "hub" / "models--test--evil"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    inside = repo / "blobs" / "deadbeef"
    inside.write_bytes(b"GGUF" + b"\1" * 64)
    (snapshot / "a.gguf").symlink_to(outside)
    if second:  # then each GGUF file is its own model, `test/evil:a.gguf`
        (snapshot / "b.gguf").symlink_to(inside)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return outside, inside, snapshot


def rm(tmp_path, name: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1",
           "MLXCHAT_HOME": str(tmp_path / "home")}
    return subprocess.run([sys.executable, "-m", "app.cli", "rm", name, "--yes"], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["test/evil:a.gguf"])
def test_rm_never_deletes_a_target_outside_the_cache(tmp_path, name):
    outside, inside, snapshot = cache_with_outside_link(tmp_path, second=":" in name)
    done = rm(tmp_path, name)
    assert done.returncode == 0, done.stderr
    assert outside.read_bytes().startswith(b"GGUF")
    assert not (snapshot / "a.gguf").is_symlink()
    if ":" in name:
        assert (snapshot / "b.gguf").read_bytes() == inside.read_bytes()  # the other file stays
