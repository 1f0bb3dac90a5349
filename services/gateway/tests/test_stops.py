"""StopMatcher: holds back possible stop prefixes, cuts at the first stop, independent of chunking."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet_gateway.stops import StopMatcher, cut_at_first_stop, find_first_stop

pytestmark = pytest.mark.unit


def _run(stops: list[str], chunks: list[str]) -> tuple[str, bool, list[str]]:
    """Feed all chunks (as a caller would: stop feeding once stopped), then flush."""
    matcher = StopMatcher(stops)
    emits, stopped = [], False
    for piece in chunks:
        emit, stopped = matcher.feed(piece)
        emits.append(emit)
        if stopped:
            break
    emits.append(matcher.flush())
    return "".join(emits), stopped, emits


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in pairwise(bounds)]


def test_stop_split_over_two_chunks() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("hello ST") == ("hello ", False)
    assert matcher.feed("OP world") == ("", True)
    assert matcher.stopped
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_held_prefix_is_released_when_it_diverges() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("ab S") == ("ab ", False)
    assert matcher.feed("T") == ("", False)
    assert matcher.feed("x") == ("STx", False)
    assert matcher.feed("ST") == ("", False)
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""


def test_text_before_the_stop_in_the_same_chunk() -> None:
    assert StopMatcher(["\n\n"]).feed("line one\n\nline two") == ("line one", True)


def test_stop_at_the_very_start() -> None:
    assert StopMatcher(["###"]).feed("### title") == ("", True)


def test_no_stops_pass_everything_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.flush() == ""
    assert StopMatcher(["", ""]).feed("a") == ("a", False)


def test_first_ending_stop_wins() -> None:
    # "bc" completes before "abcd" does, as a streaming reader would see it.
    assert StopMatcher(["abcd", "bc"]).feed("xabcd") == ("xa", True)
    assert cut_at_first_stop("xabcd", ["abcd", "bc"]) == ("xa", True)
    # Same end: the longer (earlier starting) stop cuts more.
    assert StopMatcher(["cd", "bcd"]).feed("abcde") == ("a", True)


def test_longest_possible_prefix_is_held() -> None:
    matcher = StopMatcher(["abc", "bcd"])
    assert matcher.feed("xab") == ("x", False)  # "ab" could start "abc"
    assert matcher.feed("c") == ("", True)


def test_unicode_stops() -> None:
    matcher = StopMatcher(["東京"])
    assert matcher.feed("в 東") == ("в ", False)
    assert matcher.feed("京 x") == ("", True)


def test_find_first_stop_positions() -> None:
    assert find_first_stop("hello world", ["o w", "world"]) == (4, 7)
    assert find_first_stop("hello", ["x"]) is None


def _reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Brute force: scan end positions left to right; at the first end where a stop ends, cut there."""
    for end in range(len(text) + 1):
        starts = [end - len(s) for s in stops if s and end >= len(s) and text[end - len(s) : end] == s]
        if starts:
            return text[: min(starts)], True
    return text, False


ALPHABET = "abc"
stops_strategy = st.lists(st.text(alphabet=ALPHABET, min_size=0, max_size=4), max_size=4)


@settings(max_examples=500, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=30),
    stops=stops_strategy,
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=10),
)
def test_emits_equal_the_text_cut_at_the_first_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    expected = _reference_cut(text, stops)
    assert cut_at_first_stop(text, stops) == expected
    joined, stopped, _ = _run(stops, _split(text, cuts))
    assert (joined, stopped) == expected
    # Nothing emitted ever contains a whole stop string.
    assert not any(stop and stop in joined for stop in stops)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=20), stops=stops_strategy)
def test_character_by_character_emits_as_early_as_possible(text: str, stops: list[str]) -> None:
    # After each character, everything is emitted except the longest suffix that starts a stop.
    matcher = StopMatcher(stops)
    emitted = ""
    for index, char in enumerate(text):
        emit, stopped = matcher.feed(char)
        emitted += emit
        if stopped:
            break
        seen = text[: index + 1]
        held = len(seen) - len(emitted)
        live = [s for s in stops if s]
        longest = max(
            (k for s in live for k in range(1, len(s)) if k <= len(seen) and seen.endswith(s[:k])), default=0
        )
        assert held == longest
