"""Random-weight speech models for tests and benchmarks, as the folders a user would pull.

- Whisper (speech to text, mlx-audio's `whisper`): config.json in MLX's layout, the model's
  weights, a Whisper tokenizer (the bundled SmolLM2 byte-level BPE padded to GPT-2's 50,257
  entries, then Whisper's special tokens at Whisper's own ids: end of text, start of transcript,
  the languages, the tasks, no-timestamps and the 1,501 timestamps) and the feature extractor's
  JSON, so that transformers' `WhisperProcessor` and `mlx_audio.stt.load` load it.
- Kokoro (text to speech, mlx-audio's `kokoro`): config.json with a phoneme vocabulary, the
  weights and a few random voice packs under voices/.

Weights are mlx-audio's own seeded initialisation; folders are named by a hash of their recipe
and built once per cache directory (bench/shapes.py's `folder_to_build`).

    folder = whisper_folder(WHISPER_TINY)        # tests: a 30 s window, 64-wide, 2+2 layers
    folder = whisper_folder(WHISPER_LARGE_V3_TURBO)   # bench.voice: the full-size shape
    folder = kokoro_folder(KOKORO_TINY)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path

from bench.shapes import folder_to_build, publish

GPT2_VOCAB = 50257  # Whisper's text vocabulary (GPT-2's byte-level BPE) before its special tokens
TIMESTAMPS = 1501  # <|0.00|> ... <|30.00|>

# MLX-layout Whisper configs (mlx-audio's ModelDimensions). The encoder always takes a 30 s window
# (1,500 audio positions); the tiny decoder's short context keeps a random model's runaway
# transcripts short (at most n_text_ctx / 2 tokens a window).
WHISPER_TINY = {
    "model_type": "whisper", "n_mels": 80, "n_audio_ctx": 1500, "n_audio_state": 64,
    "n_audio_head": 2, "n_audio_layer": 2, "n_vocab": 51865, "n_text_ctx": 64,
    "n_text_state": 64, "n_text_head": 2, "n_text_layer": 2,
}
WHISPER_LARGE_V3_TURBO = {
    "model_type": "whisper", "n_mels": 128, "n_audio_ctx": 1500, "n_audio_state": 1280,
    "n_audio_head": 20, "n_audio_layer": 32, "n_vocab": 51866, "n_text_ctx": 448,
    "n_text_state": 1280, "n_text_head": 20, "n_text_layer": 4,
}

# Kokoro's phoneme alphabet (misaki's symbols and punctuation), enough for the espeak-ng
# phonemes engine/decoding/speech.py feeds it; id 0 is the start/end pad.
PHONEMES = (";:,.!?¡¿—…\"«»“” ()$%&*+-/0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
            "abcdefghijklmnopqrstuvwxyzæçðøħŋœǀǁǂǃɐɑɒɓɔɕɖɗɘəɚɛɜɝɞɟɠɡɢɣɤɥɦɧɨɪɫɬɭɮɯɰɱɲɳɴɵɶɸɹɺɻɽɾ"
            "ʀʁʂʃʄʈʉʊʋʌʍʎʏʐʑʒʓʔʕʘʙʛʜʝʟʡʢʤʧʦʣʨʩʪʫˈˌːˑ˞ᵊᵻ↓↑→↗↘'̩̃")
KOKORO_VOCAB = {p: i + 1 for i, p in enumerate(dict.fromkeys(PHONEMES))}

_ISTFT_82M = {"upsample_kernel_sizes": [20, 12], "upsample_rates": [10, 6],
              "gen_istft_hop_size": 5, "gen_istft_n_fft": 20,
              "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
              "resblock_kernel_sizes": [3, 7, 11], "upsample_initial_channel": 512}
# Kokoro-82M's shape (hexgrad/Kokoro-82M's config.json, with this vocabulary).
KOKORO_82M = {
    "model_type": "kokoro", "istftnet": _ISTFT_82M, "dim_in": 64, "dropout": 0.2,
    "hidden_dim": 512, "max_conv_dim": 512, "max_dur": 50, "multispeaker": True, "n_layer": 3,
    "n_mels": 80, "n_token": 178, "style_dim": 128, "text_encoder_kernel_size": 5,
    "plbert": {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 2048,
               "max_position_embeddings": 512, "num_hidden_layers": 12, "dropout": 0.1},
    "vocab": KOKORO_VOCAB,
}
# The smallest Kokoro mlx-audio builds: its decoder's 1,024 channels, the 512-wide features between
# its parts and the 128-wide style halves are fixed in its code, so only the text encoder (ALBERT),
# the predictor's depth and the vocoder (its upsampling: 20 samples a frame where Kokoro makes
# 300, so a random model speaks fast; one residual block a stage) shrink; a short `max_dur` keeps
# a random model's phonemes a few frames long.
KOKORO_TINY = {
    **KOKORO_82M,
    "istftnet": {**_ISTFT_82M, "upsample_rates": [2, 2], "upsample_kernel_sizes": [4, 4],
                 "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]]},
    "max_dur": 6, "n_layer": 1,
    "plbert": {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
               "max_position_embeddings": 512, "num_hidden_layers": 1, "dropout": 0.1},
}
KOKORO_VOICES = ("af_heart", "am_echo", "bf_emma")


def whisper_special_tokens(n_vocab: int) -> list[str]:
    """Whisper's special tokens in id order from GPT2_VOCAB, for a model of `n_vocab` tokens."""
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    languages = list(LANGUAGES)[:n_vocab - GPT2_VOCAB - 8 - TIMESTAMPS]
    no_speech = "<|nospeech|>" if len(languages) >= 100 else "<|nocaptions|>"
    return (["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{c}|>" for c in languages]
            + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", no_speech,
               "<|notimestamps|>"] + [f"<|{i * 0.02:.2f}|>" for i in range(TIMESTAMPS)])


def _whisper_tokenizer(n_vocab: int) -> dict[str, Any]:
    """tokenizer.json: the bundled byte-level BPE, its control tokens renamed and the vocabulary
    padded to GPT2_VOCAB with unreachable entries, then Whisper's special tokens."""
    from engine.loading.registry import resolve

    _, bundled = resolve(None)
    tok = json.loads((bundled / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:  # its own control tokens become plain, unreachable entries
        vocab[f"<|smol{added['id']}|>"] = vocab.pop(added["content"])
    for i in range(len(vocab), GPT2_VOCAB):
        vocab[f"<|pad{i}|>"] = i
    special = whisper_special_tokens(n_vocab)
    tok["added_tokens"] = [{"id": GPT2_VOCAB + i, "content": t, "single_word": False,
                            "lstrip": False, "rstrip": False, "normalized": False, "special": True}
                           for i, t in enumerate(special)]
    tok["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                            "use_regex": True}
    tok["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                      "use_regex": True}
    return tok


def _whisper_files(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "tokenizer.json": _whisper_tokenizer(config["n_vocab"]),
        "tokenizer_config.json": {
            "tokenizer_class": "WhisperTokenizer", "model_max_length": config["n_text_ctx"],
            "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
            "processor_class": "WhisperProcessor"},
        "preprocessor_config.json": {
            "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": config["n_mels"],
            "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30, "n_fft": 400,
            "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right",
            "padding_value": 0.0, "return_attention_mask": False,
            "processor_class": "WhisperProcessor"},
    }


def whisper_folder(config: dict[str, Any] = WHISPER_TINY, seed: int = 0,
                   root: Path | None = None) -> Path:
    """A random-weight Whisper folder for `config` (see the module docstring)."""
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

    folder, tmp = folder_to_build("whisper", [config, seed], root)
    if tmp is None:
        return folder
    mx.random.seed(seed)
    model = Model(ModelDimensions.from_dict(config), dtype=mx.float16)
    decoder = model.decoder
    # Whisper learns its decoder's positions (mlx-audio starts them at zero): random ones here.
    decoder.positional_embedding = mx.random.normal(decoder.positional_embedding.shape)
    # mlx-audio's timestamp rule weighs all 1,501 timestamps together against the best text
    # token before it masks them; on random weights the timestamps always win there, every token
    # ends up masked and decoding yields token 0 over and over. Smaller timestamp rows leave a
    # random model's text tokens ahead, as a trained model's are.
    table = decoder.token_embedding.weight
    table = table / mx.sqrt(mx.mean(table * table))  # unit scale: logits as peaked as trained ones
    begin = config["n_vocab"] - TIMESTAMPS
    decoder.token_embedding.weight = mx.concatenate([table[:begin], table[begin:] * 0.1])
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"),
                        {k: v.astype(mx.float16) for k, v in weights.items()})
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for name, content in _whisper_files(config).items():
        (tmp / name).write_text(json.dumps(content, ensure_ascii=False))
    return publish(tmp, folder)


def kokoro_folder(config: dict[str, Any] = KOKORO_TINY, voices: tuple[str, ...] = KOKORO_VOICES,
                  seed: int = 0, root: Path | None = None) -> Path:
    """A random-weight Kokoro folder for `config`, with random voice packs named `voices`."""
    from mlx_audio.tts.models.kokoro.kokoro import Model, ModelConfig

    folder, tmp = folder_to_build("kokoro", [config, list(voices), seed], root)
    if tmp is None:
        return folder
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(config))
    # mlx-audio starts every weight-normed convolution's direction at all ones (a checkpoint
    # always replaces it): random directions instead, or every channel computes the same thing
    model.update(tree_map_with_path(
        lambda path, v: mx.random.normal(v.shape) if path.endswith("weight_v") else v,
        model.parameters()))
    weights = {}
    for key, value in tree_flatten(model.parameters()):
        # saved as Kokoro's checkpoints hold them: mlx-audio's `sanitize` transposes some
        # convolutions back on load (those it returns as a new array)
        kept = model.sanitize({key: value}).get(key) is value
        weights[key] = (value if kept else value.transpose(0, 2, 1)).astype(mx.bfloat16)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights)
    (tmp / "config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    (tmp / "voices").mkdir()
    for i, name in enumerate(voices):
        # a voice pack: one style vector (timbre, then prosody) per phoneme count, 510 of them
        pack = mx.random.normal((510, 1, 2 * config["style_dim"]), key=mx.random.key(seed + i))
        mx.save_safetensors(str(tmp / "voices" / f"{name}.safetensors"), {"voice": pack * 0.1})
    return publish(tmp, folder)
