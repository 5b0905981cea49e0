"""llama.cpp's CUDA build as the GPU bench's anchor, measured on the same machine in the same call as
our rows (`python -m bench.gpu_step --parts llamacpp,...`).

`bash bench/setup-llamacpp cuda` builds it into bench/.llamacpp-cuda/bin. This module writes a
random-weight llama of the Qwen3-8B shape's sizes (hidden, layers, heads, MLP width; the vocabulary
of the llama.cpp vocab file the build keeps, 128,256 words) as an F16 GGUF, has llama.cpp quantize
it to Q8_0 and Q4_0 ("pure": every tensor), and runs `llama-bench` (decode of `gen` tokens and a
prompt of `prompt` tokens, flash attention, every layer on the GPU) and `llama-batched-bench`
(N streams of 64-token prompts). Its weights are not ours: the comparison is of speeds on the same
sizes, and a row also gives our rate scaled by the bytes each side reads per token.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent / ".llamacpp-cuda"
TYPES = {"F16": "qwen3-8b", "Q8_0": "qwen3-8b-8bit", "Q4_0": "qwen3-8b-4bit"}  # our shape per type


def binaries(root: Path = ROOT) -> Path | None:
    """The build's bin folder, when `bash bench/setup-llamacpp cuda` made it."""
    b = root / "bin"
    return b if (b / "llama-bench").exists() else None


def vocab_file(root: Path = ROOT) -> Path:
    return root / "ggml-vocab-llama-bpe.gguf"


def write_random_llama(out: Path, config: dict[str, Any], vocab: Path, seed: int = 0) -> Path:
    """An F16 GGUF of a llama with `config`'s sizes, N(0, 0.02) weights, the tokenizer of `vocab`."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads, ffn = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // heads
    writer = GGUFWriter(str(out), "llama")
    n_vocab = 0
    for key, field in GGUFReader(str(vocab)).fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
            value = field.contents()
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(value)
            writer.add_key_value(key, value, vtype, sub)
    writer.add_context_length(32768)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(n_vocab)
    rng = np.random.default_rng(seed)
    block = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float16)

    def rnd(*shape: int) -> np.ndarray:  # a repeated random block: the file's values, not its speed
        n = int(np.prod(shape))
        return np.tile(block, -(-n // block.size))[:n].reshape(shape)

    ones = np.ones(hidden, np.float32)
    writer.add_tensor("token_embd.weight", rnd(n_vocab, hidden))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", rnd(n_vocab, hidden))
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        writer.add_tensor(p + "ffn_norm.weight", ones)
        writer.add_tensor(p + "attn_q.weight", rnd(heads * head_dim, hidden))
        writer.add_tensor(p + "attn_k.weight", rnd(kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_v.weight", rnd(kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_output.weight", rnd(hidden, heads * head_dim))
        writer.add_tensor(p + "ffn_gate.weight", rnd(ffn, hidden))
        writer.add_tensor(p + "ffn_up.weight", rnd(ffn, hidden))
        writer.add_tensor(p + "ffn_down.weight", rnd(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def quantize(bin_dir: Path, src: Path, kind: str) -> Path:
    dst = src.with_name(src.name.replace("F16", kind))
    p = subprocess.run([str(bin_dir / "llama-quantize"), "--pure", str(src), str(dst), kind,
                        str(os.cpu_count() or 4)], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"llama-quantize {kind}: {p.stderr[-800:]}")
    return dst


def bench(bin_dir: Path, models: list[Path], gen: int, prompt: int, reps: int) -> list[dict[str, Any]]:
    """llama-bench's JSON rows: decode of `gen` tokens and a `prompt`-token prompt per model, flash
    attention on, every layer on the GPU, `reps` repetitions (per-rep rates in `samples_ts`)."""
    cmd = [str(bin_dir / "llama-bench"), "-ngl", "99", "-fa", "1", "-p", str(prompt), "-n", str(gen),
           "-r", str(reps), "-o", "json"]
    for m in models:
        cmd += ["-m", str(m)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"llama-bench: {p.stderr[-800:]}")
    return json.loads(p.stdout)


def batched(bin_dir: Path, model: Path, streams: str = "1,8,32", prompt: int = 64, gen: int = 256) -> list[dict[str, float]]:
    """llama-batched-bench: N streams of `prompt`-token prompts, `gen` tokens each; per N the
    generation rate (tok/s over all streams)."""
    p = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", str(model), "-ngl", "99", "-fa", "1",
                        "-c", "16384", "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(gen),
                        "-npl", streams], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"llama-batched-bench: {p.stderr[-800:]}")
    rows = []
    for line in p.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and re.fullmatch(r"\d+", cells[0]):
            # |PP|TG|B|N_KV|T_PP s|S_PP t/s|T_TG s|S_TG t/s|T s|S t/s|
            rows.append({"streams": int(cells[2]), "gen_tps": float(cells[7]), "prompt_tps": float(cells[5])})
    return rows


def measure(config: dict[str, Any], work: Path, gen: int = 128, prompt: int = 4096, reps: int = 10,
            streams: str = "1,8,32") -> dict[str, Any]:
    """Build the three files, run both benches; returns per type (F16/Q8_0/Q4_0) the decode and
    prompt rates (per rep), the file's bytes per token, and the batched rates of F16 and Q4_0."""
    bin_dir = binaries()
    if bin_dir is None:
        raise RuntimeError("no llama.cpp CUDA build: run `bash bench/setup-llamacpp cuda` first")
    work.mkdir(parents=True, exist_ok=True)
    f16 = write_random_llama(work / "llama-F16.gguf", config, vocab_file())
    files = {"F16": f16, "Q8_0": quantize(bin_dir, f16, "Q8_0"), "Q4_0": quantize(bin_dir, f16, "Q4_0")}
    out: dict[str, Any] = {"types": {}, "batched": {}}
    for r in bench(bin_dir, list(files.values()), gen, prompt, reps):
        kind = next(k for k, f in files.items() if Path(r["model_filename"]).name == f.name)
        entry = out["types"].setdefault(kind, {"bytes": files[kind].stat().st_size, "model_size": r.get("model_size")})
        entry["decode_tps" if r.get("n_gen") else "prompt_tps"] = r.get("samples_ts") or [r["avg_ts"]]
    for kind in ("F16", "Q4_0"):
        out["batched"][kind] = batched(bin_dir, files[kind], streams)
    for f in files.values():
        f.unlink(missing_ok=True)
    return out
