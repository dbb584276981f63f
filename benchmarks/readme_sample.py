"""docs/sample.svg: what `specdec run` shows (the coloured stream, the statistics), recorded from a real run.

    python benchmarks/readme_sample.py                       # the quick start's prompt, 96 tokens, the default target
    python benchmarks/readme_sample.py -t smollm2-135m -n 48 --out /tmp/s.svg   # quicker

It runs `specdec run PROMPT ARGS` in this process with the stream and the statistics going to one Rich console made
with `record=True` (as a terminal would show them: styled), then writes that console with `Console.save_svg`.
Loading spinners and progress bars go to a console that is not recorded. The timings are those of the machine
at that moment: record it on a quiet one. The run uses a scratch SPECDEC_HOME (nothing learnt is
kept) and the prompt cache is off.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "specdec_cli/prompts/edit/textwrap_rename.txt"


def record(args: list[str], out: Path, *, width: int = 110) -> None:
    """Run `specdec run ARGS` with one recording console for stdout and stderr, and save it as an SVG at `out`."""
    from rich.console import Console

    from specdec_cli.cli import render
    from specdec_cli.cli.app import app
    from specdec_cli.cli.commands import run as run_command
    from specdec_cli.cli.console import THEME, RichReporter

    console = Console(
        theme=THEME, highlight=False, record=True, force_terminal=True, width=width, file=io.StringIO(), soft_wrap=True
    )
    run_command.err_console = lambda: console  # the statistics
    quiet = Console(file=io.StringIO())
    run_command.RichReporter = lambda _console: RichReporter(quiet)  # loading spinners and bars: not recorded
    run_command.wants_color = lambda stream, plain: True  # styled, as on a terminal
    render.make_console = lambda **kw: console  # the stream
    try:
        app(["run", *args, "--no-prompt-cache"], standalone_mode=False)
    finally:
        console.save_svg(str(out), title="specdec run " + " ".join(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "sample.svg")
    parser.add_argument("-t", "--target")
    parser.add_argument("-n", "--max-tokens", type=int, default=96)
    opts = parser.parse_args(argv)
    args = [PROMPT, "-n", str(opts.max_tokens)] + (["-t", opts.target] if opts.target else [])
    with tempfile.TemporaryDirectory() as home:
        os.environ["SPECDEC_HOME"] = home
        os.chdir(ROOT)
        record(args, opts.out)
    print(f"wrote {opts.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
