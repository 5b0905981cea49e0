"""Issue 54 (LOW): `mlx.launch -n 2` on a model whose heads do not split over two ranks (the bundled
SmolLM2: 9 heads, 3 KV heads): every rank exits with the one clear line and status 1, rank 0
included, none with a traceback (rank 0 used to die in its STOP broadcast, "[ring] connection to
a peer was lost", once rank 1 had refused the model and left). Real `mlxchat serve` processes,
started as `mlx.launch --backend ring` starts them; the real bundled model (its load is what let
rank 1 leave while rank 0 still broadcast)."""

import json
import os
import subprocess
import sys

from tests.live_server import REPO, free_port, linked_home


def test_a_model_two_ranks_cannot_split_stops_both_with_one_line(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
    heartbeat = f"127.0.0.1:{free_port()}"
    procs = []
    for rank in range(2):
        home = linked_home(tmp_path / f"home{rank}", "kernels", "converted", "models")
        env = {**os.environ, "MLXCHAT_HOME": str(home), "MLX_RANK": str(rank),
               "MLX_HOSTFILE": str(hostfile), "MLXCHAT_HEARTBEAT": heartbeat}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--no-browser", "--port", str(free_port())],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        errors = [line for line in out.splitlines() if line.startswith("Error:")]
        assert proc.returncode == 1 and len(errors) == 1, (rank, proc.returncode, out[-2000:])
        assert "cannot split smollm2-135m-instruct over 2 processes" in errors[0]
        assert "num_attention_heads 9" in errors[0] and "world sizes that divide them all: 3" \
            in errors[0]
        assert "Traceback" not in out and "connection to a peer" not in out, (rank, out[-2000:])
