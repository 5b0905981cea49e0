"""`python -m bench.decode`'s llama.cpp row from a fresh clone: its child runs in llama-cpp-python's
own venv (`bash bench/setup-llamacpp`), which has none of our packages and no PYTHONPATH, on the
bundled model's GGUF, and returns its figures. Skipped where that venv was not built (CI does not
build it: ~15 minutes of a 2-core machine)."""

import json
import os
import subprocess
import sys

import pytest

from bench.decode import LLAMA_VENV, LLAMA_VENV_AVX512
from live_server import REPO

# Each row whose venv is built here: (its name in bench.decode, the venv).
BUILT = [(row, venv) for row, venv in (("llama.cpp", LLAMA_VENV), ("llama.cpp-avx512", LLAMA_VENV_AVX512))
         if (venv / "bin" / "python").exists()]


@pytest.mark.skipif(not BUILT, reason="no llama.cpp venv: bash bench/setup-llamacpp [avx512]")
def test_the_llama_cpp_row_runs_without_pythonpath(tmp_path):
    name, _ = BUILT[0]
    out = tmp_path / "decode.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-m", "bench.decode", "--models", "bundled", "--rows",
                          name, "--reps", "1", "--prompt-tokens", "32", "--gen-tokens", "4",
                          "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    row = json.loads(out.read_text())["models"]["bundled"]["rows"][name]
    assert "error" not in row, row.get("error")
    assert row["decode_tps"] > 0 and row["prefill_tps"] > 0 and len(row["tokens"]) >= 4
    assert row["peak_rss_mb"] > 0  # the worker's own memory figure: the import that failed
