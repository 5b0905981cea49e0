"""Issue 24 LOW: `mlxchat serve` on a database written by a newer mlxchat exits with one `Error:`
line naming both schema versions, no traceback (the real CLI, in a child process)."""

import sqlite3

from live_server import free_port

import pytest

from app.storage import DB_NAME, SCHEMA_VERSION, Storage
from cli_runs import mlxchat, refusal

# The real CLI in a child process (~2 s importing mlx-lm): a fast test in the second tier.
pytestmark = [pytest.mark.fast, pytest.mark.slow]


def test_a_database_from_a_newer_mlxchat_is_one_error_line(tmp_path):
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    storage = Storage(home / "data" / DB_NAME)
    path = storage.path
    storage.close()
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    line = refusal(mlxchat("serve", "--no-browser", "--port", str(free_port()), home=home, timeout=300))
    assert "newer than this mlxchat" in line and str(SCHEMA_VERSION + 1) in line
