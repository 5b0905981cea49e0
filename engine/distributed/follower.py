"""Every rank but 0: run the plans rank 0 broadcasts, with this rank's shard, until STOP."""

import logging
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..model_cache import LOCAL
from ..errors import ModelLoadError
from ..loading.registry import LoadedModel, load_model
from .group import World
from .heartbeat import Doorbell
from .plan import Op, Plan, broadcast
from .sharded import batch_edit, cache_offset
from .snapshots import FollowerFiles

log = logging.getLogger(__name__)


def follow(world: World, bell: Doorbell | None = None) -> int:
    """The follower loop; returns the number of plans run. Never decides anything itself: a
    plan that does not fit this rank's state (an unknown cache at a nonzero offset, an offset
    that differs) is a bug that would desynchronise the ranks, so it raises. With `bell`, it
    sleeps until rank 0 rings each plan instead of spinning in the collective (heartbeat.py)."""
    rank = _Follower(world)
    steps = 0
    while True:
        if bell is not None:
            bell.wait_for(steps + 1)
        plan = broadcast(world.group, None)
        steps += 1
        if not rank.run(plan):
            return steps


class _Follower:
    """This rank's model shard and its caches by id, as the plans so far left them."""

    def __init__(self, world: World):
        self.world = world
        self.lm: LoadedModel | None = None
        self.caches: dict[int, list[Any]] = {}
        self.files = FollowerFiles(world)
        self._ops: dict[Op, Callable[[Plan], list[Any] | None]] = {
            Op.COPY: lambda plan: LOCAL.copy(self.caches[plan.cache_id]),
            Op.RESTORE: lambda plan: LOCAL.restore(self.caches[plan.cache_id], plan.length),
            Op.MERGE: lambda plan: batch_edit(plan, self.caches),
            Op.EXTEND: lambda plan: batch_edit(plan, self.caches),
            Op.EXTRACT: lambda plan: batch_edit(plan, self.caches),
            Op.FILTER: lambda plan: batch_edit(plan, self.caches),
            Op.CHECK: lambda plan: self.files.check(plan, self.lm),
            Op.READ: self.files.read,
            Op.FORWARD: self._forward,
        }

    def run(self, plan: Plan) -> bool:
        """Run one plan; False once it says STOP. A plan's new cache is kept as `plan.target`."""
        self.files.work(plan, self.caches)
        for cache_id in plan.drops:
            self.caches.pop(cache_id, None)
        if plan.op == Op.STOP:
            self.files.close()
            if plan.name:  # rank 0 refused the model before any rank loaded it
                raise ModelLoadError(plan.name, code="not_shardable")
            return False
        if plan.op == Op.LOAD:
            self._load(plan.name)
        elif self.lm is None:
            raise RuntimeError(f"{plan.op.name} before any model was loaded")
        else:
            made = self._ops[plan.op](plan)
            if made is not None:
                self.caches[plan.target] = made
        return True

    def _load(self, name: str) -> None:
        self.lm, self.caches = None, {}
        mx.clear_cache()
        self.lm = load_model(name, group=self.world.group)
        log.info("rank %d loaded its shard of %s", self.world.rank, name)

    def _forward(self, plan: Plan) -> None:
        cache = self.caches.get(plan.cache_id)
        if cache is None:
            cache = self.caches[plan.cache_id] = make_prompt_cache(self.lm.model)
        if cache_offset(cache) != plan.offset:
            raise RuntimeError(f"cache {plan.cache_id} holds {cache_offset(cache)} tokens, "
                               f"rank 0's holds {plan.offset}: the ranks diverged")
        mx.eval(self.lm.model(plan.tokens.astype(mx.uint32), cache=cache))
