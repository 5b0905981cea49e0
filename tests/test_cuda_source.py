"""The CUDA kernels of the one-token decode step (engine/kernels/fused_cuda.py) compile as MLX would
compile them, here, without a GPU: each kernel the step launches is recorded on the CPU (a stand-in
for `mx.fast.cuda_kernel` that keeps the source, the inputs' dtypes and the template arguments, and
returns zeros), its source written out the way MLX's CUDA backend writes a custom kernel
(mlx/backend/cuda/custom_kernel.cpp `build_kernel`: each input `const <its dtype>*`, each output
`<dtype>*`, the template arguments as `constexpr` / `using` lines before the body), and nvcc
compiles it for sm_90. A kernel that does not compile would fail the first decode step of every
request on an NVIDIA GPU; this finds it before a device call. Skipped where nvcc is missing."""

import shutil
import subprocess

import mlx.core as mx
import pytest

from bench.shapes import Shape, build_module
from engine.kernels import batch_attention, decode_step, fused_cuda, qmm_rows_cuda
from engine.kernels.gpu_layout import to_gpu_layout
from tiny_models import LLAMA

NVCC = shutil.which("nvcc")
pytestmark = [pytest.mark.skipif(NVCC is None, reason="nvcc is not installed"), pytest.mark.timeout(300)]

CTYPE = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.uint32: "uint32_t",
         mx.int32: "int32_t"}
# a model the kernels take (head dim 64, 16-bit): llama (no q/k norms, RoPE's frequencies only),
# qwen2 (projection biases), qwen3 (q/k norms), in bf16 and fp16, dense and 4- and 8-bit
WIDE = {**LLAMA, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64}
KINDS = [("llama", None, mx.bfloat16), ("qwen2", None, mx.float16), ("qwen3", None, mx.bfloat16),
         ("llama", 4, mx.bfloat16), ("qwen3", 4, mx.float16), ("qwen3", 8, mx.bfloat16)]


class Recorder:
    """Stands in for `mx.fast.cuda_kernel`: every launch's kernel source as MLX would write it."""

    def __init__(self):
        self.sources: dict[str, str] = {}

    def __call__(self, name, input_names, output_names, source, header="", **_):
        def launch(inputs, output_shapes, output_dtypes, template=(), **__):
            args = "_".join(str(v) for _, v in template)
            lines = [f"const {CTYPE[a.dtype]}* {n}" for n, a in zip(input_names, inputs)]
            lines += [f"{CTYPE[d]}* {n}" for n, d in zip(output_names, output_dtypes)]
            consts = []
            for key, value in template:
                if isinstance(value, bool):
                    consts.append(f"  constexpr bool {key} = {'true' if value else 'false'};")
                elif isinstance(value, int):
                    consts.append(f"  constexpr int {key} = {value};")
                else:
                    consts.append(f"  using {key} = {CTYPE[value]};")
            signature = ",\n    ".join(lines) + ") {\n" + "\n".join(consts) + "\n" + source
            key = f"{name}_{args}({', '.join(lines)})"
            if key not in self.sources:  # each kernel named as MLX names it, made unique here
                self.sources[key] = (
                    f"{header}\nnamespace mlx::core::cu {{\nnamespace cg = cooperative_groups;\n"
                    f"__global__ void kernel_{len(self.sources)}(\n    {signature}\n}}\n}}\n")
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return launch


def test_every_kernel_the_decode_step_launches_compiles(tmp_path, monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(fused_cuda.mx.fast, "cuda_kernel", recorder)
    monkeypatch.setattr(fused_cuda, "_KERNELS", {})
    monkeypatch.setattr(fused_cuda, "_HEADER", [f'#include "{fused_cuda.DEVICE_CODE}"\n'])
    for kind, bits, dtype in KINDS:
        model = to_gpu_layout(build_module(Shape(kind, {**WIDE, "model_type": kind}, bits=bits),
                                           dtype=dtype, seed=1))
        program = decode_step.DecodeProgram.build(model, fused_cuda)
        assert program is not None, (kind, bits, dtype)
        layer = program.layers[0]
        kv = [mx.zeros((1, layer.kv_heads, 1024, layer.head_dim), dtype) for _ in range(2 * len(program.layers))]
        program._forward(mx.array([[3]]), mx.array([5], dtype=mx.int32), *kv)
        for variant in ({"prefetch": False}, {"prefetch": 2}, {"rows": 1, "unroll": 8}):  # the bench's sweep
            q = program.layers[0].o
            fused_cuda.matvec(mx.zeros((1, 1, q.inputs), dtype), q.w, q.scales, q.biases, q.bits,
                              q.group_size, 1, mx.zeros((q.w.shape[0],), dtype), **variant)
        if bits in (4, 8):  # the int8-activation products (--int8-activations): every product and the head
            int8 = decode_step.DecodeProgram.build(model, fused_cuda, int8=True)
            int8._forward(mx.array([[3]]), mx.array([5], dtype=mx.int32), *kv)
            q = int8.layers[0].gate_up
            fused_cuda.qdot(mx.zeros((1, 1, q.inputs), dtype), q.w, q.scales, q.biases, q.bits, q.group_size, 2,
                            norm=(int8.layers[0].norm_post, 1e-5), rows=1, unroll=8)  # the bench's sweep
        if bits == 4:  # the tensor-core variant (MLXCHAT_CUDA_MV=mma)
            q = program.layers[0].gate_up
            fused_cuda.qmma4(mx.zeros((1, 1, q.inputs), dtype), q.w, q.scales, q.biases, q.group_size, 2,
                             norm=(program.layers[0].norm_post, 1e-5))
    for rows, heads, kv, dim, dtype in ((3, 8, 2, 64, mx.bfloat16), (40, 32, 8, 128, mx.float16)):
        # a batched step's attention: split (3 rows, then the combine) and not (40 rows)
        batch_attention.attend_rows(mx.zeros((rows, heads, 1, dim), dtype), mx.zeros((rows + 1, kv, 256, dim), dtype),
                                    mx.zeros((rows + 1, kv, 256, dim), dtype), mx.zeros((rows,), mx.int32),
                                    mx.ones((rows,), mx.int32), dim ** -0.5)
        for norm in (True, False):  # and the same step's one attention call (norms, RoPE, the new column)
            layer = batch_attention._random_layer(heads, kv, dim, norm, dtype, mx.random.key(0))
            cache = batch_attention._slot_cache(mx.zeros((rows + 1, kv, 256, dim), dtype),
                                                mx.zeros((rows + 1, kv, 256, dim), dtype), [0] * rows, 1)
            batch_attention.attention_rows(layer, mx.zeros((rows, 1, (heads + 2 * kv) * dim), dtype), cache)
    for m, dtype in ((2, mx.bfloat16), (9, mx.float16), (32, mx.bfloat16)):  # a batched step's 4-bit products
        for gs in (64, 128):
            w, scales, biases = mx.quantize(mx.zeros((48, 512)), group_size=gs, bits=4)
            qmm_rows_cuda.qmm4_rows(mx.zeros((m, 1, 512), dtype), w, scales.astype(dtype), biases.astype(dtype), gs)
    qmm_rows_cuda.qmm4_rows(mx.zeros((32, 1, 512), mx.bfloat16), w, scales.astype(mx.bfloat16),  # the bench's sweep
                            biases.astype(mx.bfloat16), 128, tiles=4, unroll=1)
    qmm_rows_cuda.qmm4_rows(mx.zeros((9, 1, 512), mx.float16), w, scales.astype(mx.float16),  # plus a residual
                            biases.astype(mx.float16), 128, residual=mx.zeros((9, 1, 48), mx.float16))
    assert len(recorder.sources) >= 20
    prelude = ("#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cstdint>\n"
               "#include <cooperative_groups.h>\n")
    # one translation unit (the device code is included once): one nvcc run, to PTX (what NVRTC
    # makes of it)
    unit = tmp_path / "kernels.cu"
    unit.write_text(prelude + "\n".join(recorder.sources.values()))
    out = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-ptx", "-diag-suppress", "128,177",
                          "-o", str(tmp_path / "kernels.ptx"), str(unit)], capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    assert out.stdout.count("error") == 0
