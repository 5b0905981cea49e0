"""Convert a GGUF file into an mlx-lm model folder, so every model loads through `mlx_lm.load()`.

The tensors are read with the `gguf` package and become MLX arrays or MLX affine quantized triples
(weight, scales, biases) in gguf_quant.py; gguf_arch.py maps them onto the mlx-lm model class of
the file's architecture. What is left here is `config.json` with per-layer quantization and a
`tokenizer.json` from the GGUF vocabulary.
"""

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError
from .gguf_arch import ARCHITECTURES, LLAMA_LAYER, arch_for, map_tensors, rename
from .gguf_quant import GROUP_SIZE, to_mlx
from .gguf_tokenizer import add_bos, tokenizer_json


def _scalar(value: Any) -> Any:
    """A metadata number as a Python value (a list for an array)."""
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _metadata_value(field: Any) -> Any:
    """A metadata value as `mx.load` gives it: str, list of str, or an mx.array for numbers."""
    from gguf import GGUFValueType

    value = field.contents()
    if field.types[0] == GGUFValueType.STRING or (
        field.types[0] == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING
    ):
        return value
    return mx.array(value)


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors (quantized ones as `name.weight`, `name.scales`, `name.biases`) and metadata;
    a corrupt or truncated file becomes a clear error."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path)
        metadata = {name: _metadata_value(f) for name, f in reader.fields.items()
                    if not name.startswith("GGUF.")}
        weights: dict[str, mx.array] = {}
        for tensor in reader.tensors:
            converted = to_mlx(np.asarray(tensor.data), tensor.tensor_type)
            if isinstance(converted, tuple):
                stem = tensor.name.removesuffix(".weight")
                weights[f"{stem}.weight"], weights[f"{stem}.scales"], weights[f"{stem}.biases"], _ = converted
            else:
                weights[tensor.name] = converted
    except (ValueError, IndexError, KeyError, OSError, NotImplementedError) as exc:
        raise ModelLoadError(f"Cannot read GGUF file {path.name}: it is corrupt or truncated ({exc})")
    return weights, metadata


def _rename(name: str) -> str:
    """A llama-family GGUF tensor name as mlx-lm's."""
    return rename(name, LLAMA_LAYER)


def _quantization(weights: dict[str, mx.array]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` entry: the most common width, and the modules that differ."""
    per_module: dict[str, int] = {}
    for name, w in weights.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            per_module[module] = weights[f"{module}.weight"].shape[-1] * 32 // (w.shape[-1] * GROUP_SIZE)
    if not per_module:
        return None
    widths = list(per_module.values())
    common = max(set(widths), key=widths.count)
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common}
    quantization.update({m: {"group_size": GROUP_SIZE, "bits": b}
                         for m, b in sorted(per_module.items()) if b != common})
    return quantization


def _config(arch_name: str, md: dict[str, Any], weights: dict[str, mx.array],
            side: dict[str, list]) -> dict[str, Any]:
    arch = ARCHITECTURES[arch_name]

    def get(key: str, default: Any = None) -> Any:
        return _scalar(md.get(f"{arch_name}.{key}", default))

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    config: dict[str, Any] = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "vocab_size": len(md["tokenizer.ggml.tokens"]),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "head_dim": get("attention.key_length", hidden // heads),
    }
    config.update(arch.extra_config(get, config, side))
    quantization = _quantization(weights)
    if quantization:
        config["quantization"] = quantization
    return config


def source_gguf(folder: Path) -> Path | None:
    """The GGUF a converted folder came from (`convert_gguf` writes it in source.json), while
    that file is still there; None for any other folder."""
    try:
        source = json.loads((Path(folder) / "source.json").read_text()).get("gguf")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(source) if source and Path(source).is_file() else None


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Write an mlx-lm model folder for `gguf` into `out_dir` (atomically) and return it."""
    weights, md = read_gguf(gguf)
    arch_name = md.get("general.architecture")
    renamed, side = map_tensors(arch_for(arch_name, Path(gguf).name), weights)
    config = _config(arch_name, md, renamed, side)
    tokenizer_json_text, special = tokenizer_json(md, arch_name)
    tokens = md["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        value = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[_scalar(value)] if value is not None else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": md.get("tokenizer.chat_template"),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding") or token("eos"),
        "unk_token": token("unknown"),
        "add_bos_token": add_bos(md),
        "model_max_length": config["max_position_embeddings"],
        "additional_special_tokens": special,
    }
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), renamed, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "tokenizer.json").write_text(tokenizer_json_text)
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "name": md.get("general.name")}))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
