"""The CUDA kernels of the one-token decode step (engine/kernels/fused_cuda.py) compile as MLX would
compile them, here, without a GPU: each kernel the step launches is recorded on the CPU (a stand-in
for `mx.fast.cuda_kernel` that keeps the source, the inputs' dtypes and the template arguments, and
returns zeros), its source written out the way MLX's CUDA backend writes a custom kernel
(mlx/backend/cuda/custom_kernel.cpp `build_kernel`: each input `const <its dtype>*`, each output
`<dtype>*`, the template arguments as `constexpr` / `using` lines before the body), and nvcc
compiles it for sm_90 (bench/cuda_source.py records them; `python -m bench.cuda_source` reports
their SASS). A kernel that does not compile would fail the first decode step of every request on
an NVIDIA GPU; this finds it before a device call. Skipped where nvcc is missing."""

import shutil
import subprocess

import pytest

from bench import cuda_source

NVCC = shutil.which("nvcc")
pytestmark = [pytest.mark.skipif(NVCC is None, reason="nvcc is not installed"), pytest.mark.timeout(300)]


def test_every_kernel_the_decode_step_launches_compiles(tmp_path):
    sources = cuda_source.record()  # the step's kernels, the batched step's, the bench's variants
    assert len(sources) >= 20
    # one translation unit (the device code is included once): one nvcc run, to PTX (what NVRTC
    # makes of it)
    unit = tmp_path / "kernels.cu"
    unit.write_text(cuda_source.translation_unit(sources))
    out = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-ptx", "-diag-suppress", "128,177",
                          "-o", str(tmp_path / "kernels.ptx"), str(unit)], capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    assert out.stdout.count("error") == 0
