"""A one-token decode step of a dense llama-family model (llama, qwen2, qwen3 in the GPU layout) as
one compiled program of fused kernels.

At batch 1 a GPU decode step reads every weight once; what it costs beyond that is the host
recording and launching each op of its graph. mlx-lm's step is ~1,000 ops for an 8B model (~1,450
in bf16); this program is 5 kernels a layer (RMSNorm + q/k/v product; q/k norms + RoPE + the
cache write + attention; o_proj + residual; RMSNorm + gate/up + SwiGLU; down + residual) plus the
embedding and the head (engine/kernels/fused_cuda.py), traced once through `mx.compile`: later
steps replay the recorded graph without running any Python per op.

For the graph to be the same at every step, nothing in it depends on the position but an array:
the position is an input (1,) int32, the kernels read it, and the KV cache's buffers keep one
length, `CAP_STEP` positions at a time. The program owns the buffers it writes in place: on its
first step over a cache (after a prefill, a restore from the prefix cache, or any other writer),
and when a buffer is full, it copies the cache's keys and values into new buffers of its own
(`_own`), rounded up to the next `CAP_STEP`. So a buffer it writes into is never a snapshot's or
another request's, and the compiled graph is traced again only when the buffers grow. The caches
stay mlx-lm's `KVCache` objects with their `keys`, `values` and `offset` as mlx-lm's own update
leaves them, so prefill, snapshots, batching and every other path read them unchanged.

`attach(model)` makes a model's one-token steps over plain KV caches take the program (every other
call runs the model's own forward); engine/kernels/gpu_layout.py attaches it on CUDA unless
`MLXCHAT_CUDA_DECODE=0`. On the CPU, tests attach it with engine/kernels/fused_ref.py, the same
kernels in MLX ops, and compare its tokens with mlx-lm's (tests/test_decode_step.py).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import KVCache

from .. import device
from .fused_cuda import q8_fits
from .gpu_layout import StackedAttention, StackedMLP
from .inputs import value
from .rope import inverse_frequencies

log = logging.getLogger(__name__)

SWITCH = "MLXCHAT_CUDA_DECODE"
# The precisions (bits of the decoder's products) whose models take the program with the switch
# unset: where it measured faster than the model's own forward through the engine. Every one now
# (bench.gpu_step --parts step, H100 of 2026-12-07, 8 reps: 4-bit 253 tok/s against the model's
# own forward's 200, 8-bit 271 against 186, bf16 174 against 153; docs/gpu.md). The tuple stays
# so that a precision can leave the program again with one edit if a card measures it slower.
DEFAULT_BITS = (4, 8, 16)
CAP_STEP = 1024  # the cache buffers grow by this many positions; the graph is traced per length
MODELS = (llama.Model, qwen2.Model, qwen3.Model)


@dataclass
class Proj:
    """A linear layer's arrays as the matvec kernel reads them: W dense (bits 16) or MLX's affine
    4/8-bit layout, and its bias, if any."""

    w: mx.array
    scales: mx.array | None
    biases: mx.array | None
    bits: int
    group_size: int
    bias: mx.array | None = None
    int8: bool = False  # multiplies int8 activations (4/8 bits; DecodeProgram.build's `int8`)

    @classmethod
    def of(cls, m: nn.Module) -> "Proj | None":
        bias = m["bias"] if "bias" in m else None
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            if getattr(m, "mode", "affine") != "affine" or "biases" not in m or m.bits not in (4, 8):
                return None
            return cls(m["weight"], m["scales"], m["biases"], m.bits, m.group_size, bias)
        if isinstance(m, (nn.Linear, nn.Embedding)) and m["weight"].ndim == 2:  # SmallMMLinear too
            return cls(m["weight"], None, None, 16, 0, bias)
        return None

    @property
    def inputs(self) -> int:
        cols = self.w.shape[1]
        return cols * 32 // self.bits if self.bits in (4, 8) else cols

    def __call__(self, k: ModuleType, x: mx.array, epilogue: int = 0, a: mx.array | None = None,
                 norm: tuple[mx.array, float] | None = None, ahead: tuple = ()) -> mx.array:
        if epilogue == 0 and self.bias is not None:
            epilogue, a = 1, self.bias
        return k.matvec(x, self.w, self.scales, self.biases, self.bits, self.group_size, epilogue, a, norm,
                        int8=self.int8, ahead=ahead)

    def first_rows(self, budget: int, swiglu: bool = False) -> tuple[tuple[mx.array, int, int], ...]:
        """Byte ranges of this product's arrays holding the rows its kernel reads first, at most
        `budget` bytes in all (fused_cuda's `ahead`): the first rows of W, its scales and biases (of
        each half for SwiGLU: a warp reads a gate row and its up row together)."""
        arrays = [t for t in (self.w, self.scales, self.biases) if t is not None]
        total = sum(t.nbytes for t in arrays)
        if budget <= 0 or total == 0:
            return ()
        share = min(1.0, budget / total)
        out = []
        for t in arrays:
            rows, row_bytes = t.shape[0], t.nbytes // t.shape[0]
            starts = (0, rows // 2) if swiglu else (0,)
            span = int(rows // len(starts) * share)
            out += [(t, r0 * row_bytes, span * row_bytes) for r0 in starts if span > 0]
        return tuple(out)


@dataclass
class Layer:
    """One decoder layer's weights and the attention's shape, read off the GPU layout's modules."""

    norm_in: mx.array
    eps_in: float
    qkv: Proj
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    rope: nn.Module
    inv_freq: mx.array  # float32, per rotated pair
    params: mx.array  # float32: the q/k norms' eps, RoPE's position scale, the attention's scale
    counters: mx.array  # int32 per kv head: the attention kernel's splits done (zero between steps)
    heads: int
    kv_heads: int
    head_dim: int
    rotated: int
    traditional: bool
    scale: float
    o: Proj
    norm_post: mx.array
    eps_post: float
    gate_up: Proj
    down: Proj


def read_layer(block: nn.Module) -> Layer | None:
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    if type(attn) is not StackedAttention or type(mlp) is not StackedMLP:
        return None
    projs = [Proj.of(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(p is None for p in projs) or any(p.bias is not None for p in projs[1:]):
        return None
    if type(block.input_layernorm) is not nn.RMSNorm or type(block.post_attention_layernorm) is not nn.RMSNorm:
        return None
    freqs = inverse_frequencies(attn.rope)
    q_norm = attn.q_norm if "q_norm" in attn else None
    if freqs is None or (q_norm is not None and type(q_norm) is not nn.RMSNorm):
        return None
    head_dim = attn.split[0] // attn.n_heads
    inv, pos_scale = freqs
    eps = q_norm.eps if q_norm is not None else 0.0
    return Layer(
        norm_in=block.input_layernorm.weight, eps_in=block.input_layernorm.eps, qkv=projs[0],
        q_norm=q_norm, k_norm=attn.k_norm if q_norm is not None else None, rope=attn.rope,
        inv_freq=mx.array(inv), params=mx.array([eps, pos_scale, attn.scale], dtype=mx.float32),
        counters=mx.zeros((attn.n_kv_heads,), dtype=mx.int32),
        heads=attn.n_heads, kv_heads=attn.n_kv_heads, head_dim=head_dim, rotated=attn.rope.dims,
        traditional=bool(attn.rope.traditional), scale=float(attn.scale), o=projs[1],
        norm_post=block.post_attention_layernorm.weight, eps_post=block.post_attention_layernorm.eps,
        gate_up=projs[2], down=projs[3])


def cuda_fits(layers: list[Layer], head: Proj, dtype: mx.Dtype) -> bool:
    """Whether fused_cuda.py's kernels take these shapes: 16-bit activations, attention shapes
    its kernel takes, a hidden size the fused norm can stage, product inputs a whole number of
    128-bit words."""
    from . import fused_cuda

    projs = [p for layer in layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [head]
    staged = all(p.inputs <= fused_cuda.MAX_STAGED for layer in layers for p in (layer.qkv, layer.gate_up))
    return (dtype in (mx.bfloat16, mx.float16) and staged and all(map(_attention_fits, layers))
            and all(_product_fits(p, dtype) for p in projs))


def _attention_fits(layer: Layer) -> bool:
    """Head dims of 64, 128 or 256 (a warp a head), whole groups of query heads, the group's
    heads x head dim within the kernel's shared memory, an even number of rotated dims."""
    from . import fused_cuda

    return (layer.head_dim in (64, 128, 256) and layer.heads % layer.kv_heads == 0
            and (layer.heads // layer.kv_heads) * layer.head_dim <= fused_cuda.MAX_GROUP_DIMS
            and layer.rotated % 2 == 0 and layer.rotated <= layer.head_dim)


def _product_fits(p: Proj, dtype: mx.Dtype) -> bool:
    """A packed row a whole number of 128-bit words, each within one group; a dense W of x's dtype."""
    if p.bits in (4, 8):
        word = 128 // p.bits
        return p.inputs % word == 0 and p.group_size % word == 0
    return p.w.dtype == dtype and p.inputs % 8 == 0


class DecodeProgram:
    """The compiled one-token step of one model (see the module's docstring)."""

    def __init__(self, model: nn.Module, layers: list[Layer], head: Proj, kernels: ModuleType,
                 cap_step: int = CAP_STEP, int8: bool = False):
        inner = model.model
        projections = [head] + [p for layer in layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        for p in projections:
            p.int8 = int8 and q8_fits(p.bits, p.inputs)
        self.int8 = any(p.int8 for p in projections)  # some product takes int8 activations
        self.embed, self.layers, self.head = inner.embed_tokens, layers, head
        self.norm, self.eps = inner.norm.weight, inner.norm.eps
        self.kernels, self.cap_step = kernels, cap_step
        self.in_place = kernels.IN_PLACE
        self.enabled = True  # the bench turns it off to measure the model's own forward
        self._compiled: dict[int, Any] = {}  # per thread: MLX's streams are (see _step)
        self._next: dict[int, tuple[int, mx.array]] = {}  # per thread: the position the last step made
        # MLX's streams are per thread: an array left unevaluated here would be bound to this
        # thread's stream and fail in the thread that steps ("There is no Stream(gpu, 0) in
        # current thread"), where models are built in one thread and served in another
        mx.eval([a for layer in layers for a in (layer.inv_freq, layer.params, layer.counters)])

    @classmethod
    def build(cls, model: nn.Module, kernels: ModuleType, cap_step: int = CAP_STEP,
              int8: bool = False) -> "DecodeProgram | None":
        """The program for `model`, or None when its kind or layers are not one it runs. `int8`:
        its 4/8-bit products multiply int8 activations (the lossy path `--int8-activations`
        chooses, as our CPU kernels' int8 path computes them: fused_ref.int8_product)."""
        if not isinstance(model, MODELS) or getattr(model.model, "sharding_group", None) is not None:
            return None
        if type(model.model.norm) is not nn.RMSNorm:
            return None
        layers = [read_layer(block) for block in model.model.layers]
        if not layers or any(layer is None for layer in layers):
            return None
        tied = getattr(model.args, "tie_word_embeddings", False) or "lm_head" not in model
        head = Proj.of(model.model.embed_tokens if tied else model.lm_head)
        if head is None or head.bias is not None:
            return None
        if not kernels.IN_PLACE or cuda_fits(layers, head, model.model.norm.weight.dtype):
            return cls(model, layers, head, kernels, cap_step, int8)
        return None

    def _forward(self, tokens: mx.array, pos: mx.array, *kv: mx.array) -> tuple[mx.array, ...]:
        k = self.kernels
        h = self.embed(tokens)
        written = []
        budget = ahead_bytes()
        for i, layer in enumerate(self.layers):
            after = self.layers[i + 1].qkv if i + 1 < len(self.layers) else self.head
            qkv = layer.qkv(k, h, norm=(layer.norm_in, layer.eps_in))
            o, keys, values = k.attention(layer, qkv, pos, kv[2 * i], kv[2 * i + 1],
                                          ahead=layer.o.first_rows(budget))
            h = layer.o(k, o, 1, h, ahead=layer.gate_up.first_rows(budget, swiglu=True))
            up = layer.gate_up(k, h, 2, norm=(layer.norm_post, layer.eps_post), ahead=layer.down.first_rows(budget))
            h = layer.down(k, up, 1, h, ahead=after.first_rows(budget))
            written += [keys, values]
        logits = self.head(k, h, norm=(self.norm, self.eps))
        # the next step's position, made on the device (see __call__)
        return ((logits,) if self.in_place else (logits, *written)) + (pos + 1,)

    def _step(self, *args: mx.array) -> tuple[mx.array, ...]:
        """The compiled step, traced once per thread that calls it: a traced graph's kernels keep
        the stream of the thread that traced it, and MLX's streams are per thread (the loader's
        check runs in one thread, the scheduler's steps in another)."""
        fn = self._compiled.get(threading.get_ident())
        if fn is None:
            fn = self._compiled[threading.get_ident()] = mx.compile(self._forward)
        return fn(*args)

    def _position(self, at: int) -> mx.array:
        """The step's position `at` as a one-value kernel input (engine/kernels/inputs.py): the
        array the last step made on the device where it is `at`, else one made here. A position
        the host writes every step would make each attention kernel wait on a page of MLX's
        managed pool of small arrays (see inputs.py); one the step makes stays on the device."""
        made = self._next.get(threading.get_ident())
        if made is not None and made[0] == at:
            return made[1]
        return value(at, mx.int32)

    def accepts(self, inputs: mx.array, cache: Any) -> bool:
        """A one-token step of one sequence over mlx-lm's plain KV caches, one per layer."""
        return (self.enabled and inputs.shape == (1, 1) and isinstance(cache, list) and len(cache) == len(self.layers)
                and all(type(c) is KVCache for c in cache) and cache[0].keys is not None)

    def __call__(self, inputs: mx.array, cache: list[KVCache]) -> mx.array:
        at = cache[0].offset
        self._own(cache, at)
        kv = [a for c in cache for a in (c.keys, c.values)]
        out = self._step(inputs, self._position(at), *kv)
        self._next[threading.get_ident()] = (at + 1, out[-1])
        for i, c in enumerate(cache):
            if not self.in_place:
                c.keys, c.values = out[1 + 2 * i], out[2 + 2 * i]
                c._fused_kv = (c.keys, c.values)
            c.offset = at + 1
        return out[0]

    def _own(self, cache: list[KVCache], at: int) -> None:
        """Give every layer buffers of this program's own with room at position `at`: the first
        `at` positions copied into buffers of the next multiple of `cap_step` positions."""
        if all(_owned(c) and c.keys.shape[2] > at and c.offset == at for c in cache):
            return
        cap = (at // self.cap_step + 1) * self.cap_step
        fresh = []
        for c in cache:
            arrays = []
            for a in (c.keys, c.values):
                shape = (*a.shape[:2], cap - at, a.shape[3])
                arrays.append(mx.concatenate([a[..., :at, :], mx.zeros(shape, a.dtype)], axis=2))
            c.keys, c.values = arrays
            c._fused_kv = (c.keys, c.values)
            fresh += arrays
        mx.eval(fresh)


def _owned(c: KVCache) -> bool:
    """Whether `c`'s buffers are the ones a DecodeProgram gave it (no other writer since)."""
    owned = getattr(c, "_fused_kv", None)
    return owned is not None and owned[0] is c.keys and owned[1] is c.values


class FusedDecode:
    """Mixed into a model's class by `attach`: one-token steps over plain KV caches take the
    model's DecodeProgram, everything else the model's own forward."""

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        program = self.decode_program
        if cache is not None and not kwargs and program.accepts(inputs, cache):
            return program(inputs, cache)
        return super().__call__(inputs, cache=cache, **kwargs)


_CLASSES: dict[type, type] = {}


def attach(model: nn.Module, kernels: ModuleType | None = None, cap_step: int = CAP_STEP,
           checked: bool | None = None, int8: bool | None = None) -> bool:
    """Give `model` a DecodeProgram on `kernels` (default: fused_cuda.py on CUDA, nothing
    elsewhere) when it can run one; returns whether it did. `checked` (default: for the default
    kernels): the program is checked on the model first (`check`); one whose kernels do not
    compile or run on this device, or whose logits part from the model's own, is not attached
    (the model runs its own forward, and the log says why). `int8`: the program's quantized
    products take int8 activations (None: the process's default, `--int8-activations`)."""
    from .native import int8_activations

    checked = kernels is None if checked is None else checked
    int8 = int8_activations() if int8 is None else int8
    how = "on"
    if kernels is None:
        how = mode()
        if how == "off":
            return False
        if how == "ref":
            from . import fused_ref as kernels
        else:
            from . import fused_cuda as kernels
    program = DecodeProgram.build(model, kernels, cap_step, int8)
    if program is None:
        return False
    if how == "auto" and program.layers[0].qkv.bits not in DEFAULT_BITS and not program.int8:
        log.info("one-token steps run the model's own forward at %d bits (%s=1: the compiled step)",
                 program.layers[0].qkv.bits, SWITCH)
        return False
    if checked:
        gate = check(model, program)
        if not gate["kept"]:
            log.warning("one-token steps run the model's own forward: the compiled step %s",
                        f"failed ({gate['error']})" if "error" in gate else
                        f"parts from it by {gate['rel_diff']:.3g} of the largest logit")
            return False
    cls = type(model)
    if cls not in _CLASSES:
        base = cls.__bases__[-1] if issubclass(cls, FusedDecode) else cls
        _CLASSES[cls] = type(f"Fused{base.__name__}", (FusedDecode, base), {})
    model.__class__ = _CLASSES[cls]
    object.__setattr__(model, "decode_program", program)
    return True


AHEAD_SWITCH = "MLXCHAT_CUDA_AHEAD"


def ahead_bytes() -> int:
    """How many bytes of the next kernel's weights each kernel of the step prefetches into L2 while
    it runs (`MLXCHAT_CUDA_AHEAD`, in MB; default 0: none)."""
    value = os.environ.get(AHEAD_SWITCH, "").strip()
    return int(float(value) * 2**20) if value.replace(".", "", 1).isdigit() else 0


GATE = 0.05  # the most the program's logits may part from the model's own, of the largest logit


def check(model: nn.Module, program: DecodeProgram, prompt: list[int] | None = None,
          steps: int = 2) -> dict[str, Any]:
    """The program's logits against the model's own forward (`model` not yet attached, or with
    the program turned off) over `steps` greedy one-token steps after `prompt` (default: 8 token
    ids every vocabulary has), each side on its own cache fed the same tokens: the largest
    difference over the largest logit, the greedy tokens they agree on, and whether it is within
    GATE (`kept`). A kernel that does not compile or run gives `kept` False and the `error`."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt = list(prompt or range(1, 9))
    enabled, program.enabled = program.enabled, False
    try:
        mine, theirs = make_prompt_cache(model), make_prompt_cache(model)
        x = mx.array([prompt], dtype=mx.uint32)
        mx.eval(model(x, cache=mine), model(x, cache=theirs))
        token, worst, same = prompt[-1], 0.0, 0
        for _ in range(steps):
            y = mx.array([[token]], dtype=mx.uint32)
            a = program(y, mine).astype(mx.float32)
            b = model(y, cache=theirs).astype(mx.float32)
            worst = max(worst, (mx.abs(a - b).max() / mx.abs(b).max()).item())
            same += int(mx.argmax(a).item() == mx.argmax(b).item())
            token = int(mx.argmax(b).item())
    except Exception as exc:  # noqa: BLE001 - a kernel that does not compile or run here
        return {"program": True, "error": f"{type(exc).__name__}: {exc}"[:2000], "kept": False}
    finally:
        program.enabled = enabled
    return {"program": True, "rel_diff": worst, "same_argmax": f"{same}/{steps}", "kept": worst < GATE}


def mode() -> str:
    """From `MLXCHAT_CUDA_DECODE`: "off" ("0", or MLX not on CUDA); "ref" (the program on
    fused_ref.py's MLX ops on any device: for checking it where CUDA is not); "on" ("1": every
    precision); else "auto" (the precisions in DEFAULT_BITS)."""
    value = os.environ.get(SWITCH, "").strip().lower()
    if value == "ref":
        return "ref"
    if device.backend() != "cuda" or value == "0":
        return "off"
    return "on" if value == "1" else "auto"
