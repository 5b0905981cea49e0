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


def test_service_gap_measures_every_side_with_its_gaps_between_tokens(tmp_path):
    """`python -m bench.service_gap`, the next device run's diagnosis of the service's batch-1
    decode, runs end to end: every side (the Engine with and without its prefix cache, at the
    Engine's and at Python's default GIL switch interval, the caller's thread, mlx-lm) has a rate
    and the median and 90th-percentile gaps between its tokens."""
    out = tmp_path / "gap.json"
    run = subprocess.run([sys.executable, "-m", "bench.service_gap", "--shapes", "tiny", "--reps", "1",
                          "--gen", "16", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    [result] = json.loads(out.read_text())["results"]
    sides = {k: v for k, v in result.items() if k != "shape"}
    assert set(sides) == {"service_cache", "service_nocache", "service_5ms", "direct", "mlx"}
    for side in sides.values():
        assert side["median_tps"] > 0 and 0 < side["gap_ms_p50"] <= side["gap_ms_p90"], side


def test_gpu_step_measures_bandwidth_steps_memory_parts_and_the_demo(tmp_path):
    """`python -m bench.gpu_step`, the device run for issue 34, runs every part end to end on the
    tiny shapes: the read bandwidth, each side's decode rate, step time and graph ops with the
    fraction of the bandwidth, peak memory by part now and before the change, and the founding
    demo's request (here on the tiny hybrid) with streamed text equal to the final text."""
    out = tmp_path / "step.json"
    run = subprocess.run([sys.executable, "-m", "bench.gpu_step", "--device", "cpu", "--shapes", "tiny",
                          "--parts", "bw,step,memory,demo", "--demo-shape", "tiny-hybrid", "--reps", "1",
                          "--gen", "12", "--bw-gb", "0.05", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bandwidth"]["read"]["median"] > 0 and data["bandwidth"]["copy"]["median"] > 0
    rows = {(r["suite"], r["metric"].split(",")[0]): r for r in data["rows"]}
    assert set(rows) == {("gpu_step", "decode batch 1 (service)"), ("gpu_step", "fraction of read bandwidth (service)"),
                         ("memory", "peak"), ("memory", "cold TTFT"), ("demo", "peak"), ("demo", "TTFT"),
                         ("demo", "decode")}
    for row in rows.values():
        assert row["ours"] > 0 and row["baseline"] > 0, row
    step = rows[("gpu_step", "decode batch 1 (service)")]["extra"]
    assert step["graph_ops"]["ours"]["total"] > 0 and min(step["step_ms"]["ours_step"]) > 0
    parts = rows[("memory", "peak")]["extra"]["parts_gb"]
    assert {"mlx", "ours_all", "ours_chunk2048_all", "ours_chunk1024_all", "ours_before_all"} == set(parts) and parts["mlx"]["kv"] > 0
    assert "streamed text == final text: True" in rows[("demo", "peak")]["notes"]


@pytest.mark.slow  # seconds of compute by design: the second tier
@pytest.mark.fast
def test_protocols_bench_measures_every_adapter_against_chat_completions(tmp_path):
    """`python -m bench.protocols` runs end to end on the tiny model: for each adapter
    (/v1/messages, /v1/responses, /api/chat) a time to first token and a decode rate against
    /v1/chat/completions', over the same greedy answer (the same text, token for token)."""
    out = tmp_path / "protocols.json"
    run = subprocess.run([sys.executable, "-m", "bench.protocols", "--reps", "1", "--gen", "8",
                          "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["metric"] for r in rows) == sorted(
        f"{kind} {path}" for kind in ("TTFT", "decode")
        for path in ("/v1/messages", "/v1/responses", "/api/chat"))
    for row in rows:
        assert row["shape"] == "tiny" and row["baseline_name"] == "/v1/chat/completions"
        assert row["ours"] > 0 and row["baseline"] > 0 and row["ratio"] > 0, row
        assert row["extra"]["same_text_as_chat"] is True, row
        assert row["extra"]["tokens"] == [8], row


@pytest.mark.fast
def test_concurrency_step_measures_streams_interference_cache_ops_and_mixed_cost(tmp_path):
    """`python -m bench.concurrency_step --shapes`, the device run for issue 33, runs every part
    end to end on the tiny shape: streams against batch_generate with host ms per step, the gaps
    of running streams while a long prompt prefills (mixed steps, and with them off) against
    their steady gaps with the prompt's TTFT against an idle engine's, the cache join/leave cost,
    the mixed-step cost model and the matmul rate by rows."""
    out = tmp_path / "streams.json"
    run = subprocess.run([sys.executable, "-m", "bench.concurrency_step", "--shapes", "tiny",
                          "--device", "cpu", "--counts", "1,2", "--streams", "2", "--prompt", "16",
                          "--gen", "12", "--reps", "1", "--long-prompt", "120",
                          "--budgets", "chunk,16,alt16", "--cache-rows", "2", "--chunks", "16",
                          "--parts", "streams,interfere,cache,mixcost,matmul", "--matmul-rows", "1,4",
                          "--matmul-dim", "64", "--matmul-layers", "2", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    matmul, result = json.loads(out.read_text())["results"]
    assert [r["rows"] for r in matmul["chain"]] == [1, 4] and min(r["ms"]["mlx"] for r in matmul["chain"]) > 0
    assert matmul["check_ok"] and {r["rows"] for r in matmul["check"]} >= {1, 2, 8, 13, 32}
    assert [r["streams"] for r in result["streams"]] == [1, 2]
    for row in result["streams"]:
        assert min(row["median_tps"].values()) > 0 and min(row["median_host_ms_per_step"].values()) > 0
    inter = result["interfere"]
    assert set(inter["summary"]) == {"chunk", "16", "alt16"} and inter["idle_ttft_s"] > 0
    assert inter["runs"]["budget_16"][0]["mixed_steps"] and not inter["runs"]["budget_alt16"][0]["mixed_steps"]
    for s in inter["summary"].values():
        assert s["ttft_s"] > 0 and s["during_p95"] > 0 and s["steady_p95"] > 0
    [cache] = result["cache"]
    assert cache["rows"] == 2 and cache["extend_then_filter_ms"] > 0 and cache["decode_step_ms"] > 0
    assert min(cache["join_ms"].values()) > 0 and min(cache["join_long_ms"].values()) > 0
    [mix] = result["mixcost"]
    assert mix["mixed_ms"] > 0 and mix["alternating_ms"] > 0


@pytest.mark.fast
def test_the_prefill_kernel_group_times_each_quantized_product_both_ways():
    """`bench.gpu_step --parts kernels --kernel-groups prefill`: on a 4-bit model in the GPU
    layout, each decoder product of a prompt chunk (q/k/v, o, gate/up, down) on MLX's quantized
    product and on the dense path, the dense path's output within bf16 rounding of MLX's, and the
    chunk's attention under both masks."""
    import dataclasses

    import mlx.core as mx

    from bench import gpu_step
    from bench.shapes import SHAPES, build_module
    from engine.kernels.gpu_layout import to_gpu_layout

    model = to_gpu_layout(build_module(dataclasses.replace(SHAPES["tiny"], bits=4), dtype=mx.bfloat16, seed=1))
    rows = gpu_step._prefill_products(model.model, "tiny", m=64)
    products = [r for r in rows if r.unit == "TFLOP/s"]
    assert [r.metric.split(",")[0] for r in products] == list(gpu_step.PREFILL_PRODUCTS)
    for r in products:
        assert r.ours > 0 and r.baseline > 0 and r.extra["predequantized"] > 0 and r.extra["rel"] < 5e-2, r
    [attention] = [r for r in rows if r.unit == "ms"]
    assert attention.ours > 0 and set(attention.extra) == {"causal", "boolean"}
