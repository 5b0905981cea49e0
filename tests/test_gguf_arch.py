"""GGUF import of gemma2, gemma3, phi3, qwen3moe and a Mistral-style llama.

Each tiny model starts as random weights in the Hugging Face layout (an mlx-lm model built from an
HF-style config: the reference). The test then writes the GGUF file the way llama.cpp's
`convert_hf_to_gguf.py` would from those weights: llama.cpp's tensor names, q/k rows permuted for
llama, 1 added to every Gemma norm weight, experts stacked, a sentencepiece vocabulary and a chat
template in the metadata. The file goes through the registry's real path (conversion into the
cache, `mlx_lm.load`), and its logits must equal the reference's: a missed norm offset or q/k
permutation changes them far beyond the tolerance.
"""

import json

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from engine import UnsupportedArchitecture
from engine.loading.registry import load_model

pytestmark = pytest.mark.fast

TOKENS = [1, 7, 280, 42, 5, 260, 99, 3, 17, 250]  # longer than the sliding windows below
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                 "<end_of_turn>\n{% endfor %}<start_of_turn>model\n")
SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}

# Hugging Face module names -> llama.cpp's GGUF names (gguf-py's tensor_mapping.py).
_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps", "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "ffn_post_norm",
}


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small sentencepiece vocabulary: specials, Gemma's turn markers, 256 byte tokens, pieces."""
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
    types = [2, 3, 3, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["\u2581"] + list("abcdefghijklmnopqrstuvwxyz") + ["\u2581h", "\u2581w", "hi", "\u2581hi"]
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


VOCAB = len(_spm_vocab()[0])


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for llama: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _windowed_gemma2(model, window: int):
    """Gemma 2 as Hugging Face and llama.cpp run it, from mlx-lm's gemma2 layers (whose model
    has no window): even layers see only the last `window` tokens, odd layers all of them."""
    def forward(tokens: mx.array) -> mx.array:
        h = model.model.embed_tokens(tokens) * (model.args.hidden_size ** 0.5)
        n = tokens.shape[1]
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        for index, layer in enumerate(model.layers):
            visible = (j <= i) & ((i - j < window) if index % 2 == 0 else True)
            h = layer(h, mx.array(visible), None)
        logits = model.model.embed_tokens.as_linear(model.model.norm(h))
        return mx.tanh(logits / model.final_logit_softcapping) * model.final_logit_softcapping
    return forward


def _reference(config: dict, seed: int):
    """The HF-layout model with random weights; norm weights random too, so offsets show."""
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for name in weights:
        if name.endswith("norm.weight"):
            weights[name] = mx.random.normal(weights[name].shape) * 0.3 + (
                0.0 if config["model_type"].startswith("gemma") else 1.0)
        elif name.endswith(".weight"):
            weights[name] = mx.random.normal(weights[name].shape) * 0.2
    model.load_weights(list(weights.items()))
    if config["model_type"] == "gemma2":
        model = _windowed_gemma2(model, config["sliding_window"])
    return model, {k: np.array(v, dtype=np.float32) for k, v in weights.items()}


def _gguf_name(hf: str, gemma: bool) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    if module == "post_attention_layernorm":
        return f"blk.{layer}.{'attn_post_norm' if gemma else 'ffn_norm'}.{suffix}"
    return f"blk.{layer}.{_LAYER_TO_GGUF[module]}.{suffix}"


def _write_gguf(path, arch: str, config: dict, weights: dict[str, np.ndarray], meta) -> None:
    """What convert_hf_to_gguf.py writes for these HF weights."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    if arch != "phi3":
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    tokens, scores, types = _spm_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(4 if arch.startswith("gemma") else 2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    meta(writer)
    gemma = arch.startswith("gemma")
    for name, w in weights.items():
        if gemma and name.endswith("norm.weight"):
            w = w + 1.0
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            w = _permute(w, config["num_attention_heads"])
        if arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            w = _permute(w, config["num_key_value_heads"])
        writer.add_tensor(_gguf_name(name, gemma), w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


CASES = {
    "gemma2": (
        {"model_type": "gemma2", **SHAPE, "query_pre_attn_scalar": 16, "sliding_window": 4,
         "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
        lambda w: (w.add_attn_logit_softcapping(50.0), w.add_final_logit_softcapping(30.0),
                   w.add_sliding_window(4)),
    ),
    "gemma3": (
        {"model_type": "gemma3_text", **SHAPE, "num_hidden_layers": 6,  # 5 local, 1 global
         "query_pre_attn_scalar": 16, "rope_theta": 1e6,
         "rope_local_base_freq": 10000.0, "sliding_window": 4, "sliding_window_pattern": 6},
        lambda w: w.add_sliding_window(4),
    ),
    "phi3": (
        {"model_type": "phi3", **{k: v for k, v in SHAPE.items() if k != "head_dim"},
         "partial_rotary_factor": 0.75, "tie_word_embeddings": False},
        lambda w: w.add_rope_dimension_count(12),
    ),
    "qwen3moe": (
        {"model_type": "qwen3_moe", **SHAPE, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "norm_topk_prob": True, "rope_theta": 1e6, "tie_word_embeddings": False},
        lambda w: (w.add_expert_count(4), w.add_expert_used_count(2),
                   w.add_expert_feed_forward_length(32)),
    ),
    "llama": (  # Mistral-style: sentencepiece vocabulary, head_dim set apart from hidden/heads
        {"model_type": "llama", **SHAPE, "head_dim": 32, "tie_word_embeddings": False},
        lambda w: None,
    ),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_architecture_logits_equal_the_hf_layout_reference(tmp_path, arch):
    config, meta = CASES[arch]
    config = {**config, "vocab_size": VOCAB}
    reference, weights = _reference(config, seed=3)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, arch, config, weights, meta)

    lm = load_model(str(path))
    assert lm.config["model_type"] == config["model_type"]
    tokens = mx.array([TOKENS])
    ours = lm.model(tokens).astype(mx.float32)
    theirs = reference(tokens).astype(mx.float32)
    scale = mx.abs(theirs).max().item()
    assert scale > 1.0
    assert mx.abs(ours - theirs).max().item() < 1e-3 * scale


def test_norm_offset_and_permutation_would_be_caught(tmp_path):
    """The same checks fail on a file written without llama.cpp's +1 / permutation."""
    for arch in ("gemma3", "llama"):
        config, meta = CASES[arch]
        config = {**config, "vocab_size": VOCAB}
        reference, weights = _reference(config, seed=3)
        path = tmp_path / f"plain-{arch}.gguf"
        # Write as if no transformation had been applied by the converter.
        plain = {k: (v - 1.0 if arch == "gemma3" and k.endswith("norm.weight") else v)
                 for k, v in weights.items()}
        if arch == "llama":
            inverse = {}
            for k, v in plain.items():
                heads = (config["num_attention_heads"] if k.endswith("q_proj.weight")
                         else config["num_key_value_heads"] if k.endswith("k_proj.weight") else None)
                inverse[k] = _unpermute(v, heads) if heads else v
            plain = inverse
        _write_gguf(path, arch, config, plain, meta)
        lm = load_model(str(path))
        tokens = mx.array([TOKENS])
        diff = mx.abs(lm.model(tokens).astype(mx.float32) - reference(tokens)).max().item()
        assert diff > 1e-2 * mx.abs(reference(tokens)).max().item(), arch


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    config, meta = CASES["gemma3"]
    config = {**config, "vocab_size": VOCAB}
    _, weights = _reference(config, seed=1)
    path = tmp_path / "chat-gemma3.gguf"
    _write_gguf(path, "gemma3", config, weights, meta)
    lm = load_model(str(path))
    tokenizer_config = json.loads((lm.path / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                           add_generation_prompt=True)
    tokens = _spm_vocab()[0]
    assert ids[:2] == [tokens.index("<s>"), tokens.index("<start_of_turn>")]
    assert ids.count(tokens.index("<start_of_turn>")) == 2  # control tokens stay single ids
    encoded = lm.tokenizer.encode("hi why")
    # BOS (llama.cpp's default for sentencepiece); Gemma adds no prefix space
    assert encoded[:2] == [tokens.index("<s>"), tokens.index("hi")]
    assert lm.tokenizer.decode(encoded[1:]) == "hi why"
    assert lm.tokenizer.eos_token_id == tokens.index("<end_of_turn>")


# Llama 3.1: llama.cpp stores the "llama3" RoPE scaling only as per-frequency factors.
LLAMA3 = {"model_type": "llama", **SHAPE, "rope_theta": 500000.0, "tie_word_embeddings": False}
LLAMA3_SCALINGS = {
    "published": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    "fitted": {"factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 16.0,
               "original_max_position_embeddings": 512},
}


def _llama_cpp_rope_freqs(config: dict) -> np.ndarray:
    """The `rope_freqs` tensor convert_hf_to_gguf.py writes for a "llama3" rope_scaling."""
    scaling, base, dim = config["rope_scaling"], config["rope_theta"], config["head_dim"]
    old = scaling["original_max_position_embeddings"]
    low_wavelen = old / scaling["low_freq_factor"]
    high_wavelen = old / scaling["high_freq_factor"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * np.pi * base ** (i / dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling["factor"])
        else:
            smooth = (old / wavelen - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize("case", list(LLAMA3_SCALINGS))
def test_llama3_rope_freqs_become_mlx_lm_rope_scaling(tmp_path, case):
    config = {**LLAMA3, "vocab_size": VOCAB,
              "rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALINGS[case]}}
    reference, weights = _reference(config, seed=5)
    freqs = _llama_cpp_rope_freqs(config)
    assert 1.0 < freqs.max() and freqs.min() == 1.0  # the scaling reaches these positions
    scaled, plain = tmp_path / "scaled.gguf", tmp_path / "plain.gguf"
    _write_gguf(scaled, "llama", config, weights, lambda w: w.add_tensor("rope_freqs.weight", freqs))
    _write_gguf(plain, "llama", config, weights, lambda w: None)

    lm = load_model(str(scaled))
    assert lm.config["rope_scaling"]["rope_type"] == "llama3"
    mx.random.seed(0)
    tokens = mx.random.randint(0, VOCAB, (1, 600))  # positions past the scaled wavelengths
    theirs = reference(tokens).astype(mx.float32)
    scale = mx.abs(theirs).max().item()
    assert mx.abs(lm.model(tokens).astype(mx.float32) - theirs).max().item() < 1e-3 * scale
    # Without the factors (plain RoPE) the same weights answer differently: the check can fail.
    unscaled = load_model(str(plain)).model(tokens).astype(mx.float32)
    assert mx.abs(unscaled - theirs).max().item() > 1e-2 * scale


def test_rope_freqs_that_are_not_llama3_scaling_are_refused(tmp_path):
    config = {**LLAMA3, "vocab_size": VOCAB}
    _, weights = _reference(config, seed=5)
    odd = np.linspace(3.0, 1.0, config["head_dim"] // 2).astype(np.float32)  # decreasing
    path = tmp_path / "odd.gguf"
    _write_gguf(path, "llama", config, weights, lambda w: w.add_tensor("rope_freqs.weight", odd))
    with pytest.raises(UnsupportedArchitecture, match="rope_freqs are not a Llama 3 RoPE"):
        load_model(str(path))


def test_gemma2_sliding_window_applies_in_the_cache_too(tmp_path):
    """Token by token through the model's own cache (a rotating one for the sliding layers), the
    logits past the window equal the windowed reference; without the window they would not."""
    from mlx_lm.models.cache import make_prompt_cache

    config, meta = CASES["gemma2"]
    config = {**config, "vocab_size": VOCAB}
    reference, weights = _reference(config, seed=3)
    path = tmp_path / "tiny-gemma2.gguf"
    _write_gguf(path, "gemma2", config, weights, meta)
    lm = load_model(str(path))
    assert lm.config["sliding_window"] == 4
    cache = make_prompt_cache(lm.model)
    steps = [lm.model(mx.array([[t]]), cache=cache)[0, -1] for t in TOKENS]
    theirs = reference(mx.array([TOKENS]))[0].astype(mx.float32)
    scale = mx.abs(theirs).max().item()
    assert mx.abs(mx.stack(steps).astype(mx.float32) - theirs).max().item() < 1e-3 * scale
    unwindowed = _windowed_gemma2(lm.model, window=len(TOKENS))(mx.array([TOKENS]))[0]
    assert mx.abs(unwindowed.astype(mx.float32) - theirs).max().item() > 1e-2 * scale


def test_gemma2_batched_decoding_equals_one_at_a_time(tmp_path):
    """Rows of different lengths decoded together (left-padded batch masks over grouped-query
    heads, which mlx-lm's own gemma2 cannot take) give each row's logprobs as decoded alone."""
    from engine import Engine

    config, meta = CASES["gemma2"]
    config = {**config, "vocab_size": VOCAB}
    _, weights = _reference(config, seed=3)
    path = tmp_path / "tiny-gemma2.gguf"
    _write_gguf(path, "gemma2", config, weights, meta)
    engine = Engine(str(path), max_running=4, prefix_cache=False).start()
    try:
        params = engine.params({"max_tokens": 8, "temperature": 0}).with_(logprobs=2)
        asks = [[{"role": "user", "content": text}] for text in ("hi", "abc hi w", "why hello hi")]

        def logprobs(handles):
            return [[(e.logprobs.token, round(e.logprobs.logprob, 4)) for e in h.events()
                     if e.logprobs is not None] for h in handles]

        alone = [logprobs([engine.submit(m, params)])[0] for m in asks]
        together = logprobs([engine.submit(m, params) for m in asks])
    finally:
        engine.stop()
    assert all(len(row) == 8 for row in alone)
    assert together == alone
