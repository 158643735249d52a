"""TextStream: streamed text with stop strings, over the byte tokenizer (a token per byte, so
every stop string and every multi-byte character is split across tokens)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.text import MAX_STOP_STRINGS, TextStream, stop_string_problems
from serving.tokenizer import ByteTokenizer

TOK = ByteTokenizer(300)


def stream(text: str, stop, step: int = 1):
    ids = TOK.encode(text, add_special_tokens=False)
    s, pieces = TextStream(TOK, stop=stop), []
    for i in range(0, len(ids), step):
        pieces.append(s.push(ids[i:i + step]))
        if s.stopped:
            break
    pieces.append(s.finish())
    return s, pieces


@pytest.mark.parametrize("text, stop, want, stopped", [
    ("hello world. bye", ["."], "hello world", True),
    ("hello world. bye", ["world", "hello"], "", True),           # earliest stop wins
    ("0ô0", ["ô", "0ô0"], "0", True),                              # the first complete: "0ô0" ends later
    ("xabcd", ["abcd", "bc"], "xa", True),                         # "bc" is complete first, at any step
    ("xabc", ["bc", "abc"], "x", True),                            # ending together: the longer
    ("abcabd", ["abd"], "abc", True),                              # a false start is released later
    ("no stop here", ["zz"], "no stop here", False),
    ("tail ab", ["abc"], "tail ab", False),                        # a held prefix is released at the end
    ("naïve 東京 ok", ["京 o"], "naïve 東", True),                  # multi-byte characters around the stop
    ("x", [], "x", False),
])
def test_stop_strings(text, stop, want, stopped):
    for step in (1, 2, 5):
        s, pieces = stream(text, stop, step)
        assert "".join(pieces) == want == s.text and s.stopped == stopped
        for k in range(len(pieces)):  # no released text is ever part of a stop string
            released = "".join(pieces[:k + 1])
            assert not any(x in released for x in stop)


@settings(max_examples=60, deadline=None, database=None)
@given(text=st.text(max_size=40), stop=st.lists(st.text(min_size=1, max_size=4), max_size=3),
       step=st.integers(1, 4))
def test_released_text_is_the_text_before_the_first_stop(text, stop, step):
    # The first stop string is the one complete first, read a character at a time.
    _, pieces = stream(text, stop, step)
    end = next((n for n in range(len(text) + 1) if any(text[:n].endswith(s) for s in stop)), None)
    want = text if end is None else text[:end - max(len(s) for s in stop if text[:end].endswith(s))]
    assert "".join(pieces) == want


def test_after_a_stop_nothing_more_comes_out():
    s = TextStream(TOK, stop=["!"])
    assert s.push(TOK.encode("hi!", add_special_tokens=False)) == "hi" and s.stopped
    assert s.push(TOK.encode("more", add_special_tokens=False)) == "" and s.finish() == ""


def test_malformed_stop_strings_are_named():
    assert stop_string_problems(["ok"]) == []
    assert "non-empty" in stop_string_problems([""])[0]
    assert "at most 256 characters" in stop_string_problems(["x" * 300])[0]
    assert f"at most {MAX_STOP_STRINGS}" in stop_string_problems(["a"] * 17)[0]
    with pytest.raises(ValueError, match="non-empty"):
        TextStream(TOK, stop=[""])


def test_update_cancels_once_and_ends_with_stop_whatever_the_engine_says():
    """The one output policy of the gRPC loop and the CLI: a stop string asks for one cancel;
    the final output finishes with stop (even if the engine reports abort or length), and
    tokens after the stop string give no text."""
    from serving.engine import FinishReason, RequestOutput

    ids = TOK.encode("ab.cd", add_special_tokens=False)
    s = TextStream(TOK, stop=["."])
    u1 = s.update(RequestOutput("r", ids[:2]))
    assert (u1.text, u1.cancel, u1.finish_reason) == ("ab", False, None)
    u2 = s.update(RequestOutput("r", ids[2:4]))
    assert (u2.text, u2.cancel, u2.finish_reason) == ("", True, None)
    u3 = s.update(RequestOutput("r", ids[4:]))
    assert (u3.text, u3.cancel) == ("", False)  # cancel was already asked for
    u4 = s.update(RequestOutput("r", [], finish_reason=FinishReason.ABORT))
    assert (u4.text, u4.cancel, u4.finish_reason) == ("", False, FinishReason.STOP)
    assert s.text == "ab"

    plain = TextStream(TOK, stop=["zz"])
    assert plain.update(RequestOutput("r", ids[:4])).text == "ab.c"
    end = plain.update(RequestOutput("r", ids[4:], finish_reason=FinishReason.LENGTH))
    assert (end.text, end.finish_reason) == ("d", FinishReason.LENGTH)
