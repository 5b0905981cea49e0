"""Quantized GGUF tensors become MLX affine triples: Q4_0/Q4_1/Q8_0 repacked exactly, K-quants
requantized (Q4_K/Q5_K to 4 bits, Q6_K to 8, group size 32) within one step of the new grid
(max - min of the group over 2^bits - 1; `mx.quantize` keeps zero exact, which can cost more than
half a step) of llama.cpp's own dequantization (the `gguf` package's reference code)."""

import json

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from engine.loading.gguf import read_gguf
from engine.loading.registry import load_model

pytestmark = pytest.mark.fast

GROUP = 32
EXPECTED_BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8, Q.Q4_K: 4, Q.Q5_K: 4, Q.Q6_K: 8, Q.Q5_0: 8}


def _k_blocks(qtype: Q, rows: int, cols: int, rng) -> np.ndarray:
    """Random but valid K-quant blocks (every byte pattern is one), with modest fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    count = rows * cols // block
    raw = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    d = np.full(count, 0.002, np.float16).view(np.uint8).reshape(count, 2)
    if qtype == Q.Q6_K:
        raw[:, -2:] = d  # Q6_K keeps its scale last
    else:
        raw[:, 0:2] = d
        raw[:, 2:4] = np.full(count, 0.004, np.float16).view(np.uint8).reshape(count, 2)
    return raw.reshape(rows, cols // block * size)


def _raw(qtype: Q, rows: int, cols: int, rng) -> np.ndarray:
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return _k_blocks(qtype, rows, cols, rng)
    return quantize(rng.normal(size=(rows, cols)).astype(np.float32) * 0.05, qtype)


def _write(path, tensors: dict[str, tuple[np.ndarray, Q]], arch: str = "llama", meta=None) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    if meta:
        meta(writer)
    for name, (raw, qtype) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _dequantized(weights: dict[str, mx.array], stem: str) -> tuple[np.ndarray, int]:
    w, scales = weights[f"{stem}.weight"], weights[f"{stem}.scales"]
    bits = w.shape[-1] * 32 // (scales.shape[-1] * GROUP)
    out = mx.dequantize(w, scales, weights[f"{stem}.biases"], GROUP, bits)
    return np.array(out.astype(mx.float32)), bits


def test_legacy_quants_are_repacked_exactly_as_mlx_loads_them(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"{q.name}.weight": (_raw(q, 8, 256, rng), q) for q in (Q.Q4_0, Q.Q4_1, Q.Q8_0)}
    path = tmp_path / "legacy.gguf"
    _write(path, tensors)
    ours, _ = read_gguf(path)
    theirs = mx.load(str(path))
    assert set(ours) == set(theirs)
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and mx.array_equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0])
def test_k_quants_are_requantized_within_one_step(tmp_path, qtype):
    rng = np.random.default_rng(1)
    raw = _raw(qtype, 16, 512, rng)
    path = tmp_path / f"{qtype.name}.gguf"
    _write(path, {"t.weight": (raw, qtype)})
    weights, _ = read_gguf(path)
    ours, bits = _dequantized(weights, "t")
    assert bits == EXPECTED_BITS[qtype]
    reference = dequantize(raw, qtype)
    groups = reference.reshape(16, -1, GROUP)
    step = (groups.max(-1) - groups.min(-1)) / (2**bits - 1)
    # One step of the new grid, plus fp16 rounding of the scale and offset.
    bound = step + 1e-3 * np.abs(groups).max(-1) + 1e-6
    err = np.abs(ours.reshape(16, -1, GROUP) - groups).max(-1)
    assert (err <= bound).all()
    if qtype == Q.Q5_0:
        return  # kept at 8 bits: larger than the file, by design
    # Compact: the MLX arrays take about as much memory as the file's blocks.
    nbytes = sum(weights[f"t.{p}"].nbytes for p in ("weight", "scales", "biases"))
    assert nbytes <= 1.5 * raw.nbytes


def test_k_quant_model_converts_with_per_layer_bits_and_close_logits(tmp_path):
    """A Q4_K_M-style tiny llama: Q4_K mostly, Q6_K for attn_v and ffn_down, F32 norms."""
    rng = np.random.default_rng(2)
    hidden, inter, heads, vocab = 256, 512, 4, 320
    tensors: dict[str, tuple[np.ndarray, Q]] = {
        "token_embd.weight": (_raw(Q.Q6_K, vocab, hidden, rng), Q.Q6_K),
        "output_norm.weight": (np.ones(hidden, np.float32), Q.F32),
        "output.weight": (_raw(Q.Q6_K, vocab, hidden, rng), Q.Q6_K),
        "blk.0.attn_norm.weight": (np.ones(hidden, np.float32), Q.F32),
        "blk.0.ffn_norm.weight": (np.ones(hidden, np.float32), Q.F32),
    }
    for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", hidden, hidden),
                             ("attn_v", hidden, hidden), ("attn_output", hidden, hidden),
                             ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden),
                             ("ffn_down", hidden, inter)):
        qtype = Q.Q6_K if name in ("attn_v", "ffn_down") else Q.Q4_K
        tensors[f"blk.0.{name}.weight"] = (_raw(qtype, rows, cols, rng), qtype)

    def meta(w):
        w.add_block_count(1), w.add_embedding_length(hidden), w.add_feed_forward_length(inter)
        w.add_head_count(heads), w.add_head_count_kv(heads), w.add_context_length(512)
        w.add_layer_norm_rms_eps(1e-5), w.add_rope_freq_base(10000.0)
        w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default")
        w.add_token_list(["t", "0"] + [f"t{i}" for i in range(vocab - 2)])
        w.add_token_merges(["t 0"])
        w.add_eos_token_id(0)

    path = tmp_path / "tiny-q4_k_m.gguf"
    _write(path, tensors, meta=meta)
    lm = load_model(str(path))
    config = json.loads((lm.path / "config.json").read_text())
    q = config["quantization"]
    assert (q["group_size"], q["bits"]) == (32, 4)
    for module in ("model.embed_tokens", "lm_head", "model.layers.0.self_attn.v_proj",
                   "model.layers.0.mlp.down_proj"):
        assert q[module] == {"group_size": 32, "bits": 8}
    assert "model.layers.0.self_attn.q_proj" not in q  # the common 4 bits
    assert (lm.path / "model.safetensors").stat().st_size < 1.4 * path.stat().st_size

    # Reference: the same llama built from llama.cpp's own dequantization of every tensor.
    from mlx_lm.models import llama
    from engine.loading.gguf import _rename

    dense = {_rename(n): mx.array(dequantize(raw, qt) if qt != Q.F32 else raw)
             for n, (raw, qt) in tensors.items()}
    args = {k: v for k, v in config.items() if k != "quantization"}
    direct = llama.Model(llama.ModelArgs.from_dict(args))
    direct.load_weights(list(dense.items()))
    tokens = mx.array([[3, 17, 99, 250, 8, 1]])
    ours, theirs = lm.model(tokens).astype(mx.float32), direct(tokens)
    # Random K-quant bytes spread weights evenly over each block's range, the worst case for
    # requantizing; a misread block (wrong sub-block scale or order) is off by whole multiples.
    rel = (mx.abs(ours - theirs).max() / mx.abs(theirs).max()).item()
    assert rel < 0.1
