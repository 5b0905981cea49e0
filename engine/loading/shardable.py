"""Whether a model can be split over a group of processes (tensor parallel, mlx-lm's
`model.shard`): every sharded dimension must divide by the world size. Checked before any rank
loads weights or computes, so a model that cannot be split is refused with one line instead of
failing inside attention at the first request."""

from typing import Any

from ..errors import ModelLoadError

# Config fields that mlx-lm's shard() splits across ranks, where a model has them.
SHARDED_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                  "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size")


def check_shardable(name: str, config: dict[str, Any], world_size: int) -> None:
    """Raise ModelLoadError naming the model, the dimensions that do not divide and the world
    sizes that would work, unless every sharded dimension divides by `world_size`."""
    if world_size <= 1:
        return
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    sizes = {f: v for f in SHARDED_FIELDS
             if isinstance(v := config.get(f, text.get(f)), int) and v > 0}
    bad = {f: v for f, v in sizes.items() if v % world_size}
    if not bad:
        return
    fits = [n for n in range(2, 17) if all(v % n == 0 for v in sizes.values())]
    numbers = ", ".join(f"{f} {v}" for f, v in bad.items())
    works = f"world sizes that divide them all: {', '.join(map(str, fits))}" if fits else \
        "no world size from 2 to 16 divides them all: serve it in one process"
    raise ModelLoadError(f"cannot split {name} over {world_size} processes: {numbers} do not "
                         f"divide by {world_size} ({works})", code="not_shardable")
