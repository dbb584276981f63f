"""Incremental detokenization and stop strings."""

from specdec_cli.core.detok import TextStream, piece_text

PIECES = {
    1: b"Hel",
    2: b"lo",
    3: b" wor",
    4: b"ld",
    5: "é".encode()[:1],
    6: "é".encode()[1:],
    7: b"\n",
    8: b"END",
    9: b"[bold]",
}


def push_all(stream, tokens, kind="target"):
    out, hit = [], False
    for t in tokens:
        segs, hit = stream.push(kind, t)
        out.extend(segs)
        if hit:
            break
    return "".join(t for _, t in out), hit


def test_multibyte_character_split_over_two_tokens_is_held_until_complete():
    s = TextStream(PIECES.__getitem__)
    segs, _ = s.push("accepted", 5)
    assert segs == []
    segs, _ = s.push("target", 6)
    assert segs == [("target", "é")]


def test_stop_string_across_tokens_is_never_shown():
    s = TextStream(PIECES.__getitem__, ("o wo",))
    text, hit = push_all(s, [1, 2, 3, 4])
    assert hit and text == "Hell"
    assert s.text == "Hell"


def test_hit_names_the_stop_string_that_occurs_first_in_the_text():
    s = TextStream(PIECES.__getitem__, ("world", "o wo", "lo"))  # "lo" and "o wo" both end in the third token
    assert s.hit is None
    text, hit = push_all(s, [1, 2, 3, 4])
    assert hit and text == "Hel" and s.hit == "lo"
    tie = TextStream(PIECES.__getitem__, ("lo w", "lo wor"))  # both complete at " wor", at one position
    push_all(tie, [1, 2, 3])
    assert tie.hit == "lo w"  # the one listed first


def test_possible_stop_prefix_is_held_then_released():
    s = TextStream(PIECES.__getitem__, ("lo there",))
    first, _ = s.push("target", 1)
    assert "".join(t for _, t in first) == "He"  # the final "l" could start "lo there"
    segs, hit = s.push("accepted", 2)
    assert not hit and segs == [("target", "l")]  # now "lo" is held
    segs, hit = s.push("target", 3)
    assert not hit and "".join(t for _, t in segs) == "lo wor"
    assert [k for k, _ in segs] == ["accepted", "target"]  # held text keeps its kind


def test_flush_releases_held_text():
    s = TextStream(PIECES.__getitem__, ("ENDX",))
    text, hit = push_all(s, [1, 8])
    assert not hit and text == "Hel"
    assert "".join(t for _, t in s.flush()) == "END"


def test_markup_like_text_is_plain_text():
    s = TextStream(PIECES.__getitem__)
    text, _ = push_all(s, [9])
    assert text == "[bold]"


def test_piece_text_replaces_invalid_utf8():
    assert piece_text(PIECES.__getitem__, [5]) == "\ufffd"


def test_text_is_everything_released_with_or_without_stop_strings():
    for stop in ((), ("END",), ("wor", "zz")):
        s = TextStream(PIECES.__getitem__, stop)
        shown, _ = push_all(s, [1, 2, 5, 6, 3, 4, 7, 9, 1])
        shown += "".join(t for _, t in s.flush())
        assert s.text == shown and shown.startswith("Helloé")
