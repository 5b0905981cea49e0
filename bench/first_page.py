"""From `mlxchat serve` to a page that answers: the seconds until `GET /` (followed to the
conversation) answers 200, and until `/health` says ok (the model loaded), for a server started
as a user starts it, on an empty data folder whose cache holds the model (converted, kernels
built: the page's time does not depend on it, the model's does).

    python -m bench.first_page [--runs 5]

Prints each run and the median with the spread (min-max), and the CPU time the server spent
until its page answered (user + system, from /proc: what a busy machine cannot inflate). Goal:
the page within 2 s whatever the model's state (docs/usage.md#starting-the-first-minute)."""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("MLXCHAT_TEST_HOME", REPO / ".mlxchat-home")) / "cache"


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, its finished children's included (an
    exec keeps the pid and the count) (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def one_run(port: int) -> tuple[float, float, float]:
    """(seconds to the page, CPU seconds by then, seconds to a loaded model)."""
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        (home / "cache").symlink_to(CACHE, target_is_directory=True)
        # as a shell without LD_PRELOAD runs it: `mlxchat` preloads OpenBLAS itself (a restart)
        env = {**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
               "MLXCHAT_HOME": str(home)}
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--no-browser",
                                 "--port", str(port)], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            page = cpu = None
            while page is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/", follow_redirects=True,
                                 timeout=5).status_code == 200:
                        page, cpu = time.monotonic() - started, _cpu_s(proc.pid)
                except httpx.HTTPError:
                    time.sleep(0.02)
            while httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["status"] != "ok":
                time.sleep(0.05)
            return page, cpu, time.monotonic() - started
        finally:
            proc.send_signal(2)
            proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--port", type=int, default=8391)
    args = parser.parse_args()
    rows = []
    for i in range(args.runs):
        page, cpu, ready = one_run(args.port)
        rows.append((page, cpu, ready))
        print(f"run {i + 1}: page {page:.2f} s (server CPU {cpu:.2f} s), model ready {ready:.1f} s",
              flush=True)
    for name, column in (("page", 0), ("server CPU to the page", 1), ("model ready", 2)):
        values = [r[column] for r in rows]
        print(f"{name}: median {statistics.median(values):.2f} s "
              f"(min {min(values):.2f}, max {max(values):.2f}, {len(values)} runs)")
    print(f"load average then: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
