"""Random-weight models with the shapes of real ones, for speed runs on any device.

Each shape is an mlx-lm config; `build(name)` makes the mlx-lm model class from it, fills every
parameter with random bf16 values (lazily, so no fp32 copy is ever materialised), quantizes with
`nn.quantize` where the shape asks for it, and wraps it as an `engine.loading.registry.LoadedModel`.

Speed runs need no text: prompts are token ids drawn directly (`prompt_ids`), and the tokenizer is
`IdTokenizer`, whose detokenizer renders token `i` as " i" at constant cost per token and which has no
EOS, so every run decodes exactly the tokens it asks for. Both our engine and mlx-lm get the same
tokenizer object, so neither side pays for detokenizing more than the other.

`build_folder(config, seed)` writes a random-weight model as a real mlx-lm folder instead (with the
bundled SmolLM2 tokenizer files), which `load_model` and `mlx_lm.server` load as they would a
user's model; tests/tiny_models.py builds its tiny models with it.

    python -m bench.shapes            # list the shapes with their parameter counts
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.tokenizer_utils import StreamingDetokenizer, TokenizerWrapper

_SMOLLM2_135M = {
    "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
    "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "vocab_size": 49152,
    "rope_theta": 100000.0, "rope_traditional": False, "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}
_QWEN3_8B = {
    "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "intermediate_size": 12288,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
    "vocab_size": 151936, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
}
# A small Qwen3.5 (gated-delta linear attention in 3 of every 4 layers, full attention in the 4th).
_QWEN3_5_HYBRID = {
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 1024, "num_hidden_layers": 24,
        "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": 248320, "tie_word_embeddings": True,
        "linear_num_value_heads": 16, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
    },
}
# Qwen3.5-9B's text model (its published config.json; the vision tower left out): the small
# hybrid's layout at the 9B's sizes. The founding demonstration ran it at 8 bits on a 24 GiB Mac.
_QWEN3_5_9B = {"model_type": "qwen3_5", "text_config": {
    **_QWEN3_5_HYBRID["text_config"], "hidden_size": 4096, "num_hidden_layers": 32,
    "intermediate_size": 12288, "num_attention_heads": 16, "num_key_value_heads": 4,
    "tie_word_embeddings": False, "linear_num_value_heads": 32}}
# tests/tiny_models.py's hybrid with Qwen3.5's linear-attention head sizes, for CPU runs of the
# hybrid suite.
_TINY_HYBRID = {
    "model_type": "qwen3_5", "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
    "vocab_size": 512, "tie_word_embeddings": True, "max_position_embeddings": 8192,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}
# For CPU tests of the harness only.
_TINY = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 512,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Shape:
    name: str
    config: dict[str, Any]
    bits: int | None = None  # quantize every Linear/Embedding to this many bits
    group_size: int = 64
    about: str = ""


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("smollm2-135m", _SMOLLM2_135M, about="SmolLM2-135M shape, bf16"),
    Shape("qwen3-8b", _QWEN3_8B, about="Qwen3-8B shape, bf16"),
    Shape("qwen3-8b-8bit", _QWEN3_8B, bits=8, about="Qwen3-8B shape, 8-bit (group 64)"),
    Shape("qwen3-8b-4bit", _QWEN3_8B, bits=4, about="Qwen3-8B shape, 4-bit (group 64)"),
    Shape("qwen3_5-9b-8bit", _QWEN3_5_9B, bits=8,
          about="Qwen3.5-9B shape (the founding demo's model), 8-bit (group 64)"),
    Shape("qwen3_5-hybrid", _QWEN3_5_HYBRID, about="Qwen3.5 hybrid shape (~0.8B, linear attention), bf16"),
    Shape("tiny", _TINY, about="2-layer llama, for CPU tests of the bench itself"),
    Shape("tiny-hybrid", _TINY_HYBRID, about="4-layer Qwen3.5-style hybrid with real linear-attention heads, for CPU"),
)}
GPU_DEFAULT = ("smollm2-135m", "qwen3-8b", "qwen3-8b-8bit", "qwen3_5-hybrid")
CPU_DEFAULT = ("tiny", "smollm2-135m")


# -- tokenizer --------------------------------------------------------------------------------------

class IdDetokenizer(StreamingDetokenizer):
    """Token i -> " i": constant work per token, like a BPE streaming detokenizer."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self.tokens: list[int] = []
        self._text = ""
        self._segment = ""

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self._segment += f" {token}"

    def finalize(self) -> None:
        pass

    @property
    def text(self) -> str:
        self._text += self._segment
        self._segment = ""
        return self._text

    @property
    def last_segment(self) -> str:
        segment, self._segment = self._segment, ""
        self._text += segment
        return segment


class _IdHF:
    """The few attributes TokenizerWrapper reads from a Hugging Face tokenizer."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_id = None
        self.bos_token = None
        self.chat_template = None
        self.vocab = {}  # only its size is ever asked for via config

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(t) % self.vocab_size for t in text.split()]

    def decode(self, ids, **_: Any) -> str:
        return "".join(f" {int(i)}" for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [str(i) for i in ids] if isinstance(ids, list) else str(ids)

    def get_vocab(self) -> dict[str, int]:
        return {}


class IdTokenizer(TokenizerWrapper):
    """A TokenizerWrapper with no EOS whose detokenizer is `IdDetokenizer`."""

    def __init__(self, vocab_size: int):
        self._tokenizer = _IdHF(vocab_size)
        self._detokenizer = IdDetokenizer()
        self._eos_token_ids = set()
        self._think_start = self._think_end = None
        self._think_start_tokens = self._think_end_tokens = None
        self._structural_markers = None
        self._response_format = {}
        self._chat_template = None
        self._thinking_kwarg = None
        self.has_chat_template = False
        self._tool_parser = None

    @property
    def detokenizer(self):
        self._detokenizer.reset()
        return self._detokenizer

    @property
    def eos_token_ids(self):
        return self._eos_token_ids


# -- models -----------------------------------------------------------------------------------------

def text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config", config)


def _randomize(model: nn.Module, dtype: mx.Dtype, seed: int) -> None:
    """Replace every parameter by random values of its shape in `dtype`, before any is evaluated."""
    key = mx.random.key(seed)
    leaves = tree_flatten(model.parameters())
    keys = iter(mx.random.split(key, max(2, len(leaves))))

    def fill(p: mx.array) -> mx.array:
        k = next(keys)
        if p.ndim >= 2:  # matrices and embeddings: N(0, 1/fan_in) keeps activations bounded
            return (mx.random.normal(p.shape, dtype=mx.float32, key=k)
                    * (1.0 / math.sqrt(p.shape[-1]))).astype(dtype)
        return p.astype(dtype)  # norms, biases, A_log, dt_bias, ...: their defaults

    model.update(tree_map(fill, model.parameters()))


def build_module(shape: Shape, dtype: mx.Dtype | None = mx.bfloat16, seed: int = 0) -> nn.Module:
    """The mlx-lm model of `shape`, with N(0, 1/fan_in) weights in `dtype` or, with `dtype` None,
    mlx-lm's own initialisation (fp32) under `mx.random.seed(seed)`."""
    from mlx_lm.utils import _get_classes

    config = copy.deepcopy(shape.config)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)  # the parameters `_randomize` keeps (a hybrid's A_log) are drawn in __init__
    model = model_class(args_class.from_dict(config))
    if dtype is not None:
        _randomize(model, dtype, seed)
    if shape.bits:
        nn.quantize(model, group_size=shape.group_size, bits=shape.bits)
    mx.eval(model.parameters())
    model.eval()
    return model


def nbytes(model: nn.Module) -> int:
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


def ours_and_mlx_lm(shape: Shape, dtype: mx.Dtype | None, seed: int = 0
                    ) -> tuple[nn.Module, dict[str, Any], str]:
    """The model our engine runs, the extras of its `LoadedModel` and its compute path: on a GPU
    ours takes the GPU layout (as load_model's fastest_layout gives it there) and mlx-lm keeps its
    own copy of the same weights, as `mlx_lm.load` gives them, under "mlx_lm_model" (see
    common.mlx_lm_paths)."""
    from engine.kernels import decode_step
    from engine.kernels.fastest import AS_LOADED, GPU_COMPILED_STEP, GPU_LAYOUT, fastest_layout
    from engine.kernels.gpu_layout import to_gpu_layout

    model = build_module(shape, dtype, seed)
    if mx.default_device() != mx.gpu:
        if decode_step.mode() == "ref":  # MLXCHAT_CUDA_DECODE=ref: the compiled step on MLX ops
            attached = decode_step.attach(to_gpu_layout(model))
            return model, {}, GPU_COMPILED_STEP if attached else GPU_LAYOUT
        return model, {}, AS_LOADED
    model, compute = fastest_layout(model, shape.config)
    return model, {"mlx_lm_model": build_module(shape, dtype, seed)}, compute


def build(name: str, dtype: mx.Dtype = mx.bfloat16, seed: int = 0):
    """The shape `name` as an engine `LoadedModel` with random weights and `IdTokenizer`."""
    from engine.kernels.gated_delta import use_chunked_prefill
    from engine.loading.registry import LoadedModel

    shape = SHAPES[name]
    model, extras, compute = ours_and_mlx_lm(shape, dtype, seed)
    use_chunked_prefill(model)  # as engine.loading.registry.load_model does
    config = copy.deepcopy(shape.config)
    text = text_config(config)
    config.setdefault("vocab_size", text["vocab_size"])
    config.setdefault("max_position_embeddings", text.get("max_position_embeddings", 8192))
    if shape.bits:
        config["quantization"] = {"group_size": shape.group_size, "bits": shape.bits}
    return LoadedModel(name=f"random:{name}", model=model, tokenizer=IdTokenizer(text["vocab_size"]),
                       config=config, path=Path(f"/nonexistent/random-{name}"),
                       extras={**extras, "shape": name, "weights_bytes": nbytes(model)},
                       compute=compute)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def folder_to_build(model_type: str, recipe: Any, root: Path | None = None) -> tuple[Path, Path | None]:
    """Where a random-weight folder made from `recipe` (JSON) lives under `root` (default: our
    cache), named by a hash of it, and an empty scratch folder to build it in (renamed into place
    when done), or None when it is already built."""
    from engine.paths import cache_dir

    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    folder = (root or cache_dir() / "tiny-models") / f"{model_type}-{key}"
    if (folder / "model.safetensors").exists():
        return folder, None
    return folder, scratch_for(folder)


def scratch_for(folder: Path) -> Path:
    """An empty scratch folder beside `folder`, this process's and thread's own, so that two test
    processes building the same folder at once never share one; `publish` moves it into place."""
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, folder: Path) -> Path:
    """Rename the finished `tmp` to `folder`; if another process got there first, keep theirs."""
    try:
        tmp.rename(folder)
    except OSError:
        if not (folder / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def copy_bundled_tokenizer(folder: Path) -> None:
    """The bundled model's tokenizer files into `folder`."""
    from engine.loading.registry import resolve

    _, tokenizer_folder = resolve(None)  # the bundled model, converted once
    for name in TOKENIZER_FILES:
        if (tokenizer_folder / name).exists():
            shutil.copy(tokenizer_folder / name, folder / name)


def build_folder(config: dict[str, Any], seed: int = 0, root: Path | None = None) -> Path:
    """Write an mlx-lm folder with random weights for `config` (mlx-lm's own seeded
    initialisation) and the bundled model's tokenizer files, under `root` (default: our cache).
    The folder's name hashes the config and seed, so it is built once and reused."""
    folder, tmp = folder_to_build(config["model_type"], [config, seed], root)
    if tmp is None:
        return folder
    model = build_module(Shape(folder.name, config), dtype=None, seed=seed)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    copy_bundled_tokenizer(tmp)
    publish(tmp, folder)
    return folder


# A tiny Qwen3-Embedding shape (the bundled tokenizer's vocabulary, a short context), for CPU runs
# of the embeddings bench and tests/tiny_models.py.
TINY_QWEN3 = {
    "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
    "vocab_size": 49152, "rope_theta": 1000000.0, "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}

# Qwen3-Embedding's sentence-transformers files, as its repository ships them: last-token
# pooling, normalised, and its query instruction (engine/loading/embedding_recipe.py reads them).
QWEN3_EMBEDDING_QUERY = ("Instruct: Given a web search query, retrieve relevant passages that "
                         "answer the query\nQuery:")


def _sentence_transformers_files(hidden_size: int) -> dict[str, Any]:
    return {
        "modules.json": [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"},
        ],
        "1_Pooling/config.json": {
            "word_embedding_dimension": hidden_size, "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": True, "include_prompt": True},
        "config_sentence_transformers.json": {
            "prompts": {"query": QWEN3_EMBEDDING_QUERY, "document": ""},
            "default_prompt_name": None, "similarity_fn_name": "cosine"},
    }


def embedding_folder(config: dict[str, Any], seed: int = 0, root: Path | None = None) -> Path:
    """`build_folder` plus Qwen3-Embedding's sentence-transformers files: a random-weight
    dedicated embedding model (a `qwen3` config) as the engine sees one."""
    folder = build_folder(config, seed, root)
    target = folder.with_name(f"{folder.name}-embedding")
    if not (target / "model.safetensors").exists():
        tmp = scratch_for(target)
        shutil.copytree(folder, tmp, dirs_exist_ok=True)
        for name, content in _sentence_transformers_files(int(config["hidden_size"])).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(json.dumps(content, indent=2))
        publish(tmp, target)
    return target


def fim_folder(config: dict[str, Any], family: str, seed: int = 0,
               root: Path | None = None) -> Path:
    """`build_folder` of `config` (the bundled tokenizer's vocabulary) with a FIM family's special
    tokens (engine/loading/fim_tokens.py `FAMILIES`) added to its tokenizer, ids from the
    vocabulary's end on: a code model's FIM tokens as the engine finds them in a real tokenizer."""
    from engine.loading.fim_tokens import FAMILIES

    spec = next(f for f in FAMILIES if f.name == family)
    tokens = [t for t in (spec.prefix, spec.suffix, spec.middle, spec.repo, spec.file_sep,
                          spec.end) if t is not None]
    base = int(config["vocab_size"])
    folder = build_folder({**config, "vocab_size": base + len(tokens)}, seed, root)
    target = folder.with_name(f"{folder.name}-fim-{family}")
    if (target / "model.safetensors").exists():
        return target
    tmp = scratch_for(target)
    shutil.copytree(folder, tmp, dirs_exist_ok=True)
    entry = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True}
    tok = json.loads((tmp / "tokenizer.json").read_text())
    tok["added_tokens"] += [{"id": base + i, "content": t, **entry} for i, t in enumerate(tokens)]
    (tmp / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((tmp / "tokenizer_config.json").read_text())
    cfg.get("added_tokens_decoder", {}).update(
        {str(base + i): {"content": t, **entry} for i, t in enumerate(tokens)})
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg))
    return publish(tmp, target)


def vocab_size(name: str) -> int:
    return int(text_config(SHAPES[name].config)["vocab_size"])


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """`n` random token ids in [10, vocab) (low ids are often control tokens in real vocabularies)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def conversation(total: int, vocab: int, system: int = 64, turn: int = 300, last_user: int = 120,
                 seed: int = 0) -> tuple[list[int], list[int]]:
    """Token ids of a chat of about `total` tokens (system prompt, alternating user/assistant
    turns, a final user turn of `last_user` tokens) and the offsets where its messages end."""
    tokens = prompt_ids(system, vocab, seed)
    ends = [len(tokens)]
    i = 1
    while len(tokens) + turn + last_user < total:
        tokens += prompt_ids(turn, vocab, seed + i)
        ends.append(len(tokens))
        i += 1
    tokens += prompt_ids(total - len(tokens), vocab, seed + 10_000)
    ends.append(len(tokens))
    return tokens, ends


def main() -> None:
    for shape in SHAPES.values():
        cfg = text_config(shape.config)
        print(f"{shape.name:16} {shape.about}: {cfg['num_hidden_layers']} layers, hidden "
              f"{cfg['hidden_size']}, vocab {cfg['vocab_size']}")


if __name__ == "__main__":
    main()
