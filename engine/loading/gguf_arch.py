"""Per-architecture mapping of a GGUF file onto an mlx-lm model: tensor names, the tensor changes
llama.cpp's converter made that must be undone, and `config.json` fields.

What llama.cpp's `convert_hf_to_gguf.py` changes, and how it is undone here:
- llama: q/k rows permuted so that RoPE rotates interleaved pairs. Rather than permuting back, the
  config asks mlx-lm for the traditional (interleaved) RoPE, which is the same computation.
- gemma2: its sliding window goes into the config for gemma2_window.py (mlx-lm's gemma2 has none).
- gemma2/gemma3: every `*norm.weight` stored with 1 added (llama.cpp multiplies by the weight,
  Gemma by 1 + weight). mlx-lm's Gemma classes add the 1 themselves, so it is subtracted here.
- phi3: q/k/v and gate/up stay fused (`attn_qkv`, `ffn_up`), as mlx-lm's phi3 expects them.
- qwen3moe: experts stored stacked (`ffn_*_exps`), as mlx-lm's `switch_mlp` expects them.
- llama 3.1: its RoPE scaling stored as per-frequency factors (`rope_freqs`), turned back into
  mlx-lm's "llama3" `rope_scaling` (gguf_rope.py).
"""

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx

from ..errors import UnsupportedArchitecture
from .gguf_rope import llama3_rope_scaling

_COMMON_LAYER = {
    "attn_norm": "input_layernorm",
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
LLAMA_LAYER = {**_COMMON_LAYER, "ffn_norm": "post_attention_layernorm"}
_GEMMA_LAYER = {
    **_COMMON_LAYER,
    "attn_post_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_post_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {**LLAMA_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_QWEN3MOE_LAYER = {
    **LLAMA_LAYER,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class Arch:
    """How one GGUF architecture becomes one mlx-lm model type."""

    model_type: str
    layer_names: dict[str, str]
    norm_shift: float = 0.0  # subtracted from every norm weight
    # (metadata getter, common config, tensors kept out of the model) -> more config fields
    extra_config: Callable[[Callable[..., Any], dict[str, Any], dict[str, list]], dict[str, Any]] = (
        lambda get, config, side: {}
    )
    dropped: tuple[str, ...] = field(default=())  # GGUF tensors consumed by extra_config


def _llama(get, config, side):
    # Mistral-style files are llama too. Like llama.cpp's llama graph, full attention on every
    # layer: a `sliding_window` key, where present, is not applied (mlx-lm's llama class needs at
    # least one full-attention layer, and Mistral's window spans its usual contexts anyway).
    extra: dict[str, Any] = {"rope_traditional": True, "attention_bias": False, "mlp_bias": False}
    if "rope_freqs" in side:  # Llama 3.1's scaled long context
        scaling = llama3_rope_scaling(side["rope_freqs"], config["rope_theta"], config["head_dim"])
        if scaling is not None:
            extra["rope_scaling"] = scaling
    return extra


def _pre_attn_scalar(config, big_layer_count: int) -> float:
    # llama.cpp scales queries by 1/sqrt(hidden/heads) for the largest size (27B), by
    # 1/sqrt(head_dim) otherwise; the GGUF stores neither, so follow llama.cpp's rule.
    if config["num_hidden_layers"] == big_layer_count:
        return config["hidden_size"] / config["num_attention_heads"]
    return config["head_dim"]


def _gemma2(get, config, side):
    return {
        # llama.cpp's default where the file has no key (every Gemma 2 has this window)
        "sliding_window": get("attention.sliding_window", 4096),
        "attn_logit_softcapping": get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": get("final_logit_softcapping", 30.0),
        "query_pre_attn_scalar": _pre_attn_scalar(config, 46),
    }


def _window_pattern(value: int | list[bool]) -> int:
    """Every n-th layer global: llama.cpp writes n, or one flag per layer (true = sliding)."""
    if isinstance(value, int):
        return value
    return value.index(False) + 1 if False in value else len(value) + 1


def _gemma3(get, config, side):
    extra = {
        "query_pre_attn_scalar": _pre_attn_scalar(config, 62),
        "sliding_window": get("attention.sliding_window", 512),
        "sliding_window_pattern": _window_pattern(get("attention.sliding_window_pattern", 6)),
        "rope_local_base_freq": 10000.0,  # llama.cpp's fixed value for the local layers
    }
    if get("rope.scaling.type", None) == "linear":
        extra["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor", 1.0)}
    return extra


def _phi3(get, config, side):
    rope_dim = get("rope.dimension_count", config["head_dim"])
    extra: dict[str, Any] = {"partial_rotary_factor": rope_dim / config["head_dim"]}
    if "rope_factors_long" in side:
        extra["rope_scaling"] = {
            "type": "longrope",
            "long_factor": side["rope_factors_long"],
            "short_factor": side["rope_factors_short"],
        }
        extra["original_max_position_embeddings"] = get("rope.scaling.original_context_length",
                                                        4096)
    return extra


def _qwen3moe(get, config, side):
    moe = get("expert_feed_forward_length")
    return {
        "num_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
        "moe_intermediate_size": moe,
        "intermediate_size": config["intermediate_size"] or moe,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
    }


ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch("llama", LLAMA_LAYER, extra_config=_llama, dropped=("rope_freqs",)),
    "qwen2": Arch("qwen2", LLAMA_LAYER),
    "qwen3": Arch("qwen3", LLAMA_LAYER),
    "gemma2": Arch("gemma2", _GEMMA_LAYER, norm_shift=1.0, extra_config=_gemma2),
    "gemma3": Arch("gemma3_text", _GEMMA_LAYER, norm_shift=1.0, extra_config=_gemma3),
    "phi3": Arch("phi3", _PHI3_LAYER, extra_config=_phi3,
                 dropped=("rope_factors_long", "rope_factors_short")),
    "qwen3moe": Arch("qwen3_moe", _QWEN3MOE_LAYER, extra_config=_qwen3moe),
}


def arch_for(name: str | None, filename: str) -> Arch:
    if name not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"unsupported architecture {name!r} in {filename} "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return ARCHITECTURES[name]


def rename(name: str, layer_names: dict[str, str] = LLAMA_LAYER) -> str:
    """A GGUF tensor name (`blk.3.attn_q.weight`) as mlx-lm's (`model.layers.3.self_attn...`)."""
    stem, _, suffix = name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match.group(2) in layer_names:
        return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}.{suffix}"
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    raise UnsupportedArchitecture(f"Unexpected GGUF tensor {name!r}")


def map_tensors(arch: Arch, weights: dict[str, mx.array]) -> tuple[dict[str, mx.array], dict]:
    """Rename to mlx-lm's names and undo llama.cpp's changes; return the tensors kept out of
    the model (consumed by the config) separately, by stem."""
    renamed, side = {}, {}
    for name, w in weights.items():
        stem = name.rsplit(".", 1)[0]
        if stem in arch.dropped:
            side[stem] = w.astype(mx.float32).tolist()
            continue
        if arch.norm_shift and name.endswith("norm.weight"):
            w = (w.astype(mx.float32) - arch.norm_shift).astype(w.dtype)
        renamed[rename(name, arch.layer_names)] = w
    return renamed, side
