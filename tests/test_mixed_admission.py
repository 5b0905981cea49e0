"""Admission by memory, not by count (issue 33): with no `max_running`, every request whose
model cache fits the memory budget runs at once, in one batched step; the budget, not a count,
refuses the next one; `max_running` still caps the rows when given (`mlxchat serve --max-running`).
Tiny random-weight llama (tests/tiny_models.py)."""

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
