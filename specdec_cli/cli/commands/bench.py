"""`specdec bench`: every drafting method and llama-cpp-python's own prompt lookup, on one prompt set, on this machine.

What runs, in which order, what is timed and how it is summarised: `specdec_cli.measure.bench`. This command draws
the spinners and the progress bar, prints the report (`bench_report`), writes --json, --plot and --markdown, and
re-renders a saved --json document (`--from-json`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from specdec_cli.cli.commands.bench_report import check_plot_path, markdown_table, report, write_plot
from specdec_cli.cli.console import RichReporter, err_console, make_console, sweep_task, write_json
from specdec_cli.errors import UsageError
from specdec_cli.measure import sweep
from specdec_cli.measure.bench import (
    JSON_VERSION,
    BenchConfig,
    BenchOptions,
    BenchRun,
    BenchSummary,
    config_from_label,
    configs_for,
    json_doc,
    run,
    summarize,
    without_unpaired_draft,
)
from specdec_cli.prompts import PromptCase


def execute(prompts: list[PromptCase], *, models, options: BenchOptions) -> int:
    """Measure every configuration on `prompts`, print the report, write --json/--plot/--markdown.

    models: `spec.ModelOptions`. Returns the exit code: 0, or 130 when interrupted (the runs so far are reported
    and written). Raises UsageError, ModelError, IncompatiblePairError, ContextOverflowError, BackendError.
    """
    from specdec_cli.spec import parse_k_option

    sweep.check_prompts(prompts, "bench")
    parse_k_option(options.k)
    if options.json_path == "-" and options.markdown:
        raise UsageError("--json - and --markdown both want stdout.", "Write the JSON to a file: --json bench.json.")
    if options.plot_path:
        check_plot_path(options.plot_path)
    err = err_console()
    out = err if options.json_path == "-" or options.markdown else make_console()
    options, note = without_unpaired_draft(options, models)
    if note:
        err.print(Text(note, style="spec.warn"))
    configs = configs_for(options.methods, options.peer, native=options.native if options.llama_cpp else False)
    bench = run(
        prompts,
        configs,
        models=models,
        options=options,
        reporter=RichReporter(err),
        progress=lambda total: sweep_task(err, "bench", total),
    )
    for line in bench.notes:
        err.print(Text(line, style="spec.warn"))
    doc = json_doc(bench, prompts, configs, models=models, options=options)
    return _finish(doc, bench, configs, prompts, f"{len(bench.runs)} of {bench.planned} runs", out=out, options=options)


def execute_workload(name: str, *, models, options: BenchOptions) -> int:
    """`--workload NAME` for a sitting of its own (`measure.bench_workloads.OWN`): measure, then report and write
    --json/--plot/--markdown as `execute` does. Returns 0, or 130 when interrupted."""
    from specdec_cli.measure.bench_workloads import run_workload

    err = err_console()
    out = err if options.json_path == "-" or options.markdown else make_console()
    if options.plot_path:
        check_plot_path(options.plot_path)
    sitting = run_workload(name, models=models, options=options, reporter=RichReporter(err))
    doc = json_doc(sitting.bench, sitting.prompts, sitting.configs, models=models, options=options)
    doc.update(workload=name, peer=None)
    done = f"{len(sitting.bench.runs)} runs"
    return _finish(doc, sitting.bench, sitting.configs, sitting.prompts, done, out=out, options=options)


def _finish(
    doc: dict[str, Any],
    bench: BenchRun,
    configs: list[BenchConfig],
    prompts: list[PromptCase],
    done: str,
    *,
    out: Console,
    options: BenchOptions,
) -> int:
    """Summarise `bench`'s runs into `doc`, print the report (after a warning saying `done`, the runs made, when it
    was interrupted) and write --json/--plot/--markdown. Returns the exit code: 0, or 130 when interrupted."""
    summaries = summarize(bench.runs, configs, [(p.name, p.kind) for p in prompts])
    doc["summary"] = [s.to_dict() for s in summaries]
    if bench.interrupted:
        out.print(Text(f"Interrupted after {done}: the numbers below cover only those.", style="spec.warn"))
    render(doc, summaries, out=out, options=options)
    if options.json_path:
        write_json(options.json_path, doc)
    return 130 if bench.interrupted else 0


def render(doc: dict[str, Any], summaries: list[BenchSummary], *, out: Console, options: BenchOptions) -> None:
    """The Rich report to `out`, then --markdown (stdout) and --plot."""
    out.print(report(doc, summaries), soft_wrap=False)
    if options.markdown:
        sys.stdout.write(markdown_table(doc, summaries) + "\n")
        sys.stdout.flush()
    if options.plot_path:
        write_plot(options.plot_path, doc, summaries)
        out.print(Text(f"chart written to {options.plot_path}", style="spec.label"))


def from_json(path: str, *, options: BenchOptions) -> int:
    """Re-render a saved `--json` document (the report, --markdown, --plot) without measuring anything."""

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(
            f"Cannot read --from-json {path}: {e}.", "Give a file written by specdec bench --json."
        ) from None
    if not isinstance(doc, dict) or doc.get("version") != JSON_VERSION or "runs" not in doc:
        raise UsageError(
            f"{path} is not a specdec bench --json file (version {JSON_VERSION}).",
            "Write one with specdec bench --json PATH.",
        )
    if options.plot_path:
        check_plot_path(options.plot_path)
    configs = [config_from_label(label) for label in doc["configs"]]
    summaries = summarize(doc["runs"], configs, [(p["name"], p["kind"]) for p in doc["prompts"]])
    render(doc, summaries, out=err_console() if options.markdown else make_console(), options=options)
    return 0
