"""A newcomer's first hour, measured (issue 55): from an empty home, the README's quick start, the same run again,
`specdec tune --k 4..16` and one chat turn in a pseudo terminal, each a new `specdec` process as a user runs it.

Prints one row per step: its wall time, the verify-curve measurements it made (the "verify curve measured in X s"
and "verify curve disturbed … measuring it again" lines on its stderr, and the curves learnt.json gained or changed),
and the speedups it printed (`--compare`'s median and min-max, with how the passes compared with the curve's
prediction at their depth; tune's overall speedup per configuration, from its
--json; the chat turn's tok/s and acceptance from its footer). Then `specdec doctor --json` says whether a kept
curve is marked stale after these ordinary runs.

The home is new: SPECDEC_HOME, XDG_CONFIG_HOME, XDG_DATA_HOME, XDG_CACHE_HOME and SPECDEC_PROMPT_CACHE point into a
temporary directory. The model files are not downloaded again: SPECDEC_CACHE is a new directory holding hard links
to the shared cache's model files and their checksum markers (so the host check runs as for a newcomer), or, where
links cannot be made (another file system), the shared cache itself, which the report then says.

    python benchmarks/first_hour.py                      # the default target, tune with one repeat
    python benchmarks/first_hour.py --repeats 3          # tune --repeats 3 (issue 55's check)
    python benchmarks/first_hour.py -t smollm2-135m --skip-tune   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICK_START = ROOT / "specdec_cli" / "prompts" / "edit" / "textwrap_rename.txt"
CHAT_MESSAGE = "Write a Python function that checks whether a string is a palindrome."
CHAT_TOKENS = 256
STEP_TIMEOUT_S = 3600.0  # one step; a first hour is an hour

# the lines `specdec_cli/session.py` and `core/verify_timing.py` say when they measure a verify curve
# "measured in 49.1 s (none kept for this model here) and kept", "... and kept as provisional: ...", "..., the machine
# still busy (...): kept as it is"; the older wording without the reason reads the same
CURVE_DONE = re.compile(r"verify curve measured in ([0-9.]+) s.*?(and kept|but not kept|the machine still busy)")
CURVE_AGAIN = re.compile(r"verify curve disturbed \(.*?\): (?:waiting [0-9]+ s and )?measuring it again")
CURVE_STALE = re.compile(r"verify curve stale: (.*?); measuring it again")
# `render.print_compare`: "compare plain decoding 8.1 tok/s, speculative 16.9 tok/s → 2.08× speedup (median of 3
# pairs, 1.98–2.13×)"
COMPARE = re.compile(
    r"compare\s+plain decoding ([0-9.]+) tok/s, speculative ([0-9.]+) tok/s → ([0-9.]+)× speedup"
    r"(?: \(median of \d+ pairs, ([0-9.]+)–([0-9.]+)×\))?"
)
# `chat_view.footer_text`: "247 tokens · 12.3 tok/s · acceptance 61% · mean accepted 2.10 · prefill ..."
FOOTER = re.compile(r"^(\d+) tokens · ([0-9.]+) tok/s · ")
ACCEPTANCE = re.compile(r" · acceptance (\d+)% · ")
# `render.pass_placement`, the stats table's "verify curve" row: "..., passes 1.02× the curve's prediction at depth 700"
PLACEMENT = re.compile(r"passes ([0-9.]+)× the curve's prediction at depth (\d+)")
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07")


@dataclass
class Curves:
    """The verify-curve measurements one step made, from its stderr."""

    done: list[tuple[float, bool]] = field(default_factory=list)  # (seconds, kept) per finished measurement
    disturbed: int = 0  # attempts the machine disturbed (measured again at once)
    stale: list[str] = field(default_factory=list)  # why a kept curve was measured again

    @property
    def attempts(self) -> int:
        return len(self.done) + self.disturbed

    def __str__(self) -> str:
        if not self.attempts and not self.stale:
            return "none"
        parts = [f"{s:.0f} s {'kept' if kept else 'not kept'}" for s, kept in self.done]
        if self.disturbed:
            parts.append(f"{self.disturbed} disturbed")
        parts += [f"stale: {why}" for why in self.stale]
        return f"{self.attempts}: " + ", ".join(parts)


def parse_curves(stderr: str) -> Curves:
    """The curve measurements announced in a step's stderr (colour codes and progress bars allowed)."""
    text = ANSI.sub("", stderr)
    return Curves(
        done=[(float(m.group(1)), m.group(2) != "but not kept") for m in CURVE_DONE.finditer(text)],
        disturbed=len(CURVE_AGAIN.findall(text)),
        stale=CURVE_STALE.findall(text),
    )


def parse_compare(stderr: str) -> str | None:
    """`--compare`'s speedup as printed: "2.08× (1.98–2.13×), plain 8.1 tok/s"; None without a compare line."""
    m = COMPARE.search(ANSI.sub("", stderr))
    if m is None:
        return None
    spread = f" ({m.group(4)}–{m.group(5)}×)" if m.group(4) else ""
    placed = PLACEMENT.search(ANSI.sub("", stderr))
    at = f"; passes {placed.group(1)}× the curve's prediction at depth {placed.group(2)}" if placed else ""
    return f"{float(m.group(3)):.2f}×{spread}, plain {m.group(1)} tok/s{at}"


def parse_tune(doc: dict) -> str | None:
    """tune's --json: each configuration's overall speedup (geometric mean over prompts), auto's per prompt, and
    the best; None for a document without a summary."""
    summary = doc.get("summary") or []
    if not summary:
        return None
    overall = [
        f"{s['config']} {s['speedup_geomean']:.2f}×"
        for s in summary
        if s.get("speedup_geomean") is not None and s.get("config") != "none"
    ]
    auto = next((s for s in summary if s.get("config") == "auto"), None)
    per_prompt = ""
    if auto is not None and auto.get("speedup"):
        fixed = [s for s in summary if s.get("config") not in ("none", "auto")]

        def against_best(prompt: str, v: float) -> str:  # issue 55: auto >= 0.95 x the best fixed K on each prompt
            best = max(fixed, key=lambda s: (s.get("speedup") or {}).get(prompt, 0.0), default=None)
            b = (best.get("speedup") or {}).get(prompt) if best is not None else None
            return f"{prompt} {v:.2f}×" + (f" (best fixed {best['config']} {b:.2f}×: {v / b:.2f} of it)" if b else "")

        per_prompt = "; auto by prompt: " + ", ".join(against_best(p, v) for p, v in auto["speedup"].items())
    return ", ".join(overall) + per_prompt + (f"; best {doc['best']}" if doc.get("best") else "")


def parse_footer(screen: str) -> str | None:
    """The chat turn's footer as "12.3 tok/s, acceptance 61%, 247 tokens"; None before it is shown."""
    for line in ANSI.sub("", screen).replace("\r", "").splitlines():
        m = FOOTER.search(line.strip())
        if m is not None:
            a = ACCEPTANCE.search(line)
            acceptance = f", acceptance {a.group(1)}%" if a else ", nothing drafted"
            return f"{m.group(2)} tok/s{acceptance}, {m.group(1)} tokens"
    return None


def curve_changes(before: dict, after: dict) -> int:
    """Curves learnt.json gained or whose measurement changed between two reads of its "curves" section."""

    def measured(entry):
        curve = entry.get("curve") if isinstance(entry, dict) else None
        return (curve.get("measured_at"), curve.get("seconds"), curve.get("stale")) if isinstance(curve, dict) else None

    return sum(measured(e) is not None and measured(before.get(k)) != measured(e) for k, e in after.items())


@dataclass
class Row:
    step: str
    seconds: float
    curves: Curves
    learnt: int  # curves learnt.json gained or changed
    result: str  # the speedups (or what the step printed instead)
    code: int


# ----------------------------------------------------------------------------------------------------------------
# Running the steps


def specdec(*args: str) -> list[str]:
    return [sys.executable, "-m", "specdec_cli", *args]


def home_env(root: Path, shared_cache: Path) -> tuple[dict[str, str], str]:
    """The environment of an empty home under `root`, and a note on how the model cache is shared."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_") or k in ("SPECDEC_DEBUG",)}
    env.update(
        SPECDEC_HOME=str(root / "home"),
        XDG_CONFIG_HOME=str(root / "config"),
        XDG_DATA_HOME=str(root / "data"),
        XDG_CACHE_HOME=str(root / "cache"),
        SPECDEC_PROMPT_CACHE=str(root / "prompt-cache"),
        COLUMNS="240",  # the stats table's rows unwrapped
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    cache = root / "models"
    cache.mkdir(parents=True)
    try:
        for f in shared_cache.iterdir():
            if f.is_file() and (f.name.endswith(".gguf") or f.name.endswith(".gguf.sha256")):
                os.link(f, cache / f.name)
        env["SPECDEC_CACHE"] = str(cache)
        return env, f"model files hard-linked from {shared_cache}; host check, prompt cache and curves fresh"
    except OSError as e:
        env["SPECDEC_CACHE"] = str(shared_cache)
        return env, (
            f"model cache shared ({shared_cache}: no hard links there, {e.strerror or e}); its host.json "
            "may spare the host check"
        )


def learnt_curves(env: dict[str, str]) -> dict:
    path = Path(env["SPECDEC_HOME"]) / "data" / "learnt.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("curves", {})
    except (OSError, ValueError, AttributeError):
        return {}


def run_step(name: str, argv: list[str], env: dict[str, str], parse) -> Row:
    """One `specdec` process with stdout and stderr captured (as a script runs it); `parse(stdout, stderr)` says what
    it printed."""
    before = learnt_curves(env)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(argv[2:])}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    p = subprocess.run(
        argv,
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        timeout=STEP_TIMEOUT_S,
    )
    seconds = time.monotonic() - t0
    if p.returncode != 0:
        print(p.stderr[-3000:], file=sys.stderr)
    return Row(
        name,
        seconds,
        parse_curves(p.stderr),
        curve_changes(before, learnt_curves(env)),
        parse(p.stdout, p.stderr) or f"exit {p.returncode}",
        p.returncode,
    )


def chat_step(argv: list[str], env: dict[str, str], timeout: float = STEP_TIMEOUT_S) -> Row:
    """`specdec chat` in a pseudo terminal (as a person runs it): wait for the prompt, send one message, wait for
    the turn's footer, then /quit. The wall time is the whole process's."""
    import pty

    before = learnt_curves(env)
    print(f"[{time.strftime('%H:%M:%S')}] chat turn: {' '.join(argv[2:])}", file=sys.stderr, flush=True)
    master, slave = pty.openpty()
    t0 = time.monotonic()
    p = subprocess.Popen(
        argv,
        env={**env, "TERM": env.get("TERM", "xterm-256color"), "COLUMNS": "120"},
        cwd=ROOT,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        close_fds=True,
        start_new_session=True,
    )
    os.close(slave)
    screen = ""
    sent = quit_sent = False
    deadline = t0 + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not data:
                    break
                screen += data.decode("utf-8", "replace")
            if not sent and ">>> " in screen:
                os.write(master, (CHAT_MESSAGE + "\r").encode())
                sent = True
            elif sent and not quit_sent and parse_footer(screen.split(CHAT_MESSAGE, 1)[-1]) is not None:
                os.write(master, b"/quit\r")
                quit_sent = True
            if p.poll() is not None and not ready:
                break
        code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        p.kill()
        code = p.wait()
    finally:
        os.close(master)
    seconds = time.monotonic() - t0
    reply = screen.split(CHAT_MESSAGE, 1)[-1] if sent else ""
    result = parse_footer(reply) or ("no reply" if sent else "no prompt")
    return Row(
        "chat turn (pty)", seconds, parse_curves(screen), curve_changes(before, learnt_curves(env)), result, code
    )


def doctor_step(env: dict[str, str], root: Path) -> Row:
    out = root / "doctor.json"

    def parse(stdout: str, stderr: str) -> str | None:
        try:
            doc = json.loads(out.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        curves = [c for c in doc.get("verify_curves", []) if c.get("key")]
        stale = sum(bool(c.get("curve", {}).get("stale")) for c in curves)
        return f"{len(curves)} curve{'s' * (len(curves) != 1)} kept, {stale} marked stale"

    return run_step("doctor", specdec("doctor", "--json", str(out)), env, parse)


# ----------------------------------------------------------------------------------------------------------------
# The report


def table(rows: list[Row]) -> str:
    """The report: one line per step, then the totals."""
    header = ("step", "wall", "curve measurements (stderr)", "learnt.json curves", "speedups / result")
    cells = [header] + [
        (
            r.step + ("" if r.code == 0 else f" (exit {r.code})"),
            f"{r.seconds:.1f} s",
            str(r.curves),
            str(r.learnt),
            r.result,
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header) - 1)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(widths))) + "  " + c[-1] for c in cells]
    lines.insert(1, "-" * max(len(line) for line in lines))
    total_s = sum(r.seconds for r in rows)
    measured = sum(r.curves.attempts for r in rows)
    measured_s = sum(s for r in rows for s, _ in r.curves.done)
    lines.append(
        f"total {total_s:.0f} s; verify curve measured {measured} time{'s' * (measured != 1)} "
        f"({measured_s:.0f} s of finished measurements)"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--target",
        "-t",
        help="target model for every step (a catalog name or a .gguf path) "
        "[default: the catalog's default, as the quick start]",
    )
    ap.add_argument("--repeats", type=int, default=1, help="specdec tune --repeats N [default: 1]")
    ap.add_argument("--skip-tune", action="store_true", help="leave out specdec tune --k 4..16")
    ap.add_argument(
        "--cache",
        type=Path,
        help="the shared model cache [default: $SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec]",
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary home (its path is printed)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from specdec_cli.config import cache_dir

    shared = args.cache or cache_dir()
    target = ["-t", args.target] if args.target else []
    root = Path(tempfile.mkdtemp(prefix="specdec-first-hour-"))
    rows: list[Row] = []
    try:
        env, note = home_env(root, shared)
        print(f"empty home in {root}; {note}", file=sys.stderr)
        quick = specdec("run", str(QUICK_START.relative_to(ROOT)), "-n", "256", "--compare", *target)
        compare = lambda out, err: parse_compare(err)  # noqa: E731
        rows.append(run_step("quick start", quick, env, compare))
        rows.append(run_step("second run", quick, env, compare))
        if not args.skip_tune:
            tune_json = root / "tune.json"

            def tune(out: str, err: str) -> str | None:
                try:
                    return parse_tune(json.loads(tune_json.read_text(encoding="utf-8")))
                except (OSError, ValueError):
                    return None

            rows.append(
                run_step(
                    f"tune --k 4..16 --repeats {args.repeats}",
                    specdec("tune", "--k", "4..16", "--repeats", str(args.repeats), "--json", str(tune_json), *target),
                    env,
                    tune,
                )
            )
        rows.append(chat_step(specdec("chat", "-n", str(CHAT_TOKENS), *target), env))
        rows.append(doctor_step(env, root))
    finally:
        if rows:
            print(table(rows))
        if args.keep:
            print(f"the home is kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r.code == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
