"""Stop conditions on their own: the stop-string and stop-sequence matchers with scripted pieces,
the EOS set, the budget, the context, cancellation and the deadline (with a fake clock)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.errors import InvalidRequestError
from minillm.runtime.request import OutputStream
from minillm.runtime.stopping import (
    StopCriteria, StopReason, StopSequenceMatcher, StopStringMatcher, cancel_check,
)


def run(pieces, stops, include=False):
    """Push pieces, then flush; returns (released per push, flushed tail, matcher)."""
    m = StopStringMatcher(stops, include_stop_string=include)
    released = [m.push(p) for p in pieces]
    tail = m.flush()
    assert m.text == "".join(released) + tail
    return released, tail, m


# --- the cases, exactly ----------------------------------------------------------------
def test_stop_string_across_many_pieces_streams_exactly_abc():
    released, tail, m = run(["AB", "C", "DEF", "G", "HI", "J", "KL"], ["DEFGHIJ"])
    assert released == ["AB", "C", "", "", "", "", ""] and tail == ""
    assert "".join(released) == "ABC"
    assert (m.matched, m.match_start) == ("DEFGHIJ", 3)


def test_held_prefix_released_when_ruled_out():
    m = StopStringMatcher(["DEFGHIJ"])
    assert m.push("DE") == ""  # could begin the stop string: held
    assert m.held == "DE"
    assert m.push("X") == "DEX"  # 'DEX' cannot: released
    assert m.flush() == "" and m.text == "DEX" and m.matched is None


def test_held_prefix_is_flushed_at_the_end():
    released, tail, m = run(["AB", "DEF"], ["DEFGHIJ"])  # e.g. max new tokens after 'DEF'
    assert released == ["AB", ""] and tail == "DEF" and m.text == "ABDEF" and m.matched is None


def test_include_stop_string():
    released, tail, m = run(["AB", "C", "DEF", "G", "HI", "J", "KL"], ["DEFGHIJ"], include=True)
    assert "".join(released) + tail == "ABCDEFGHIJ"
    assert released[-1] == "" and released[-2] == "DEFGHIJ"  # nothing after the stop string


# --- more edges --------------------------------------------------------------------------------
def test_stop_string_inside_one_piece_cuts_mid_piece():
    released, tail, _ = run(["Hello. World"], [". "])
    assert released == ["Hello"] and tail == ""


def test_earliest_match_wins_among_several_stops():
    # Both complete in this piece; '\n' ends first.
    assert run(["one\ntwo END"], ["END", "\n"])[0] == ["one"]
    # 'XYZ' starts first but 'Y' is complete first: a stream of single characters would stop at
    # 'Y', so one big piece does too.
    assert run(["aXYZ"], ["XYZ", "Y"])[0] == ["aX"]
    assert run(["a", "X", "Y", "Z"], ["XYZ", "Y"])[0] == ["a", "", "X", ""]
    # Same end: the longer (earlier-starting) one.
    _, _, m = run(["abcd"], ["cd", "bcd"])
    assert m.matched == "bcd" and m.text == "a"


def test_overlapping_prefix_is_held_correctly():
    # 'aab' with stop 'ab': after 'aa' only the last 'a' can begin the stop string.
    m = StopStringMatcher(["ab"])
    assert m.push("aa") == "a" and m.held == "a"
    assert m.push("b") == "" and m.matched == "ab" and m.text == "a"


def test_after_a_match_nothing_more_is_released():
    m = StopStringMatcher(["X"])
    assert m.push("aXb") == "a"
    assert m.push("more") == "" and m.flush() == "" and m.text == "a"


def test_no_stop_strings_releases_everything_at_once():
    assert run(["a", "b"], [])[0] == ["a", "b"]


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [3]])
def test_bad_stop_strings_are_invalid_requests(bad):
    with pytest.raises(InvalidRequestError):
        StopStringMatcher(bad)


def reference_cut(text: str, stops: list[str], include: bool) -> str:
    """One-shot: the first stop string to be complete reading left to right."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text
    end, start, _ = min(hits)
    return text[:end] if include else text[:start]


@settings(max_examples=400, deadline=None)
@given(text=st.text("abc", max_size=30), stops=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=10), include=st.booleans())
def test_stream_equals_one_shot_cut_however_the_text_is_split(text, stops, cuts, include):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    released, tail, m = run(pieces, stops, include)
    assert m.text == reference_cut(text, stops, include)
    if not include:  # a stop string never leaks, not even for a moment
        assert not any(s in m.text for s in stops)


# --- stop-token sequences ----------------------------------------------------------------------
def test_stop_sequence_holds_ids_and_cuts_them():
    m = StopSequenceMatcher([[7, 8, 9]])
    assert [m.push(i) for i in [1, 7, 8, 2, 7, 8, 9, 5]] == [[1], [], [], [7, 8, 2], [], [], [], []]
    assert m.matched == (7, 8, 9) and m.flush() == []


def test_stop_sequence_include_and_flush():
    m = StopSequenceMatcher([[7, 8]], include=True)
    assert [m.push(i) for i in [1, 7, 8]] == [[1], [], [7, 8]]
    m = StopSequenceMatcher([[7, 8]])
    assert [m.push(i) for i in [1, 7]] == [[1], []] and m.flush() == [7]


def test_longer_sequence_wins_when_both_end_on_the_same_id():
    m = StopSequenceMatcher([[9], [8, 9]])
    assert [m.push(i) for i in [1, 8, 9]] == [[1], [], []] and m.matched == (8, 9)


@pytest.mark.parametrize("bad", [[[]], [[1, -2]], [["a"]]])
def test_bad_stop_sequences(bad):
    with pytest.raises(InvalidRequestError):
        StopSequenceMatcher(bad)


# --- the chain for one request -----------------------------------------------------------------
class FakeDetok:
    """Each id is one character: 65 -> 'A'."""

    def __init__(self):
        self.flushed = 0

    def add(self, i):
        return chr(i)

    def flush(self):
        self.flushed += 1
        return ""


def test_output_stream_sequence_then_string():
    out = OutputStream(FakeDetok(), stop=["QR"], stop_token_ids=[[88, 89]])  # 'XY'
    deltas = [out.add(ord(c)) for c in "ABXQ"]
    assert deltas == ["A", "B", "", "X"]  # 'X' held (may begin 'XY'), released by 'Q'; 'Q' held
    assert out.add(ord("R")) == "" and out.stop_reason is StopReason.STOP_STRING and out.condition == "QR"
    assert out.text == "ABX" and out.finish() == ""

    out = OutputStream(FakeDetok(), stop=["QR"], stop_token_ids=[[88, 89]])
    assert [out.add(ord(c)) for c in "AXY"] == ["A", "", ""]
    assert out.stop_reason is StopReason.STOP_SEQUENCE and out.condition == [88, 89] and out.text == "A"


def test_output_stream_finish_releases_held_ids_and_text():
    detok = FakeDetok()
    out = OutputStream(detok, stop=["QRS"], stop_token_ids=[[88, 89]])
    assert [out.add(ord(c)) for c in "AQRX"] == ["A", "", "", ""]
    assert out.finish() == "QRX" and out.text == "AQRX" and out.stop_reason is None and detok.flushed == 1


# --- EOS set, budget, context ------------------------------------------------------------------
def test_eos_is_a_set_and_the_second_id_stops():
    c = StopCriteria(eos_token_ids=frozenset({1, 106}), max_new_tokens=10)
    assert [c.check(t, n, 100) for n, t in enumerate([5, 7, 106], start=1)] == [None, None, StopReason.EOS]
    assert c.check(1, 1, 100) is StopReason.EOS


def test_budget_and_context_and_precedence():
    c = StopCriteria(eos_token_ids=frozenset({2}), max_new_tokens=3)
    assert c.check(5, 2, 10) is None
    assert c.check(5, 3, 10) is StopReason.MAX_NEW_TOKENS
    assert c.check(5, 2, 0) is StopReason.CONTEXT_FULL
    assert c.check(2, 3, 0) is StopReason.EOS  # EOS first, then the budget, then the context
    assert c.check(5, 3, 0) is StopReason.MAX_NEW_TOKENS


# --- cancellation and timeout ------------------------------------------------------------------
def test_cancel_event_or_callable():
    event = threading.Event()
    c = StopCriteria(cancel=cancel_check(event))
    assert c.interrupted() is None
    event.set()
    assert c.interrupted() is StopReason.CANCELLED
    calls = iter([False, True])
    assert StopCriteria(cancel=cancel_check(lambda: next(calls))).interrupted() is None
    with pytest.raises(InvalidRequestError, match="threading.Event or a callable"):
        cancel_check(42)


def test_timeout_with_a_fake_clock():
    now = [100.0]
    c = StopCriteria(deadline=100.5, clock=lambda: now[0])
    assert c.interrupted() is None
    now[0] = 100.49
    assert c.interrupted() is None
    now[0] = 100.5
    assert c.interrupted() is StopReason.TIMEOUT


def test_stop_reason_values_are_what_the_trace_prints():
    assert [r.value for r in StopReason] == ["eos", "max new tokens", "stop string", "stop-token sequence",
                                             "cancelled", "timed out", "context full"]


def test_a_stop_reason_prints_as_its_phrase():
    from minillm.runtime.stopping import StopReason

    assert f"{StopReason.STOP_STRING}" == str(StopReason.STOP_STRING) == "stop string"  # as the README shows
    assert StopReason("context full") is StopReason.CONTEXT_FULL
