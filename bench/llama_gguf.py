"""The random-weight llamas (and qwen3s) of bench/decode.py as GGUF files, so llama.cpp runs the
same weights.

`write_gguf(folder, out)` writes an mlx-lm llama folder as a GGUF of llama.cpp's `llama`
architecture: every weight dequantized from MLX's affine layout (F32, or F16 for a file that is
only requantized), tensor names as llama.cpp's (the inverse of engine/loading/gguf_arch.py's
mapping), and q/k rows permuted as llama.cpp's `convert_hf_to_gguf.py` does (`LlamaModel.permute`):
mlx-lm's llama with `rope_traditional` false rotates the two halves of each head (Hugging Face's
RoPE), llama.cpp rotates interleaved pairs. The tokenizer metadata is copied from the bundled
SmolLM2 GGUF, whose vocabulary the bench folders use.

`quantize(src, dst, python)` has llama.cpp itself requantize such a file to Q4_0, in the llama.cpp
venv (`python` has llama_cpp importable). It is "pure" Q4_0: the tied embedding too, as the mlx-lm
folder is 4-bit everywhere (llama.cpp's default would make that tensor Q6_K). Q4_0 is symmetric
(one scale per 32 weights), where the folder is affine (scale and bias per 32), so llama.cpp's
weights are a re-rounding of ours, not the same numbers.

`random_gguf(folder, python)` is that Q4_0 file, cached next to the folder.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import numpy as np

from engine.loading.gguf_arch import LLAMA_LAYER, TOP_NAMES

_TO_GGUF_LAYER = {mlx: gguf for gguf, mlx in LLAMA_LAYER.items()}
_TO_GGUF_TOP = {mlx: gguf for gguf, mlx in TOP_NAMES.items()}

_QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
params.pure = True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def gguf_name(name: str) -> str:
    """An mlx-lm llama tensor name (`model.layers.3.self_attn.q_proj.weight`) as llama.cpp's."""
    stem, _, suffix = name.rpartition(".")
    if stem in _TO_GGUF_TOP:
        return f"{_TO_GGUF_TOP[stem]}.{suffix}"
    _, _, layer, module = stem.split(".", 3)  # model.layers.N.<module>
    return f"blk.{layer}.{_TO_GGUF_LAYER[module]}.{suffix}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from (half, pair) to (pair, half)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized(folder: Path) -> tuple[dict, list[tuple[str, tuple[int, ...]]], Iterator[np.ndarray]]:
    """The folder's config, its weights' names and shapes, and the weights in that order as float32
    numpy arrays (quantized ones dequantized), made one at a time: an 8B folder's float32 weights
    do not fit in this machine's memory at once."""
    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization") or {}
    weights = mx.load(str(folder / "model.safetensors"))
    names = [n for n in weights if not n.endswith((".scales", ".biases"))]

    def spec(name: str) -> dict | None:
        stem = name.removesuffix(".weight")
        return quant.get(stem, quant) if f"{stem}.scales" in weights else None

    def shape(name: str) -> tuple[int, ...]:
        w, q = weights[name], spec(name)
        return tuple(w.shape) if q is None else (*w.shape[:-1], w.shape[-1] * 32 // q["bits"])

    def each() -> Iterator[np.ndarray]:
        for name in names:
            w, q, stem = weights[name], spec(name), name.removesuffix(".weight")
            if q is not None:
                w = mx.dequantize(w, weights[f"{stem}.scales"], weights[f"{stem}.biases"],
                                  group_size=q["group_size"], bits=q["bits"])
            yield np.asarray(w.astype(mx.float32))

    return config, [(n, shape(n)) for n in names], each()


def _copy_tokenizer(writer, source: Path) -> None:
    from gguf import GGUFReader, GGUFValueType

    for key, field in GGUFReader(source).fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub)


def write_gguf(folder: Path, out: Path, *, f16: bool = False) -> Path:
    """`folder` (an mlx-lm llama or qwen3 with the SmolLM2 vocabulary) as an F32 (or F16) GGUF at
    `out`. A qwen3 is written as llama.cpp's `qwen3` (its q/k norms included; its RoPE rotates
    halves as mlx-lm's does, so q/k are not permuted)."""
    from gguf import GGUFWriter, LlamaFileType

    from engine.loading import bundled

    config, table, weights = dequantized(Path(folder))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    arch = config.get("model_type", "llama")
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"cannot write a {arch!r} folder as a GGUF (llama and qwen3 only)")
    writer = GGUFWriter(str(out), arch)
    writer.add_name(Path(folder).name)
    writer.add_file_type(LlamaFileType.MOSTLY_F16 if f16 else LlamaFileType.ALL_F32)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    _copy_tokenizer(writer, bundled.ensure_bundled_gguf())
    hf_rope = arch == "llama" and not config.get("rope_traditional", False)
    half = [f16 and len(shape) == 2 for _, shape in table]
    # the tensors' table first, then each tensor's data as it is made (one in memory at a time)
    for (name, shape), h in zip(table, half):
        writer.add_tensor_info(gguf_name(name), shape, np.dtype(np.float16 if h else np.float32),
                               int(np.prod(shape)) * (2 if h else 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for (name, _), h, w in zip(table, half, weights):
        if hf_rope and name.endswith("self_attn.q_proj.weight"):
            w = permute(w, heads)
        elif hf_rope and name.endswith("self_attn.k_proj.weight"):
            w = permute(w, kv_heads)
        writer.write_tensor_data(w.astype(np.float16) if h else w)
    writer.close()
    return Path(out)


def quantize(src: Path, dst: Path, python: str) -> Path:
    """llama.cpp's own Q4_0 quantization of the GGUF `src`, run by `python` (the llama.cpp venv)."""
    p = subprocess.run([python, "-c", _QUANTIZE, str(src), str(dst)], capture_output=True, text=True)
    if p.returncode != 0 or not Path(dst).exists():
        raise RuntimeError(f"llama.cpp could not quantize {src}: {(p.stderr or p.stdout)[-1000:]}")
    return Path(dst)


def random_gguf(folder: Path, python: str) -> Path:
    """The Q4_0 GGUF of a bench folder, next to it (`<folder>.Q4_0.gguf`); rebuilt when the
    folder's weights are newer."""
    folder = Path(folder)
    target = folder.with_name(folder.name + ".Q4_0.gguf")
    weights = folder / "model.safetensors"
    if target.exists() and target.stat().st_mtime_ns >= weights.stat().st_mtime_ns:
        return target
    f16 = folder.with_name(f"{folder.name}.F16.{os.getpid()}.gguf")
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        write_gguf(folder, f16, f16=True)
        quantize(f16, tmp, python)
        os.replace(tmp, target)
    finally:
        f16.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return target
