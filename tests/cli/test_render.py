"""The styled stream (`cli.render.StreamRenderer`): throttled to the screen's rate when passes come fast, every pass
shown at once when they come slowly, nothing lost at the end. Real records from the engine on the fake backend."""

from __future__ import annotations

import io
import re

import pytest

from fakes import Clock, FakeBackend, hashed_logits, unstrike
from specdec_cli.cli.render import REFRESH_S, REJECTED_SHOWN, StreamRenderer, rejected_mark
from specdec_cli.core.controller import FixedK
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import REJECTED
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.driver import generate

ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Terminal(io.StringIO):
    """A terminal that keeps what it is sent, and counts the writes of something."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.writes += bool(s)
        return super().write(s)

    def shown(self) -> str:
        return ANSI.sub("", self.getvalue())


class AsciiTerminal(io.TextIOWrapper):
    """A terminal whose encoding is ASCII (a legacy code page)."""

    def isatty(self) -> bool:
        return True


def _steps():
    """A generation with drafts accepted and rejected: its Step records and its output text."""
    prompt = [5, 9, 3, 17, 4, 22, 8, 5, 9, 3, 17]
    engine = SpeculativeEngine(FakeBackend(hashed_logits), NgramDrafter(1, 3), FixedK(3))
    result = generate(engine, prompt, GenerationConfig(max_tokens=60))
    assert len(result.steps) > 20 and result.text
    return result.steps, result.text


def test_a_fast_stream_is_printed_at_the_screens_rate_and_its_end_is_not_lost():
    steps, text = _steps()
    clock, out = Clock(), Terminal()
    renderer = StreamRenderer(out, styled=True, show_rejected=False, clock=clock)
    shown_after = []
    for step in steps:  # a GPU's passes: 5 ms apart
        clock.advance(0.005)
        renderer.step(step)
        shown_after.append(out.shown())
    prints = out.writes
    # at most one print per refresh interval (plus the first step's, shown at once)
    assert prints <= 2 + len(steps) * 0.005 / REFRESH_S < len(steps) / 2
    assert shown_after[0] == steps[0].text  # the first step is shown at once
    assert out.shown() != text  # the last steps are still gathered...
    renderer.end()
    assert out.shown() == text + "\n"  # ...and end() prints them: the whole output, in order, once


def test_a_slow_stream_shows_every_pass_as_it_comes():
    steps, text = _steps()
    clock, out = Clock(), Terminal()
    renderer = StreamRenderer(out, styled=True, show_rejected=False, clock=clock)
    so_far = ""
    for step in steps:  # a CPU's passes: 100 ms apart
        clock.advance(0.1)
        renderer.step(step)
        so_far += step.text
        assert out.shown() == so_far
    renderer.end()
    assert out.shown() == text + "\n"


def test_rejected_drafts_keep_their_place_in_a_gathered_stream():
    steps, _ = _steps()
    clock, out = Clock(), Terminal()
    renderer = StreamRenderer(out, styled=True, show_rejected=True, clock=clock)
    for step in steps:
        clock.advance(0.001)
        renderer.step(step)
    renderer.end()
    # display order: accepted, rejected (marked), target
    every = "".join(rejected_mark(t) if kind == REJECTED else t for s in steps for kind, t in s.segments)
    assert any(s.rejected for s in steps)
    assert out.shown() == every + ("" if every.endswith("\n") else "\n")


def _code_steps():
    """A reply with indented lines, whose rejected drafts hold newlines, indentation, a tab and a long tail: its Step
    records and its text."""
    from specdec_cli.core.records import ACCEPTED, TARGET, Step

    parts = [  # (accepted, rejected, target) per step
        ("def is_pal", "\nimport re\n", "indrome"),
        ("(s: str) -> bool:\n", '    """Return\n    True', "    "),
        ('"""True if s reads', "\tthe same\n\n", " the same backwards."),
        ('"""\n    s = s.lower()\n', "\n\n```python\nimport re\nprint(is_palindrome('abba'))\n", "    return"),
        (" s == s[::-1]", " \n", "\n"),
        ('\n\nprint(is_palindrome("level"))', "  # True if", "\n"),
    ]
    steps = []
    for i, (acc, rej, tgt) in enumerate(parts):
        steps.append(
            Step(
                index=i,
                k=3,
                drafted=(1, 2, 3),
                n_accepted=1,
                target_token=4,
                emitted=(1, 4),
                segments=((ACCEPTED, acc), (REJECTED, rej), (TARGET, tgt)),
                draft_ms=0.0,
                verify_ms=1.0,
                source="prompt",
            )
        )
    return steps, "".join(s.text for s in steps)


@pytest.mark.parametrize("refresh_s", [0.0, REFRESH_S], ids=["each-step", "gathered"])
def test_rejected_drafts_never_take_the_replys_lines_or_indentation(refresh_s):
    steps, text = _code_steps()
    clock, out = Clock(), Terminal()
    renderer = StreamRenderer(out, styled=True, show_rejected=True, refresh_s=refresh_s, clock=clock)
    for step in steps:
        clock.advance(0.001)
        renderer.step(step)
    renderer.end()
    kept, rejected = unstrike(out.getvalue())
    assert kept.splitlines() == text.splitlines()  # the reply's lines and indentation, exactly
    # shown where they were proposed, each whole on one line
    assert rejected == [rejected_mark(t) for s in steps for kind, t in s.segments if kind == REJECTED]
    assert rejected[0] == "↵import re↵" and "⇥the same↵↵" in rejected[2]
    assert any(r.endswith(f"…+{len(steps[3].segments[1][1]) - REJECTED_SHOWN}") for r in rejected)  # cut short


def test_rejected_drafts_fall_back_to_ascii_marks_where_the_encoding_has_no_arrows():
    steps, text = _code_steps()
    raw = io.BytesIO()
    out = AsciiTerminal(raw, encoding="ascii", newline="")
    renderer = StreamRenderer(out, styled=True, show_rejected=True, refresh_s=0.0, clock=Clock())
    for step in steps:
        renderer.step(step)
    renderer.end()  # an arrow would raise UnicodeEncodeError here
    kept, rejected = unstrike(raw.getvalue().decode("ascii"))
    assert kept.splitlines() == text.splitlines()
    assert rejected == [rejected_mark(t, ascii_only=True) for s in steps for k, t in s.segments if k == REJECTED]
    assert rejected[0] == "\\nimport re\\n" and rejected[3].endswith("...+" + str(len(steps[3].segments[1][1]) - 16))


def test_a_pipe_gets_the_replys_text_without_rejected_drafts():
    steps, text = _code_steps()
    out = io.StringIO()
    renderer = StreamRenderer(out, styled=False, show_rejected=True, clock=Clock())
    for step in steps:
        renderer.step(step)
    renderer.end()
    assert out.getvalue() == text


def test_clean_hides_rejected_drafts_and_keeps_the_colours():
    steps, text = _code_steps()
    out = Terminal()
    renderer = StreamRenderer(out, styled=True, show_rejected=False, refresh_s=0.0, clock=Clock())
    for step in steps:
        renderer.step(step)
    renderer.end()
    kept, rejected = unstrike(out.getvalue())
    assert "\x1b[" in out.getvalue() and rejected == [] and kept == text


def test_a_pipe_gets_every_steps_text_as_it_comes():
    steps, text = _steps()
    out = io.StringIO()
    renderer = StreamRenderer(out, styled=False, clock=Clock())  # a virtual clock that never moves
    so_far = ""
    for step in steps:
        renderer.step(step)
        so_far += step.text
        assert out.getvalue() == so_far
    renderer.end()
    assert out.getvalue() == text


def test_the_stream_is_written_byte_for_byte_as_rich_prints_it():
    from rich.text import Text

    from specdec_cli.cli.console import make_console
    from specdec_cli.cli.render import segment_style
    from specdec_cli.core.records import ACCEPTED, TARGET, Step

    texts = [
        "def f(x):\n",
        "    return x\n\n",
        "é [bold]not markup[/]",
        "a\rb\x07c",
        "\n",
        "x\x1b[31my",
        "  ",
        "tab\there",
        "end",
    ]
    steps = []
    for i, t in enumerate(texts):
        segments = ((ACCEPTED, t), (REJECTED, texts[-1 - i]), (TARGET, texts[(i + 3) % len(texts)]))
        steps.append(
            Step(
                index=i,
                k=2,
                drafted=(1, 2),
                n_accepted=1,
                target_token=3,
                emitted=(1, 3),
                segments=segments,
                draft_ms=0.0,
                verify_ms=1.0,
                source=("prompt", "store")[i % 2],
            )
        )
    out, expected = Terminal(), Terminal()
    renderer = StreamRenderer(out, styled=True, refresh_s=0.0, clock=Clock())  # each step printed on its own
    rich = make_console(file=expected)
    for step in steps:
        renderer.step(step)
        text = Text()
        for kind, t in step.segments:
            text.append(rejected_mark(t) if kind == REJECTED else t, style=segment_style(kind, step.source))
        rich.print(text, end="")
    assert "\x1b[" in out.getvalue() and out.getvalue() == expected.getvalue()
