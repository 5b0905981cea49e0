"""A `tokenizer.json` from a GGUF file's vocabulary: byte-level BPE (`tokenizer.ggml.model` =
'gpt2') built here, sentencepiece ('llama': Llama 2, Mistral, Gemma, Phi-3) through transformers'
GGUF tokenizer builders, which know each family's quirks."""

from typing import Any

import mlx.core as mx

from ..errors import UnsupportedArchitecture

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


def _token_types(md: dict[str, Any], count: int) -> list[int]:
    types = md.get("tokenizer.ggml.token_type")
    return types.tolist() if isinstance(types, mx.array) else list(types or [1] * count)


def _byte_level_bpe(md: dict[str, Any]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

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
    return tokenizer


def _sentencepiece(md: dict[str, Any], arch: str):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tokens = md["tokenizer.ggml.tokens"]
    spec: dict[str, Any] = {
        "tokenizer_type": "llama",
        "tokens": tokens,
        "scores": mx.array(md["tokenizer.ggml.scores"]).tolist(),
        "token_type": _token_types(md, len(tokens)),
    }
    if "tokenizer.ggml.merges" in md:
        spec["merges"] = md["tokenizer.ggml.merges"]
    for key in ("bos", "eos", "unknown", "padding"):
        value = md.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            spec[f"{'unk' if key == 'unknown' else 'pad' if key == 'padding' else key}_token_id"] = _scalar(value)
    tokenizer, _ = convert_gguf_tokenizer(arch, spec)
    return tokenizer


def add_bos(md: dict[str, Any]) -> bool:
    """llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise."""
    default = md.get("tokenizer.ggml.model") == "llama"
    return bool(_scalar(md.get("tokenizer.ggml.add_bos_token", default)))


def tokenizer_json(md: dict[str, Any], arch: str) -> tuple[str, list[str]]:
    """The `tokenizer.json` text for this file, and its special-token strings."""
    from tokenizers import AddedToken, processors

    kind = md.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(md)
    elif kind == "llama":
        tokenizer = _sentencepiece(md, arch)
    else:
        raise UnsupportedArchitecture(
            f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, "
            "'llama' sentencepiece)"
        )
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types = _token_types(md, len(tokens))
    # Type 3 = control tokens (<|im_start|> ...), type 4 = user-defined: both must stay single ids.
    special = [tokens[i] for i, t in enumerate(types) if t == 3]
    user_defined = [tokens[i] for i, t in enumerate(types) if t == 4]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    if add_bos(md):
        bos = tokens[_scalar(md["tokenizer.ggml.bos_token_id"])]
        bos_id = _scalar(md["tokenizer.ggml.bos_token_id"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, bos_id)],
        )
    else:
        tokenizer.post_processor = None
    return tokenizer.to_str(), special
