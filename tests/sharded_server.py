"""`mlxchat serve` as several ranks on this host, started as `mlx.launch --backend ring` starts
them (MLX_RANK and MLX_HOSTFILE per rank) but by the test itself, so that a test can kill one rank."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.live_server import REPO, free_port, linked_home, wait_healthy

# every rank loads its shard and builds nothing (CPU kernels shared), but on a busy 2-core
# machine several ranks starting at once take minutes
START_TIMEOUT_S = 420


def serve_command(port: int, model: Path) -> list[str]:
    return [sys.executable, "-m", "app.cli", "serve", "--no-browser", "--port", str(port),
            "--model", str(model)]


class ShardedServer:
    """`ranks` processes of `mlxchat serve --model MODEL`; rank 0 answers at `url`. With one
    rank it is a plain single-process server (no distributed variables set)."""

    def __init__(self, root: Path, model: Path | str, ranks: int = 2,
                 env: dict[str, str] | None = None):
        """`model`: a folder, or a name the servers resolve (a hub-cache entry with `env`'s
        HF_HUB_CACHE). Starting again on the same `root` reuses every rank's home (its caches)."""
        self.root, self.model, self.ranks, self.env = root, Path(model), ranks, env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.logs = [root / f"rank{r}.log" for r in range(ranks)]

    def start(self) -> "ShardedServer":
        hostfile = self.root / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(self.ranks)]))
        heartbeat = f"127.0.0.1:{free_port()}"
        for rank in range(self.ranks):
            # a home of its own, caches included: no prefix-cache files from earlier runs
            # ... but the CPU kernels built once for every test (a build per home costs minutes
            # on a busy 2-core machine)
            home = linked_home(self.root / f"home{rank}", "kernels")
            env = {**os.environ, **self.env, "MLXCHAT_HOME": str(home)}
            if self.ranks > 1:
                env.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile),
                           MLXCHAT_HEARTBEAT=heartbeat)
            with open(self.logs[rank], "ab") as log:
                self.procs.append(subprocess.Popen(serve_command(self.port, self.model), cwd=REPO,
                                                   env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            wait_healthy(self.url, timeout=START_TIMEOUT_S,
                         alive=lambda: all(p.poll() is None for p in self.procs))
        except BaseException:
            self.stop()  # no server left running by a failed start
            raise
        return self

    def signal(self, rank: int, sig: int) -> None:
        self.procs[rank].send_signal(sig)

    def stop(self) -> list[int | None]:
        """Ctrl-C to rank 0, as on a terminal; returns every rank's exit code (None: still running)."""
        if self.procs[0].poll() is None:
            self.procs[0].send_signal(signal.SIGINT)
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(30))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(None)
        return codes

    def snapshot_files(self, rank: int) -> list[Path]:
        """The prefix-cache snapshot files rank `rank` keeps (in its own home)."""
        return sorted((self.root / f"home{rank}").glob("cache/prompt-cache/*/*/*.safetensors"))

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")
