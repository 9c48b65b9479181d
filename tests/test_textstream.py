"""Incremental detokenization and stop strings."""

from __future__ import annotations

from llamactor.runtime.engine.textstream import TextStream


def test_utf8_held_until_complete():
    """A multi-byte character split over tokens is released only when complete."""
    s = TextStream()
    data = "🙂".encode()
    assert s.push(data[:1]) == ""
    assert s.push(data[1:3]) == ""
    assert s.push(data[3:]) == "🙂"
    assert s.text == "🙂"


def test_stop_string_held_back_then_released():
    """Text that may start a stop string is held back until it can no longer match."""
    s = TextStream(("END",))
    assert s.push(b"abc E") == "abc "
    assert s.push(b"N") == ""
    assert s.push(b"x") == "ENx"
    assert s.push(b" EN") == " "
    assert s.push(b"D tail") == ""
    assert s.stopped_by == "END"
    assert s.text == "abc ENx "


def test_earliest_of_several_stop_strings_wins():
    s = TextStream(("world", "lo w"))
    assert s.push(b"hello world") == "hel"
    assert s.stopped_by == "lo w"


def test_flush_releases_held_text_at_the_end():
    s = TextStream(("STOP",))
    assert s.push(b"ST") == ""
    assert s.flush() == "ST"
    assert s.text == "ST"


def test_invalid_bytes_become_replacement_characters():
    s = TextStream()
    assert s.push(b"\xff") == "\ufffd"
