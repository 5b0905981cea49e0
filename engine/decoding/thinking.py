"""A thinking budget: a reasoning model may think at most `thinking_budget` tokens; then its own
closing marker (`</think>` ...) is forced and the answer follows, as llama.cpp's
`--reasoning-budget` does. Reasoning efforts, as clients name them, map to budgets here
(`EFFORT_BUDGETS`, one declaration for every protocol).

Greedy output is unchanged while the budget is not reached: the processor only looks at the
tokens until it has to act.
"""

from typing import Sequence

import mlx.core as mx

from ..errors import InvalidRequest

# Tokens of thinking per effort (OpenAI's `reasoning_effort` / `reasoning.effort`, Ollama's
# `think` levels); None: no limit. "none" closes the thinking section at once.
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 256, "low": 1024,
                                         "medium": 4096, "high": None}


def effort_budget(effort: object, field: str = "reasoning_effort") -> int | None:
    """The budget for a named effort; raises InvalidRequest naming `field` for another value."""
    if not isinstance(effort, str) or effort not in EFFORT_BUDGETS:  # (an object is no name)
        raise InvalidRequest(f"{field} must be one of {', '.join(EFFORT_BUDGETS)}, got "
                             f"{str(effort)[:40]!r}", field=field, code="invalid_value")
    return EFFORT_BUDGETS[effort]  # type: ignore[index]


def _find_last(tokens: Sequence[int], marker: Sequence[int]) -> int:
    """Where `marker` last starts in `tokens`, -1 if nowhere."""
    n = len(marker)
    for i in range(len(tokens) - n, -1, -1):
        if list(tokens[i:i + n]) == list(marker):
            return i
    return -1


class ThinkingBudget:
    """A logits processor: counts the tokens inside a thinking section (opened by the prompt or by
    the model) and, once `budget` are spent, forces the closing marker's tokens one by one."""

    def __init__(self, start: Sequence[int], end: Sequence[int], budget: int,
                 prompt: Sequence[int]):
        self.start, self.end, self.budget = list(start), list(end), budget
        self.seen = len(prompt)
        self.inside = _find_last(prompt, self.start) > _find_last(prompt, self.end)
        self.thought = 0
        self.forced = 0  # how many of the closing marker's tokens are already forced
        self.recent: list[int] = list(prompt[-max(len(self.start), len(self.end)):])

    def _observe(self, token: int) -> None:
        self.recent = (self.recent + [token])[-max(len(self.start), len(self.end)):]
        if self.recent[-len(self.end):] == self.end:
            self.inside, self.forced = False, 0
        elif self.recent[-len(self.start):] == self.start:
            self.inside, self.thought = True, 0
        elif self.inside:
            self.thought += 1

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        n = history.shape[-1]
        if n > self.seen:
            for token in history.reshape(-1)[self.seen:n].tolist():
                self._observe(int(token))
            self.seen = n
        if not self.inside or self.thought < self.budget:
            return logits
        forced = self.end[min(self._matched(), len(self.end) - 1)]
        keep = mx.arange(logits.shape[-1]) == forced
        return mx.where(keep, mx.zeros_like(logits), mx.full(logits.shape, -mx.inf, logits.dtype))

    def _matched(self) -> int:
        """How much of the closing marker the latest tokens already spell."""
        for k in range(len(self.end) - 1, 0, -1):
            if self.recent[-k:] == self.end[:k]:
                return k
        return 0


def thinking_budget(tokenizer: object, budget: int | None,
                    prompt: Sequence[int]) -> ThinkingBudget | None:
    """The processor for `budget` on a model whose tokenizer knows its think markers (None: no
    budget, or a model that does not think)."""
    if budget is None or not getattr(tokenizer, "has_thinking", False):
        return None
    start = list(getattr(tokenizer, "think_start_tokens", None) or [tokenizer.think_start_id])
    end = list(getattr(tokenizer, "think_end_tokens", None) or [tokenizer.think_end_id])
    return ThinkingBudget(start, end, budget, prompt)
