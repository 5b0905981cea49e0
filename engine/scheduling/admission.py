"""What a new request needs before the scheduler takes it: the model-cache bytes it reserves in the
memory budget, the room left under the caps, and its speculative draft (named by the request, or
by its model's settings where the request allows one) with what happens once that draft loads.
`Engine.submit` (engine/scheduling/service.py) calls these in that order."""

from typing import Callable

from ..decoding.drafts import SpeculativeOptions, SpeculatorFactory, check_draft
from ..decoding.exclusions import check_exclusions
from ..decoding.generate import Generation
from ..decoding.sampling import SamplingParams
from ..decoding.tools import ToolRequest
from ..errors import EngineError, InvalidRequest, Overloaded
from ..loading.registry import LoadedModel
from .budget import mib
from .draft_loader import DraftLoader
from .requests import RequestHandle
from .slot import ModelSlot
from .ticks import Load, Scheduler


def cache_need(slot: ModelSlot, memory_budget: int, prompt_tokens: int, max_tokens: int,
               caches: int) -> int:
    """The model-cache bytes a request reserves (`caches`: 2 for a speculative request, whose
    draft's cache grows as far again); raises InvalidRequest over what the budget could ever
    give it beside the model's weights."""
    need = slot.footprint.bytes_for(prompt_tokens + max_tokens) * caches
    room = memory_budget - slot.weight_bytes
    if need > room:
        raise InvalidRequest(
            f"this request would need about {mib(need)} of model cache (prompt "
            f"{prompt_tokens} tokens + max_tokens {max_tokens}), over the {mib(room)} the "
            f"memory budget of {mib(memory_budget)} leaves beside {slot.name}'s "
            f"weights; shorten the prompt or lower max_tokens",
            field="max_tokens", code="over_memory_budget")
    return need


def check_room(load: Load, max_running: int, max_queued: int) -> None:
    """Raise Overloaded while a model switch drains the requests, or past the caps."""
    if load.switching:  # accepted requests drain first (a model reloads with other options)
        raise Overloaded("reloading a model: the running requests are finishing",
                         retry_after=5.0)
    if load.admitted >= max_running + max_queued:
        raise Overloaded(f"server busy: {load.running} requests running and "
                         f"{load.admitted - load.running} queued (limits "
                         f"{max_running} + {max_queued})", retry_after=2.0)


def settings_draft(slot: ModelSlot, params: SamplingParams, tools: ToolRequest | None,
                   images: bool, speculation: bool) -> SpeculativeOptions | None:
    """The speculative draft the model's settings name, for a request that can take it (none
    of the options speculative decoding excludes, engine/decoding/exclusions.py); else None:
    the request runs plain. `speculation`: whether this engine can speculate at all."""
    draft = slot.default_draft() if speculation else None
    if draft is None:
        return None
    try:
        check_exclusions(speculative=True, logprobs=params.logprobs is not None,
                         tools=tools is not None and tools.choice != "none", images=images,
                         thinking_budget=params.thinking_budget is not None,
                         json_schema=params.json_schema is not None)
    except InvalidRequest:
        return None
    return SpeculativeOptions(draft)


def resident_draft(drafts: DraftLoader, lm: LoadedModel, speculative: SpeculativeOptions | None,
                   speculation: bool) -> SpeculatorFactory | None:
    """For a speculative request, its draft's factory if the draft is resident (else None:
    it loads while the request waits); raises InvalidRequest for a draft it cannot use."""
    if speculative is None:
        return None
    if not speculation:
        raise InvalidRequest("speculative decoding is not available with a model sharded "
                             "over several processes: the other ranks do not mirror the "
                             "draft model's cache or the rollback of rejected draft tokens",
                             field="speculative")
    check_draft(lm, speculative.draft)
    return drafts.resident(lm, speculative.draft)


def draft_ready(scheduler: Scheduler, handle: RequestHandle, slot: ModelSlot, lm: LoadedModel,
                factory: SpeculatorFactory | None, failure: Exception | None,
                generation: Callable[[SpeculatorFactory], Generation]) -> None:
    """On the scheduler thread, between ticks: queue the request whose draft is loaded, or end
    it if that failed, it was cancelled or its model left memory meanwhile."""
    gen = None
    try:
        if factory is not None and not handle.cancel_requested:
            if not slot.resident or slot.lm is not lm:
                raise Overloaded(f"{lm.name} left memory while its draft loaded",
                                 retry_after=5.0)
            gen = generation(factory)
    except Exception as exc:
        failure = exc if isinstance(exc, EngineError) else EngineError(
            f"{type(exc).__name__}: {exc}")
    scheduler.prepared(handle, gen, failure)
