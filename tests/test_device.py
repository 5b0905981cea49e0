"""Device selection and memory budget, tested where CI runs: on a CPU with no GPU."""

import logging

import mlx.core as mx
import pytest

from engine import device
from engine.errors import EngineError

pytestmark = pytest.mark.fast


@pytest.fixture(autouse=True)
def restore_default_device():
    before = mx.default_device()
    yield
    mx.set_default_device(before)


def test_auto_picks_cpu_without_gpu_and_says_so(caplog):
    if device.gpu_available():
        pytest.skip("this machine has a GPU")
    with caplog.at_level(logging.WARNING, logger="engine.device"):
        chosen = device.select_device("auto")
    assert chosen.type == mx.DeviceType.cpu
    assert mx.default_device().type == mx.DeviceType.cpu
    assert any("running on the CPU" in r.getMessage() for r in caplog.records)


def test_cpu_override():
    assert device.select_device("cpu").type == mx.DeviceType.cpu
    assert device.backend() == "cpu"
    assert device.describe().startswith("cpu (")


def test_gpu_request_errors_clearly_without_gpu():
    if device.gpu_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(EngineError, match="--device gpu: no GPU is available"):
        device.select_device("gpu")


def test_unknown_device_rejected():
    with pytest.raises(EngineError, match="must be one of"):
        device.select_device("tpu")


def test_memory_budget_is_sane_on_cpu():
    device.select_device("cpu")
    total, source = device.memory_total()
    assert source == "MemAvailable" and total > 0
    budget = device.memory_budget(0.5)
    assert 0 < budget <= total
    assert device.memory_budget(0.25) <= budget
    assert device.memory_budget(1.0) >= budget
    with pytest.raises(ValueError):
        device.memory_budget(0)
    with pytest.raises(ValueError):
        device.memory_budget(1.5)


def test_gpu_memory_prefers_recommended_working_set(monkeypatch):
    info = {"device_name": "Fake GPU", "memory_size": 64 << 30,
            "max_recommended_working_set_size": 48 << 30}
    monkeypatch.setattr(device, "_info", lambda d: dict(info))
    gpu = mx.Device(mx.DeviceType.gpu)
    assert device.gpu_memory(gpu) == (48 << 30, "max_recommended_working_set_size")
    assert device.memory_budget(0.5, gpu) == 24 << 30
    del info["max_recommended_working_set_size"]
    info["total_memory"] = 1  # memory_size comes first
    assert device.gpu_memory(gpu) == (64 << 30, "memory_size")
    info.clear()
    info["total_memory"] = 140 << 30  # what MLX's CUDA backend reports
    assert device.gpu_memory(gpu) == (140 << 30, "total_memory")


def test_gpu_without_memory_info_falls_back_to_ram_with_a_log_line(monkeypatch, caplog):
    monkeypatch.setattr(device, "_info", lambda d: {})
    gpu = mx.Device(mx.DeviceType.gpu)
    with caplog.at_level(logging.WARNING, logger="engine.device"):
        total, source = device.memory_total(gpu)
    assert source == "MemAvailable" and total > 0
    assert any("no memory size" in r.getMessage() for r in caplog.records)


def test_report_fields():
    device.select_device("cpu")
    r = device.report()
    assert r["backend"] == "cpu" and r["memory_bytes"] > 0 and r["mlx"] == mx.__version__
