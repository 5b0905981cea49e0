"""The real bundled model on our CPU kernels: weights stay quantized, greedy tokens equal mlx-lm's
own generation on the converted folder as loaded (4-bit weights, fp16 scales), and a build that
cannot load leaves the app answering on the fp32 layout, with one warning that names the fix."""

import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate

from engine.decoding.generate import build_prompt, generate
from engine.decoding.sampling import SamplingParams
from engine.kernels import active_path
from engine.kernels.cpu_layout import fp32_bytes
from engine.kernels.layout import KernelEmbedding, KernelLinear, KernelLlamaAttention
from chats import CONVERSATIONS
from live_server import linked_home

REPO = Path(__file__).resolve().parent.parent


def kinds(model):
    return {type(m) for _, m in model.named_modules()}


def test_the_bundled_model_runs_on_the_kernels_with_quantized_weights(lm):
    assert active_path().startswith("quantized CPU kernels"), active_path()
    found = kinds(lm.model)
    assert {KernelLinear, KernelEmbedding, KernelLlamaAttention} <= found
    assert nn.QuantizedLinear not in found and nn.Linear not in found
    head = lm.model.model.embed_tokens  # tied: the output head is the 8-bit embedding
    assert head["weight"].dtype == mx.uint32 and head.bits == 8
    held = sum(v.nbytes for _, v in __import__("mlx.utils").utils.tree_flatten(lm.model.parameters()))
    assert held < fp32_bytes(lm.model) / 4  # quantized, not the fp32 expansion


@pytest.fixture(scope="module")
def as_loaded(lm):
    """mlx-lm's own model on the same converted folder, exactly as it loads."""
    model, _ = mlx_lm_load(str(lm.path))
    return model


@pytest.fixture(scope="module")
def mlx_lm_tokens(lm, as_loaded):
    """Each identity conversation's greedy tokens from mlx-lm's own `stream_generate` on the model
    as loaded (end-of-sequence tokens dropped), computed once for the module: mlx-lm's quantized
    matmuls on the CPU cost ~0.13 s a token here, so each conversation's 48 are ~11 s."""
    found = {}

    def tokens(conversation):
        if conversation not in found:
            prompt = build_prompt(lm, messages=CONVERSATIONS[conversation])
            theirs = [r.token for r in stream_generate(as_loaded, lm.tokenizer,
                                                       mx.array(prompt.tokens), max_tokens=48)]
            eos = set(lm.tokenizer.eos_token_ids)
            found[conversation] = [t for t in theirs if t not in eos]
        return found[conversation]
    return tokens


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_greedy_tokens_equal_mlx_lm_as_loaded(lm, mlx_lm_tokens, conversation):
    prompt = build_prompt(lm, messages=CONVERSATIONS[conversation])
    ours = [e.token for e in generate(lm, prompt, SamplingParams(max_tokens=48)) if e.kind == "token"]
    assert ours == mlx_lm_tokens(conversation)
    assert len(ours) > 8


FALLBACK_SCRIPT = """
from engine.decoding.generate import build_prompt, generate
from engine.decoding.sampling import SamplingParams
from engine.kernels import active_path
from engine.loading.registry import load_model
lm = load_model(None)
prompt = build_prompt(lm, messages=[{"role": "user", "content": "What is the capital of France?"}])
tokens = [e.token for e in generate(lm, prompt, SamplingParams(max_tokens=12)) if e.kind == "token"]
print("PATH", active_path())
print("TOKENS", tokens)
"""


@pytest.mark.timeout(600)
def test_a_build_that_cannot_load_falls_back_with_one_warning(lm, tmp_path):
    """A cached extension that does not load (as one built for another mlx) on a machine without
    a compiler: the app still answers, on the fp32 layout, with the same greedy tokens."""
    home = linked_home(tmp_path / "home", "models", "converted")
    env = dict(os.environ, MLXCHAT_HOME=str(home), PYTHONPATH=str(REPO), PATH=str(tmp_path / "bin"))
    env.pop("MLXCHAT_THREADS", None)
    key = subprocess.run([sys.executable, "-c", "from engine.kernels.native import build_dir; "
                          "print(build_dir())"], env=env, capture_output=True, text=True, check=True)
    broken = Path(key.stdout.strip())
    broken.mkdir(parents=True)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    module = broken / f"_mlxchat_kernels{suffix}"
    module.write_bytes(b"built for mlx 0.0.1")
    # its digest as a build records it: the module is intact, and only loading it fails
    module.with_name(module.name + ".sha256").write_text(hashlib.sha256(module.read_bytes()).hexdigest())
    out = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=500, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    warnings = [line for line in out.stderr.splitlines() if "CPU kernels are unavailable" in line]
    assert len(warnings) == 1, out.stderr[-2000:]
    assert "does not load" in warnings[0] and "missing build tools: cmake" in warnings[0]
    assert "Fix: run scripts/setup" in warnings[0]
    assert "PATH fp32 layout (CPU kernels unavailable:" in out.stdout
    prompt = build_prompt(lm, messages=[{"role": "user", "content": "What is the capital of France?"}])
    ours = [e.token for e in generate(lm, prompt, SamplingParams(max_tokens=12)) if e.kind == "token"]
    assert f"TOKENS {ours}" in out.stdout


@pytest.mark.timeout(600)
def test_a_load_transform_runs_before_the_cpu_layout():
    """A dequantizing transform (a speculative target's) sees the model as loaded; the layout then
    takes the dense model it leaves: no kernel-backed or quantized layer remains, and it answers."""
    from engine.decoding.speculative import dequantize
    from engine.kernels.layout import KernelLlamaBlock
    from engine.loading.registry import load_model

    dense = load_model(None, transform=dequantize(mx.float32))
    found = kinds(dense.model)
    assert not found & {KernelLinear, KernelEmbedding, KernelLlamaBlock, nn.QuantizedLinear}
    prompt = build_prompt(dense, messages=CONVERSATIONS["english"])
    assert [e.token for e in generate(dense, prompt, SamplingParams(max_tokens=4)) if e.kind == "token"]


def test_batched_greedy_steps_equal_each_row_alone_and_mlx_lm(lm, mlx_lm_tokens):
    """The three identity conversations decoded together over mlx-lm's BatchKVCache (left-padded
    to the longest prompt; one-token steps on our fused ops with per-row positions) give each row
    the greedy tokens it gets alone over a plain KVCache, and those are the first tokens mlx-lm's
    own `stream_generate` gives that conversation on the model as loaded (the identity test's
    reference, computed once for the module). mlx-lm's own model is not run on the batch: on the
    CPU its quantized matmuls took 23 s for the 3 x 49-row padded prefill and 16 steps, and it
    would only show mlx-lm's batch equal to mlx-lm alone."""
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    steps = 16
    prompts = [build_prompt(lm, messages=c).tokens for c in CONVERSATIONS.values()]
    width = max(map(len, prompts))
    padded = mx.array([[0] * (width - len(p)) + p for p in prompts])

    cache = [BatchKVCache([width - len(p) for p in prompts]) for _ in lm.model.layers]
    logits, out = lm.model(padded, cache=cache)[:, -1:], []
    for _ in range(steps):
        tokens = mx.argmax(logits, axis=-1)
        out.append(tokens[:, 0].tolist())
        logits = lm.model(tokens, cache=cache)
    ours = [list(row) for row in zip(*out)]

    for row, (conversation, prompt) in enumerate(zip(CONVERSATIONS, prompts)):
        cache, alone = make_prompt_cache(lm.model), []
        logits = lm.model(mx.array([prompt]), cache=cache)[:, -1:]
        for _ in range(steps):
            token = mx.argmax(logits, axis=-1)
            alone.append(token.item())
            logits = lm.model(token, cache=cache)
        assert ours[row] == alone, row
        theirs = mlx_lm_tokens(conversation)
        assert len(theirs) >= steps, (conversation, theirs)  # no end of answer within the steps
        assert ours[row] == theirs[:steps], conversation
