"""The current results page: one command measures a small fixed set, keeps it as data, and renders the Markdown.

    make results                                  # = python benchmarks/results.py: measure, write JSON, render
    python benchmarks/results.py --render         # render docs/results.md (and the README's figure) from the JSON
    python benchmarks/results.py --quick --json /tmp/r.json --markdown /tmp/r.md --readme /tmp/README.md
                                                  # the same plumbing on the tiny model, 16 tokens: seconds

What runs (`RUNS`, in this order, each a separate `specdec run ... --compare --json`): the quick start that `make`
runs (the default target and `--method auto` on an edit, 256 tokens), the same prompt with `--method none` (plain
against plain: the noise floor of the sitting), and free writing (where nothing can be copied). Each `--compare`
replays the run against plain decoding in 3 interleaved pairs in the same process and gives the median speedup with
its min-max (specdec_cli/measure/comparison.py). Run it alone on the machine: another process's load shows up as a
wide min-max.

docs/results.json holds: the date (UTC), the host and build (`specdec doctor --json`: CPU, cores, OS, Python,
llama-cpp-python, llama.cpp's system info line, AMX kernels in use and why, GPU offload, the verify curve), and per
run the command line and what `--json` wrote (speedup, min-max, tok/s of both sides, tokens per target pass,
acceptance, whether the outputs are identical). docs/results.md is rendered from it alone (`render`), so `--render`
needs no model; the README's figure sits between `README_BEGIN` and `README_END` and is rendered too
(`readme_block`); tests/test_docs.py checks that both match the JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JSON_PATH = ROOT / "docs" / "results.json"
MD_PATH = ROOT / "docs" / "results.md"
README_PATH = ROOT / "README.md"
README_BEGIN = "<!-- results: rendered by `python benchmarks/results.py --render` from docs/results.json -->"
README_END = "<!-- /results -->"
VERSION = 1

QUICKSTART = "specdec_cli/prompts/edit/textwrap_rename.txt"
# (name, what it shows, the arguments after `specdec run`); --json PATH is added when it runs.
RUNS = [
    (
        "quickstart",
        "the quick start `make` runs: the default target and method on an edit",
        [QUICKSTART, "-n", "256", "--compare"],
    ),
    (
        "noise floor",
        "the same prompt, plain decoding against itself: a speedup inside this band means nothing",
        [QUICKSTART, "-n", "256", "--method", "none", "--compare"],
    ),
    (
        "free text",
        "free writing, where nothing can be copied: auto falls back to plain steps",
        ["specdec_cli/prompts/write/lighthouse_story.txt", "-n", "256", "--compare"],
    ),
]
QUICK_ARGS = ["-t", "smollm2-135m", "-n", "16", "--compare", "1"]  # --quick: the plumbing, on the tiny model


def _specdec(args: list[str], **kw) -> subprocess.CompletedProcess:
    """`specdec ARGS` with this Python (the venv that runs this script), from the repository root."""
    return subprocess.run([sys.executable, "-m", "specdec_cli", *args], cwd=ROOT, text=True, **kw)


def _host(target: str | None = None) -> dict:
    """What `specdec doctor --json -` says of this machine and its llama.cpp build (nothing is loaded), with the
    verify curve kept for `target` (a model file's name: the quick start's), not whichever the data lists first."""
    done = _specdec(["doctor", "--json", "-"], capture_output=True, check=True)
    return host_facts(json.loads(done.stdout), target)


def host_facts(doc: dict, target: str | None) -> dict:
    """`_host`'s dict from a `specdec doctor --json` document: the curve is `target`'s (None: none kept for it)."""
    curves = [c for c in doc.get("verify_curves") or [] if c.get("target") == target]
    return {
        "cpu": doc.get("cpu"),
        "cores": doc.get("cores"),
        "usable_cpus": doc.get("usable_cpus"),
        "threads": doc.get("threads_default"),
        "os": doc.get("os"),
        "python": doc.get("python"),
        "specdec": doc.get("specdec"),
        "llama_cpp_python": doc.get("llama_cpp_python"),
        "system_info": doc.get("system_info"),
        "gpu_offload": doc.get("gpu_offload"),
        "amx_in_use": (doc.get("amx") or {}).get("in_use"),
        "amx_reason": (doc.get("amx") or {}).get("reason"),
        "verify_curve_ms": _curve_points(curves[0]["curve"]) if curves else None,
    }


def _curve_points(curve: dict) -> dict | None:
    """{b: ms} at a few batch sizes from a `VerifyCurve.to_dict()` ({"ms": [v(1), v(2), ...], ...})."""
    ms = curve.get("ms")  # v(b) at ms[b - 1]
    if isinstance(ms, list) and ms:
        return {str(b): round(float(ms[b - 1]), 1) for b in (1, 2, 4, 8, 16, 32, 64) if b <= len(ms)}
    return None


def _run(name: str, what: str, args: list[str]) -> dict:
    """One `specdec run ARGS --json TMP`: its command line and the figures its JSON holds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        print(f"results: {name}: specdec run {' '.join(args)}", file=sys.stderr, flush=True)
        _specdec(["run", *args, "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
        doc = json.loads(out.read_text(encoding="utf-8"))
    stats, compare = doc["stats"], doc.get("compare") or {}
    return {
        "name": name,
        "what": what,
        "command": "specdec run " + " ".join(args),
        "target": Path(doc["config"]["target"]).name,
        "method": doc["config"]["method"],
        "n_tokens": stats["n_generated"],
        "tokens_per_pass": round(stats["tokens_per_pass"], 2),
        "acceptance_rate": round(stats["acceptance_rate"], 3),
        "by_source": stats.get("by_source") or {},
        "speedup": compare.get("speedup"),
        "speedup_min": compare.get("speedup_min"),
        "speedup_max": compare.get("speedup_max"),
        "pairs": compare.get("pairs"),
        "speculative_tokens_per_s": compare.get("speculative_tokens_per_s"),
        "plain_tokens_per_s": compare.get("plain_tokens_per_s"),
        "identical": compare.get("identical"),
        "verdict": compare.get("verdict"),
    }


def measure(*, quick: bool = False) -> dict:
    """Run `RUNS` (with `QUICK_ARGS` instead of their options when `quick`) and return the results document."""
    runs = (
        RUNS
        if not quick
        else [(n, w, [a[0], *QUICK_ARGS, *(["--method", "none"] if "none" in a else [])]) for n, w, a in RUNS]
    )
    started = dt.datetime.now(dt.UTC)
    measured = [_run(*r) for r in runs]
    host = _host(measured[0]["target"])  # after the runs: the curve the first one measured, where there was none
    return {
        "version": VERSION,
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "command": "make results",
        "quick": quick,
        "host": host,
        "runs": measured,
    }


# -- rendering: from the document alone ------------------------------------------------------------------------------


def _x(value) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _num(value, fmt: str = "{:.1f}") -> str:
    return "—" if value is None else fmt.format(value)


def _pairs(n, lead: str) -> str:
    return "" if not n else f"{lead}{n} pair{'s' * (n != 1)}"


def _percent(value) -> str:
    return "—" if value is None else f"{100 * value:.0f} %"


def _output(run: dict) -> str:
    """How the outputs compare: "identical", "parted at a numerical near-tie", "DIVERGENCE" (`measure.audit`)."""
    verdict = "identical" if run.get("identical") else run.get("verdict")
    return f"parted at a {verdict}" if verdict and "near-tie" in verdict else verdict or "—"


def readme_block(doc: dict) -> str:
    """The README's one figure: the quick start's speedup, with its host and date, between the markers."""
    quick = next(r for r in doc["runs"] if r["name"] == "quickstart")
    host = doc["host"]
    where = ", ".join(
        str(x) for x in (host.get("cpu"), f"{host['threads']} threads" if host.get("threads") else None) if x
    )
    facts = [f"min-max {_x(quick['speedup_min'])}-{_x(quick['speedup_max'])}{_pairs(quick.get('pairs'), ' over ')}"]
    if quick.get("tokens_per_pass") is not None:
        facts.append(f"{quick['tokens_per_pass']:.2f} tokens per target pass")
    if _output(quick) != "—":
        facts.append(f"outputs {_output(quick)}")
    line = (
        f"On {where} ({doc['date']}), the quick start ran **{_x(quick['speedup'])}** as fast as plain decoding "
        f"({', '.join(facts)}): [docs/results.md](docs/results.md)."
    )
    return f"{README_BEGIN}\n{line}\n{README_END}"


def render(doc: dict) -> str:
    """docs/results.md from the results document."""
    host = doc["host"]
    lines = [
        "# Results",
        "",
        "<!-- generated by `make results` (benchmarks/results.py) from docs/results.json: do not edit by hand -->",
        "",
        f"The current figures ({doc['date']}), regenerated by one command: `{doc['command']}`. Every dated sitting "
        "before them, with its own host, build and benchmarks, is in [results-history.md](results-history.md).",
    ]
    if doc.get("source"):
        lines += ["", f"**Source:** {doc['source']}"]
    if doc.get("quick"):
        lines += ["", "**A `--quick` run (the tiny model, 16 tokens): a plumbing check, not a result.**"]
    lines += [
        "",
        "## Host and build",
        "",
        "| | |",
        "| --- | --- |",
        f"| CPU | {host.get('cpu') or '—'}, {host.get('cores') or '?'} cores, {host.get('usable_cpus') or '?'} usable "
        f"CPUs, {host.get('threads') or '?'} threads |",
        f"| OS, Python | {host.get('os') or '—'}, Python {host.get('python') or '—'} |",
        f"| specdec, llama-cpp-python | {host.get('specdec') or '—'}, {host.get('llama_cpp_python') or '—'} |",
        f"| AMX kernels in use | {_yes(host.get('amx_in_use'))}"
        f"{': ' + host['amx_reason'] if host.get('amx_reason') else ''} |",
        f"| GPU offload | {_yes(host.get('gpu_offload'))} |",
        f"| llama.cpp system info | `{(host.get('system_info') or '—').replace('|', chr(92) + '|')}` |",  # \| in a cell
    ]
    curve = host.get("verify_curve_ms")
    if curve:
        lines.append(
            "| verify curve (ms of one target pass over b tokens) | "
            + ", ".join(f"v({b}) {ms}" for b, ms in curve.items())
            + " |"
        )
    lines += [
        "",
        "## Runs",
        "",
        "Each row is one `specdec run ... --compare`: the run, then pairs of it replayed and plain decoding, "
        "interleaved in one process; the speedup is the median of the per-pair ratios, with their min-max.",
        "",
        "| run | command | speedup (min-max) | speculative / plain tok/s | tokens per pass | acceptance | output |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in doc["runs"]:
        lines.append(
            f"| {r['name']} | `{r['command']}` | {_x(r['speedup'])} ({_x(r['speedup_min'])}-{_x(r['speedup_max'])}"
            f"{_pairs(r.get('pairs'), ', ')}) "
            f"| {_num(r['speculative_tokens_per_s'])} / {_num(r['plain_tokens_per_s'])} "
            f"| {_num(r['tokens_per_pass'], '{:.2f}')} "
            f"| {_percent(r['acceptance_rate'])} | {_output(r)} |"
        )
    lines += ["", *(f"- **{r['name']}**: {r['what']}." for r in doc["runs"])]
    lines += [
        "",
        "## Regenerate",
        "",
        "```bash",
        "make results                              # measure (about 10 minutes on 2 cores), "
        "write docs/results.json, render",
        "python benchmarks/results.py --render     # render this page and the README's figure from docs/results.json",
        "```",
        "",
        "Run it alone on the machine. The README quotes the quick start's row of this page and nothing else.",
        "",
    ]
    return "\n".join(lines)


def _yes(value) -> str:
    return {True: "yes", False: "no"}.get(value, "—")


def with_readme_block(readme: str, doc: dict) -> str:
    """`readme` with the text between `README_BEGIN` and `README_END` rendered again. Raises ValueError when the
    markers are missing."""
    start = readme.index(README_BEGIN)
    end = readme.index(README_END, start) + len(README_END)
    return readme[:start] + readme_block(doc) + readme[end:]


def write_rendered(doc: dict, markdown: Path, readme: Path | None) -> None:
    markdown.write_text(render(doc), encoding="utf-8")
    if readme is not None and readme.exists():
        readme.write_text(with_readme_block(readme.read_text(encoding="utf-8"), doc), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--render", action="store_true", help="Measure nothing: render from the JSON.")
    parser.add_argument("--quick", action="store_true", help="The tiny model, 16 tokens: a plumbing check.")
    parser.add_argument("--json", type=Path, default=JSON_PATH, help="The results document (default: %(default)s).")
    parser.add_argument("--markdown", type=Path, default=MD_PATH, help="The page (default: %(default)s).")
    parser.add_argument(
        "--readme", type=Path, default=README_PATH, help="The README whose figure is rendered (default: %(default)s)."
    )
    args = parser.parse_args(argv)
    if args.quick and not args.render and args.json == JSON_PATH:
        parser.error("--quick writes no result: give --json, --markdown and --readme paths of your own")
    if args.render:
        doc = json.loads(args.json.read_text(encoding="utf-8"))
    else:
        doc = measure(quick=args.quick)
        args.json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    write_rendered(doc, args.markdown, args.readme)
    print(f"results: wrote {args.markdown}" + ("" if args.render else f" and {args.json}"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
