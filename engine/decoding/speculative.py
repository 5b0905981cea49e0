"""Speculative decoding: a cheap drafter proposes k tokens, the target checks them all in one forward
pass, and the accepted prefix plus one token of the target's own is emitted.

Greedy: accept the longest prefix where the draft equals the target's argmax; the extra token is the
target's argmax after it, so the output equals plain one-token-per-step decoding.
Sampling: the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023): accept draft token
d with probability min(1, p(d)/q(d)); on the first rejection draw from norm(max(p - q, 0)); if all k
pass, draw a bonus token from p. p and q are the filtered, temperature-scaled distributions the plain
sampler draws from, so the emitted tokens follow the target's distribution exactly.

Caches lag the sequence: a model's cache holds a prefix, and the tokens past it are fed at its next
forward. After verification a trimmable cache is trimmed back to the accepted prefix. Recurrent
layers (ArraysCache in qwen3_5 / qwen3_next) cannot be trimmed: their arrays are restored to the
snapshot taken before the forward (references to immutable arrays, so a snapshot costs nothing), the
attention layers are trimmed to the same point, and the accepted tokens are fed again as part of
the next verification pass — no extra forward pass.
"""

import copy
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..errors import InvalidRequest
from ..model_cache import can_roll_back, roll_back, rollback_mark
from ..mlx_lm_adapter import text_model
from ..loading.registry import LoadedModel
from .sampling import SamplingParams, TokenSampler, filter_logprobs, log_softmax

# logits row (V,) -> (token, the distribution it was drawn from or None when greedy)
Pick = Callable[[mx.array], tuple[mx.array, mx.array | None]]


# -- caches ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheMark:
    """Where a cache stood before a speculative forward: its length and, for recurrent layers, their
    arrays (None when every layer can be trimmed)."""

    length: int
    arrays: tuple[list | None, ...] | None


def mark_cache(cache: list[Any], length: int) -> CacheMark:
    return CacheMark(length, rollback_mark(cache))


def check_cache(cache: list[Any]) -> None:
    for c in cache:
        if not can_roll_back(c):
            raise InvalidRequest(f"speculative decoding cannot roll back a {type(c).__name__}")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def rewind_cache(cache: list[Any], mark: CacheMark, fed: list[int], seq: list[int]) -> int:
    """`fed` went into the cache after `mark`; `seq` is the true sequence. Drop what disagrees with it
    and return how many tokens the cache now holds (the caller feeds seq from there next time)."""
    keep = common_prefix(fed, seq[mark.length:])
    if keep == len(fed):
        return mark.length + keep
    if mark.arrays is None:
        for c in cache:
            c.trim(len(fed) - keep)
        return mark.length + keep
    for c, arrays in zip(cache, mark.arrays):
        roll_back(c, arrays, len(fed))
    return mark.length


# -- models ---------------------------------------------------------------------------------------
def split_model(model: nn.Module) -> tuple[nn.Module, Callable[[mx.array], mx.array]]:
    """(body giving the final normed hidden states, head giving logits) of an mlx-lm model."""
    text = text_model(model)
    body = text.model
    head = getattr(text, "lm_head", None) or body.embed_tokens.as_linear
    return body, head


def truncated(model: nn.Module, layers: int) -> nn.Module:
    """A self-draft: the first `layers` decoder layers of `model` with its final norm and head, sharing
    its weights."""
    text_owner = text_model(model)
    draft_text = copy.copy(text_owner)
    draft_text.model = copy.copy(text_owner.model)
    draft_text.model.layers = list(text_owner.model.layers[:layers])
    if text_owner is model:
        return draft_text
    draft = copy.copy(model)
    draft.language_model = draft_text
    return draft


def dequantize(dtype: mx.Dtype = mx.float32) -> Callable[[nn.Module], nn.Module]:
    """A `load_model` transform: dequantize every quantized layer and cast the weights to `dtype`."""
    from mlx_lm.utils import dequantize_model

    def transform(model: nn.Module) -> nn.Module:
        model = dequantize_model(model)
        model.set_dtype(dtype)
        mx.eval(model.parameters())
        return model

    return transform


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must share the target's tokenizer: the same ids for the same strings."""
    tv, dv = target.tokenizer.vocab, draft.tokenizer.vocab
    if tv != dv:
        differ = len(set(tv.items()) ^ set(dv.items()))
        raise InvalidRequest(f"draft {draft.name!r} cannot speculate for {target.name!r}: their "
                             f"vocabularies differ ({len(tv)} vs {len(dv)} entries, {differ} differing)")


# -- sampling -------------------------------------------------------------------------------------
def sampling_probs(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """The distribution `TokenSampler` draws from, for each row of (n, V) log-probabilities."""
    return mx.softmax(filter_logprobs(logprobs, params) * (1.0 / params.temperature), axis=-1)


def accept_sampled(p: mx.array, q: mx.array, drafts: mx.array, key: mx.array) -> tuple[int, int]:
    """The rejection rule. p: (k+1, V) target distributions, q: (k, V) the draft's, drafts: (k,).
    Returns (drafts accepted, the token that follows them)."""
    k = drafts.size
    u_key, t_key = mx.random.split(key)
    rows = p
    accept = mx.zeros((0,), dtype=mx.bool_)
    if k:
        index = mx.arange(k)
        u = mx.random.uniform(shape=(k,), key=u_key)
        accept = u * q[index, drafts] < p[index, drafts]  # u < p/q without dividing
        residual = mx.maximum(p[:k] - q, 0.0)
        residual = mx.where(residual.sum(-1, keepdims=True) > 0, residual, p[:k])
        rows = mx.concatenate([residual, p[k:]])
    # One draw per row; the row after the accepted prefix is the one used (a single sync).
    tokens = mx.random.categorical(mx.log(rows), key=t_key)
    mx.eval(accept, tokens)
    accepted = common_prefix(accept.tolist(), [True] * k)
    return accepted, tokens.tolist()[accepted]


# -- policy ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpecConfig:
    """How many tokens to draft. Costs are in units of one plain target decode step; they make the
    choice of k deterministic (a seeded request gives the same tokens every run). The bench measures
    them for a pair."""

    k_max: int = 4
    adaptive: bool = True
    draft_cost: float = 0.1  # one draft token
    verify_cost: float = 0.05  # each extra token in the verification pass
    prior_acceptance: float = 0.6
    probe_every: int = 8  # with k = 0 chosen, draft one token this often to keep measuring
    trial_tokens: int = 4  # plain tokens decoded (and timed) before the first round
    trial_rounds: int = 3  # speculative rounds after which it stays on only while it is faster

    def expected_speedup(self, alpha: float, k: int) -> float:
        tokens = sum(alpha**i for i in range(k + 1))
        return tokens / (1 + k * (self.draft_cost + self.verify_cost))

    def best_k(self, alpha: float) -> int:
        return max(range(self.k_max + 1), key=lambda k: (self.expected_speedup(alpha, k), -k))


class AdaptiveK:
    """k from the running per-token acceptance rate (an exponentially weighted count of accepted
    drafts over drafts tried, where drafts after the first rejection are not tried)."""

    DECAY = 0.8

    def __init__(self, config: SpecConfig):
        self.config = config
        self.accepts, self.trials = 2 * config.prior_acceptance, 2.0
        self.idle = 0

    @property
    def alpha(self) -> float:
        return self.accepts / self.trials

    def choose(self) -> int:
        if not self.config.adaptive:
            return self.config.k_max
        k = self.config.best_k(min(self.alpha, 0.999))
        if k == 0:
            self.idle += 1
            if self.idle >= self.config.probe_every:
                self.idle = 0
                return 1
        return k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.accepts = self.DECAY * self.accepts + accepted
            self.trials = self.DECAY * self.trials + accepted + (accepted < drafted)


class Pace:
    """Tokens per second of one way of decoding, over a decaying window of recent steps."""

    DECAY = 0.7

    def __init__(self) -> None:
        self.tokens = self.seconds = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.DECAY * self.tokens + tokens
        self.seconds = self.DECAY * self.seconds + seconds

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.tokens and self.seconds > 0 else None


# -- drafters -------------------------------------------------------------------------------------
class Drafter(Protocol):
    needs_hidden: bool  # whether it drafts from the target's hidden states (MTP)

    def prefill(self, start: int, tokens: mx.array, hidden: mx.array | None) -> None:
        """The target consumed prompt `tokens` at positions start.. (`hidden`: its rows for them)."""

    def propose(self, seq: list[int], k: int, pick: Pick) -> tuple[list[mx.array], list[mx.array]]:
        """k tokens continuing `seq` (lazy scalars) and the distributions they were drawn from."""

    def commit(self, seq: list[int], start: int, hidden: mx.array | None) -> None:
        """`seq` is the accepted sequence; the target's hidden rows for positions start.. of it."""


class ModelDrafter:
    """Drafts with a separate, smaller model of the same vocabulary (its own cache)."""

    needs_hidden = False

    def __init__(self, model: nn.Module):
        self.model = model
        self.cache = make_prompt_cache(model)
        check_cache(self.cache)
        self.length = 0
        self._mark: CacheMark | None = None
        self._fed: list[int] = []
        self._drafts: list[mx.array] = []

    def prefill(self, start: int, tokens: mx.array, hidden: mx.array | None) -> None:
        if start == self.length:  # else (a reused prefix) `propose` catches up
            self.model(tokens[None], cache=self.cache)
            self.length += tokens.size
            mx.eval([c.state for c in self.cache])

    def propose(self, seq: list[int], k: int, pick: Pick) -> tuple[list[mx.array], list[mx.array]]:
        self._mark = mark_cache(self.cache, self.length)
        self._fed = seq[self.length:]
        logits = self.model(mx.array(self._fed, dtype=mx.uint32)[None], cache=self.cache)
        drafts, probs = [], []
        for i in range(k):
            token, q = pick(logits[0, -1])
            drafts.append(token)
            probs.append(q)
            if i < k - 1:
                logits = self.model(token.reshape(1, 1), cache=self.cache)
        self._drafts = drafts[:-1]
        return drafts, probs

    def commit(self, seq: list[int], start: int, hidden: mx.array | None) -> None:
        if self._mark is None:  # nothing drafted this round (k = 0): catch up at the next one
            return
        fed = self._fed + [int(d.item()) for d in self._drafts]
        self.length = rewind_cache(self.cache, self._mark, fed, seq)
        self._mark = None


# -- the decode strategy --------------------------------------------------------------------------
class Speculator:
    """One request's speculative decode state. `Generation` routes its prefill forwards through
    `prefill` (so a drafter sees the prompt) and, after the first token, its decode steps through
    `step`."""

    def __init__(self, target: nn.Module, drafter: Drafter, config: SpecConfig = SpecConfig()):
        self.target = target
        self.drafter = drafter
        self.config = config
        self.policy = AdaptiveK(config)
        self.body, self.head = split_model(target) if drafter.needs_hidden else (None, None)
        self.drafted = self.accepted = self.steps = self.emitted = 0
        # Whether it pays, measured: speculative rounds against plain (pipelined) decoding of the
        # same request. A drafter that reads the target's hidden states cannot skip tokens, so
        # with one it never pauses and never switches off; nor does a fixed k (adaptive off).
        self.can_pause = not drafter.needs_hidden and config.adaptive
        self.speculative_pace, self.plain_pace = Pace(), Pace()
        self.switched_off = False
        self.switched_off_at: int | None = None  # tokens emitted when it switched off
        self._k: int | None = None  # k for the next round, decided by `plain_run`

    def opening_run(self) -> int:
        """Plain tokens to decode before the first round: they time plain decoding, for the
        comparison, at no cost (they are what decoding without a draft would do anyway)."""
        return self.config.trial_tokens if self.can_pause else 0

    def plain_run(self, emitted: int) -> int | None:
        """After a round (`emitted` tokens so far): 0 to speculate now, n > 0 to decode n tokens
        plainly first (k = 0 was chosen, or plain decoding is being timed), None to decode plainly
        to the end. Speculation switches itself off as soon as it is measured slower than plain
        decoding and either the acceptance seen so far makes drafting not pay (k = 0) or it has
        had its `trial_rounds`: a draft that loses costs a round or few, then nothing."""
        if self.switched_off:
            return None
        if not self.can_pause:
            return 0
        spec, plain = self.speculative_pace.rate, self.plain_pace.rate
        k = self.policy.choose()
        if plain is not None and spec is not None and spec < plain \
                and (k == 0 or self.steps >= self.config.trial_rounds):
            self.switched_off, self.switched_off_at = True, emitted
            return None
        if plain is None and self.steps >= self.config.trial_rounds:
            return self.config.trial_tokens
        if k == 0:
            self._k = 1  # the round after the plain run probes the acceptance again
            return self.config.probe_every
        self._k = k
        return 0

    def record(self, speculative: bool, tokens: int, seconds: float) -> None:
        """Wall time of a decode step of this request and the tokens it emitted."""
        (self.speculative_pace if speculative else self.plain_pace).add(tokens, seconds)

    def _forward(self, inputs: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array | None]:
        if self.body is None:
            return self.target(inputs[None], cache=cache), None
        hidden = self.body(inputs[None], cache=cache)
        return self.head(hidden), hidden

    def prefill(self, inputs: mx.array, cache: list[Any], start: int) -> mx.array:
        """The target's forward over prompt tokens at positions start..; returns the logits."""
        logits, hidden = self._forward(inputs, cache)
        self.drafter.prefill(start, inputs, None if hidden is None else hidden[0])
        return logits

    def _picker(self, params: SamplingParams, key: mx.array) -> Pick:
        if params.greedy:
            return lambda logits: (mx.argmax(logits), None)
        keys = iter(mx.random.split(key, self.config.k_max))

        def pick(logits: mx.array) -> tuple[mx.array, mx.array]:
            q = sampling_probs(log_softmax(logits[None]), params)[0]
            return mx.random.categorical(mx.log(q), key=next(keys)), q

        return pick

    def _target_logprobs(self, rows: mx.array, seq: list[int], drafts: list[mx.array],
                         sampler: TokenSampler) -> mx.array:
        """Row i predicts the token after seq + drafts[:i]; repetition penalties see that history."""
        if sampler.processors:
            history = mx.concatenate([mx.array(seq, dtype=mx.uint32)]
                                     + [d.reshape(1).astype(mx.uint32) for d in drafts])
            processed = []
            for i in range(rows.shape[0]):
                row = rows[i:i + 1]
                for processor in sampler.processors:
                    row = processor(history[:len(seq) + i], row)
                processed.append(row)
            rows = mx.concatenate(processed)
        return log_softmax(rows)

    def step(self, seq: list[int], cache: list[Any], length: int, budget: int,
             sampler: TokenSampler, eos: set[int]) -> tuple[list[int], int]:
        """One draft-and-verify round. `seq` is the whole sequence so far (prompt + output), of which
        `cache` holds the first `length`; at most `budget` tokens may be emitted. Returns the new
        tokens (at least one) and how many tokens of seq + new the cache holds now."""
        k = self._k if self._k is not None else self.policy.choose()
        self._k = None
        k = max(min(k, budget - 1), 0)
        params = sampler.params
        sampler.key, key = mx.random.split(sampler.key)
        draft_key, accept_key = mx.random.split(key)
        mark = mark_cache(cache, length)
        pending = seq[length:]
        drafts, probs = self.drafter.propose(seq, k, self._picker(params, draft_key)) if k else ([], [])
        inputs = mx.concatenate([mx.array(pending, dtype=mx.uint32)]
                                + [d.reshape(1).astype(mx.uint32) for d in drafts])
        logits, hidden = self._forward(inputs, cache)
        logprobs = self._target_logprobs(logits[0, len(pending) - 1:], seq, drafts, sampler)
        if params.greedy:
            target = mx.argmax(logprobs, axis=-1)
            mx.eval(target, drafts)
            best = target.tolist()
            drafted = [int(d.item()) for d in drafts]
            accepted = common_prefix(drafted, best)
            following = best[accepted]
        else:
            draft_tokens = mx.stack(drafts).astype(mx.uint32) if k else mx.zeros((0,), mx.uint32)
            q = mx.stack(probs) if k else mx.zeros((0, logprobs.shape[-1]))
            accepted, following = accept_sampled(sampling_probs(logprobs, params), q, draft_tokens,
                                                 accept_key)
            drafted = draft_tokens.tolist()
        new = drafted[:accepted] + [following]
        for i, token in enumerate(new):
            if token in eos:
                new = new[: i + 1]
                break
        seq_new = seq + new
        length = rewind_cache(cache, mark, pending + drafted, seq_new)
        rows = min(len(pending) + k, len(seq_new) - 1 - mark.length)
        self.drafter.commit(seq_new, mark.length, None if hidden is None else hidden[0, :rows])
        self.policy.update(k, accepted)
        self.drafted += k
        self.accepted += accepted
        self.steps += 1
        self.emitted += len(new)
        return new, length

    def stats(self) -> dict[str, Any]:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "target_steps": self.steps,
            "tokens_per_target_step": self.emitted / self.steps if self.steps else None,
            "switched_off": self.switched_off,
            "switched_off_at_token": self.switched_off_at,
            "speculative_tokens_per_s": _round(self.speculative_pace.rate),
            "plain_tokens_per_s": _round(self.plain_pace.rate),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def model_speculator(target: LoadedModel, draft: LoadedModel | nn.Module,
                     config: SpecConfig = SpecConfig()) -> Speculator:
    """A fresh per-request speculator drafting with `draft` (a loaded model, checked for vocabulary
    compatibility, or a module derived from the target such as `truncated(...)`)."""
    if isinstance(draft, LoadedModel):
        check_compatible(target, draft)
        draft = draft.model
    return Speculator(target.model, ModelDrafter(draft), config)
