"""Multi-token-prediction (MTP) heads of Qwen3.5 / Qwen3-Next, which mlx-lm drops on load, and a
drafter that self-speculates with them.

The head (as in the reference implementations): embed the next token, RMS-normalise it and the
main model's final (normed) hidden state separately, concatenate [embedding, hidden], project 2H -> H
with `fc`, run one full-attention decoder layer of the main architecture (its own KV cache), and a
final norm; the main model's `lm_head` turns the result into logits. Chaining feeds the head's own
output back in as the hidden state of the next draft.
"""

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ..errors import ModelLoadError
from ..loading.registry import LoadedModel
from ..mlx_lm_adapter import text_model
from .speculative import Pick, split_model

MTP_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


class MtpHead(nn.Module):
    def __init__(self, layer: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = [layer]
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: KVCache) -> mx.array:
        """(1, n, H) embeddings of tokens t+1 and hidden states at t -> (1, n, H) for t+2."""
        x = mx.concatenate([self.pre_fc_norm_embedding(embeddings),
                            self.pre_fc_norm_hidden(hidden)], axis=-1)
        x = self.fc(x)
        x = self.layers[0](x, mask=create_attention_mask(x, cache), cache=cache)
        return self.norm(x)


def _text_args(model: nn.Module) -> Any:
    return text_model(model).args


def build_mtp_head(model: nn.Module) -> MtpHead:
    """An MTP head (random weights) shaped for `model`, a qwen3_5 / qwen3_next mlx-lm model."""
    args = _text_args(model)
    family = args.model_type
    if family == "qwen3_next":
        from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer as Layer
    elif family.startswith("qwen3_5"):
        from mlx_lm.models.qwen3_5 import DecoderLayer as Layer
    else:
        raise ModelLoadError(f"{family!r} models have no MTP head (supported: {', '.join(MTP_FAMILIES)})")
    # A layer index whose layer is full attention (every `full_attention_interval`-th layer), and
    # whose MLP is the MoE block where the model has one: the MTP layer is of that kind.
    interval = args.full_attention_interval
    index = next(i for i in range(interval - 1, 10 * interval, interval)
                 if i not in getattr(args, "mlp_only_layers", []))
    return MtpHead(Layer(args, index), args.hidden_size, args.rms_norm_eps)


def _mtp_layer_count(config: dict) -> int:
    text = config.get("text_config", config)
    return int(text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 0)))


def _read_mtp_weights(folder: Path) -> tuple[dict[str, mx.array], bool]:
    """The checkpoint's mtp.* tensors (keys relative to the head) and whether the checkpoint is a raw
    Hugging Face one (its norms store w - 1, and experts are unstacked), judged as mlx-lm does: an
    unsanitized conv1d weight."""
    index = folder / "model.safetensors.index.json"
    files = (sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
             if index.exists() else sorted(folder.glob("*.safetensors")))
    weights: dict[str, mx.array] = {}
    raw = False
    for f in files:
        for key, value in mx.load(str(f)).items():
            if "conv1d.weight" in key and value.shape[-1] != 1:
                raw = True
            if key.startswith("mtp.") or ".mtp." in key:
                weights[key[key.index("mtp.") + 4:]] = value
    return weights, raw


def _sanitize(weights: dict[str, mx.array], raw: bool, num_experts: int) -> dict[str, mx.array]:
    out = dict(weights)
    if raw:
        for key, value in weights.items():
            if "norm.weight" in key and value.ndim == 1 and "linear_attn" not in key:
                out[key] = value + 1.0
    for name in ("up_proj", "down_proj", "gate_proj"):
        for suffix in ("weight", "scales", "biases"):
            experts = [f"layers.0.mlp.experts.{e}.{name}.{suffix}" for e in range(num_experts)]
            if num_experts and experts[0] in out:
                out[f"layers.0.mlp.switch_mlp.{name}.{suffix}"] = mx.stack([out.pop(k) for k in experts])
    return out


def load_mtp_head(lm: LoadedModel) -> MtpHead:
    """Load the MTP head from the checkpoint folder of `lm`; raises ModelLoadError if it has none."""
    if lm.family not in MTP_FAMILIES:
        raise ModelLoadError(f"{lm.name}: {lm.family!r} models have no MTP head")
    layers = _mtp_layer_count(lm.config)
    if layers == 0:
        raise ModelLoadError(f"{lm.name}: no MTP head (its config declares no MTP layers)")
    if layers != 1:
        raise ModelLoadError(f"{lm.name}: config declares {layers} MTP layers; only 1 is supported")
    weights, raw = _read_mtp_weights(lm.path)
    if not weights:
        raise ModelLoadError(f"{lm.name}: no MTP head (the checkpoint in {lm.path} has no mtp.* weights)")
    head = build_mtp_head(lm.model)
    weights = _sanitize(weights, raw, getattr(_text_args(lm.model), "num_experts", 0))
    quant = lm.config.get("quantization")
    if quant and any(k.endswith(".scales") for k in weights):
        nn.quantize(head, group_size=quant["group_size"], bits=quant["bits"],
                    class_predicate=lambda path, _: f"{path}.scales" in weights)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"{lm.name}: mtp.* weights do not fit the MTP head: {exc}") from exc
    mx.eval(head.parameters())
    return head


class MtpDrafter:
    """Drafts with an MTP head from the target's own hidden states.

    The head's cache holds one entry per position j (pair: target hidden at j, token j+1). The
    target's hidden rows wait in `self.hidden` until the token after them is known; `propose` first
    consumes every pair it can (the last one yields draft 1), then chains k - 1 more steps, whose
    cache entries `commit` drops again.
    """

    needs_hidden = True

    def __init__(self, target: nn.Module, head: MtpHead):
        body, self.lm_head = split_model(target)
        self.embed = body.embed_tokens
        self.head = head
        self.cache = KVCache()
        self.length: int | None = None  # positions whose pair is in the cache
        self.hidden: mx.array | None = None  # (n, H) target hidden rows from position self.length
        self.chained = 0

    def prefill(self, start: int, tokens: mx.array, hidden: mx.array | None) -> None:
        self._keep(start, hidden)

    def _keep(self, start: int, hidden: mx.array) -> None:
        """Store the target's hidden rows for positions start.. (those not already held)."""
        if self.length is None:
            self.length = start  # a reused prefix has no hidden states: the head starts here
        skip = self.length + (0 if self.hidden is None else self.hidden.shape[0]) - start
        rows = hidden[max(skip, 0):]
        if rows.shape[0]:
            self.hidden = rows if self.hidden is None else mx.concatenate([self.hidden, rows])

    def propose(self, seq: list[int], k: int, pick: Pick) -> tuple[list[mx.array], list[mx.array]]:
        assert self.length is not None and self.hidden is not None
        n = len(seq) - 1 - self.length
        tokens = mx.array(seq[self.length + 1:], dtype=mx.uint32)
        out = self.head(self.embed(tokens[None]), self.hidden[None, :n], self.cache)
        self.hidden = self.hidden[n:] if self.hidden.shape[0] > n else None
        self.length += n
        x = out[:, -1:]
        drafts, probs = [], []
        for i in range(k):
            token, q = pick(self.lm_head(x)[0, -1])
            drafts.append(token)
            probs.append(q)
            if i < k - 1:
                x = self.head(self.embed(token.reshape(1, 1)), x, self.cache)
        self.chained = max(k - 1, 0)
        return drafts, probs

    def commit(self, seq: list[int], start: int, hidden: mx.array | None) -> None:
        self.cache.trim(self.chained)
        self.chained = 0
        self._keep(start, hidden)
