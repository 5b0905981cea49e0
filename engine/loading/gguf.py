"""Convert a GGUF file into an mlx-lm model folder, so every model loads through `mlx_lm.load()`.

`mx.load(path, return_metadata=True)` already turns Q4_0/Q4_1/Q8_0 tensors into MLX affine
quantized triples (weight, scales, biases; group size 32). What is left is renaming tensors to the
Hugging Face names mlx-lm expects, writing `config.json` with per-layer quantization, and building a
`tokenizer.json` from the GGUF vocabulary and merges.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import ModelLoadError, UnsupportedArchitecture

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Pre-tokenizer split patterns, as llama.cpp names them in `tokenizer.ggml.pre`.
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, mx.array) else value


def _check_readable(path: Path) -> None:
    """MLX's GGUF reader can crash the process on malformed headers, so try it in a child first."""
    probe = "import sys, mlx.core as mx; mx.load(sys.argv[1], return_metadata=True)"
    result = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        detail = result.stderr.strip().splitlines()[-1:] or [f"exit status {result.returncode}"]
        raise ModelLoadError(f"Cannot read GGUF file {path.name}: it is corrupt or truncated "
                             f"({detail[0]})")


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Load tensors and metadata, turning a corrupt or truncated file into a clear error."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    _check_readable(path)
    try:
        weights, metadata = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # mlx raises RuntimeError/ValueError with C++ messages
        raise ModelLoadError(f"Cannot read GGUF file {path.name}: it is corrupt or truncated ({exc})")
    return weights, metadata


def _rename(name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{suffix}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    raise UnsupportedArchitecture(f"Unexpected GGUF tensor {name!r}")


def _config(arch: str, md: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return _scalar(md.get(f"{arch}.{key}", default))

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "vocab_size": len(md["tokenizer.ggml.tokens"]),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in weights,
        "head_dim": get("attention.key_length", hidden // heads),
    }
    if arch == "llama":
        # llama.cpp permutes q/k rows for llama; mlx-lm undoes that with the traditional RoPE.
        config["rope_traditional"] = True
        config["attention_bias"] = False
        config["mlp_bias"] = False
    quantization: dict[str, Any] = {}
    for name, w in weights.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            weight = weights[f"{module}.weight"]
            bits = weight.shape[-1] // w.shape[-1]
            quantization[module] = {"group_size": 32, "bits": bits}
    if quantization:
        common = max({(q["bits"]) for q in quantization.values()},
                     key=lambda b: sum(q["bits"] == b for q in quantization.values()))
        config["quantization"] = {"group_size": 32, "bits": common}
        config["quantization"].update(
            {m: q for m, q in sorted(quantization.items()) if q["bits"] != common}
        )
    return config


def _tokenizer_json(md: dict[str, Any]) -> tuple[str, list[str]]:
    """Build a byte-level BPE `tokenizers` model; return its JSON and the special-token strings."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedArchitecture(
            f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE, 'gpt2', is supported)"
        )
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = md.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in ("qwen2", "llama-bpe", "llama3"):
        pattern = _QWEN2_PATTERN if pre == "qwen2" else _LLAMA3_PATTERN
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False), byte_level,
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    types = md.get("tokenizer.ggml.token_type")
    types = types.tolist() if isinstance(types, mx.array) else (types or [1] * len(tokens))
    # Type 3 = control tokens (<|im_start|> ...), type 4 = user-defined: both must stay single ids.
    special = [tokens[i] for i, t in enumerate(types) if t == 3]
    user_defined = [tokens[i] for i, t in enumerate(types) if t == 4]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    if _scalar(md.get("tokenizer.ggml.add_bos_token", False)):
        bos = tokens[_scalar(md["tokenizer.ggml.bos_token_id"])]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1",
            special_tokens=[(bos, vocab[bos])],
        )
    return tokenizer.to_str(), special


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Write an mlx-lm model folder for `gguf` into `out_dir` (atomically) and return it."""
    weights, md = read_gguf(gguf)
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"unsupported architecture {arch!r} in {Path(gguf).name} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    renamed = {_rename(k): v for k, v in weights.items()}
    config = _config(arch, md, renamed)
    tokenizer_json, special = _tokenizer_json(md)
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
        "add_bos_token": bool(_scalar(md.get("tokenizer.ggml.add_bos_token", False))),
        "model_max_length": config["max_position_embeddings"],
        "additional_special_tokens": special,
    }
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), renamed, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "tokenizer.json").write_text(tokenizer_json)
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "name": md.get("general.name")}))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
