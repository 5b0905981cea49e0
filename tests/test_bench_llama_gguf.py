"""bench/llama_gguf.py: the bench's random llama written as a GGUF is the same model.

A tiny random 4-bit llama is built by bench/decode.py's `random_folder` (the code path of the
350M and 1B bench models), written as an F32 GGUF by `write_gguf`, and both are loaded as the app
loads them (`load_model` on the folder, and on the .gguf file through our GGUF converter). Their
logits must agree at every position of a 10-token prompt within 0.05 (logits reach ~5; the
folder model runs fp16 activations, the GGUF one fp32). Position 0 has no rotation, so the later
positions are what check the q/k permutation: written without it, they differ by more than 1.
llama.cpp itself is not needed (its bench venv is not installed in CI).
"""
import hashlib
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from bench.decode import random_folder
from bench.llama_gguf import write_gguf
from engine.loading.folders import converted_folder
from engine.loading.registry import load_model

pytestmark = pytest.mark.fast

SHAPE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2)
PROMPT = [1, 500, 2000, 37, 9000, 12, 44, 100, 8000, 3]
TOLERANCE = 0.05


@pytest.mark.slow  # seconds of compute by design: the second tier
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_gguf_of_a_random_folder_gives_the_folder_models_logits(tmp_path, kind):
    shape = SHAPE if kind == "llama" else {**SHAPE, "model_type": "qwen3", "head_dim": 16}
    name = f"{kind}-gguf-test-" + hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]
    folder = random_folder(name, shape)
    gguf = write_gguf(folder, tmp_path / "tiny.gguf")
    try:
        ours, theirs = load_model(str(folder)), load_model(str(gguf))
        assert theirs.config["model_type"] == kind
        if kind == "llama":  # llama.cpp's rotation, on permuted q/k
            assert theirs.config["rope_traditional"] is True
            assert not ours.config.get("rope_traditional", False)
        ids = mx.array([PROMPT])
        a = np.array(ours.model(ids).astype(mx.float32))[0]
        b = np.array(theirs.model(ids).astype(mx.float32))[0]
    finally:
        shutil.rmtree(converted_folder(gguf), ignore_errors=True)
    assert np.abs(a).max() > 1.0  # logits far from zero, so the tolerance is a real bound
    per_position = np.abs(a - b).max(axis=-1)
    assert per_position.max() < TOLERANCE, per_position
