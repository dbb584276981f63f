"""benchmarks/first_hour.py: its arguments and the parsing of what each step prints (never the hour itself: the
coordinator runs it alone). The compare line and the chat footer are printed here by the code that prints them for
users, so a change of their wording breaks this test rather than the report."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import pytest

from fakes import FakeBackend, hashed_logits
from specdec_cli.cli.commands.chat_history import Turn
from specdec_cli.cli.commands.chat_view import footer_text
from specdec_cli.cli.console import make_console
from specdec_cli.cli.render import print_compare
from specdec_cli.core.controller import FixedK
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.driver import generate
from specdec_cli.measure.paired import Pair, Paired

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "first_hour.py"


def _load():
    spec = importlib.util.spec_from_file_location("first_hour", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["first_hour"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fh = _load()

# A first run's stderr as a terminal shows it: a progress bar, a disturbed attempt, the kept curve, the stats.
CURVE_STDERR = """\x1b[?25lmeasuring this machine's verify curve (once per model and machine) ━━━━ 64/130 steps\r
verify curve disturbed (a one-token pass took 66.4 ms at the start and 2291.1 ms at the end): measuring it again
measuring this machine's verify curve (once per model and machine) ━━━━━━ 130/130 steps\x1b[?25h
verify curve measured in 164.2 s and kept (specdec doctor shows it)
    prompt  812 tokens, prefill 9.12 s (89 tok/s)
verify curve stale: the passes took 1.43× the curve's ms; measuring it again
verify curve measured in 70.5 s but not kept: a one-token pass took 70 ms at the start and 900 ms at the end (the \
machine was busy); the next run measures it again
"""


def test_curve_measurements_are_counted_from_stderr():
    curves = fh.parse_curves(CURVE_STDERR)
    assert curves.done == [(164.2, True), (70.5, False)] and curves.disturbed == 1
    assert curves.stale == ["the passes took 1.43× the curve's ms"] and curves.attempts == 3
    assert str(curves).startswith("3: 164 s kept, 70 s not kept, 1 disturbed, stale: ")
    assert str(fh.parse_curves("    prompt  812 tokens\n")) == "none"


def test_the_compare_line_as_run_prints_it():
    out = io.StringIO()
    paired = Paired(pairs=(Pair(16.9, 8.1, True), Pair(17.2, 8.0, False), Pair(15.9, 8.2, True)))
    print_compare(make_console(file=out), paired, shared=247, n_spec=247, n_plain=247)
    assert fh.parse_compare("stats...\n" + out.getvalue()) == "2.09× (1.94–2.15×), plain 8.1 tok/s"
    one = io.StringIO()
    print_compare(make_console(file=one), Paired(pairs=(Pair(9.0, 10.0, True),)), shared=3, n_spec=4, n_plain=4)
    assert fh.parse_compare(one.getvalue()) == "0.90×, plain 10.0 tok/s"
    assert fh.parse_compare("no comparison here") is None
    from types import SimpleNamespace

    from specdec_cli.cli.render import pass_placement

    stats = SimpleNamespace(
        cheap_passes=46, curve_passes=50, verify_ms=1070.0, curve_ms=1000.0, curve_depth=700, branch_passes=0
    )
    placed = f"verify curve │ {pass_placement(stats)}\n"  # the stats table's row, as run prints it
    assert (
        fh.parse_compare(placed + out.getvalue())
        == "2.09× (1.94–2.15×), plain 8.1 tok/s; passes 1.07× the curve's prediction at depth 700"
    )


def test_the_chat_footer_as_chat_prints_it():
    engine = SpeculativeEngine(FakeBackend(hashed_logits), NgramDrafter(1, 3), FixedK(3))
    result = generate(engine, [5, 9, 3, 17, 4, 22, 8, 5, 9, 3, 17], GenerationConfig(max_tokens=40))
    footer = footer_text(Turn(user="q", assistant=result.text, stats=result.stats, method="ngram"))
    screen = f">>> {fh.CHAT_MESSAGE}\r\n\x1b[1mdef\x1b[0m is_palindrome(s):\r\n\x1b[2m{footer}\x1b[0m\r\n>>> "
    s = result.stats
    expected = f"{s.tokens_per_s:.1f} tok/s, acceptance {s.acceptance_rate:.0%}, {s.n_generated} tokens"
    assert s.n_drafted and fh.parse_footer(screen) == expected
    assert fh.parse_footer(f">>> {fh.CHAT_MESSAGE}\r\ndef is_pal") is None  # the reply has not ended


def test_tune_speedups_from_its_json():
    doc = {
        "best": "k6",
        "summary": [
            {"config": "none", "speedup_geomean": 1.0, "speedup": {"bisect_rename": 1.0}},
            {"config": "k4", "speedup_geomean": 1.24, "speedup": {"bisect_rename": 1.24}},
            {"config": "k6", "speedup_geomean": 1.32, "speedup": {"bisect_rename": 1.32}},
            {"config": "auto", "speedup_geomean": 1.04, "speedup": {"bisect_rename": 1.06, "free": 1.02}},
        ],
    }
    assert fh.parse_tune(doc) == (
        "k4 1.24×, k6 1.32×, auto 1.04×; auto by prompt: bisect_rename 1.06× (best fixed k6 1.32×: 0.80 of it), "
        "free 1.02×; best k6"
    )
    assert fh.parse_tune({"summary": []}) is None


def test_learnt_curves_that_changed_are_counted():
    old = {"a": {"curve": {"measured_at": "t1", "seconds": 160.0, "stale": False}}}
    new = {
        "a": {"curve": {"measured_at": "t2", "seconds": 58.0, "stale": False}},
        "b": {"curve": {"measured_at": "t3", "seconds": 50.0, "stale": False}},
    }
    assert fh.curve_changes({}, old) == 1 and fh.curve_changes(old, old) == 0 and fh.curve_changes(old, new) == 2


def test_the_table_has_a_row_per_step_and_the_totals():
    rows = [
        fh.Row("quick start", 190.0, fh.parse_curves(CURVE_STDERR), 1, "2.08× (1.98–2.13×), plain 8.1 tok/s", 0),
        fh.Row("second run", 20.0, fh.Curves(), 0, "2.10×", 0),
    ]
    text = fh.table(rows)
    lines = text.splitlines()
    assert lines[0].startswith("step") and lines[2].startswith("quick start") and "190.0 s" in lines[2]
    assert "2.08× (1.98–2.13×)" in lines[2] and lines[3].startswith("second run") and "none" in lines[3]
    assert lines[-1] == "total 210 s; verify curve measured 3 times (235 s of finished measurements)"


def test_arguments_and_help():
    args = fh.parse_args(["--skip-tune", "--repeats", "3", "--target", "smollm2-135m"])
    assert args.skip_tune and args.repeats == 3 and args.target == "smollm2-135m"
    with pytest.raises(SystemExit):
        fh.parse_args(["--repeats", "0"])
    p = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--skip-tune" in p.stdout and "--repeats" in p.stdout and "--target" in p.stdout


def test_the_home_is_empty_and_the_models_are_linked_not_downloaded(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "m.gguf").write_bytes(b"GGUF")
    (shared / "m.gguf.sha256").write_text("abc")
    (shared / "host.json").write_text("{}")
    monkeypatch.setenv("SPECDEC_VERIFY_CURVE", "off")
    env, note = fh.home_env(tmp_path / "run", shared)
    cache = Path(env["SPECDEC_CACHE"])
    assert sorted(f.name for f in cache.iterdir()) == ["m.gguf", "m.gguf.sha256"]  # no host verdict carried over
    assert (cache / "m.gguf").stat().st_ino == (shared / "m.gguf").stat().st_ino and "hard-linked" in note
    assert "SPECDEC_VERIFY_CURVE" not in env  # a newcomer's environment: the curve is measured
    for var in ("SPECDEC_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "SPECDEC_PROMPT_CACHE"):
        assert env[var].startswith(str(tmp_path / "run"))


def test_the_curve_lines_of_this_version_are_counted() -> None:
    text = (
        "verify curve disturbed (a one-token pass took 66.4 ms at the start and 2291.1 ms at the end): waiting 10 s "
        "and measuring it again\n"
        "verify curve measured in 49.1 s (another device or offload (CPU, 0 layers offloaded here)) and kept as "
        "provisional: a one-token pass took 70 ms (the machine was busy); the next run measures it again, once\n"
        "verify curve measured in 52.0 s (provisional) and kept (specdec doctor shows it)\n"
    )
    curves = fh.parse_curves(text)
    assert curves.done == [(49.1, True), (52.0, True)] and curves.disturbed == 1
