"""Admission by memory, not by count (issue 33): with no `max_running`, every request whose
model cache fits the memory budget runs at once, in one batched step; the budget, not a count,
refuses the next one; `max_running` still caps the rows when given (`mlxchat serve --max-running`).
Tiny random-weight llama (tests/tiny_models.py)."""

from collections import Counter

import pytest

from engine.decoding.sampling import SamplingParams
from engine.errors import Overloaded
from engine.scheduling.service import MAX_RUNNING_ROWS
from tiny_models import tiny_llama
from watched_model import tokens_of, watched

pytestmark = pytest.mark.fast

PROMPT = list(range(100, 132))


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(autouse=True)
def one_burst(monkeypatch):
    """A test's submissions in a row are gathered as one burst however slowly its thread runs: on
    a loaded machine they spread past the idle engine's 0.5 ms quiet time, the first request
    started alone, and the batches these tests count came out otherwise."""
    from engine.scheduling import ticks

    monkeypatch.setattr(ticks, "ADMIT_QUIET_S", 0.05)
    monkeypatch.setattr(ticks, "ADMIT_WAIT_S", 0.5)


@pytest.mark.parametrize("cap", [None, 3])
def test_requests_that_fit_the_memory_budget_run_together_up_to_the_cap(llama, serve, cap):
    target = watched(llama)
    probe = serve(llama)
    need = probe.request_bytes(len(PROMPT), 12)
    weights = probe.status().weight_bytes  # the budget holds the model's weights too
    engine = serve(target, max_running=cap, max_queued=0 if cap is None else 8,
                   prefix_cache=False, memory_budget=weights + int(need * 6.5))
    assert engine.max_running == (cap or MAX_RUNNING_ROWS)
    target.model.gate.clear()  # all six are admitted before the first model call
    handles = [engine.submit(prompt_tokens=PROMPT[i:] + PROMPT[:i], params=SamplingParams(max_tokens=12))
               for i in range(6)]
    with pytest.raises(Overloaded, match="memory budget"):
        engine.submit(prompt_tokens=PROMPT, params=SamplingParams(max_tokens=12))
    target.model.gate.set()
    assert all(len(tokens_of(h)) == 12 for h in handles)
    assert max(target.model.batch_sizes) == (6 if cap is None else cap)
    assert engine.status().reserved_bytes == 0


def test_serve_takes_a_max_running_override_and_refuses_a_bad_one():
    from click.testing import CliRunner

    from app.cli.commands import cli

    runner = CliRunner()
    assert "--max-running" in runner.invoke(cli, ["serve", "--help"]).output
    bad = runner.invoke(cli, ["serve", "--max-running", "0", "--no-browser"])
    assert bad.exit_code == 2 and "--max-running" in bad.output


LONG = [100 + (i * 7) % 300 for i in range(400)]


@pytest.mark.parametrize("room_for_padding", [False, True])
def test_a_long_row_joins_short_ones_only_where_the_budget_holds_its_padding(llama, serve, room_for_padding):
    """A decode batch keeps every row as wide as its longest (mlx-lm's layout): a 400-token row
    beside three 32-token ones makes all four 408 tokens wide, more than their own reservations
    hold, and so does the call that feeds the four prompts' last tokens together. Both reserve that
    padding in the memory budget; where the budget has no room for it, the long row runs alone
    beside the short ones. Either way each answer is the one it gets alone, and every byte is
    given back at the end."""
    target = watched(llama)
    probe = serve(llama)
    weights = probe.status().weight_bytes
    own = probe.request_bytes(len(LONG), 8) + 3 * probe.request_bytes(len(PROMPT), 8)
    # every row as wide as the long one, with a step to spare: where the long prompt's last token
    # goes through a call of its own before the others join, the rows end a column further right
    together = 4 * probe.request_bytes(len(LONG) + 1, 8)
    alone = {}
    for prompt in [LONG] + [PROMPT[i:] + PROMPT[:i] for i in range(3)]:
        alone[tuple(prompt)] = tokens_of(probe.submit(prompt_tokens=prompt, params=SamplingParams(max_tokens=8)))
    budget = weights + (together if room_for_padding else own) + 1024
    engine = serve(target, prefix_cache=False, memory_budget=budget)
    target.model.gate.clear()  # all four are admitted before the first model call
    prompts = [LONG] + [PROMPT[i:] + PROMPT[:i] for i in range(3)]
    handles = [engine.submit(prompt_tokens=p, params=SamplingParams(max_tokens=8)) for p in prompts]
    target.model.gate.set()
    assert [tokens_of(h) for h in handles] == [alone[tuple(p)] for p in prompts]
    steps = Counter(rows for rows, tokens in target.model.shapes if tokens == 1)
    # the prompts' last tokens go through one call together (prefill_together, its merged cache
    # as padded), then 7 batched steps: of 4 rows, or of the 3 short ones beside the long one's own
    if room_for_padding:
        assert steps[4] == 8 and steps[3] == 0, steps
    else:
        assert steps[4] == 0 and steps[3] == 8, steps
    assert engine.status().reserved_bytes == 0


@pytest.mark.parametrize("room", ["the rows' extents", "the column they end at"])
def test_the_padding_counts_how_far_right_a_short_row_with_a_long_answer_ends(llama, serve, room):
    """Rows are right-aligned at one column: three 250-token prompts that may answer 100 tokens
    beside a 400-token one that answers 8 end at column 500, not at the longest row's own extent
    (408) or theirs (350); once the long row leaves, their columns stay (too few unused ones to
    make the buffers shrink). A budget that holds only the rows' extents keeps the long row out of
    the batch; one that holds the column they end at lets all four decode together."""
    target = watched(llama)
    probe = serve(llama)
    weights = probe.status().weight_bytes
    mid = [[(7 * i + 3 * j) % 400 + 50 for j in range(250)] for i in range(3)]
    prompts, budgets = [LONG] + mid, [8, 100, 100, 100]
    own = sum(probe.request_bytes(len(p), m) for p, m in zip(prompts, budgets))
    # the long row may take its 8 steps alone while the others still prefill, and join after any
    widest = 400 + 8 + 100 if room == "the column they end at" else max(400 + 8, 250 + 100)
    padding = 4 * probe.request_bytes(widest, 0) - own
    alone = {tuple(p): tokens_of(probe.submit(prompt_tokens=p, params=SamplingParams(max_tokens=m)))
             for p, m in zip(prompts, budgets)}
    # room for the merged prompts' call (every row as wide as the long prompt) in both cases
    prefill = 4 * probe.request_bytes(len(LONG) + 1, 0) - own
    engine = serve(target, prefix_cache=False, memory_budget=weights + own + max(padding, prefill) + 1024)
    target.model.gate.clear()
    handles = [engine.submit(prompt_tokens=p, params=SamplingParams(max_tokens=m)) for p, m in zip(prompts, budgets)]
    target.model.gate.set()
    assert [tokens_of(h) for h in handles] == [alone[tuple(p)] for p in prompts]
    steps = Counter(rows for rows, tokens in target.model.shapes if tokens == 1)
    if room == "the column they end at":
        assert steps[4] > 0, steps
    else:
        assert steps[4] == 0, steps
    assert engine.status().reserved_bytes == 0
