"""Every CUDA kernel mlxchat's GPU decode launches, compiled here by nvcc for sm_90, without a GPU.

    python -m bench.cuda_source [--arch sm_90] [--out DIR] [--kernel SUBSTRING]

Each kernel is recorded on the CPU: a stand-in for `mx.fast.cuda_kernel` keeps the source, the
inputs' dtypes and the template arguments, and returns zeros. Its source is then written out the
way MLX's CUDA backend writes a custom kernel (mlx/backend/cuda/custom_kernel.cpp `build_kernel`:
each input `const <its dtype>*`, each output `<dtype>*`, the template arguments as `constexpr` /
`using` lines before the body). The kernels recorded are:
- the one-token step of llama, qwen2 and qwen3 (bf16 and fp16, dense, 4- and 8-bit), exact and on
  int8 activations, with the bench's variants;
- the batched step's attention and its 4-bit products of 2-32 rows.

tests/test_cuda_source.py compiles them to PTX, so a kernel that would not compile fails there
and not on the device. This command compiles them to SASS (with the CUDA toolkit's `cuobjdump`,
or `CUOBJDUMP`) and prints, for each kernel:
- its registers and spills;
- its SASS instruction count;
- its collective code (`WARPSYNC.COLLECTIVE`: shuffles nvcc could not prove converged);
- how many of its 128-bit global loads it issues before its last barrier (loads ptxas moved past
  a barrier wait for it).
These are the static facts behind a kernel's occupancy and latency, checked before spending device
time.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import common

CTYPE = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.uint32: "uint32_t",
         mx.int32: "int32_t"}
PRELUDE = "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cstdint>\n#include <cooperative_groups.h>\n"
# a model the kernels take (head dim 64, 16-bit): llama (no q/k norms, RoPE's frequencies only),
# qwen2 (projection biases), qwen3 (q/k norms), in bf16 and fp16, dense and 4- and 8-bit
WIDE = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-5,
        "vocab_size": 49152, "rope_theta": 10000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": False}
KINDS = [("llama", None, mx.bfloat16), ("qwen2", None, mx.float16), ("qwen3", None, mx.bfloat16),
         ("llama", 4, mx.bfloat16), ("qwen3", 4, mx.float16), ("qwen3", 8, mx.bfloat16)]


class Recorder:
    """Stands in for `mx.fast.cuda_kernel`: every launch's kernel source as MLX would write it
    (`sources`: one per kernel and template, in launch order)."""

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
                # each kernel's header in force for it alone, as in MLX's one compilation a kernel
                # (a header may redefine __global__: fused_cuda._kernel's bounds)
                self.sources[key] = (
                    f'#pragma push_macro("__global__")\n{header}\nnamespace mlx::core::cu {{\n'
                    f"namespace cg = cooperative_groups;\n"
                    f"__global__ void kernel_{len(self.sources)}(\n    {signature}\n}}\n}}\n"
                    f'#pragma pop_macro("__global__")\n')
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return launch


def record() -> dict[str, str]:
    """The sources of every kernel the GPU decode launches (see the module's docstring), recorded
    with the Recorder standing in for `mx.fast.cuda_kernel` (restored after)."""
    from engine.kernels import fused_cuda

    recorder = Recorder()
    saved = fused_cuda.mx.fast.cuda_kernel, dict(fused_cuda._KERNELS), list(fused_cuda._HEADER)
    fused_cuda.mx.fast.cuda_kernel = recorder
    fused_cuda._KERNELS.clear()
    fused_cuda._HEADER[:] = [f'#include "{fused_cuda.DEVICE_CODE}"\n']
    try:
        _launch_all()
    finally:
        fused_cuda.mx.fast.cuda_kernel = saved[0]
        fused_cuda._KERNELS.clear()
        fused_cuda._KERNELS.update(saved[1])
        fused_cuda._HEADER[:] = saved[2]
    return recorder.sources


def _launch_all() -> None:
    """Launch each kernel once per variant (with `mx.fast.cuda_kernel` stood in for: see `record`)."""
    from engine.kernels import batch_attention, decode_step, fused_cuda, qmm_rows_cuda
    from engine.kernels.gpu_layout import to_gpu_layout

    from .shapes import Shape, build_module

    for kind, bits, dtype in KINDS:
        model = to_gpu_layout(build_module(Shape(kind, {**WIDE, "model_type": kind}, bits=bits), dtype=dtype, seed=1))
        program = decode_step.DecodeProgram.build(model, fused_cuda)
        if program is None:
            raise RuntimeError(f"no decode program for {kind}, {bits} bits, {dtype}")
        layer = program.layers[0]
        kv = [mx.zeros((1, layer.kv_heads, 1024, layer.head_dim), dtype) for _ in range(2 * len(program.layers))]
        program._forward(mx.array([[3]]), mx.array([5], dtype=mx.int32), *kv)
        q = program.layers[0].o
        for variant in ({"prefetch": False}, {"prefetch": 2}, {"rows": 1, "unroll": 8},  # the bench's sweep
                        {"ahead": ((q.w, 0, 4096),)}):  # an L2 prefetch
            fused_cuda.matvec(mx.zeros((1, 1, q.inputs), dtype), q.w, q.scales, q.biases, q.bits,
                              q.group_size, 1, mx.zeros((q.w.shape[0],), dtype), **variant)
        fused_cuda.attention(layer, mx.zeros((1, 1, layer.qkv.w.shape[0]), dtype), mx.array([5], dtype=mx.int32),
                             kv[0], kv[1], split_keys=32, ahead=((q.w, 0, 4096),))  # fewer splits, a prefetch
        if bits in (4, 8):  # the int8-activation products (--int8-activations): every product and the head
            int8 = decode_step.DecodeProgram.build(model, fused_cuda, int8=True)
            int8._forward(mx.array([[3]]), mx.array([5], dtype=mx.int32), *kv)
            q = int8.layers[0].gate_up
            fused_cuda.qdot(mx.zeros((1, 1, q.inputs), dtype), q.w, q.scales, q.biases, q.bits, q.group_size, 2,
                            norm=(int8.layers[0].norm_post, 1e-5), rows=1, unroll=8)  # the bench's sweep
        if bits == 4:  # the tensor-core variant (MLXCHAT_CUDA_MV=mma); the folded one (=fold), bounded
            q = program.layers[0].gate_up
            with common.environ({fused_cuda.MV_SWITCH: "fold", fused_cuda.BLOCKS_SWITCH: "3"}):
                fused_cuda.matvec(mx.zeros((1, 1, q.inputs), dtype), q.w, q.scales, q.biases, q.bits, q.group_size,
                                  2, norm=(program.layers[0].norm_post, 1e-5), rows=2)
            fused_cuda.qmma4(mx.zeros((1, 1, q.inputs), dtype), q.w, q.scales, q.biases, q.group_size, 2,
                             norm=(program.layers[0].norm_post, 1e-5))
    for rows, heads, kv_heads, dim, dtype in ((3, 8, 2, 64, mx.bfloat16), (40, 32, 8, 128, mx.float16)):
        # a batched step's attention: split (3 rows, then the combine) and not (40 rows)
        buffers = [mx.zeros((rows + 1, kv_heads, 256, dim), dtype) for _ in range(2)]
        batch_attention.attend_rows(mx.zeros((rows, heads, 1, dim), dtype), *buffers, mx.zeros((rows,), mx.int32),
                                    mx.ones((rows,), mx.int32), dim ** -0.5)
        for norm in (True, False):  # and the same step's one attention call (norms, RoPE, the new column)
            layer = batch_attention._random_layer(heads, kv_heads, dim, norm, dtype, mx.random.key(0))
            cache = batch_attention._slot_cache(*buffers, [0] * rows, 1)
            batch_attention.attention_rows(layer, mx.zeros((rows, 1, (heads + 2 * kv_heads) * dim), dtype), cache)
    for m, dtype in ((2, mx.bfloat16), (9, mx.float16), (32, mx.bfloat16)):  # a batched step's 4-bit products
        for gs in (64, 128):
            w, scales, biases = mx.quantize(mx.zeros((48, 512)), group_size=gs, bits=4)
            qmm_rows_cuda.qmm4_rows(mx.zeros((m, 1, 512), dtype), w, scales.astype(dtype), biases.astype(dtype), gs)
    qmm_rows_cuda.qmm4_rows(mx.zeros((32, 1, 512), mx.bfloat16), w, scales.astype(mx.bfloat16),  # the bench's sweep
                            biases.astype(mx.bfloat16), 128, tiles=4, unroll=1)
    qmm_rows_cuda.qmm4_rows(mx.zeros((9, 1, 512), mx.float16), w, scales.astype(mx.float16),  # plus a residual
                            biases.astype(mx.float16), 128, residual=mx.zeros((9, 1, 48), mx.float16))


def translation_unit(sources: dict[str, str]) -> str:
    """One translation unit of all the kernels (the device code included once)."""
    return PRELUDE + "\n".join(sources.values())


def sass_report(sources: dict[str, str], out: Path, arch: str = "sm_90") -> list[dict[str, Any]]:
    """Compile the kernels to a cubin in `out` and read each one's registers, spills and SASS:
    one dict a kernel, in launch order."""
    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if shutil.which("nvcc") is None or cuobjdump is None:
        raise RuntimeError("needs nvcc and cuobjdump (the CUDA toolkit's; or CUOBJDUMP=path)")
    unit, cubin = out / "kernels.cu", out / "kernels.cubin"
    unit.write_text(translation_unit(sources))
    p = subprocess.run(["nvcc", f"-arch={arch}", "-std=c++17", "-cubin", "-Xptxas", "-v", "-diag-suppress", "128,177",
                        "-o", str(cubin), str(unit)], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(p.stderr[-4000:])
    usage: dict[str, dict[str, int]] = {}
    current = None
    for line in p.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            current = m.group(1)
        elif current and (m := re.search(r"(\d+) bytes spill stores", line)):
            usage.setdefault(current, {})["spill_bytes"] = int(m.group(1))
        elif current and (m := re.search(r"Used (\d+) registers", line)):
            usage.setdefault(current, {})["registers"] = int(m.group(1))
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    names = list(sources)
    rows = []
    for body in re.split(r"\n\s+Function : ", sass)[1:]:
        mangled = body.split("\n", 1)[0].strip()
        index = int(re.search(r"kernel_(\d+)", mangled).group(1))
        ops = [m.group(2) for m in re.finditer(r"\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", body)]
        barriers = [i for i, op in enumerate(ops) if op.startswith("BAR")]
        loads = [i for i, op in enumerate(ops) if op.startswith("LDG.E.128")]
        counts = collections.Counter(ops)
        rows.append({"index": index, "kernel": names[index].split("(")[0], "instructions": len(ops),
                     "collective": counts["WARPSYNC.COLLECTIVE"], "loads_128": len(loads),
                     "loads_before_barrier": sum(1 for i in loads if barriers and i < barriers[-1]),
                     **usage.get(mangled, {})})
    return sorted(rows, key=lambda r: r["index"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", help="where the .cu and .cubin are kept (default: a temporary folder)")
    ap.add_argument("--kernel", default="", help="only kernels whose name holds this")
    a = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    sources = record()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        rows = sass_report(sources, out, a.arch)
    print(f"{'kernel':88s} {'regs':>5s} {'spill':>5s} {'SASS':>6s} {'coll':>5s} {'LDG128 before barrier':>22s}")
    for r in rows:
        if a.kernel in r["kernel"]:
            print(f"{r['kernel'][:88]:88s} {r.get('registers', 0):5d} {r.get('spill_bytes', 0):5d} "
                  f"{r['instructions']:6d} {r['collective']:5d} {r['loads_before_barrier']:10d} of {r['loads_128']:<4d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
