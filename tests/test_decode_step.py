"""engine/kernels/decode_step.py, the compiled one-token decode step, run on the CPU with
engine/kernels/fused_ref.py (the fused kernels' computation in MLX ops): its greedy tokens equal
mlx-lm's own generation for llama, qwen2 (projection biases), qwen3 (q/k norms) and 4- and 8-bit
weights, across buffer growths, after another writer touched the cache, and with the caches
mlx-lm's update would leave; and the shapes the CUDA kernels take are told apart from the ones
they do not. The CUDA kernels themselves are checked against the same reference on a GPU
(`python -m bench.gpu_step --parts kernels`)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from bench.shapes import Shape, build_module
from engine.kernels import decode_step, fused_cuda, fused_ref
from engine.kernels import cache_variant
from engine.kernels.gpu_layout import to_gpu_layout
from engine.kernels.layout import int8_activations_of
from tiny_models import LLAMA

pytestmark = pytest.mark.fast

CONFIGS = {
    "llama": (LLAMA, None),
    "llama-traditional-rope": ({**LLAMA, "rope_traditional": True}, None),
    "qwen2": ({**LLAMA, "model_type": "qwen2"}, None),
    "qwen3": ({**LLAMA, "model_type": "qwen3"}, None),
    "llama-4bit": (LLAMA, 4),
    "qwen3-8bit": ({**LLAMA, "model_type": "qwen3"}, 8),
}
PROMPT = [5, 17, 300, 42, 9, 1000, 77, 3, 12, 8]


def models(kind: str, cap_step: int = 8):
    """(mlx-lm's model, the same weights in the GPU layout with a DecodeProgram on the reference
    kernels), fp32."""
    config, bits = CONFIGS[kind]
    shape = Shape(kind, config, bits=bits)
    fused = to_gpu_layout(build_module(shape, dtype=None, seed=3))
    assert decode_step.attach(fused, fused_ref, cap_step=cap_step)
    return build_module(shape, dtype=None, seed=3), fused


def greedy(model, n: int, prompt=PROMPT) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1))
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("kind", CONFIGS)
def test_greedy_tokens_equal_mlx_lm_across_buffer_growths(kind):
    plain, fused = models(kind)
    calls, positions = [], []
    program = fused.decode_program
    original = program._step

    def step(*a):
        calls.append(a[1][0].item())
        out = original(*a)
        positions.append((a[1], out[-1]))
        return out

    program._step = step
    assert greedy(fused, 30) == greedy(plain, 30)
    # every one-token step ran the program at its own position: mlx-lm feeds the prompt's last
    # token as a step, and computes one step ahead of the tokens it yields
    assert calls == list(range(len(PROMPT) - 1, len(PROMPT) - 1 + len(calls))) and len(calls) >= 30
    # after the first, each step's position is the array the step before it made on the device
    assert all(positions[i][0] is positions[i - 1][1] for i in range(1, len(positions)))


def test_cache_holds_what_mlx_lm_update_leaves_and_other_writers_are_taken_over():
    plain, fused = models("qwen3")
    caches = make_prompt_cache(plain), make_prompt_cache(fused)
    a = b = None
    feeds = [PROMPT, [11], [4000], [7], [1, 2, 3], [99], [12], [13]]  # a 3-token call between steps
    for feed in feeds:
        x = mx.array([feed])
        a, b = plain(x, cache=caches[0]), fused(x, cache=caches[1])
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()
    for c0, c1 in zip(*caches):
        assert c0.offset == c1.offset == len(PROMPT) + 9
        for x0, x1 in ((c0.keys, c1.keys), (c0.values, c1.values)):  # the positions held
            n = c0.offset
            assert mx.allclose(x0[..., :n, :], x1[..., :n, :], rtol=1e-5, atol=1e-5).item()
    assert all(decode_step._owned(c) for c in caches[1])


def test_a_snapshot_taken_between_steps_keeps_its_positions():
    """The prefix cache snapshots a cache between steps (a compact copy) and later restores it as
    a view; decoding on from the restored cache takes the buffers over (a copy) before writing."""
    _, fused = models("llama")
    cache = make_prompt_cache(fused)
    fused(mx.array([PROMPT]), cache=cache)
    for t in (11, 12, 13):
        fused(mx.array([[t]]), cache=cache)
    snapshot = [KVCache.from_state((mx.array(c.keys[..., :c.offset, :]), mx.array(c.values[..., :c.offset, :]), c.offset))
                for c in cache]
    kept = [mx.array(c.keys) for c in snapshot]
    restored = [KVCache.from_state((c.keys[..., :c.offset, :], c.values[..., :c.offset, :], c.offset)) for c in snapshot]
    for t in (21, 22):
        fused(mx.array([[t]]), cache=restored)
    assert all(mx.array_equal(c.keys, k).item() for c, k in zip(snapshot, kept))
    assert restored[0].offset == snapshot[0].offset + 2


def test_other_calls_run_the_models_own_forward():
    _, fused = models("llama")
    program = fused.decode_program
    assert not program.accepts(mx.array([[1, 2]]), make_prompt_cache(fused))  # a prompt chunk
    assert not program.accepts(mx.array([[1], [2]]), make_prompt_cache(fused))  # two rows
    cache = make_prompt_cache(fused)
    assert not program.accepts(mx.array([[1]]), cache)  # nothing prefilled yet
    fused(mx.array([PROMPT]), cache=cache)
    assert program.accepts(mx.array([[1]]), cache)


def test_cuda_kernels_take_16_bit_models_with_their_head_dims():
    """What fused_cuda.py's kernels take is decided on the model's shapes (no GPU needed to tell):
    16-bit activations and head dims of 64/128/256; fp32 and head dim 16 are left to mlx-lm."""
    wide = {**LLAMA, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    for bits in (None, 4, 8):
        model = to_gpu_layout(build_module(Shape("w", wide, bits=bits), dtype=mx.bfloat16, seed=1))
        assert decode_step.DecodeProgram.build(model, fused_cuda) is not None
    fp32 = to_gpu_layout(build_module(Shape("w", wide), dtype=None, seed=1))
    assert decode_step.DecodeProgram.build(fp32, fused_cuda) is None
    narrow = to_gpu_layout(build_module(Shape("n", LLAMA), dtype=mx.bfloat16, seed=1))
    assert decode_step.DecodeProgram.build(narrow, fused_cuda) is None
    assert decode_step.DecodeProgram.build(narrow, fused_ref) is not None


def test_the_next_kernels_first_rows_are_what_it_prefetches(monkeypatch):
    """`MLXCHAT_CUDA_AHEAD` (MB) sets how much of the next product each kernel prefetches into L2:
    whole rows of W, its scales and biases, from the start (of each half for SwiGLU, whose warps
    read a gate row and its up row together); the same program gives the same tokens with it on
    (on the CPU nothing is prefetched: the ranges are only handed to the kernels)."""
    _, fused = models("llama-4bit")
    layer = fused.decode_program.layers[0]
    p = layer.gate_up
    arrays = [p.w, p.scales, p.biases]
    whole = p.first_rows(sum(a.nbytes for a in arrays), swiglu=True)
    assert [(lo, n) for _, lo, n in whole] == [(lo, a.nbytes // 2) for a in arrays for lo in (0, a.nbytes // 2)]
    half = p.first_rows(sum(a.nbytes for a in arrays) // 2)
    rows = p.w.shape[0] // 2
    assert [(a is b, lo, n) for (a, lo, n), b in zip(half, arrays)] == [
        (True, 0, rows * b.nbytes // p.w.shape[0]) for b in arrays]
    assert p.first_rows(0) == ()
    monkeypatch.setenv(decode_step.AHEAD_SWITCH, "0.5")
    assert decode_step.ahead_bytes() == 2**19
    plain, ahead = models("llama-4bit")
    assert greedy(ahead, 6) == greedy(plain, 6)


@pytest.mark.parametrize("switch, attached", [("", {None, 4, 8}), ("1", {None, 4, 8}), ("0", set())])
def test_the_program_attaches_by_default_at_the_precisions_it_measured_faster(monkeypatch, switch, attached):
    """With MLXCHAT_CUDA_DECODE unset, the loader attaches the program to models of the precisions
    in DEFAULT_BITS (bf16, 8- and 4-bit: the H100 measured it faster than the model's own forward at
    each); =1 at every precision, =0 none. (On a GPU each attach also runs `check`; here it passes.)"""
    monkeypatch.setattr(decode_step.device, "backend", lambda: "cuda")
    monkeypatch.setenv(decode_step.SWITCH, switch)
    monkeypatch.setattr(decode_step, "check", lambda model, program, *a, **k: {"kept": True})
    wide = {**LLAMA, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    got = {bits for bits in (None, 4, 8)
           if decode_step.attach(to_gpu_layout(build_module(Shape("w", wide, bits=bits), dtype=mx.bfloat16, seed=1)))}
    assert got == attached and decode_step.DEFAULT_BITS == (4, 8, 16)


@pytest.mark.parametrize("group_size", [64, 128])
def test_tensor_core_kernels_fragment_layout_computes_the_product(group_size):
    """fused_cuda.emulate_qmma4 restates which nibbles and x values the 4-bit tensor-core kernel
    puts in which register of which mma (PTX's m16n8k16 layout) and how it scales each 64-wide
    chunk: with that mapping the sums are MLX's quantized product (fp32 rounding apart)."""
    import numpy as np

    mx.random.seed(0)
    w, scales, biases = mx.quantize(mx.random.normal((48, 512)) * 0.05, group_size=group_size, bits=4)
    x = mx.random.normal((512,))
    ref = mx.quantized_matmul(x[None], w, scales, biases, transpose=True, group_size=group_size, bits=4)[0]
    got = fused_cuda.emulate_qmma4(np.array(x), np.array(w), np.array(scales), np.array(biases), group_size)
    assert np.abs(got - np.array(ref)).max() <= 1e-4 * np.abs(np.array(ref)).max()


def kernels_with(**changes):
    """fused_ref.py with some of its functions replaced: kernels that fail, or compute wrongly."""
    import types

    module = types.ModuleType("changed_kernels")
    module.__dict__.update({k: v for k, v in vars(fused_ref).items() if not k.startswith("__")})
    module.__dict__.update(changes)
    return module


def broken_attention(*_):
    raise RuntimeError("no kernel image is available for execution on the device")


def wrong_attention(layer, qkv, pos, keys, values):
    out, keys, values = fused_ref.attention(layer, qkv, pos, keys, values)
    return out * 3, keys, values


@pytest.mark.parametrize("kernels,attached", [(fused_ref, True), (kernels_with(attention=broken_attention), False),
                                              (kernels_with(attention=wrong_attention), False)])
def test_the_loader_attaches_a_program_only_where_it_runs_and_agrees(kernels, attached, caplog):
    """The loader checks the program on the model before attaching it (decode_step.check): a kernel
    that fails on the device, or logits that part from the model's own, leave the model on its own
    forward with a warning saying why, and its tokens are mlx-lm's either way."""
    config, bits = CONFIGS["qwen3"]
    shape = Shape("qwen3", config, bits=bits)
    plain = build_module(shape, dtype=None, seed=3)
    model = to_gpu_layout(build_module(shape, dtype=None, seed=3))
    with caplog.at_level("WARNING", logger="engine.kernels.decode_step"):
        assert decode_step.attach(model, kernels, cap_step=8, checked=True) is attached
    assert hasattr(model, "decode_program") is attached
    assert ("one-token steps run the model's own forward" in caplog.text) is (not attached)
    assert greedy(model, 12) == greedy(plain, 12)


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activations_take_the_quantized_products_and_the_model_says_so(bits):
    """With `int8` (`--int8-activations`) the program's 4/8-bit products multiply int8 activations
    (fused_ref.int8_product here; fused_cuda.qdot on CUDA): its logits part from the model's own
    forward by a little, within the loader's gate, where the exact program's do not part at all;
    the model reports the choice (layout.int8_activations_of), so the prefix cache keeps its
    snapshots apart; a bf16 model has no product to take it."""
    shape = Shape("qwen3", {**LLAMA, "model_type": "qwen3"}, bits=bits)
    exact, lossy = (to_gpu_layout(build_module(shape, dtype=None, seed=3)) for _ in range(2))
    assert decode_step.attach(exact, fused_ref, cap_step=8, int8=False)
    assert decode_step.attach(lossy, fused_ref, cap_step=8, checked=True, int8=True)
    assert lossy.decode_program.int8 and not exact.decode_program.int8
    assert int8_activations_of(lossy) is True and int8_activations_of(exact) is None  # as on MLX's GPU path
    assert cache_variant(lossy) == {"activations": "int8"} and cache_variant(exact) == {}
    gate_exact = decode_step.check(exact, exact.decode_program)
    gate_lossy = decode_step.check(lossy, lossy.decode_program)
    assert gate_exact["rel_diff"] < 1e-6 < gate_lossy["rel_diff"] < decode_step.GATE, (gate_exact, gate_lossy)
    dense = to_gpu_layout(build_module(Shape("qwen3", {**LLAMA, "model_type": "qwen3"}), dtype=None, seed=3))
    assert decode_step.attach(dense, fused_ref, cap_step=8, int8=True) and not dense.decode_program.int8


def test_a_program_built_in_one_thread_steps_in_another():
    """MLX's streams are per thread: the arrays the program makes (the CUDA attention reads its
    counters, RoPE frequencies and parameters) are evaluated where it is built, so the scheduler's
    thread can step a model the loading thread built."""
    import threading

    plain, fused = models("qwen3")
    out: dict = {}

    def run():
        try:
            layer = fused.decode_program.layers[0]
            mx.eval(layer.counters + 1, layer.inv_freq * 2, layer.params * 2)
            out["tokens"] = greedy(fused, 8)
        except Exception as exc:  # noqa: BLE001 - reported below
            out["error"] = repr(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert "error" not in out, out
    assert out["tokens"] == greedy(plain, 8)


def test_the_folded_4bit_words_give_the_product_and_the_switches_build_that_kernel(monkeypatch):
    """MLXCHAT_CUDA_MV=fold: dot_word (cuda/fused_decode.cuh) moves each nibble q of a word to bits
    3-6 of its byte under bit 7 ((w << 3) & 0x78787878 | 0x80808080, and w >> 1 for the high
    nibbles) and byte-permutes it under 1.0f's top byte 0x3F: the float 1 + q / 16. Restated here
    in numpy, every nibble of random words comes out so, and 16 (sum((1 + q/16) x) - sum(x)) is the
    word's q . x. With MLXCHAT_CUDA_MV_BLOCKS=3 the step's 4-bit products are compiled folded under
    __launch_bounds__(128, 3) (MLX writes the declaration: the header redefines __global__), the
    SwiGLU one at 2 units a warp; the recorded sources are what nvcc compiles in test_cuda_source."""
    import numpy as np

    from bench.cuda_source import Recorder

    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=64, dtype=np.uint64).astype(np.uint32)
    lo = ((words << np.uint32(3)) & np.uint32(0x78787878)) | np.uint32(0x80808080)
    hi = ((words >> np.uint32(1)) & np.uint32(0x78787878)) | np.uint32(0x80808080)
    for byte in range(4):
        for placed, shift in ((lo, 0), (hi, 4)):
            # __byte_perm(placed, 0x3F000000, 0x7044 + (byte << 8)): bytes 0x3F, placed's `byte`, 0, 0
            bits = np.uint32(0x3F000000) | (((placed >> np.uint32(8 * byte)) & np.uint32(0xFF)) << np.uint32(16))
            q = (words >> np.uint32(8 * byte + shift)) & np.uint32(15)
            assert np.array_equal(bits.view(np.float32), 1 + q.astype(np.float32) / 16)
    q = rng.integers(0, 16, size=(64, 32)).astype(np.float32)
    x = np.array(mx.random.normal((64, 32)).astype(mx.bfloat16).astype(mx.float32))
    folded = 16 * (((1 + q / 16) * x).sum(1, dtype=np.float32) - x.sum(1, dtype=np.float32))
    assert np.allclose(folded, (q * x).sum(1), rtol=0, atol=1e-4 * np.abs(q * x).sum(1).max())

    recorder = Recorder()
    monkeypatch.setattr(fused_cuda.mx.fast, "cuda_kernel", recorder)
    monkeypatch.setattr(fused_cuda, "_KERNELS", {})
    monkeypatch.setenv(fused_cuda.MV_SWITCH, "fold")
    monkeypatch.setenv(fused_cuda.BLOCKS_SWITCH, "3")
    w, scales, biases = mx.quantize(mx.random.normal((1024, 256)), group_size=64, bits=4)
    fused_cuda.matvec(mx.zeros((1, 1, 256), mx.bfloat16), w, scales.astype(mx.bfloat16),
                      biases.astype(mx.bfloat16), 4, 64, 2, norm=(mx.ones((256,), mx.bfloat16), 1e-5))
    source = "".join(s for k, s in recorder.sources.items() if k.startswith("mlxchat_matvec_q_norm_b3_"))
    assert source.count("__global__ void") == 1 and "constexpr bool FOLD = true;" in source
    assert "constexpr int R = 2;" in source
    assert "#define __global__ __attribute__((global)) __launch_bounds__(128, 3)" in source
    monkeypatch.delenv(fused_cuda.BLOCKS_SWITCH)
    monkeypatch.delenv(fused_cuda.MV_SWITCH)
    fused_cuda.matvec(mx.zeros((1, 1, 256), mx.bfloat16), w, scales.astype(mx.bfloat16),
                      biases.astype(mx.bfloat16), 4, 64, 2)
    plain = [s for k, s in recorder.sources.items() if k.startswith("mlxchat_matvec_q_")][-1]
    assert "constexpr bool FOLD = false;" in plain and "__launch_bounds__" not in plain
