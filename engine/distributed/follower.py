"""Every rank but 0: run the plans rank 0 broadcasts, with this rank's shard, until STOP."""

import logging
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..kernels.caches import LOCAL
from ..loading.registry import LoadedModel, load_model
from .group import World
from .plan import Op, broadcast
from .sharded import batch_edit, cache_offset
from .snapshots import FollowerFiles

log = logging.getLogger(__name__)


def follow(world: World) -> int:
    """The follower loop; returns the number of plans run. Never decides anything itself: a
    plan that does not fit this rank's state (an unknown cache at a nonzero offset, an offset
    that differs) is a bug that would desynchronise the ranks, so it raises."""
    lm: LoadedModel | None = None
    caches: dict[int, list[Any]] = {}
    snapshot_files = FollowerFiles(world)
    steps = 0
    while True:
        plan = broadcast(world.group, None)
        steps += 1
        snapshot_files.work(plan, caches)
        for cache_id in plan.drops:
            caches.pop(cache_id, None)
        if plan.op == Op.STOP:
            snapshot_files.close()
            return steps
        if plan.op == Op.LOAD:
            lm, caches = None, {}
            mx.clear_cache()
            lm = load_model(plan.name, group=world.group)
            log.info("rank %d loaded its shard of %s", world.rank, plan.name)
        elif lm is None:
            raise RuntimeError(f"{plan.op.name} before any model was loaded")
        elif plan.op == Op.COPY:
            caches[plan.target] = LOCAL.copy(caches[plan.cache_id])
        elif plan.op == Op.RESTORE:
            caches[plan.target] = LOCAL.restore(caches[plan.cache_id], plan.length)
        elif plan.op in (Op.MERGE, Op.EXTEND, Op.EXTRACT, Op.FILTER):
            made = batch_edit(plan, caches)
            if made is not None:
                caches[plan.target] = made
        elif plan.op == Op.CHECK:
            snapshot_files.check(plan, lm)
        elif plan.op == Op.READ:
            made = snapshot_files.read(plan)
            if made is not None:
                caches[plan.target] = made
        elif plan.op == Op.FORWARD:
            cache = caches.get(plan.cache_id)
            if cache is None:
                cache = caches[plan.cache_id] = make_prompt_cache(lm.model)
            if cache_offset(cache) != plan.offset:
                raise RuntimeError(f"cache {plan.cache_id} holds {cache_offset(cache)} tokens, "
                                   f"rank 0's holds {plan.offset}: the ranks diverged")
            mx.eval(lm.model(plan.tokens.astype(mx.uint32), cache=cache))
