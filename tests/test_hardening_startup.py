"""Issue 14, cases 9 and 10 before any model loads: each start-up fault is one line and a non-zero
exit from the real CLI; one server per data folder; migrations safe against concurrent openers."""

import multiprocessing
import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from app.storage.folder_lock import FolderLock
from app.storage import SCHEMA_VERSION, Storage
from cli_runs import mlxchat, mlxchat_options, refusal

pytestmark = pytest.mark.fast
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the real CLI in a child process (~2 s importing mlx-lm): the second tier
def test_wildcard_host_without_allow_remote(tmp_path):
    line = refusal(mlxchat("serve", "--no-browser", "--host", "0.0.0.0", home=tmp_path))
    assert "--allow-remote" in line


@pytest.mark.slow  # the real CLI in a child process (~2 s importing mlx-lm): the second tier
def test_allow_remote_without_a_key_needs_an_explicit_opt_out(tmp_path):
    line = refusal(mlxchat("serve", "--no-browser", "--host", "0.0.0.0", "--allow-remote",
                           home=tmp_path))
    assert "--api-key" in line and "--no-api-key" in line


@pytest.mark.slow  # the real CLI in a child process (~2 s importing mlx-lm): the second tier
def test_mlxchat_home_that_is_a_file(tmp_path):
    home = tmp_path / "home"
    home.write_text("not a folder")
    assert "check MLXCHAT_HOME" in refusal(mlxchat("serve", "--no-browser", home=home))


@pytest.mark.slow  # the real CLI in a child process (~2 s importing mlx-lm): the second tier
def test_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refusal(mlxchat("serve", "--no-browser", "--port", str(port), home=tmp_path))
    assert f":{port}" in line and "in use" in line


@pytest.mark.slow  # the real CLI in a child process (~2 s importing mlx-lm): the second tier
def test_a_second_server_on_one_data_folder_names_the_first(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from app.storage.folder_lock import FolderLock; Path(sys.argv[1]).mkdir(parents=True); "
         "FolderLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(120)",
         str(tmp_path / "data")], cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        line = refusal(mlxchat("serve", "--no-browser", "--port", "1", home=tmp_path))
        assert f"pid {holder.pid}" in line and str(tmp_path / "data") in line
    finally:
        holder.kill()
        holder.wait()
    FolderLock(tmp_path / "data").acquire().release()  # the kernel dropped the dead holder's lock


@pytest.mark.parametrize("args, name", [(["--port", "0"], "--port"),
                                        (["--port", "65536"], "--port")])
def test_numeric_options_are_range_checked(tmp_path, args, name):
    assert name in refusal(mlxchat_options("serve", "--no-browser", *args, home=tmp_path))


@pytest.mark.parametrize("args, name", [(["--top-p", "1.5"], "--top-p"),
                                        (["-n", "0"], "'-n'"), (["-t", "-1"], "-t")])
def test_sampling_options_are_range_checked(tmp_path, args, name):
    assert name in refusal(mlxchat_options("chat", *args, home=tmp_path))


def _open(path: str, barrier) -> int:
    barrier.wait()
    storage = Storage(Path(path))
    storage.close()
    return 0


@pytest.mark.slow  # seconds of compute by design: the second tier
def test_concurrent_openers_migrate_a_new_database_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(4) as pool:
        for round_ in range(3):
            path = tmp_path / f"db{round_}.sqlite"
            barrier = manager.Barrier(4)
            assert pool.starmap(_open, [(str(path), barrier)] * 4) == [0] * 4
            db = sqlite3.connect(path)
            assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
            db.close()


def test_a_damaged_database_is_moved_aside_and_a_fresh_one_created(tmp_path):
    path = tmp_path / "mlxchat.db"
    path.write_bytes(os.urandom(8192))
    damaged = path.read_bytes()
    storage = Storage(path)
    try:
        assert storage.moved_aside is not None and storage.moved_aside.read_bytes() == damaged
        assert storage.moved_aside.name.startswith("mlxchat.db.corrupt-")
        conv = storage.create_conversation(title="works")
        assert storage.get_conversation(conv.id).title == "works"
    finally:
        storage.close()
