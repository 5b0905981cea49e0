"""The shape suites that the device runs (`python -m bench ... --device gpu`) run end to end on the
CPU with the tiny shape: every row measured (ours and mlx-lm's), none failed, and the JSON written,
so a device run does not fail on a harness error."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("suite", ["decode", "concurrency", "prefix"])
def test_a_shape_suite_runs_on_the_tiny_shape_and_measures_both_sides(suite, tmp_path):
    out = tmp_path / f"{suite}.json"
    run = subprocess.run([sys.executable, "-m", "bench", suite, "--device", "cpu", "--shapes", "tiny",
                          "--quick", "--reps", "2", "--no-delegate", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and not [r for r in rows if r["metric"] in ("FAILED", "skipped")]
    for row in rows:
        assert row["suite"] == suite and row["shape"] == "tiny"
        assert row["ours"] > 0 and row["baseline"] > 0 and row["ratio"] > 0, row
