"""Run mlx-lm's own model classes on mlxchat's CPU kernels, weights kept quantized.

`to_kernel_layout` changes the class of leaf modules in place (their parameters stay the same
arrays), as engine/kernels/cpu_layout.py does for its fp32 layout:

- `nn.QuantizedLinear` -> `KernelLinear` and `nn.QuantizedEmbedding` -> `KernelEmbedding` (whose
  `as_linear` is a tied output head): 1-8 rows run our quantized matmul straight on MLX's affine
  layout, short prompts the same kernel 8 rows at a time; long prompts (BLAS_ROWS rows or more) run
  `prefill_matmul` when an optimised BLAS is loaded: a tile of the weight (8 MB of fp32) dequantized
  at a time, then multiplied through BLAS, so no weight is ever whole in fp32;
- `nn.RMSNorm` -> `KernelRMSNorm`, `nn.RoPE` -> `KernelRoPE`;
- mlx-lm's llama `Attention` -> `KernelLlamaAttention`: one-token steps over a plain `KVCache`
  or a `BatchKVCache` (or their 8-bit forms, kv8.py, whose packed rows the kernels read) take our
  single-query attention, prompt chunks over either our causal attention (each position the
  same arithmetic as a decode step there; over a `BatchKVCache`, each row from its left padding
  on, outside a sliding window's layers); everything else runs mlx-lm's own code;
- mlx-lm's llama `MLP` -> `KernelMLP`: our SwiGLU between its products;
- mlx-lm's llama `TransformerBlock` -> `KernelLlamaBlock`: where every part of the layer took the
  kernels, a one-token step over a plain `KVCache` or a `BatchKVCache` is one op that also writes
  the cache (else two fused ops around the cache's own update).

A one-token step over mlx-lm's `BatchKVCache` (the scheduler's batched decoding) gives each row
its own RoPE position (the cache's per-row `offset`) and hides the keys before each row's
`left_padding`. That is all the mask does that mlx-lm's llama model builds for such a step
(`cache.make_mask(1)`: key t is visible to row b when `left_padding[b] <= t`), so the mask
itself is not read. A prompt chunk of L positions over such a cache (rows prefilled together) is
the same with causality: `make_mask(L)` shows row b's position i the keys `left_padding[b]`
to `_idx + i`, which `prefill_attention(..., starts=left_padding)` attends (a position that sees
no key, a left-padded one, gets what MLX gives it: the mean of every value); its RoPE takes
each row's `offset`, as mlx-lm's. Only the mask's kind and shape are checked, so the layers of
a sliding window, whose mask also hides keys older than the window, keep mlx-lm's code.

Activations are fp32 (the non-quantized parameters are cast to fp32; scales and biases keep their
dtype), and every weight is dequantized exactly (q * scale + bias in fp32) and accumulated in
fp32. A layer the kernels cannot take (other bits, group sizes or modes) keeps MLX's own
quantized op, with the reason logged. With int8 activations chosen at conversion
(`to_kernel_layout(model, int8=True)`; by default the process's choice, native.int8_activations),
products of fewer than INT8_BLAS_ROWS rows take the lossy int8-activation kernels instead (a
prompt chunk's x quantized once, each block of W's rows kept in cache while every 8 rows of x
pass over it); `int8_activations_of` says which a converted model took.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.activations import swiglu

from . import native
from ..model_cache import batch_kv, plain_kv
from .inputs import int32
from .kv8 import packed_kv
from .cpu_layout import swap_matvec

log = logging.getLogger(__name__)

# From this many rows on (prompt prefill), dequantizing the weight to fp32 (a tile at a time) for
# BLAS beats our kernel 8 rows at a time; below it the dequantization costs more than it saves.
BLAS_ROWS = 64
# On the int8 path our kernel (x quantized once, W read once per chunk) keeps up with BLAS longer:
# 70 vs 55 G multiply-adds/s at 128 rows, 71 vs 92 at 512 (a 3B layer, two cores, Zen 4).
INT8_BLAS_ROWS = 256
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def unsupported(module: nn.Module) -> str | None:
    """Why our kernels cannot run this quantized module, or None when they can."""
    mode = getattr(module, "mode", "affine")
    if mode != "affine":
        return f"quantization mode {mode!r} (only affine)"
    if module.bits not in BITS:
        return f"{module.bits}-bit weights (only {' and '.join(map(str, BITS))})"
    if module.group_size not in GROUP_SIZES:
        return f"group size {module.group_size} (only {', '.join(map(str, GROUP_SIZES))})"
    if "biases" not in module or module["scales"].dtype not in (mx.float32, mx.float16, mx.bfloat16):
        return "scales/biases of an unsupported kind"
    return None


class _Run:
    """Set when a model is converted: the loaded extension, and whether products of BLAS_ROWS
    rows or more run dequantized through BLAS (an optimised BLAS is loaded and the extension
    finds its cblas_sgemm) or on the kernel."""

    kernels: Any = None
    blas = False


def quantized_product(module: "KernelLinear | KernelEmbedding", x: mx.array) -> mx.array:
    """`x @ W.T` for a quantized module `W` (KernelLinear or KernelEmbedding), x in fp32."""
    kernels = _Run.kernels
    w, scales, biases = module["weight"], module["scales"], module["biases"]
    rows = x.size // x.shape[-1]
    if rows >= (INT8_BLAS_ROWS if module.int8_activations else BLAS_ROWS) and _Run.blas:
        return kernels.prefill_matmul(x, w, scales, biases, module.group_size, module.bits)
    return kernels.quantized_matmul(x, w, scales, biases, module.group_size, module.bits,
                                    int8=module.int8_activations)


class KernelLinear(nn.QuantizedLinear):
    int8_activations = False  # set per layer by to_kernel_layout

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_product(self, x.astype(mx.float32))
        return y + self["bias"] if "bias" in self else y


_IDS = (mx.int32, mx.uint32, mx.int64, mx.uint64)


class KernelEmbedding(nn.QuantizedEmbedding):
    int8_activations = False  # set per layer by to_kernel_layout

    def __call__(self, x: mx.array) -> mx.array:
        """The rows `x` as fp32: one op of ours (kernels.embedding) for 32- and 64-bit ids, the
        same values as gathering them and mx.dequantize, whose ~35 graph nodes it replaces."""
        if x.dtype in _IDS:
            return _Run.kernels.embedding(x, self["weight"], self["scales"], self["biases"],
                                          self.group_size, self.bits)
        return mx.dequantize(self["weight"][x], self["scales"][x].astype(mx.float32),
                             self["biases"][x].astype(mx.float32), self.group_size, self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_product(self, x.astype(mx.float32))


class KernelRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32 or self.weight.dtype != mx.float32:
            return super().__call__(x)
        return _Run.kernels.rms_norm(x, self.weight, self.eps)


class KernelRoPE(nn.RoPE):
    """MLX's RoPE on our kernel: at an int offset, or at per-row offsets (a `BatchKVCache`'s
    `offset`, one per row of x's first axis), each row then exactly as at its own int offset."""

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if x.dtype != mx.float32 or x.ndim < 3:
            return super().__call__(x, offset)
        if isinstance(offset, int):
            return _Run.kernels.rope(x, self.dims, self.traditional, self.base, self.scale, offset)
        if isinstance(offset, mx.array) and offset.ndim == 1 and offset.shape[0] == x.shape[0]:
            return _Run.kernels.rope(x, self.dims, self.traditional, self.base, self.scale, 0,
                                     offsets=int32(offset))
        return super().__call__(x, offset)


def _one_token_step(x: mx.array, mask: Any, cache: Any) -> tuple[bool, mx.array | None]:
    """Whether this step is one our decode ops take, and for a `BatchKVCache` each row's first
    visible key (its left padding; None for a plain `KVCache`)."""
    if x.shape[1] != 1 or x.dtype != mx.float32:
        return False, None
    if plain_kv(cache) and mask is None:
        return True, None
    if batch_kv(cache) and (mask is None or isinstance(mask, mx.array)):
        return True, int32(cache.left_padding)
    return False, None


def _append(cache: Any, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
    """Append k and v to the cache; every position's keys and values as our attention reads them
    (an 8-bit cache's packed rows, kv8.py)."""
    return cache.store(k, v) if packed_kv(cache) else cache.update_and_fetch(k, v)


def _row_offsets(cache: Any) -> mx.array | None:
    """A `BatchKVCache`'s per-row positions of the incoming token (None for a plain cache)."""
    return int32(cache.offset) if batch_kv(cache) else None


def _prompt_chunk(x: mx.array, mask: Any, cache: Any, sliding: bool = False) -> tuple[bool, mx.array | None]:
    """Whether this call is a prompt chunk our prefill attention takes, and for a `BatchKVCache`
    each row's first visible key (its left padding; None for a plain `KVCache`): several
    positions of one sequence over a plain `KVCache` under mlx-lm's causal mask, or of every row
    over a `BatchKVCache` under the boolean (B, 1, L, keys) mask its `make_mask` builds (key t
    visible to row b's position i when `left_padding[b] <= t <= _idx + i`), in a layer without a
    sliding window (`sliding`: its mask also hides keys older than the window)."""
    if x.shape[1] < 2 or x.dtype != mx.float32:
        return False, None
    if plain_kv(cache):
        return mask is None or (isinstance(mask, str) and mask == "causal"), None
    if (not sliding and batch_kv(cache) and isinstance(mask, mx.array) and mask.dtype == mx.bool_
            and mask.ndim == 4 and mask.shape[1] == 1 and mask.shape[0] in (1, x.shape[0])
            and mask.shape[2:] == (x.shape[1], cache._idx + x.shape[1])):
        return True, int32(cache.left_padding)
    return False, None


class KernelLlamaAttention(llama.Attention):
    # set by to_kernel_layout for the layers of a sliding window (mlx-lm's `use_sliding`), whose
    # batched prompt chunks keep mlx-lm's code: their masks hide keys the left padding does not
    sliding = False

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        ours, starts = _one_token_step(x, mask, cache)
        if not ours:
            chunk, starts = _prompt_chunk(x, mask, cache, self.sliding)
            if chunk:
                return self._prompt_chunk(x, cache, starts)
            return super().__call__(x, mask, cache)
        B = x.shape[0]
        # One position: (B, 1, heads * dim) reshapes to (B, heads, 1, dim) without a transpose.
        # Per-row offsets (an array) take MLX's rope (KernelRoPE passes them on).
        q = self.rope(self.q_proj(x).reshape(B, self.n_heads, 1, -1), offset=cache.offset)
        k = self.rope(self.k_proj(x).reshape(B, self.n_kv_heads, 1, -1), offset=cache.offset)
        v = self.v_proj(x).reshape(B, self.n_kv_heads, 1, -1)
        k, v = _append(cache, k, v)
        out = _Run.kernels.decode_attention(q, k, v, self.scale, starts=starts)
        return self.o_proj(out.reshape(B, 1, -1))

    def _prompt_chunk(self, x: mx.array, cache: Any, starts: mx.array | None) -> mx.array:
        """mlx-lm's prompt step with our causal attention, whose output comes in the layout
        o_proj reads (one query position after another). Over a `BatchKVCache` each row's RoPE
        takes its own offset (`cache.offset` an array: `KernelRoPE`'s per-row offsets) and its
        keys before `starts` (its left padding) stay hidden."""
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=cache.offset)
        k = self.rope(k, offset=cache.offset)
        k, v = _append(cache, k, v)
        return self.o_proj(_Run.kernels.prefill_attention(q, k, v, self.scale, starts=starts))


class KernelMLP(llama.MLP):
    """mlx-lm's llama MLP with our SwiGLU (multithreaded; MLX's CPU runs its compiled one on one
    thread, a large part of a prompt chunk).

    A prompt chunk (BLAS_ROWS rows or more) evaluates each layer's MLP output before the next layer
    is built: MLX allocates an op's output when it queues it, ahead of its CPU thread, so an
    unevaluated chunk had several layers' activations (an 8B MLP's are 512 x 14,336 x 4 bytes
    twice) held at once. One sync a layer costs nothing next to a layer's prompt products; the
    chunk's peak memory no longer grows with the model's depth (tests/test_kernels_prefill.py)."""

    def __call__(self, x: mx.array) -> mx.array:
        g, u = self.gate_proj(x), self.up_proj(x)
        ours = g.dtype == mx.float32 and u.dtype == mx.float32
        y = self.down_proj(_Run.kernels.swiglu(g, u) if ours else swiglu(g, u))
        if x.size // x.shape[-1] >= BLAS_ROWS:
            mx.eval(y)
        return y


def _qw(layer: nn.Module) -> tuple:
    return layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits


class KernelLlamaBlock(llama.TransformerBlock):
    """mlx-lm's llama layer whose one-token steps take our fused ops where every part of the layer
    took the kernels (`fused_decode`):

    - over a plain `KVCache` or a `BatchKVCache` (fp32, or their 8-bit forms' packed rows, kv8.py)
      with room for the new position, one op (`kernels.FusedLayer`, built on the layer's first such
      step): norm, q/k/v, RoPE, the new keys and values written into the cache's buffers (packed
      as `kv8.pack` packs them, for an 8-bit cache), attention, o_proj, residual, norm, MLP,
      residual. As in mlx-lm's update (`update_and_fetch`), the `keys` and `values` arrays are
      updated in place, their memory reused unless another array (a view, a snapshot's slice)
      still holds it, and the cache's `keys`, `values` and `offset` (and a batched cache's
      `_idx`) are then what mlx-lm's update leaves. A `BatchKVCache` writes every row at its
      shared `_idx`, each row's RoPE at its own `offset` and its keys from its `left_padding` on
      (`_one_op_step`); a step that needs a larger buffer (every 256 tokens) takes the path below,
      mlx-lm's update growing it;
    - otherwise (that growth step) two ops around the cache's own update:
      attn_in (norm, q/k/v, RoPE) and block_out (attention, o_proj, residual, norm, MLP,
      residual).

    Each is the same kernels as the single ops; other steps run mlx-lm's code. The fused op holds
    the weights the layer had at its first step (the model's weights do not change once converted)."""

    fused_decode = False  # set per layer by to_kernel_layout when every part can take the kernels
    int8_activations = False  # likewise, for its products
    _fused: Any = None  # the layer's kernels.FusedLayer, made on its first one-op step

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        ours, starts = _one_token_step(x, mask, cache) if self.fused_decode else (False, None)
        if not ours:
            return super().__call__(x, mask, cache)
        y = self._one_op_step(x, cache, starts)
        if y is not None:
            return y
        offsets = _row_offsets(cache)
        kernels, attn, mlp = _Run.kernels, self.self_attn, self.mlp
        norm1, norm2, rope = self.input_layernorm, self.post_attention_layernorm, attn.rope
        q, k, v = kernels.attn_in(x, norm1.weight, norm1.eps, _qw(attn.q_proj), _qw(attn.k_proj),
                                  _qw(attn.v_proj), attn.n_heads, attn.n_kv_heads, rope.dims,
                                  rope.traditional, rope.base, rope.scale,
                                  0 if offsets is not None else cache.offset,
                                  int8=self.int8_activations, offsets=offsets)
        k, v = _append(cache, k, v)
        return kernels.block_out(x, q, k, v, attn.scale, _qw(attn.o_proj), norm2.weight, norm2.eps,
                                 _qw(mlp.gate_proj), _qw(mlp.up_proj), _qw(mlp.down_proj),
                                 int8=self.int8_activations, starts=starts)

    def _one_op_step(self, x: mx.array, cache: Any, starts: mx.array | None) -> mx.array | None:
        """The one op over a cache with room at the new position (else None: a step that grows
        the buffer). The cache then holds what mlx-lm's
        `update_and_fetch` leaves: `offset` + 1 (per row for a `BatchKVCache`, `starts` its left
        padding, whose rows are all written at its shared `_idx`, then `_idx` + 1)."""
        keys, batched = cache.keys, starts is not None
        at = cache._idx if batched else cache.offset
        if keys is None or at >= keys.shape[2]:
            return None
        if keys.dtype != (mx.uint32 if packed_kv(cache) else mx.float32):
            return None
        fused = self._fused or self._fuse()
        if not batched:
            y = fused(x, keys, cache.values, at)  # updates keys and values in place
            cache.offset = at + 1
            return y
        # updates keys and values in place; the offsets + 1 come out of the same op
        y, cache.offset = fused.batch(x, keys, cache.values, at, int32(cache.offset), starts)
        cache._idx = at + 1
        return y

    def _fuse(self) -> Any:
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2, rope = self.input_layernorm, self.post_attention_layernorm, attn.rope
        self._fused = _Run.kernels.FusedLayer(
            norm1.weight, norm1.eps, _qw(attn.q_proj), _qw(attn.k_proj), _qw(attn.v_proj),
            attn.n_heads, attn.n_kv_heads, rope.dims, rope.traditional, rope.base, rope.scale,
            attn.scale, _qw(attn.o_proj), norm2.weight, norm2.eps, _qw(mlp.gate_proj),
            _qw(mlp.up_proj), _qw(mlp.down_proj), int8=self.int8_activations)
        return self._fused


def _fusable(block: nn.Module) -> bool:
    attn, mlp = block.self_attn, block.mlp
    projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                   mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return (type(attn) is KernelLlamaAttention and type(attn.rope) is KernelRoPE
            and type(block.input_layernorm) is KernelRMSNorm
            and type(block.post_attention_layernorm) is KernelRMSNorm
            and all(type(p) is KernelLinear and "bias" not in p for p in projections)
            and len({p.bits for p in projections[:3]}) == 1
            and mlp.gate_proj.bits == mlp.up_proj.bits)


_SWAPS = (
    (nn.QuantizedLinear, KernelLinear),
    (nn.QuantizedEmbedding, KernelEmbedding),
    (nn.RMSNorm, KernelRMSNorm),
    (nn.RoPE, KernelRoPE),
    (llama.Attention, KernelLlamaAttention),
    (llama.MLP, KernelMLP),
    (llama.TransformerBlock, KernelLlamaBlock),
)
_QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


def quantized_layers(model: nn.Module) -> int:
    return sum(isinstance(m, _QUANTIZED) for _, m in model.named_modules())


def kernel_layout_wanted(model: nn.Module) -> tuple[bool, str]:
    """Whether to run `model` on our kernels here, and why (not)."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return False, "not running on the CPU"
    if not quantized_layers(model):
        return False, "the model has no quantized layers"
    status = native.status()
    return status.module is not None, status.reason


def _to_fp32(module: nn.Module) -> None:
    """Cast the module's own floating parameters to fp32, except a quantized layer's scales and
    biases, which our kernels read as they are."""
    quantized = isinstance(module, _QUANTIZED) and unsupported(module) is None
    own = {k: v for k, v in module.items() if isinstance(v, mx.array)}
    cast = {k: v.astype(mx.float32) for k, v in own.items()
            if mx.issubdtype(v.dtype, mx.floating) and v.dtype != mx.float32
            and not (quantized and k in ("scales", "biases"))}
    if cast:
        module.update(cast)


def to_kernel_layout(model: nn.Module, *, int8: bool | None = None) -> nn.Module:
    """Swap in the kernel-backed modules; returns the model. Call where kernel_layout_wanted(), on
    the model as it will run: a later change of its layers (e.g. dequantizing them) is not seen.
    `int8`: take the lossy int8-activation kernels (None: the process's default,
    native.int8_activations)."""
    from ..device import fast_blas_loaded

    _Run.kernels = native.kernels()
    _Run.blas = fast_blas_loaded() and _Run.kernels.has_sgemm()
    int8 = native.int8_activations() if int8 is None else int8
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        _to_fp32(module)
        for plain, fast in _SWAPS:
            if type(module) is not plain:  # exact type: leave subclasses (LoRA...) alone
                continue
            why = unsupported(module) if plain in _QUANTIZED else None
            if why:
                log.info("%s stays on MLX's quantized op: %s", name, why)
                continue
            module.__class__ = fast
            counts[fast.__name__] = counts.get(fast.__name__, 0) + 1
    for name, module in model.named_modules():
        if type(module) is KernelLlamaBlock:
            if type(module.self_attn) is KernelLlamaAttention:
                module.self_attn.sliding = bool(getattr(module, "use_sliding", False))
            module.fused_decode = _fusable(module)
            module._fused = None
        if type(module) in (KernelLinear, KernelEmbedding, KernelLlamaBlock):
            module.int8_activations = int8
    dense = swap_matvec(model)  # any dense fp32 layer left: W @ x for one row, as cpu_layout does
    mx.eval(model.parameters())
    huge = huge_pages(model)
    log.info("CPU kernels (%s%s): %s; %d dense layers; prefill on %s; %.0f MB of weights on 2 MB "
             "pages", native.status().reason, f", int8 activations below {INT8_BLAS_ROWS} rows" if int8 else "",
             ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), dense,
             "fp32 BLAS" if _Run.blas else "the quantized kernel", huge / 2**20)
    return model


def int8_activations_of(model: nn.Module | None) -> bool | None:
    """Whether `model`'s layers take int8 activations on our CPU kernels (True also where its
    compiled GPU decode step's products take them: decode_step.py); None when no layer runs on
    our CPU kernels and no step takes them (the choice does not apply to it: the fp32 layout,
    MLX's own GPU path, a model with no quantized layer)."""
    if getattr(getattr(model, "decode_program", None), "int8", False):
        return True
    found = [m.int8_activations for _, m in model.named_modules()
             if type(m) in (KernelLinear, KernelEmbedding)] if model is not None else []
    return any(found) if found else None


def huge_pages(model: nn.Module) -> int:
    """Back the kernels' quantized weights with 2 MB pages where the OS allows it
    (`kernels.huge_pages`; Linux with transparent huge pages): every decode step streams all of
    them, and from 4 KB pages the read test and most 1B-shape products here ran slower
    (bench.matvec --pages 4k,2m, docs/performance.md). Returns the bytes now on 2 MB pages."""
    total = 0
    for _, module in model.named_modules():
        if type(module) in (KernelLinear, KernelEmbedding):
            for key in ("weight", "scales", "biases"):
                total += _Run.kernels.huge_pages(module[key])
    return total
