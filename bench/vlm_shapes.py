"""Tiny random-weight vision-language models for tests and benchmarks, as mlx-vlm folders.

Each folder holds a config.json with a vision tower, mlx-vlm's own seeded initialisation of every
weight, the bundled SmolLM2 tokenizer with the family's image tokens added, a chat template that
renders image parts, and the processor's JSON files; `engine.loading.registry.load_model` and
`mlx_vlm.load` load it as they would a downloaded model. Folders are named by a hash of their
files' contents, so each is built once per cache directory.

    lm = tiny_qwen2_5_vl()     # Qwen2.5-VL: multimodal RoPE, 14-pixel patches, 2x2 merge
    lm = tiny_smolvlm()        # SmolVLM (Idefics3 layout): SigLIP tower, pixel shuffle, plain RoPE
"""

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from PIL import Image

from bench.shapes import copy_bundled_tokenizer, folder_to_build, publish
from engine.loading.registry import LoadedModel, load_model

VOCAB = 49152  # the bundled SmolLM2 tokenizer's vocabulary; image tokens are added after it

_QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN2_5_VL = {
    "model_type": "qwen2_5_vl", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB + len(_QWEN_TOKENS), "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "vision_start_token_id": VOCAB, "vision_end_token_id": VOCAB + 1, "image_token_id": VOCAB + 2,
    "video_token_id": VOCAB + 3, "vision_token_id": VOCAB + 2, "bos_token_id": 1, "eos_token_id": 2,
    "vision_config": {
        "model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
        "out_hidden_size": 64, "num_heads": 2, "patch_size": 14, "spatial_patch_size": 14,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
        "fullatt_block_indexes": [1], "in_channels": 3},
}
_QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# 56x56 to 112x112 pixels: 4 to 16 image tokens
_QWEN_FILES = {"preprocessor_config.json": {
    "min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}}

_SMOL_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
SMOLVLM = {
    "model_type": "smolvlm", "image_token_id": VOCAB + 1, "scale_factor": 2,
    "vocab_size": VOCAB + len(_SMOL_TOKENS), "eos_token_id": 2,
    "text_config": {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB + len(_SMOL_TOKENS), "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "tie_word_embeddings": False},
    "vision_config": {
        "model_type": "smolvlm_vision", "hidden_size": 32, "num_attention_heads": 2,
        "num_hidden_layers": 2, "intermediate_size": 64, "patch_size": 8, "image_size": 32,
        "num_channels": 3},
}
# SmolVLM's own template shape: it iterates the content's parts (strings are not rendered).
_SMOL_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
# one 32x32 image (no splitting): 16 patches of 8 pixels, shuffled 2x2 into 4 image tokens
_SMOL_FILES = {
    "processor_config.json": {"image_seq_len": 4, "processor_class": "SmolVLMProcessor"},
    "preprocessor_config.json": {
        "image_processor_type": "SmolVLMImageProcessor", "processor_class": "SmolVLMProcessor",
        "do_image_splitting": False, "do_resize": True, "size": {"longest_edge": 32},
        "max_image_size": {"longest_edge": 32}, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_pad": True, "resample": 1}}


def build_vlm_folder(config: dict[str, Any], tokens: list[str], template: str,
                     files: dict[str, Any], seed: int = 0, root: Path | None = None) -> Path:
    """Write a random-weight mlx-vlm folder (see the module docstring); returns its path."""
    from mlx_vlm.utils import get_model_and_args

    folder, tmp = folder_to_build(config["model_type"], [config, tokens, template, files, seed], root)
    if tmp is None:
        return folder
    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(json.loads(json.dumps(config)))
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    model_config.text_config = module.TextConfig.from_dict(config.get("text_config", config))
    mx.random.seed(seed)
    model = module.Model(model_config)
    mx.eval(model.parameters())
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    copy_bundled_tokenizer(tmp)
    added = {VOCAB + i: t for i, t in enumerate(tokens)}
    tok = json.loads((tmp / "tokenizer.json").read_text())
    tok["added_tokens"] += [{"id": i, "content": t, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}
                            for i, t in added.items()]
    (tmp / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((tmp / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    cfg.setdefault("added_tokens_decoder", {}).update(
        {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                  "single_word": False, "special": True} for i, t in added.items()})
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    for name, content in files.items():
        (tmp / name).write_text(json.dumps(content))
    return publish(tmp, folder)


def tiny_qwen2_5_vl_folder(seed: int = 0, root: Path | None = None) -> Path:
    return build_vlm_folder(QWEN2_5_VL, _QWEN_TOKENS, _QWEN_TEMPLATE, _QWEN_FILES, seed, root)


def tiny_smolvlm_folder(seed: int = 0, root: Path | None = None) -> Path:
    return build_vlm_folder(SMOLVLM, _SMOL_TOKENS, _SMOL_TEMPLATE, _SMOL_FILES, seed, root)


def tiny_qwen2_5_vl(seed: int = 0, root: Path | None = None) -> LoadedModel:
    return load_model(str(tiny_qwen2_5_vl_folder(seed, root)))


def tiny_smolvlm(seed: int = 0, root: Path | None = None) -> LoadedModel:
    return load_model(str(tiny_smolvlm_folder(seed, root)))


def random_image(seed: int, size: tuple[int, int] = (80, 60)) -> Image.Image:
    """A noise RGB image of `size` (width, height)."""
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)
