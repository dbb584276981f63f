"""`specdec bench --workload`: the sittings that were once scripts of their own, each measured into the run dicts of
`specdec_cli.measure.bench` and summarised, reported and written by the same code as the default bench.

Presets of the default bench (its worker processes, cold runs, interleaving and peers):
* `plain`: plain decoding alone (`none` and the A/A control), to compare llama-cpp-python builds: run it in each
  environment in one sitting; the report's header names the build's kernels.
* `auto`: `--method auto` with a fresh controller and with the one the earlier runs taught (`auto-warm`, what later
  `specdec run`s get through learnt.json), beside `none`, `ngram` and `suffix`, on copy-heavy edits, an explanation,
  a story and a whole-file rewrite (give the rewrite -n 512), and native llama.cpp plain and ngram-simple.
* `verify`: the default (`auto-warm`: its controller keeps learning from prompt to prompt) against `none` and native
  `ngram-simple` and `ngram-mod`, on every built-in edit and free-writing prompt; `--repeats 3` for a steady figure.

Workloads of their own (one process, one loaded target; every configuration of a prompt runs back to back):
* `predict`: predicted outputs on the packaged whole-file edits: `none`, `ngram`, `auto`, `predict` (the prediction
  alone) and `auto+predict`; then the iterate-on-an-instruction loop on the first edit, the prompt slightly changed:
  the previous reply as the prediction beside a suffix store that has learnt it (prompt "NAME-changed").
* `suffix`: does the suffix drafter get faster with use (SuffixDecoding, Oliaro et al. 2024)? One edit instruction over
  eight functions of the standard library's posixpath.py, twice, in a fresh home: pass 1 `none`, `ngram`, `suffix`
  (its store learns each finished reply); pass 2 `none`, `suffix` (warm store, the session's controller) and
  `suffix-fresh` (warm store, a new controller per prompt). The classes "pass 1" and "pass 2" carry the speedups.
* `edits`: every row a new `specdec run` process, as a user runs it: `fresh` (a new home holding only this machine's
  verify curve), `shared` (one home per repeat, warmed by three unmeasured prompts, then every prompt in turn),
  `none`; with --llama-cpp, native `ngram-simple` and `ngram-mod`.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specdec_cli.errors import UsageError
from specdec_cli.measure.bench import AUTO_WARM, BenchConfig, BenchRun, config_from_label
from specdec_cli.prompts import PromptCase, builtin, predict_cases
from specdec_cli.spec import Method

PRESETS = ("plain", "auto", "verify")
OWN = ("predict", "suffix", "edits")
WORKLOADS = ("default", *PRESETS, *OWN)


@dataclass(frozen=True)
class Preset:
    """What a preset sets in `BenchOptions` and which prompts it runs (`methods`: `--methods` syntax)."""

    methods: str
    peer: bool
    native: tuple[str, ...]
    prompts: Callable[[], list[PromptCase]]


def _named(*names: str) -> list[PromptCase]:
    """The built-in prompts with these names (file stems), in this order."""
    cases = {c.name: c for c in builtin()}
    return [cases[n] for n in names]


PRESET = {
    "plain": Preset("none", False, ("plain",), lambda: [builtin(("edit",))[0]]),
    "auto": Preset(
        f"none,ngram,suffix,auto,{AUTO_WARM}",
        False,
        ("plain", "ngram-simple"),
        lambda: _named(
            "textwrap_rename", "colorsys_type_hints", "shlex_quote", "lighthouse_story", "sched_rename_method"
        ),
    ),
    "verify": Preset(f"none,{AUTO_WARM}", False, ("ngram-simple", "ngram-mod"), lambda: builtin(("edit", "write"))),
}

EDITS_WARM = (("python_history", 96), ("tests_essay", 96), ("sched_rename_method", 384))  # never measured
SUFFIX_INSTRUCTION = (
    "Add Python type hints to this function and keep everything else exactly as it is, including "
    "the docstring and comments. Reply with the complete function only."
)
SUFFIX_FUNCTIONS = ("normcase", "isabs", "join", "split", "splitext", "basename", "dirname", "expanduser")


def check_workload(name: str) -> str:
    """Raises UsageError for a name not in WORKLOADS."""
    if name not in WORKLOADS:
        raise UsageError(f"Unknown workload {name!r}.", f"Use one of: {', '.join(WORKLOADS)}.")
    return name


# --------------------------------------------------------------------------------------------------------------
# Workloads of their own: each calls emit(config, prompt, repeat, run dict) per timed run


@dataclass
class Sitting:
    """What a workload measured: its configurations and prompts in report order, and the `BenchRun`."""

    configs: list[BenchConfig]
    prompts: list[PromptCase]
    bench: BenchRun


def run_workload(name: str, *, models, options, reporter) -> Sitting:
    """Measure workload `name` (one of OWN). models: `spec.ModelOptions`; options: `bench.BenchOptions` (max_tokens,
    repeats, k, llama_cpp); reporter: where loading the models reports. Ctrl-C returns what was measured
    (`BenchRun.interrupted`). Raises UsageError, ModelError, ContextOverflowError."""
    from specdec_cli.models import host
    from specdec_cli.models.llama import system_info
    from specdec_cli.models.machine import describe

    runs: list[dict[str, Any]] = []
    prompts: dict[str, PromptCase] = {}
    labels: dict[str, None] = {"none": None}
    n_prompt: dict[str, int] = {}  # the prompt's tokens, as the first run of ours on it counted them
    info: dict[str, Any] = {}

    def emit(config: str, case: PromptCase, repeat: int, record: dict[str, Any]) -> None:
        labels.setdefault(config, None)
        prompts.setdefault(case.name, case)
        if record.get("n_prompt"):
            n_prompt.setdefault(case.name, record["n_prompt"])
        runs.append(
            {"config": config, "prompt": case.name, "kind": case.kind, "repeat": repeat, "cold": False, **record}
        )
        reporter.note(f"{config:>14} · {case.name} · repeat {repeat + 1}: {record['tokens_per_s']:.1f} tok/s")

    interrupted = False
    target = None
    try:
        target = {"predict": _predict, "suffix": _suffix, "edits": _edits}[name](emit, info, models, options, reporter)
    except KeyboardInterrupt:
        interrupted = True
    target = target or Path(models.target or "?")
    plan = host.current_plan()
    machine = describe(
        models.threads,
        [target] if target.exists() else [],
        system_info=system_info(),
        load_plan=plan.to_dict() if plan is not None else None,
    )
    bench = BenchRun(
        target,
        None,
        machine,
        ours_info=info,
        tokens=[[0] * n_prompt.get(p, 0) for p in prompts],  # json_doc counts them
        runs=runs,
        planned=len(runs),
        interrupted=interrupted,
    )
    return Sitting([config_from_label(label) for label in labels], list(prompts.values()), bench)


@contextmanager
def _session(models, reporter, **kw) -> Iterator[tuple[Any, Any]]:
    """The session on `models` with the prompt cache off (every run measures its own prefill-free decode)."""
    from specdec_cli.assemble import Assembler
    from specdec_cli.session import open_session

    with (
        open_session(replace(models, prompt_cache=False), reporter=reporter, **kw) as session,
        Assembler(session) as assembler,
    ):
        yield session, assembler


def _generate(
    assembler, method: str, prompt, config, *, k: str = "auto", learn: bool = False, fresh: bool = True, drafter=None
):
    """One generation with `method`: a drafter of its own (closed after; it learns nothing unless `learn`), or
    `drafter` as given; a new --k auto controller when `fresh`."""
    from specdec_cli.driver import generate
    from specdec_cli.measure.sweep import NoLearning

    spec = _spec(method, k)
    own = assembler.make_drafter(spec) if drafter is None else None
    used = drafter if drafter is not None else (own if own is None or learn else NoLearning(own))
    try:
        return generate(assembler.engine(spec, fresh=fresh, drafter=used), prompt, config)
    finally:
        if own is not None:
            own.close()


def _predict(emit, info, models, options, reporter) -> Path:
    from specdec_cli.core.engine import GenerationConfig
    from specdec_cli.measure.bench_process import run_record

    base = GenerationConfig(max_tokens=options.max_tokens)
    with _session(models, reporter, method="auto") as (session, assembler):
        info.update(threads=session.target.n_threads, kernels=session.kernels())
        for repeat in range(options.repeats):
            first = None
            for case in predict_cases():
                pc = PromptCase(case.name, "predict", case.prompt)
                prompt, pred = session.prompt_tokens(case.prompt), session.prediction_tokens(case.prediction)
                _generate(assembler, "none", prompt, replace(base, max_tokens=4))  # prefill once, untimed
                for label, method, config in (
                    ("none", "none", base),
                    ("ngram", "ngram", base),
                    ("auto", "auto", base),
                    ("predict", "predict", replace(base, prediction=pred)),
                    ("auto+predict", "auto", replace(base, prediction=pred)),
                ):
                    g = _generate(assembler, method, prompt, config, k=options.k)
                    emit(
                        label,
                        pc,
                        repeat,
                        {**run_record(g), "accepted_prediction_tokens": g.stats.accepted_prediction_tokens},
                    )
                    first = first or g
            # iterate on the instruction: a changed prompt; the previous reply as the prediction vs a store that
            # learnt it
            case = predict_cases()[0]
            changed = PromptCase(
                f"{case.name}-changed",
                "iterate",
                case.prompt.replace("Return the whole file", "Return the complete file", 1)
                + "\nKeep every comment as it is.",
            )
            assert first is not None  # (the loop above ran)
            prompt, pred = session.prompt_tokens(changed.text), session.prediction_tokens(first.text)
            _generate(assembler, "none", prompt, replace(base, max_tokens=4))
            store = assembler.make_drafter(_spec("suffix", options.k))
            try:
                _generate(assembler, "suffix", session.prompt_tokens(case.prompt), base, drafter=store)  # it learns
                for label, method, config, drafter in (
                    ("none", "none", base, None),
                    ("suffix", "suffix", base, store),
                    ("auto", "auto", base, None),
                    ("auto+predict", "auto", replace(base, prediction=pred), None),
                ):
                    g = _generate(assembler, method, prompt, config, k=options.k, drafter=drafter)
                    emit(label, changed, repeat, run_record(g))
            finally:
                store.close()
        return session.target_path


def _spec(method: str, k: str):
    """SpecOptions for `method` with --k `k`."""
    from specdec_cli.spec import K, SpecOptions

    return SpecOptions(method=Method(method), k=K(k))


def suffix_prompts() -> list[PromptCase]:
    """`SUFFIX_INSTRUCTION` over each of `SUFFIX_FUNCTIONS`, read from this Python's posixpath.py."""
    source = Path(sysconfig.get_paths()["stdlib"], "posixpath.py").read_text(encoding="utf-8")
    funcs = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    return [
        PromptCase(
            name, "pass 1", f"{SUFFIX_INSTRUCTION}\n\n```python\n{ast.get_source_segment(source, funcs[name])}\n```"
        )
        for name in SUFFIX_FUNCTIONS
    ]


@contextmanager
def _home(path: Path) -> Iterator[Path]:
    """SPECDEC_HOME set to `path` for the block (the suffix store and learnt.json live there)."""
    old = os.environ.get("SPECDEC_HOME")
    os.environ["SPECDEC_HOME"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("SPECDEC_HOME", None)
        else:
            os.environ["SPECDEC_HOME"] = old


def _suffix(emit, info, models, options, reporter) -> Path:
    from specdec_cli.core.engine import GenerationConfig
    from specdec_cli.measure.bench_process import run_record

    config = GenerationConfig(max_tokens=options.max_tokens)
    with (
        tempfile.TemporaryDirectory(prefix="specdec-bench-suffix-") as tmp,
        _home(Path(tmp)),
        _session(models, reporter, need_draft=False) as (session, assembler),
    ):
        info.update(threads=session.target.n_threads, kernels=session.kernels())
        suffix = assembler.make_drafter(_spec("suffix", options.k))
        ngram = assembler.make_drafter(_spec("ngram", options.k))
        try:
            cases = [(c, session.prompt_tokens(c.text)) for c in suffix_prompts()]
            _generate(assembler, "none", cases[0][1][:32], GenerationConfig(max_tokens=8))  # untimed warm-up
            for pass_no in (1, 2):
                for case, prompt in cases:
                    # plain decoding runs in both passes: the warm pass is compared with plain decoding beside it
                    plan = (
                        [("none", None), ("ngram", ngram), ("suffix", suffix)]
                        if pass_no == 1
                        else [("none", None), ("suffix", suffix), ("suffix-fresh", suffix)]
                    )
                    pc = case if pass_no == 1 else PromptCase(f"{case.name} (pass 2)", "pass 2", case.text)
                    for label, drafter in plan:
                        g = _generate(
                            assembler,
                            label.removesuffix("-fresh"),
                            prompt,
                            config,
                            k=options.k,
                            drafter=drafter,
                            fresh=label.endswith("-fresh"),
                        )
                        emit(label, pc, 0, run_record(g))
        finally:
            suffix.close()
            ngram.close()
        return session.target_path


def _specdec_run(home: Path, args: list[str], out: Path) -> dict[str, Any]:
    """`specdec run ARGS --no-prompt-cache --json OUT` in a new process with SPECDEC_HOME=home; its --json document.
    Raises UsageError with the tail of its stderr when it fails."""
    env = {**os.environ, "SPECDEC_HOME": str(home), "NO_COLOR": "1"}
    cmd = [sys.executable, "-m", "specdec_cli", "run", *args, "--no-prompt-cache", "--json", str(out)]
    proc = subprocess.run(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise UsageError(
            f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}", "Run that command alone to see why."
        )
    return json.loads(out.read_text(encoding="utf-8"))


def seed_home(home: Path, curves: dict[str, Any]) -> Path:
    """A home whose learnt.json holds only these measured verify curves (a fresh controller, not a fresh curve)."""
    (home / "data").mkdir(parents=True, exist_ok=True)
    (home / "data" / "learnt.json").write_text(
        json.dumps({"version": 1, "entries": {}, "curves": curves}), encoding="utf-8"
    )
    return home


def _edits(emit, info, models, options, reporter) -> Path:
    from specdec_cli.measure.bench import NativeRunner

    cases = _named(
        "textwrap_rename",
        "colorsys_type_hints",
        "bisect_rename",
        "heapq_type_hints",
        "posixpath_rename",
        "genericpath_type_hints",
        "lighthouse_story",
        "shlex_quote",
    )
    warm = {c.name: c for c in _named(*(n for n, _ in EDITS_WARM))}
    common = (["-t", models.target] if models.target else []) + ["--ctx", str(models.ctx)]
    with tempfile.TemporaryDirectory(prefix="specdec-bench-edits-") as tmp:
        base = Path(tmp)
        files = {}
        for c in [*cases, *warm.values()]:
            files[c.name] = base / f"{c.name}.txt"
            files[c.name].write_text(c.text, encoding="utf-8")
        # the curve, measured once (the first run of a new home measures it), then copied into every home
        _specdec_run(base / "measure", [str(files[cases[0].name]), *common, "-n", "8"], base / "m.json")
        curves = json.loads((base / "measure" / "data" / "learnt.json").read_text(encoding="utf-8"))["curves"]
        warm0 = seed_home(base / "warm0", curves)
        for name, n in EDITS_WARM:
            _specdec_run(warm0, [str(files[name]), *common, "-n", str(n)], base / "w.json")
        native = None
        with _session(models, reporter, method="none") as (session, _):
            target, threads = session.target_path, session.target.n_threads
            info.update(threads=threads, kernels=session.kernels())
            if options.llama_cpp:
                from specdec_cli.measure.native import find_tools

                rendered = [session.target.format_chat([{"role": "user", "content": c.text}]) for c in cases]
                native = NativeRunner(find_tools(options.llama_cpp), target, rendered, threads, models.ctx)
        configs = ["fresh", "shared", "none"] + (["native-ngram-simple", "native-ngram-mod"] if native else [])
        for r in range(options.repeats):
            shared = base / f"shared{r}"
            shutil.copytree(warm0, shared)
            for i in [*range(r % len(cases), len(cases)), *range(r % len(cases))]:
                case = cases[i]
                for cfg in configs[r % len(configs) :] + configs[: r % len(configs)]:
                    if cfg.startswith("native-"):
                        assert native is not None  # (native configs only with it)
                        emit(
                            cfg,
                            case,
                            r,
                            native.call(
                                {"prompt": i, "max_tokens": options.max_tokens, "cold": False, "method": cfg[7:]}
                            ),
                        )
                        continue
                    home = shared if cfg == "shared" else seed_home(base / f"{case.name}-{cfg}-{r}", curves)
                    d = _specdec_run(
                        home,
                        [
                            str(files[case.name]),
                            *common,
                            "-n",
                            str(options.max_tokens),
                            *(["--method", "none"] if cfg == "none" else []),
                        ],
                        base / "out.json",
                    )
                    st = d["stats"]
                    emit(
                        cfg,
                        case,
                        r,
                        {
                            "tokens_per_s": st["tokens_per_s"],
                            "n_tokens": st["n_generated"],
                            "n_prompt": st["n_prompt"],
                            "n_drafted": st["n_drafted"],
                            "n_accepted": st["n_accepted"],
                            "n_steps": st["n_target_passes"],
                            "n_spec_steps": sum(1 for s in d["steps"] if s.get("drafted")),
                            "verify_ms": st["verify_ms"],
                            "curve_passes": st["curve_passes"],
                            "cheap_passes": st["cheap_passes"],
                            "tokens": d["tokens"],
                            "k_max": max((s["k"] for s in d["steps"]), default=0),
                        },
                    )
    return target
