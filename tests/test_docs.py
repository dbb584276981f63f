"""The docs stay true (issue 43), without models: every `specdec` command and option the README and docs/ show exists
in the Typer app; every environment variable the code reads is in docs/reference.md (and every `SPECDEC_*` named
there is read); relative links resolve; the generated pages match their generators; the README stays short.

docs/results-history.md is a log (commands as they were run that day) and docs/cli.md is generated (checked by
regenerating it), so the command check leaves both out."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference.md"
LOGS = {DOCS / "results-history.md", DOCS / "cli.md"}  # not checked for commands: a log, and a generated page
README_MAX_LINES = 250


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


# -- commands and options -------------------------------------------------------------------------------------------


def cli_tree() -> dict[str, set[str]]:
    """{"run": {"--target", "-t", ...}, "models list": {...}, "": the top level's options} from the Typer app."""
    from specdec_cli.cli.app import app

    def opts(command) -> set[str]:
        names = {"--help", "-h"}
        for p in command.params:
            names.update(getattr(p, "opts", ()) or ())
            names.update(getattr(p, "secondary_opts", ()) or ())
        return names

    top = typer.main.get_command(app)
    tree = {"": opts(top)}
    for name, command in top.commands.items():
        tree[name] = opts(command)
        for sub_name, sub in getattr(command, "commands", {}).items():
            tree[f"{name} {sub_name}"] = opts(sub)
    return tree


# `specdec` where a command line starts: a line's start, a code span, after a pipe, `;`, `&&`, `(` or `$ `, maybe
# after VAR=value assignments. What follows, to a comment, a closing backtick or the next command, is its arguments.
INVOCATION = re.compile(r"(?:^|[`|;&(]|\$)\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*specdec((?:[ \t]+[^\s`|;&#>)]+)*)", re.M)


def code_of(text: str) -> list[str]:
    """The code in Markdown `text`: every fenced block's lines (without shell comments) and every inline code span."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out.append(re.split(r"(?:^|\s)#", line, maxsplit=1)[0])
        else:
            out += re.findall(r"`([^`]+)`", line)
    return out


def unknown_invocations(text: str, tree: dict[str, set[str]]) -> list[str]:
    """Every `specdec ...` in the code of `text` whose command or option the app does not have, as messages."""
    bad = []
    for code in code_of(text):
        for m in INVOCATION.finditer(code):
            words = m.group(1).split()
            command, rest = "", words
            if words and not words[0].startswith("-"):
                if words[0] not in tree:
                    if re.fullmatch(r"[a-z][a-z-]*", words[0]):  # a word where a command goes: it must be one
                        bad.append(f"specdec {words[0]}: no such command (in `{code.strip()}`)")
                    continue
                command, rest = words[0], words[1:]
                if rest and f"{command} {rest[0]}" in tree:
                    command, rest = f"{command} {rest[0]}", rest[1:]
            for word in rest:
                option = word.split("=", 1)[0]
                if re.fullmatch(r"--?[a-zA-Z][\w-]*", option) and option not in tree[command]:
                    bad.append(f"specdec {command} {option}: no such option (in `{code.strip()}`)")
    return bad


def test_every_command_and_option_the_docs_show_exists():
    tree = cli_tree()
    bad = [
        f"{p.relative_to(ROOT)}: {msg}"
        for p in pages()
        if p not in LOGS
        for msg in unknown_invocations(p.read_text(encoding="utf-8"), tree)
    ]
    assert bad == [], "the docs show commands or options the CLI does not have:\n" + "\n".join(bad)


def readme_commands(text: str, tree: dict[str, set[str]]) -> set[str]:
    """The commands ("run", "models list") the code of `text` invokes."""
    found = set()
    for code in code_of(text):
        for m in INVOCATION.finditer(code):
            words = [w for w in m.group(1).split() if not w.startswith("-")][:2]
            if words and words[0] in tree:
                found.add(" ".join(words) if " ".join(words) in tree else words[0])
    return found


def test_every_command_the_readme_names_answers_help():
    from typer.testing import CliRunner

    from specdec_cli.cli.app import app

    commands = readme_commands(README.read_text(encoding="utf-8"), cli_tree())
    assert {
        "run",
        "chat",
        "serve",
        "learn",
        "check",
        "tune",
        "bench",
        "models list",
        "cache stats",
        "doctor",
    } <= commands
    for command in sorted(commands):
        result = CliRunner().invoke(app, [*command.split(), "--help"])
        assert result.exit_code == 0 and "Usage" in result.output, (command, result.output)


def test_the_invocation_check_finds_what_does_not_exist():
    tree = {
        "": {"--help", "--version"},
        "run": {"--help", "--compare", "-n"},
        "cache": {"--help"},
        "cache clear": {"--help", "--only"},
    }
    text = (
        "```bash\nspecdec run p.txt -n 8 --compare   # --nothing in a comment\nspecdec run p.txt --bogus\n"
        "SPECDEC_AMX=off specdec frobnicate\n```\nand `specdec cache clear --only prompts --yes`, "
        "`claude --model specdec --permission-mode x`, prose: specdec streams.\n"
    )
    assert unknown_invocations(text, tree) == [
        "specdec run --bogus: no such option (in `specdec run p.txt --bogus`)",
        "specdec frobnicate: no such command (in `SPECDEC_AMX=off specdec frobnicate`)",
        "specdec cache clear --yes: no such option (in `specdec cache clear --only prompts --yes`)",
    ]


# -- environment variables ------------------------------------------------------------------------------------------

PY_READS = re.compile(r"""(?:environ(?:\.get)?\(|environ\[|getenv\(|_env_path\()\s*["']([A-Z][A-Z0-9_]*)["']""")
SPECDEC_VAR = re.compile(r"\bSPECDEC_[A-Z0-9_]*[A-Z0-9]\b")
SHELL_READS = re.compile(r"\$\{([A-Z][A-Z0-9_]*)")
MAKE_READS = re.compile(r"^(?:export\s+)?([A-Z][A-Z0-9_]*)\s*\?=", re.M)
NOT_SETTINGS = {"HOME"}  # read by the install script for ~, as every program does


def variables_read(root: Path = ROOT) -> set[str]:
    """The environment variables the code reads: `os.environ`/`getenv` reads and every `SPECDEC_*` name in
    specdec_cli/, the `${VAR}` of scripts/, and the Makefile's `VAR ?=` (overridable from the environment)."""
    found: set[str] = set()
    for path in (root / "specdec_cli").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        found |= set(PY_READS.findall(text)) | set(SPECDEC_VAR.findall(text))
    for path in (root / "scripts").rglob("*"):
        if path.is_file() and path.suffix in ("", ".sh", ".py"):
            text = path.read_text(encoding="utf-8", errors="replace")
            found |= set(SHELL_READS.findall(text)) | set(SPECDEC_VAR.findall(text)) | set(PY_READS.findall(text))
    makefile = (root / "Makefile").read_text(encoding="utf-8")
    found |= set(MAKE_READS.findall(makefile)) | set(SPECDEC_VAR.findall(makefile))
    return found - NOT_SETTINGS


def documented_variables(reference: str) -> set[str]:
    """The variables the reference page's table names (in code spans in its first column)."""
    section = reference[reference.index("## Environment variables") :]
    section = section[: section.index("\n## ", 1)]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", line.split(" | ")[0]))
    return names


def test_every_variable_the_code_reads_is_documented():
    missing = variables_read() - documented_variables(REFERENCE.read_text(encoding="utf-8"))
    assert missing == set(), f"read by the code but not in docs/reference.md's table: {sorted(missing)}"


def test_every_specdec_variable_the_docs_name_is_read():
    read = variables_read()
    named = {
        (p.relative_to(ROOT), v)
        for p in pages()
        if p not in LOGS
        for v in SPECDEC_VAR.findall(p.read_text(encoding="utf-8"))
    }
    stale = sorted(f"{p}: {v}" for p, v in named if v not in read)
    assert stale == [], "the docs name SPECDEC_* variables nothing reads:\n" + "\n".join(stale)


def test_the_variable_check_finds_an_undocumented_read(tmp_path):
    (tmp_path / "specdec_cli").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "specdec_cli" / "m.py").write_text('import os\nos.environ.get("SPECDEC_NEW")\nos.getenv("OTHER")\n')
    (tmp_path / "scripts" / "s.sh").write_text('v="${LLAMA_X:-1}" "$HOME"\n')
    (tmp_path / "Makefile").write_text("PYTHON ?= python3\n")
    assert variables_read(tmp_path) == {"SPECDEC_NEW", "OTHER", "LLAMA_X", "PYTHON"}
    table = "## Environment variables\n\n| `SPECDEC_NEW`, `OTHER` | x | y |\n\n## Next\n"
    assert documented_variables(table) == {"SPECDEC_NEW", "OTHER"}


# -- links ----------------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def broken_links(path: Path, text: str) -> list[str]:
    """Relative links of the Markdown `text` (in `path`) whose file does not exist; anchors are not checked."""
    bad = []
    in_code = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same page
            file = target.split("#", 1)[0]
            if not (path.parent / file).exists():
                bad.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}: {target}")
    return bad


def test_relative_links_resolve():
    bad = [b for p in pages() for b in broken_links(p, p.read_text(encoding="utf-8"))]
    assert bad == [], "links to files that do not exist:\n" + "\n".join(bad)


def test_the_link_check_finds_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("x")
    text = (
        "[ok](there.md#a) [gone](gone.md) [web](https://x.org/y) [here](#top) ![img](img.svg)\n"
        "```\n[no](code.md)\n```\n"
    )
    assert broken_links(tmp_path / "page.md", text) == ["page.md: gone.md", "page.md: img.svg"]


# -- generated pages, and the README's length -----------------------------------------------------------------------


def results_module():
    spec = importlib.util.spec_from_file_location("results", ROOT / "benchmarks" / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_is_generated_from_the_app():
    from specdec_cli.cli.gen_docs import reference

    assert (DOCS / "cli.md").read_text(encoding="utf-8") == reference(), (
        "docs/cli.md is not current: run python -m specdec_cli.cli.gen_docs"
    )


def test_the_results_page_and_the_readme_figure_are_rendered_from_the_json():
    results = results_module()
    doc = json.loads((DOCS / "results.json").read_text(encoding="utf-8"))
    assert (DOCS / "results.md").read_text(encoding="utf-8") == results.render(doc), (
        "docs/results.md is not current: run python benchmarks/results.py --render"
    )
    assert results.readme_block(doc) in README.read_text(encoding="utf-8"), (
        "the README's figure is not current: run python benchmarks/results.py --render"
    )


def test_the_results_page_shows_the_quick_start_targets_own_curve():
    """doctor lists every curve kept here; the page's is the quick start target's, not the first listed (a tiny
    test model's curve beside the 1.5B's plain decoding made the page contradict itself)."""
    results = results_module()
    tiny = {"target": "qwen35-mtp-tiny.gguf", "curve": {"ms": [0.4, 0.5]}}
    qwen = {"target": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "curve": {"ms": [71.5, 120.0, 150.0, 203.0]}}
    doc = {"verify_curves": [tiny, qwen]}
    assert results.host_facts(doc, qwen["target"])["verify_curve_ms"] == {"1": 71.5, "2": 120.0, "4": 203.0}
    assert results.host_facts(doc, "other.gguf")["verify_curve_ms"] is None


def test_render_needs_only_the_json(tmp_path):
    """`--render` on a small fixture: the page and the README's figure, with nothing measured."""
    results = results_module()
    run = {
        "name": "quickstart",
        "what": "the quick start",
        "command": "specdec run p.txt -n 256 --compare",
        "target": "m.gguf",
        "method": "auto",
        "n_tokens": 256,
        "tokens_per_pass": 4.5,
        "acceptance_rate": 0.85,
        "by_source": {},
        "speedup": 3.21,
        "speedup_min": 3.0,
        "speedup_max": 3.4,
        "pairs": 3,
        "speculative_tokens_per_s": 40.0,
        "plain_tokens_per_s": 12.5,
        "identical": False,
        "verdict": "numerical near-tie",
    }
    doc = {
        "version": 1,
        "date": "2026-11-27 10:00 UTC",
        "command": "make results",
        "quick": False,
        "host": {
            "cpu": "Some CPU",
            "threads": 2,
            "system_info": "AVX2 = 1 | FMA = 1",
            "amx_in_use": False,
            "verify_curve_ms": {"1": 60.0, "16": 500.0},
        },
        "runs": [run],
    }
    (tmp_path / "r.json").write_text(json.dumps(doc))
    readme = tmp_path / "README.md"
    readme.write_text(f"top\n{results.README_BEGIN}\nold\n{results.README_END}\nbottom\n")
    assert (
        results.main(
            [
                "--render",
                "--json",
                str(tmp_path / "r.json"),
                "--markdown",
                str(tmp_path / "r.md"),
                "--readme",
                str(readme),
            ]
        )
        == 0
    )
    page = (tmp_path / "r.md").read_text()
    assert (
        "| quickstart | `specdec run p.txt -n 256 --compare` | 3.21× (3.00×-3.40×, 3 pairs) | 40.0 / 12.5 | 4.50 "
        "| 85 % | parted at a numerical near-tie |" in page
    )
    assert "`AVX2 = 1 \\| FMA = 1`" in page and "v(1) 60.0, v(16) 500.0" in page  # a | in a table cell escaped
    text = readme.read_text()
    assert text.startswith("top\n") and text.endswith("bottom\n") and "old" not in text
    assert (
        "On Some CPU, 2 threads (2026-11-27 10:00 UTC), the quick start ran **3.21×** as fast as plain decoding "
        "(min-max 3.00×-3.40× over 3 pairs, 4.50 tokens per target pass, outputs parted at a numerical near-tie)"
        in text
    )


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
