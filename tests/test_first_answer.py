"""A new user's first answers: the bundled model on its defaults does not fall into repetition
loops on ordinary questions (a quality check on the real model, not a timing)."""

import re
from collections import Counter

import pytest

from engine import Engine

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain what a computer virus is.",
    "How do I boil an egg?",
    "Write a short poem about the sea.",
    "What are the benefits of regular exercise?",
    "Why is the sky blue?",
    "Suggest a name for a small bakery.",
    "What should I pack for a weekend hiking trip?",
    "Summarise the plot of Cinderella in a few sentences.",
    "How can I save money on groceries?",
    "What is photosynthesis?",
]
MAX_TOKENS = 200


def loops(text: str) -> bool:
    """True when any sentence of at least 5 words occurs 3 or more times."""
    sentences = [" ".join(re.findall(r"[\w']+", s.lower())) for s in re.split(r"[.!?\n]+", text)]
    counts = Counter(s for s in sentences if len(s.split()) >= 5)
    return any(n >= 3 for n in counts.values())


@pytest.mark.fast
def test_the_loop_detector():
    assert loops("I like tea very much. " * 3)
    assert not loops("I like tea very much. I like tea very much. Then coffee.")
    assert not loops("Yes. Yes. Yes. Yes.")  # short sentences are not a loop


@pytest.mark.timeout(900)
def test_first_answers_on_the_defaults_do_not_loop():
    engine = Engine(None, max_running=len(PROMPTS), max_queued=0).start()
    try:
        handles = [engine.submit([{"role": "user", "content": p}],
                                 engine.params({"max_tokens": MAX_TOKENS, "seed": 100 + i}))
                   for i, p in enumerate(PROMPTS)]
        answers = ["".join(e.text for e in h.events()) for h in handles]
    finally:
        engine.stop()
    looping = [(p, a) for p, a in zip(PROMPTS, answers) if loops(a)]
    assert all(answers)
    assert len(looping) <= 1, looping
