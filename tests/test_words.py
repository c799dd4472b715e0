"""protos/words.py: how this process repeats another's words and lists."""

from __future__ import annotations

import itertools

from paramshard.protos.words import MAX_LISTED, listed, printable, said


def test_listed_names_the_first_and_counts_the_rest() -> None:
    assert listed([]) == "none"
    assert listed([3, 1]) == "3, 1"
    assert listed(range(MAX_LISTED)) == ", ".join(map(str, range(MAX_LISTED)))
    assert listed(range(20), most=3) == "0, 1, 2 and 17 more"
    assert listed([0, 1], count=2_000) == "0, 1 and 1,998 more"  # a reply's list, of its count


def test_listed_takes_no_more_of_an_endless_iterable_than_it_names() -> None:
    endless = itertools.count()
    assert listed(endless, count=10**9, most=2) == "0, 1 and 999,999,998 more"
    assert next(endless) == 2


def test_said_bounds_and_escapes() -> None:
    assert printable("a\tb\nc\x1b[2J\x07\x9b") == "a\tb\nc\\x1b[2J\\x07\\x9b"
    assert said("x" * 10, most=4) == "xxxx... (6 more characters)"
    assert said("\x1b" * 3, most=8) == "\\x1b" * 3  # bounded before the escapes lengthen it
