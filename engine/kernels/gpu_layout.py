"""Run mlx-lm's dense attention and SwiGLU layers on a GPU with one product where they make three
or two: q/k/v as one matmul against their weights stacked, gate/up likewise.

On a GPU a decode step is bound by the host: MLX records and launches every op of the step's
graph, and the small projections cost as much to launch as to run. Stacking the weights drops
three kernels (and their graph nodes) per layer and gives the matmuls wider outputs. Each output
column is still one row of the original weights against the same input, so the results are those
of the separate products up to the order in which a kernel sums (tests/test_gpu_layout.py checks
the logits on the CPU; on a GPU in bf16 a random model's greedy tokens can part from mlx-lm's, as
with any change of kernel: the README's GPU table gives how many stayed equal).

`to_gpu_layout` replaces, in place, each decoder layer's `self_attn` of mlx-lm's llama, qwen2 and
qwen3 classes by `StackedAttention` and each `mlp` of their MLP classes (and Qwen3-Next's, which
the Qwen3.5 hybrids use) by `StackedMLP`. Their forward is mlx-lm's, restated around the one
product; every other module (norms, RoPE, o_proj, down_proj, the cache protocol) is the loaded one.
A layer whose attention and MLP both stacked also adds its two residuals inside the o_proj and
down products where those are plain dense linears (`ResidualBlock`, `add_product`: `mx.addmm`).
Plain and affine-quantized linears are both stacked (quantized rows stack with their scales and
biases). Anything else stays as loaded. Every decoder layer evaluates a long prompt chunk before
the next is built (`EvalEachLayer`), so a chunk's peak memory is one layer's activations. On CUDA, the quantized linears qmv_cuda.mode() picks
then run their decode products on qmv_cuda.py's kernel, and the dense bf16/fp16 linears the
products of the rows smallmm_cuda.mode() picks on smallmm_cuda.py's.
"""

from __future__ import annotations

import itertools
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3, qwen3_next
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import scaled_dot_product_attention

from ..mlx_lm_adapter import text_model
from ..slot_cache import SlotKVCache
from . import batch_attention, qmv_cuda, smallmm_cuda

ATTENTION = (llama.Attention, qwen2.Attention, qwen3.Attention)
MLP = (llama.MLP, qwen2.MLP, qwen3.MLP, qwen3_next.Qwen3NextMLP)
BLOCKS = (llama.TransformerBlock, qwen2.TransformerBlock, qwen3.TransformerBlock)


def add_product(linear: nn.Module, x: mx.array, residual: mx.array) -> mx.array:
    """`residual + linear(x)`, in one op where it can be:
    - a dense linear without a bias whose product MLX's matmul runs, for 2 rows or more
      (`mx.addmm`: the add in cuBLAS's epilogue, the sum rounded once where mlx-lm rounds the
      product, then the sum; one row keeps MLX's matrix-vector kernel and the add);
    - a linear with an `add_product` of its own (qmv_cuda.QMVLinear: the 4-bit tensor-core
      kernel's epilogue, rounded as mlx-lm rounds);
    else the product and an add."""
    dense = type(linear) is nn.Linear or (type(linear) is smallmm_cuda.SmallMMLinear and not linear.takes(x))
    if dense and "bias" not in linear and qmv_cuda.rows(x) > 1:
        return mx.addmm(residual, x, linear.weight.T)
    if hasattr(linear, "add_product"):
        return linear.add_product(x, residual)
    return residual + linear(x)


def stack(linears: list[nn.Module]) -> nn.Module | None:
    """One linear whose output is the outputs of `linears` side by side, or None when they do not
    stack (mixed kinds, quantization settings or biases)."""
    kinds = {type(m) for m in linears}
    has_bias = {"bias" in m for m in linears}
    if len(kinds) != 1 or len(has_bias) != 1:
        return None
    kind, bias = kinds.pop(), has_bias.pop()
    first = linears[0]
    if kind is nn.Linear:
        out = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(out)
        names = ["weight"]
    elif kind is nn.QuantizedLinear:
        settings = {(m.group_size, m.bits, m.mode, "biases" in m) for m in linears}
        if len(settings) != 1 or first.mode != "affine":
            return None
        out = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
        nn.Module.__init__(out)
        out.group_size, out.bits, out.mode = first.group_size, first.bits, first.mode
        names = ["weight", "scales"] + (["biases"] if "biases" in first else [])
    else:
        return None
    for name in names + (["bias"] if bias else []):
        out[name] = mx.concatenate([m[name] for m in linears], axis=0)
    if kind is nn.QuantizedLinear:
        out.freeze()  # as QuantizedLinear.__init__ leaves it
    return out


def _sizes(linears: list[nn.Module]) -> list[int]:
    """Where the stacked output splits: the running sum of each part's output width (a weight's
    rows, packed or not)."""
    return list(itertools.accumulate(m.weight.shape[0] for m in linears[:-1]))


class StackedAttention(nn.Module):
    """mlx-lm's llama/qwen2/qwen3 attention with q, k and v from one product."""

    def __init__(self, attn: nn.Module, qkv: nn.Module):
        super().__init__()
        self.qkv_proj = qkv
        self.o_proj = attn.o_proj
        self.rope = attn.rope
        if "q_norm" in attn:  # qwen3
            self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.n_heads, self.n_kv_heads, self.scale = attn.n_heads, attn.n_kv_heads, attn.scale
        self.split = _sizes([attn.q_proj, attn.k_proj, attn.v_proj])
        self.rows_layer: batch_attention.RowsLayer | None | bool = False  # made at the first batched step

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None,
                 residual: mx.array | None = None) -> mx.array:
        """mlx-lm's attention; with `residual`, that plus the attention's output (`add_product`)."""
        B, L, _ = x.shape
        qkv = self.qkv_proj(x)
        # a batched decode step over the batch's cache: each row over its own keys (batch_attention.py)
        rows_attention = L == 1 and type(cache) is SlotKVCache and batch_attention.enabled(x.dtype)
        if rows_attention == "kernel" and cache.keys is not None:
            if self.rows_layer is False:
                self.rows_layer = batch_attention.RowsLayer.of(self, x.dtype)
            if self.rows_layer is not None:  # norms, RoPE, the cache's new column and attention in one kernel
                return self._out(batch_attention.attention_rows(self.rows_layer, qkv, cache), residual)
        queries, keys, values = mx.split(qkv, self.split, axis=-1)
        queries = queries.reshape(B, L, self.n_heads, -1)
        keys = keys.reshape(B, L, self.n_kv_heads, -1)
        if "q_norm" in self:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
            if rows_attention:
                attend = batch_attention.attend_rows if rows_attention == "kernel" else batch_attention.attend_rows_ref
                return self._out(attend(queries, cache.keys, cache.values, cache.left_padding, cache.offset,
                                        self.scale), residual)
        else:
            queries, keys = self.rope(queries), self.rope(keys)
        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale,
                                              mask=mask)
        return self._out(output.transpose(0, 2, 1, 3).reshape(B, L, -1), residual)

    def _out(self, attended: mx.array, residual: mx.array | None) -> mx.array:
        return self.o_proj(attended) if residual is None else add_product(self.o_proj, attended, residual)


class StackedMLP(nn.Module):
    """mlx-lm's SwiGLU MLP with gate and up from one product."""

    def __init__(self, mlp: nn.Module, gate_up: nn.Module):
        super().__init__()
        self.gate_up_proj = gate_up
        self.down_proj = mlp.down_proj
        self.split = _sizes([mlp.gate_proj, mlp.up_proj])

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """mlx-lm's MLP; with `residual`, that plus the MLP's output (`add_product`)."""
        gate, up = mx.split(self.gate_up_proj(x), self.split, axis=-1)
        act = swiglu(gate, up)
        return self.down_proj(act) if residual is None else add_product(self.down_proj, act, residual)


class ResidualBlock:
    """Mixed into a decoder layer of mlx-lm's llama, qwen2 and qwen3 (their `TransformerBlock`)
    whose attention and MLP are stacked: mlx-lm's block, `h = x + attn(norm(x))`, `h +
    mlp(norm(h))`, with both adds in the products before them (`add_product`). On a GPU a
    batched step or a prompt chunk is bound by the host's work per op (docs/gpu.md): a 36-layer
    bf16 model's step has 72 ops fewer."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h = self.self_attn(self.input_layernorm(x), mask, cache, residual=x)
        return self.mlp(self.post_attention_layernorm(h), residual=h)


def residual_blocks(model: nn.Module) -> None:
    """Give each decoder layer of `model` that ResidualBlock takes its behaviour (in place)."""
    for layer in decoder_layers(model):
        if type(layer) in BLOCKS and type(getattr(layer, "self_attn", None)) is StackedAttention \
                and type(getattr(layer, "mlp", None)) is StackedMLP:
            mix_in(layer, ResidualBlock)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """`model`'s decoder layers (of its text model, for a vision-language one)."""
    inner = text_model(model)
    return getattr(getattr(inner, "model", inner), "layers", None) or getattr(inner, "layers", [])


_MIXED: dict[tuple[type, type], type] = {}


def mix_in(layer: nn.Module, mixin: type) -> None:
    """Give `layer` `mixin`'s behaviour before its own class's (in place; one class a pair, named
    as the layer's), where it has not got it yet."""
    cls = type(layer)
    if issubclass(cls, mixin):
        return
    if (mixin, cls) not in _MIXED:
        _MIXED[mixin, cls] = type(cls.__name__, (mixin, cls), {})
    layer.__class__ = _MIXED[mixin, cls]


# A prompt chunk of this many positions or more is evaluated layer by layer (see EvalEachLayer).
EVAL_ROWS = 256


def _cache_arrays(cache: Any) -> list[mx.array]:
    """The arrays a layer's cache holds (keys and values, or recurrent state)."""
    held = [getattr(cache, "keys", None), getattr(cache, "values", None), *(getattr(cache, "cache", None) or [])]
    return [a for a in held if isinstance(a, mx.array)]


class EvalEachLayer:
    """Mixed into each decoder layer's class: a prompt chunk of EVAL_ROWS positions or more is
    evaluated, with what the layer wrote into its cache, before the next layer is built. MLX's
    CUDA backend keeps a graph's intermediates until the graph's work completes, so a chunk
    evaluated whole held every layer's activations at once (the peak grew with the chunk and the
    depth: ~2.8 MB a chunk token for Qwen3-8B); layer by layer, one layer's are held. A sync a
    layer costs nothing next to a layer's prompt work (the CPU layout's MLP does the same)."""

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = super().__call__(x, *args, **kwargs)
        if x.ndim == 3 and x.shape[1] >= EVAL_ROWS:
            cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
            mx.eval(out, *_cache_arrays(cache))
        return out


def eval_each_layer(model: nn.Module) -> None:
    """Give each of `model`'s decoder layers the EvalEachLayer behaviour (in place)."""
    for layer in decoder_layers(model):
        mix_in(layer, EvalEachLayer)


def to_gpu_layout(model: nn.Module) -> nn.Module:
    """Stack the projections of every layer that takes it (in place; returns `model`). Each
    layer's stacked weights are evaluated before the next, so the unstacked ones are freed as it
    goes and the peak memory grows by one layer's projections, not a model's."""
    for layer in getattr(model, "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(attn) in ATTENTION:
            qkv = stack([attn.q_proj, attn.k_proj, attn.v_proj])
            if qkv is not None:
                layer.self_attn = StackedAttention(attn, qkv)
                mx.eval(qkv.parameters())
        if type(mlp) in MLP:
            gate_up = stack([mlp.gate_proj, mlp.up_proj])
            if gate_up is not None:
                layer.mlp = StackedMLP(mlp, gate_up)
                mx.eval(gate_up.parameters())
    qmv_cuda.use_qmv(model, qmv_cuda.mode())
    smallmm_cuda.use_smallmm(model, smallmm_cuda.mode())
    residual_blocks(model)
    eval_each_layer(model)
    return model
