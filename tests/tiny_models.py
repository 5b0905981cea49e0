"""Tiny random-weight mlx-lm models for tests and benchmarks.

Each model is written as a real mlx-lm folder by `bench.shapes.build_folder` (config.json,
model.safetensors and the bundled SmolLM2 tokenizer files, so chat templates work) and loaded
through `engine.loading.registry.load_model`, exactly as a user's model would be. The same folder
can be served by `mlx_lm.server`.

Weights are random but seeded, and the folder name is derived from the config and seed, so a
folder is built once per cache directory and reused.

    lm = tiny_llama()          # dense: every layer a trimmable KVCache
    lm = tiny_qwen3_5()        # hybrid: ArraysCache (linear attention) + KVCache every 4th layer
    lm = tiny_qwen3_next()     # hybrid, Qwen3-Next layout
    folder = tiny_qwen3_embedding_folder()   # a Qwen3-Embedding-shaped folder (last-token pooling)
    folder = tiny_reranker_folder()          # a Qwen3-Reranker-shaped folder (yes/no scoring)
    lm = tiny_fim_llama("qwen2.5-coder")     # a tokenizer with a FIM family's special tokens
    folder = tiny_quantized_llama_folder()   # the tiny llama in 4 bits: it runs on our CPU kernels
"""

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from bench.shapes import (TINY_QWEN3, build_folder, embedding_folder, fim_folder, folder_to_build,
                          publish, scratch_for)
from engine.decoding.mtp import build_mtp_head
from engine.loading.registry import LoadedModel, load_model

VOCAB = 49152  # the bundled SmolLM2 tokenizer's vocabulary

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,  # a separate random head: tied ones repeat one token greedily
}

# The hybrid shape both Qwen3.5 and Qwen3-Next tests use: layers 0-2 linear attention
# (ArraysCache), layer 3 full attention (KVCache).
_HYBRID = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "max_position_embeddings": 8192,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "tie_word_embeddings": True,
}

QWEN3_5 = {
    "model_type": "qwen3_5",
    **_HYBRID,
    "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}

QWEN3_NEXT = {
    "model_type": "qwen3_next",
    **_HYBRID,
    "num_experts": 0,
    "num_experts_per_tok": 0,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 0,
    "mlp_only_layers": [],
    "moe_intermediate_size": 0,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
}


def tiny_model(config: dict[str, Any], seed: int = 0, root: Path | None = None) -> LoadedModel:
    lm = load_model(str(build_folder(config, seed, root)))
    assert lm.config["vocab_size"] == len(lm.tokenizer.vocab) == VOCAB
    return lm


def tiny_llama(seed: int = 0, root: Path | None = None, **overrides: Any) -> LoadedModel:
    return tiny_model({**LLAMA, **overrides}, seed, root)


def tiny_qwen3_5(seed: int = 0, root: Path | None = None, **overrides: Any) -> LoadedModel:
    return tiny_model({**QWEN3_5, **overrides}, seed, root)


def tiny_qwen3_next(seed: int = 0, root: Path | None = None, **overrides: Any) -> LoadedModel:
    return tiny_model({**QWEN3_NEXT, **overrides}, seed, root)


def tiny_quantized_llama_folder(seed: int = 0, root: Path | None = None, bits: int = 4,
                                group_size: int = 32) -> Path:
    """The tiny llama's folder quantized by mlx-lm's own `convert`, as a user quantizes a model:
    loaded on the CPU, it runs on our kernels (engine/kernels/layout.py). Built once, like the
    others."""
    from mlx_lm.convert import convert

    source = build_folder(LLAMA, seed, root)
    folder, tmp = folder_to_build("llama", [LLAMA, seed, {"bits": bits, "group_size": group_size}],
                                  root)
    if tmp is None:
        return folder
    tmp.rmdir()  # convert makes the folder itself
    convert(str(source), str(tmp), quantize=True, q_group_size=group_size, q_bits=bits)
    return publish(tmp, folder)


QWEN3 = TINY_QWEN3  # a short context (512), so that a test can go past it


def tiny_qwen3_embedding_folder(seed: int = 0, root: Path | None = None) -> Path:
    """A tiny random qwen3 mlx-lm folder with Qwen3-Embedding's sentence-transformers files
    (last-token pooling, its query prompt): a dedicated embedding model as the engine sees one."""
    return embedding_folder(QWEN3, seed, root)


# Marker tokens a tokenizer of a tool-calling, thinking family has (as added tokens, one id each).
MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>")


def tiny_marker_llama(template: str, seed: int = 0, root: Path | None = None) -> LoadedModel:
    """A tiny llama whose tokenizer also has `MARKERS` (ids VOCAB, VOCAB + 1, ...) and whose chat
    template is `template`: mlx-lm then infers the family's tool parser and think markers from
    them, as it does for a real model."""
    config = {**LLAMA, "vocab_size": VOCAB + len(MARKERS)}
    folder = build_folder(config, seed, root)
    key = hashlib.sha256(template.encode()).hexdigest()[:12]
    target = folder.with_name(f"{folder.name}-markers-{key}")
    if not (target / "model.safetensors").exists():
        tmp = scratch_for(target)
        shutil.copytree(folder, tmp, dirs_exist_ok=True)
        tok = json.loads((tmp / "tokenizer.json").read_text())
        tok["added_tokens"] += [{"id": VOCAB + i, "content": m, "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False,
                                 "special": False} for i, m in enumerate(MARKERS)]
        (tmp / "tokenizer.json").write_text(json.dumps(tok))
        cfg = json.loads((tmp / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        cfg.get("added_tokens_decoder", {}).update(
            {str(VOCAB + i): {"content": m, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": False}
             for i, m in enumerate(MARKERS)})
        (tmp / "tokenizer_config.json").write_text(json.dumps(cfg))
        publish(tmp, target)
    return load_model(str(target))


def tiny_fim_llama(family: str, seed: int = 0, root: Path | None = None,
                   **overrides: Any) -> LoadedModel:
    """A tiny llama whose tokenizer also has a FIM family's special tokens (engine/loading/
    fim_tokens.py `FAMILIES`: "qwen2.5-coder", "starcoder", "codellama", "deepseek-coder",
    "codestral"; bench/shapes.py `fim_folder`)."""
    return load_model(str(fim_folder({**LLAMA, **overrides}, family, seed, root)))


def tiny_reranker_folder(seed: int = 0, root: Path | None = None) -> Path:
    """A tiny random qwen3 folder named as a Qwen3-Reranker is (`...-Qwen3-Reranker`): an LLM
    reranker as the engine sees one (engine/loading/rerank_recipe.py)."""
    folder = build_folder(QWEN3, seed, root)
    target = folder.with_name(f"{folder.name}-Qwen3-Reranker")
    if not (target / "model.safetensors").exists():
        tmp = scratch_for(target)
        shutil.copytree(folder, tmp, dirs_exist_ok=True)
        publish(tmp, target)
    return target


def mtp_folder(config, tmp_path, raw_hf):
    """A tiny model folder whose checkpoint also carries random mtp.* weights. With `raw_hf` all
    weights are written as a Hugging Face checkpoint stores them (experts unstacked, zero-centred
    norms, conv1d as (C, 1, K)), which the loaders must undo."""
    folder = tmp_path / f"{config['model_type']}-mtp"
    shutil.copytree(build_folder(config), folder)
    model = load_model(str(folder)).model
    mx.random.seed(7)
    head = build_mtp_head(model)
    weights = dict(tree_flatten(model.parameters()))
    weights.update({f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})
    if raw_hf:
        raw = {}
        for key, value in weights.items():
            if "switch_mlp" in key:
                for e in range(value.shape[0]):
                    raw[key.replace("switch_mlp", f"experts.{e}")] = value[e]
                continue
            if "conv1d.weight" in key:
                value = value.moveaxis(2, 1)
            elif "norm.weight" in key and "linear_attn" not in key:
                value = value - 1.0
            raw[key] = value
        weights = raw
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    config = json.loads((folder / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    return folder, head


# Token prompts of different lengths for batched kernel tests (left padding 0, 5 and 3).
KERNEL_PROMPTS = [[5, 17, 200, 3, 99, 41, 7], [12, 8], [300, 2, 77, 150]]


def tiny_llama_pair(bits, gs, traditional, **overrides):
    """(ours, reference): the same random quantized llama twice; ours in the kernel layout with fp16
    scales, the reference on MLX's own ops with the same scales as fp32 (the exact same weights)."""
    import mlx.nn as nn
    from mlx_lm.models import llama

    from engine.kernels.layout import to_kernel_layout

    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=320, rope_traditional=traditional,
                           rope_theta=10000.0, tie_word_embeddings=True, **overrides)
    models = []
    for _ in range(2):
        mx.random.seed(7)
        model = llama.Model(args)
        nn.quantize(model, group_size=gs, bits=bits)
        models.append(model)
    ours, ref = models
    params = dict(tree_flatten(ours.parameters()))
    half = {k: v.astype(mx.float16) if k.endswith(("scales", "biases")) else v for k, v in params.items()}
    ours.load_weights(list(half.items()))
    ref.load_weights([(k, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
                      for k, v in half.items()])
    return to_kernel_layout(ours), ref
