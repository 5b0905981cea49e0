"""`mlxchat serve` stopped by a signal while the bundled model is still loading (the server
already listening), as a service manager or Ctrl-C stops it: one line, no traceback, exit status
0 at once (the load is not waited for), the database intact and its conversations kept."""

import os
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing

import pytest

from app.storage import DB_NAME, Storage
from live_server import REPO, app_home, free_port


def start(home) -> subprocess.Popen:
    env = {**os.environ, "MLXCHAT_HOME": str(home)}
    return subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--no-browser",
                             "--port", str(free_port())], cwd=REPO, env=env, text=True,
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=lambda s: s.name)
def test_a_signal_while_the_model_loads_stops_cleanly(tmp_path, sig):
    home = app_home(tmp_path / "home")
    db = home / "data" / DB_NAME
    db.parent.mkdir(parents=True)
    storage = Storage(db)
    kept = storage.create_conversation(settings={"sampling": {}}).id
    storage.close()

    proc = start(home)
    seen = []
    for line in proc.stderr:  # the engine reports its first loading stage, then the signal
        seen.append(line)
        if line.strip() == "loading":
            proc.send_signal(sig)
            break
    started = time.monotonic()
    output = "".join(seen) + proc.stderr.read()
    assert proc.wait(60) == 0, output
    assert time.monotonic() - started < 30  # it does not wait for the model to load
    assert f"mlxchat stopped ({sig.name} while loading the model)." in output
    assert "Traceback" not in output and "mlxchat is running" in output
    assert output.index("mlxchat is running") < output.index("Loading model")  # listens first

    with closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    reopened = Storage(db)
    assert reopened.get_conversation(kept) is not None
    reopened.close()
