"""Stop strings: the streaming matcher equals a naive reference on any input, does work linear in
the text whatever the stop strings' lengths, and oversized requests are refused as the `stop` field's
fault."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.decoding.sampling import SamplingParams
from engine.decoding.stops import MAX_STOP_CHARS, MAX_STOPS, StopMatcher
from engine.errors import InvalidRequest

pytestmark = pytest.mark.fast


class NaiveMatcher:
    """The obvious definition: search the whole pending text for every stop string, and hold back
    the longest pending suffix that is a proper prefix of one."""

    def __init__(self, stops):
        self.stops, self.pending = stops, ""

    def feed(self, text):
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])),
                   default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self):
        out, self.pending = self.pending, ""
        return out


def run(matcher, chunks):
    """Every (emitted, hit) pair until the first hit, then what a flush gives."""
    outputs = []
    for chunk in chunks:
        outputs.append(matcher.feed(chunk))
        if outputs[-1][1]:
            return outputs, ""
    return outputs, matcher.flush()


# A small alphabet (with a multi-byte and an astral character) makes overlaps and repeats common.
ALPHABET = "ab\u00e9\U0001f600"
stop_strings = st.lists(st.text(ALPHABET, min_size=1, max_size=7), min_size=1, max_size=4)
chunks = st.lists(st.text(ALPHABET, max_size=6), max_size=25)


@settings(max_examples=1500, deadline=None)
@given(stop_strings, chunks)
def test_streaming_matcher_equals_the_naive_reference(stops, chunks):
    assert run(StopMatcher(tuple(stops)), chunks) == run(NaiveMatcher(tuple(stops)), chunks)


def test_text_is_held_back_only_while_it_could_start_a_stop_string():
    m = StopMatcher(("</end>", "STOP"))
    assert m.feed("hello </e") == ("hello ", False)
    assert m.feed("n") == ("", False)
    assert m.feed("x ST") == ("</enx ", False)
    assert m.feed("OP and more") == ("", True)


def test_the_earliest_starting_stop_string_wins():
    assert StopMatcher(("abcd", "bc")).feed("xabcd") == ("x", True)
    m = StopMatcher(("bcd", "abcdef"))  # "bcd" ends first, but "abcdef" starts first
    assert m.feed("zab") == ("z", False)
    assert m.feed("cdef") == ("", True)


def test_work_is_linear_in_the_text_whatever_the_stop_lengths():
    """Text that keeps a nearly-matching suffix pending forever: every character could continue a
    stop string (the quadratic matcher re-tested every prefix length at every token)."""
    tokens = ["a" * 3] * 20_000
    text_len = sum(map(len, tokens))
    work = {}
    for length in (8, MAX_STOP_CHARS):
        stops = tuple("a" * (length - 1) + chr(ord("b") + i) for i in range(MAX_STOPS))
        m = StopMatcher(stops)
        emitted = "".join(m.feed(t)[0] for t in tokens)
        assert emitted + m.flush() == "a" * text_len
        assert len(emitted) == text_len - (length - 1)  # only a stop's worth of text held back
        work[length] = m.steps
    # KMP: each character costs at most two transitions per stop string, amortised.
    assert all(steps <= 2 * text_len * MAX_STOPS for steps in work.values())
    assert work[MAX_STOP_CHARS] <= work[8] * 1.01


def test_a_million_character_stop_string_is_refused_as_the_stop_fields_fault():
    with pytest.raises(InvalidRequest, match=r"^stop .*at most 512 characters"):
        SamplingParams(stop=("x" * 1_000_000,))


@pytest.mark.parametrize("stops, message", [
    (tuple(f"s{i}" for i in range(MAX_STOPS + 1)), r"^stop may hold at most 16 strings"),
    (("",), r"^stop strings must be non-empty"),
    ((7,), r"^stop strings must be non-empty strings"),
])
def test_too_many_or_empty_stop_strings_are_refused(stops, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(stop=stops)


def test_the_limits_themselves_are_accepted():
    params = SamplingParams(stop=tuple("x" * (MAX_STOP_CHARS - 2) + f"{i:02d}" for i in range(MAX_STOPS)))
    assert len(params.stop) == MAX_STOPS
    assert SamplingParams(stop=("y" * MAX_STOP_CHARS,)).stop == ("y" * MAX_STOP_CHARS,)
