"""The `specdec` command line. Thin: options in, `commands/*` do the work, errors go up to `specdec_cli.cli.main`."""

from __future__ import annotations

import inspect
from dataclasses import replace
from pathlib import Path

import typer

from specdec_cli import __version__
from specdec_cli.cli import options as o
from specdec_cli.core.constraint import Grammar
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.core.sampling import SamplingParams
from specdec_cli.measure.audit import NEAR_TIE_THRESHOLD
from specdec_cli.spec import K, Method, ModelOptions, SpecOptions

app = typer.Typer(
    name="specdec",
    help="Faster local LLM generation with lossless speculative decoding, shown token by token.\n\n"
    "A cheap drafter proposes K tokens, the target model checks them all in one batched pass, and you see "
    "which were accepted.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _model_options(
    target: o.Target = None,
    draft: o.DraftModel = None,
    ctx: o.Ctx = 4096,
    threads: o.Threads = None,
    gpu_layers: o.GpuLayers = -1,
    no_prompt_cache: o.NoPromptCache = False,
    verbose: o.Verbose = False,
) -> ModelOptions:
    """The one place the model options every command shares become `ModelOptions` (a `group`'s builder)."""
    return ModelOptions(
        target=target,
        draft=draft,
        ctx=ctx,
        threads=threads,
        gpu_layers=gpu_layers,
        verbose=verbose,
        prompt_cache=not no_prompt_cache,
    )


def _spec_options(
    method: o.MethodOpt = Method.auto,
    k: o.K = None,
    ngram_min: o.NgramMin = 2,
    ngram_max: o.NgramMax = 4,
    corpus: o.CorpusOpt = "auto",
) -> SpecOptions:
    """--method, --k, --ngram-min, --ngram-max and --corpus as `SpecOptions`, built and validated once (a `group`'s
    builder). A --k left out (None) is auto with `k_given` False: the K `specdec tune --save` chose then applies
    where there is one. Raises UsageError for a bad --k (exit 2)."""
    return SpecOptions(
        method=method,
        k=K(k or "auto"),
        k_given=k is not None,
        ngram_min=ngram_min,
        ngram_max=ngram_max,
        corpus=corpus or "auto",
    )


def _generation_config(
    max_tokens: o.MaxTokens = 512,
    stop: o.Stop = None,
    temperature: o.Temperature = 0.0,
    top_k: o.TopK = 40,
    top_p: o.TopP = 0.95,
    min_p: o.MinP = 0.05,
    seed: o.Seed = None,
) -> GenerationConfig:
    """--max-tokens, --stop and the sampling options as the `GenerationConfig` a command generates with (a `group`'s
    builder; the command adds the grammar `o.grammar_option` reads and --logprobs where it has them)."""
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    return GenerationConfig(max_tokens=max_tokens, stop=tuple(stop or ()), sampling=sampling)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"specdec {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
) -> None:
    pass


RUN_EXAMPLES = """
[bold]Examples[/bold]

  specdec run prompt.txt                              [dim]# auto: whatever drafts pay on this machine, K chosen each step[/dim]
  specdec run edit.txt --predict old.py --compare     [dim]# drafts from the file you expect back, speedup over plain[/dim]
  specdec run prompt.txt --method none --compare 5    [dim]# plain against plain: the noise floor of this machine now[/dim]
  specdec run prompt.txt --method ngram               [dim]# prompt lookup only[/dim]
  echo "Write a haiku" | specdec run - --temperature 0.8 --seed 1
  specdec run prompt.txt --json - > result.json       [dim]# text and every statistic as JSON[/dim]
  specdec run prompt.txt -t ./my-model.gguf -d ./my-draft.gguf --k 6
  specdec run prompt.txt --compare --strict           [dim]# exit 7 if greedy output leaves plain decoding (not a near-tie)[/dim]
  specdec run invoice.txt --json-schema invoice.schema.json   [dim]# JSON valid against the schema; keys drafted free[/dim]
  specdec run q.txt --json-object --json r.json --logprobs 5  [dim]# any JSON object; logprobs in r.json[/dim]
  specdec run q.txt --grammar answer.lark             [dim]# a Lark or GBNF grammar[/dim]
"""  # noqa: E501  (the [dim] markup is not printed: the lines people see fit)


@app.command(epilog=RUN_EXAMPLES)
@o.grouped
def run(
    prompt_file: o.PromptFile,
    models: ModelOptions = o.group(_model_options),
    method: o.MethodOpt = Method.auto,
    k: o.K = None,
    predict: o.Predict = None,
    spec: SpecOptions = o.group(_spec_options),  # --method and --k declared above, --predict between them
    config: GenerationConfig = o.group(_generation_config),
    system: o.System = None,
    raw: o.Raw = False,
    plain: o.Plain = False,
    clean: o.Clean = False,
    json_out: o.JsonOut = None,
    compare: o.Compare = 0,
    strict: bool = typer.Option(
        False,
        "--strict",
        help="Implies --compare. Exit with code 7 when the greedy "
        "output leaves plain decoding at a token that is not a numerical near-tie.",
        rich_help_panel=o.OUTPUT,
    ),
    idle_baseline: o.IdleBaseline = False,
    logprobs: o.Logprobs = None,
    constraint: Grammar | None = o.group(o.grammar_option),
    verbose: o.Verbose = False,
) -> None:
    """Generate a reply to a prompt with speculative decoding, streamed in colour, then statistics.

    Green tokens are draft tokens the target accepted, bold ones are the target's own, and struck-through red ones
    are drafts it rejected. Statistics go to stderr; stdout gets only the text when it is not a terminal.
    """
    from specdec_cli.cli.commands.run import OutputOptions, execute
    from specdec_cli.cli.inputs import read_prediction, read_prompt

    if predict == "-" and prompt_file == "-":
        raise typer.BadParameter("the prompt and the prediction cannot both come from stdin", param_hint="--predict")
    if logprobs is not None and not json_out:
        raise typer.BadParameter(
            "log-probabilities are written to the --json output; add --json PATH", param_hint="--logprobs"
        )
    text = read_prompt(prompt_file)
    prediction = read_prediction(predict) if predict is not None else None
    code = execute(
        text,
        models=models,
        spec=spec,
        config=replace(config, grammar=constraint, logprobs=logprobs),
        output=OutputOptions(
            plain=plain,
            clean=clean,
            json_path=json_out,
            compare=compare or (o.COMPARE_PAIRS if strict else 0),
            strict=strict,
            idle_baseline=idle_baseline,
        ),
        raw=raw,
        system=system,
        prediction=prediction,
    )
    if code:
        raise typer.Exit(code)


CHAT_EXAMPLES = """
[bold]Examples[/bold]

  specdec chat                          [dim]# the default target, --method auto, K chosen each step[/dim]
  specdec chat -t smollm2-135m -d smollm2-135m --system "Be brief."
  specdec chat --method ngram -n 256    [dim]# prompt lookup, short replies[/dim]
  printf 'Hi\\nName a colour\\n' | specdec chat > replies.txt

[bold]In the chat[/bold]

  /help  /stats  /k 4  /k auto  /method ngram  /predict old.py  /save chat.md  /reset  /quit
  End a line with \\ to continue it, or put lines between \"\"\" and \"\"\".
  Ctrl-C stops a reply; Ctrl-D, or Ctrl-C at an empty prompt, quits.
"""


@app.command(epilog=CHAT_EXAMPLES)
@o.grouped
def chat(
    models: ModelOptions = o.group(_model_options),
    spec: SpecOptions = o.group(_spec_options),
    config: GenerationConfig = o.group(_generation_config),
    system: o.System = None,
    plain: o.Plain = False,
    clean: o.Clean = False,
    constraint: Grammar | None = o.group(o.grammar_option),
    verbose: o.Verbose = False,
) -> None:
    """Chat with a model over several turns, each reply generated with speculative decoding and streamed in colour.

    The history goes through the model's own chat template, and both KV caches keep the conversation between
    turns, so each turn evaluates only its new tokens. When the history outgrows --ctx, the oldest turns are dropped
    (the system prompt is kept). With stdin not a terminal, each line is one message: replies go to stdout, the
    per-turn statistics to stderr.
    """
    from specdec_cli.cli.commands.chat import execute

    code = execute(
        models=models,
        spec=spec,
        config=replace(config, grammar=constraint),
        system=system,
        plain=plain,
        clean=clean,
    )
    if code:
        raise typer.Exit(code)


TUNE_EXAMPLES = """
[bold]Examples[/bold]

  specdec tune --save                        [dim]# default pair, 2 built-in prompts, K 1,2,4,8,16[/dim]
  specdec tune --k 4..16 --method ngram      [dim]# K = 4, 6, 8, 12, 16 with prompt lookup[/dim]
  specdec tune prompts/ --k 2,4,8 --json t.json   [dim]# your prompts; every run as JSON[/dim]
  specdec tune --k auto --repeats 3 -n 256   [dim]# only auto against plain decoding, steadier[/dim]

[bold]How long[/bold]: prompts × (K values + 2) × repeats generations of up to --max-tokens tokens.
Steadier: more --repeats (the median is kept), larger --max-tokens. Quicker: fewer K values (--k 4,8),
one prompt file, --max-tokens 64.
"""


TUNE_HELP = (
    "Measure decoding speed by K on this machine, and save the best setting.\n\n"
    "Plain decoding, each fixed K and auto run on the same prompts in one process, interleaved to cancel drift; "
    "only decoding is timed. Reports tok/s (median of repeats), speedup over plain decoding, acceptance rate, mean "
    "accepted length, and the measured cost of a target pass by batch size.\n\n"
    "Without prompt files it uses two built-in prompts: a copy-heavy code edit and free writing. The report goes to "
    "stdout, the progress bar to stderr."
)


@app.command(help=TUNE_HELP, epilog=TUNE_EXAMPLES)
@o.grouped
def tune(
    prompts: o.PromptDir = None,
    models: ModelOptions = o.group(_model_options, omit=("no_prompt_cache",)),
    method: o.MethodOpt = Method.auto,
    k: str = typer.Option(
        "1,2,4,8,16",
        "--k",
        "-k",
        help="Fixed K values to measure: a list (2,4,8) and ranges "
        "(4..16 = 4, 6, 8, 12, 16), or 'auto' for none. Plain decoding and auto always run.",
        rich_help_panel=o.SPEC,
    ),
    repeats: int = typer.Option(
        1,
        "--repeats",
        "-r",
        min=1,
        max=100,
        help="Runs of every configuration on every prompt; tok/s is their median.",
        rich_help_panel=o.SPEC,
    ),
    ngram_min: o.NgramMin = 2,
    ngram_max: o.NgramMax = 4,
    config: GenerationConfig = o.group(_generation_config, max_tokens=128, omit=("stop", "top_k", "top_p", "min_p")),
    json_out: str = typer.Option(
        None,
        "--json",
        help="Write every run's measurements and the machine description as JSON to PATH ('-' = stdout).",
        rich_help_panel=o.OUTPUT,
    ),
    save: bool = typer.Option(
        False,
        "--save",
        help="Save the best setting for this model pair, method and machine "
        "(config dir/tuned.json); `specdec run` uses it when --k is not given.",
        rich_help_panel=o.OUTPUT,
    ),
    plot: str = typer.Option(
        None,
        "--plot",
        help="Draw this machine's measured verify curve to PATH (.png or .svg; "
        "needs pip install 'specdec-cli\\[plot]').",
        rich_help_panel=o.OUTPUT,
    ),
    verbose: o.Verbose = False,
) -> None:
    """Measure decoding speed by K on this machine, and save the best setting (help: TUNE_HELP)."""
    from specdec_cli.cli.commands.tune import execute
    from specdec_cli.cli.inputs import from_paths
    from specdec_cli.measure.tune import TuneOptions, parse_tune_k
    from specdec_cli.prompts import builtin

    ks = parse_tune_k(k)
    if prompts:
        cases = from_paths(list(prompts))
    else:
        cases = [next(c for c in builtin((kind,))) for kind in ("edit", "write")]  # one of each: short
    code = execute(
        cases,
        models=models,
        spec=SpecOptions(method=method, k=K("auto"), ngram_min=ngram_min, ngram_max=ngram_max),
        config=config,
        options=TuneOptions(ks=ks, repeats=repeats, json_path=json_out, save=save, plot=plot),
    )
    if code:
        raise typer.Exit(code)


CHECK_EXAMPLES = """
[bold]Examples[/bold]

  specdec check prompt.txt                            [dim]# the default target, --method auto, K chosen each step[/dim]
  specdec check prompt.txt --method ngram --k 8 -n 128
  specdec check prompt.txt -t ./my-model.gguf -d ./my-draft.gguf --json report.json
  specdec check prompt.txt --threshold 0.5            [dim]# a stricter near-tie threshold (logits)[/dim]
  specdec check invoice.txt --json-schema invoice.schema.json   [dim]# a constrained run, audited constrained[/dim]
"""


@app.command(epilog=CHECK_EXAMPLES)
@o.grouped
def check(
    prompt_file: o.PromptFile,
    models: ModelOptions = o.group(_model_options),
    method: o.MethodOpt = Method.auto,
    k: o.KAuto = "auto",
    spec: SpecOptions = o.group(_spec_options, omit=("corpus",)),  # --method and --k (auto, no tuned K) above
    config: GenerationConfig = o.group(_generation_config, max_tokens=256, omit=("top_k", "top_p", "min_p", "seed")),
    temperature: float = typer.Option(  # check's own --temperature, passed to _generation_config
        0.0,
        "--temperature",
        "--temp",
        min=0.0,
        help="Must be 0: the check is greedy (sampling is checked statistically).",
        rich_help_panel=o.SAMPLING,
    ),
    threshold: float = typer.Option(
        NEAR_TIE_THRESHOLD,
        "--threshold",
        min=0.0,
        help="Near-tie threshold in "
        "logits: a token that is not the target's batch-1 argmax by less than this is "
        "a numerical near-tie, by more a divergence.",
        rich_help_panel=o.SPEC,
    ),
    system: o.System = None,
    raw: o.Raw = False,
    json_out: o.JsonOut = None,
    constraint: Grammar | None = o.group(o.grammar_option),
    verbose: o.Verbose = False,
) -> None:
    """Check that greedy speculative output is the target's own greedy output, token by token.

    Generates with speculative decoding, then re-scores the output with the target one token at a time from an
    empty cache (the numerics of plain decoding) and lists every position where the emitted token is not the
    target's argmax, with the target's logit margin there. llama.cpp's logits depend on the batch size, so a token
    may flip where the target's top two logits nearly tie: those pass. Exit code 0 when every flagged position is a
    near-tie, 7 otherwise. The report goes to stdout (stderr with --json -). With --json-object, --json-schema or
    --grammar, both the run and the re-scoring are constrained: each position is checked against the argmax among
    the tokens the grammar allows there.
    """
    from specdec_cli.cli.commands.check import execute, refuse_sampling
    from specdec_cli.cli.inputs import read_prompt

    config = replace(config, grammar=constraint)
    refuse_sampling(config)  # before reading stdin or loading models
    code = execute(
        read_prompt(prompt_file),
        models=models,
        spec=spec,
        config=config,
        json_path=json_out,
        raw=raw,
        system=system,
        threshold=threshold,
    )
    if code:
        raise typer.Exit(code)


BENCH_EXAMPLES = """
[bold]Examples[/bold]

  specdec bench                                  [dim]# default pair, one built-in prompt per class, + the peer[/dim]
  specdec bench --json bench.json --plot speedup.svg
  specdec bench --from-json bench.json --markdown   [dim]# a saved run as a Markdown table, measuring nothing[/dim]
  specdec bench prompts/ --methods none,ngram,suffix --no-peer -n 256 --repeats 3
  specdec bench -t smollm2-135m -d smollm2-135m -n 32   [dim]# a quick try on the tiny model[/dim]
  specdec bench --llama-cpp ~/llama.cpp/build/bin --no-peer   [dim]# + native llama.cpp, plain and ngram-simple[/dim]
  specdec bench --workload verify -r 3 --llama-cpp DIR   [dim]# learning auto vs none vs native ngram-*[/dim]
  specdec bench --workload predict -n 512          [dim]# --predict on whole-file edits, and iterating on one[/dim]
  specdec bench --workload plain                   [dim]# plain decoding only: compare two llama-cpp-python builds[/dim]

[bold]Workloads[/bold] (--workload): default (the above); plain, auto, verify: presets of --methods, prompts and
--native; predict, suffix, edits: sittings of their own (docs/bench.md).

[bold]How long[/bold]: prompts × configurations × (repeats + one cold run) generations; the cold runs pay a full
prefill each. The defaults (4 prompts, 7 configurations, 96 tokens, 1 repeat) take about 10 minutes with the
default pair on 2 CPU cores. Steadier: --repeats 3. Quicker: --methods none,ngram --no-peer, or one prompt file.
"""

BENCH_HELP = (
    "Benchmark every drafting method, and llama-cpp-python's own prompt lookup decoding, on a prompt set.\n\n"
    "Configurations: our methods (--methods; none is the baseline and always runs, and A/A, none timed again, is "
    "the control: its speedup is the noise floor of the sitting) in one process on one loaded "
    "target, and the peer: llama-cpp-python's Llama(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10 and 2)) "
    "in its own process, with logits_all=True (without it, it fails with a broadcast error in 0.3.36). Greedy. "
    "Runs are interleaved, repeated and warmed up; only decoding is timed.\n\n"
    "Reports per configuration: decode tok/s (median, spread), speedup over none, acceptance rate, mean accepted "
    "length, time to first token (cold cache), peak RSS, and whether the output matches none's. Without prompt "
    "files it uses one built-in prompt per class: copy-heavy code edit, code explanation, summary, free writing. "
    "The report goes to stdout (in a pipe or a file, tables take the width they need), the progress bar to stderr."
)


@app.command(help=BENCH_HELP, epilog=BENCH_EXAMPLES)
@o.grouped
def bench(
    prompts: o.PromptDir = None,
    models: ModelOptions = o.group(_model_options, omit=("no_prompt_cache",)),
    methods: str = typer.Option(
        "none,auto,ngram,suffix,draft",
        "--methods",
        help="Our methods to measure, comma-separated (none always runs: it is the baseline).",
        rich_help_panel=o.SPEC,
    ),
    no_peer: bool = typer.Option(
        False, "--no-peer", help="Skip llama-cpp-python's prompt lookup decoding.", rich_help_panel=o.SPEC
    ),
    llama_cpp: str = typer.Option(
        None,
        "--llama-cpp",
        help="Also run native llama.cpp on the same prompts: DIR holds "
        "llama-completion and llama-speculative-simple (plain, and --spec-type ngram-simple).",
        rich_help_panel=o.SPEC,
    ),
    k: o.KAuto = "auto",
    repeats: int = typer.Option(
        1,
        "--repeats",
        "-r",
        min=1,
        max=100,
        help="Timed runs of every configuration on every prompt; tok/s is their median.",
        rich_help_panel=o.SPEC,
    ),
    all_builtin: bool = typer.Option(
        False, "--all-builtin", help="Without prompt files: every built-in prompt, not one per class."
    ),
    ngram_min: o.NgramMin = 2,
    ngram_max: o.NgramMax = 4,
    max_tokens: o.MaxTokens = 96,
    json_out: str = typer.Option(
        None,
        "--json",
        help="Write every raw measurement and the machine description as JSON to PATH ('-' = stdout).",
        rich_help_panel=o.OUTPUT,
    ),
    plot: str = typer.Option(
        None,
        "--plot",
        help="Write a chart of the speedup by method and prompt class to PATH "
        "(.png or .svg; needs pip install 'specdec-cli\\[plot]').",
        rich_help_panel=o.OUTPUT,
    ),
    markdown: bool = typer.Option(
        False,
        "--markdown",
        help="Print the results as a Markdown table (one row per configuration) to stdout; the report goes to stderr.",
        rich_help_panel=o.OUTPUT,
    ),
    from_json: str = typer.Option(
        None,
        "--from-json",
        help="Measure nothing: report a run saved with --json (with --markdown and --plot).",
        rich_help_panel=o.OUTPUT,
    ),
    workload: str = typer.Option(
        "default",
        "--workload",
        "-w",
        help="What to measure: default, plain, auto, verify "
        "(presets of --methods, prompts and --native), predict, suffix or edits (sittings of "
        "their own; they take -n, --repeats, --k and --llama-cpp).",
        rich_help_panel=o.SPEC,
    ),
    native: str = typer.Option(
        None,
        "--native",
        help="With --llama-cpp: the native configurations, comma-separated: "
        "plain and llama-speculative-simple --spec-type names (default: plain,ngram-simple).",
        rich_help_panel=o.SPEC,
    ),
    verbose: o.Verbose = False,
) -> None:
    """Benchmark every drafting method and llama-cpp-python's prompt lookup (help: BENCH_HELP)."""
    from specdec_cli.cli.commands import bench as B
    from specdec_cli.cli.inputs import from_paths
    from specdec_cli.measure.bench import NATIVE, BenchOptions, parse_methods, parse_native
    from specdec_cli.measure.bench_workloads import OWN, PRESET, check_workload
    from specdec_cli.prompts import CLASSES, builtin

    preset = PRESET.get(check_workload(workload))
    if preset is not None:  # a preset's methods and peers; its prompts unless prompt files are given
        methods, no_peer = preset.methods, no_peer or not preset.peer
    no_peer = no_peer or workload in OWN  # a sitting of its own names its configurations itself
    options = BenchOptions(
        methods=parse_methods(methods),
        peer=not no_peer,
        k=k,
        ngram_min=ngram_min,
        ngram_max=ngram_max,
        max_tokens=max_tokens,
        repeats=repeats,
        llama_cpp=llama_cpp,
        native=parse_native(native) if native else (preset.native if preset else NATIVE),
        json_path=json_out,
        plot_path=plot,
        markdown=markdown,
    )
    if from_json:
        code = B.from_json(from_json, options=options)
    elif workload in OWN:
        code = B.execute_workload(workload, models=models, options=options)
    else:
        if prompts:
            cases = from_paths(list(prompts))
        elif preset is not None:
            cases = preset.prompts()
        elif all_builtin:
            cases = builtin()
        else:
            cases = [builtin((kind,))[0] for kind in CLASSES]
        code = B.execute(cases, models=models, options=options)
    if code:
        raise typer.Exit(code)


DOCTOR_EXAMPLES = """
[bold]Examples[/bold]

  specdec doctor                        [dim]# paste this into a bug report[/dim]
  specdec doctor --probe                [dim]# also try llama.cpp's AMX kernels now (Intel CPUs with AMX)[/dim]
  specdec doctor --json - > machine.json
  specdec doctor --measure --plot curve.png [dim]# measure the verify curve and flash attention now, draw the curve[/dim]
  SPECDEC_AMX=off specdec run p.txt     [dim]# force the safe (slower) load path[/dim]
  SPECDEC_FLASH_ATTN=on specdec serve   [dim]# flash attention on, whatever was measured[/dim]
"""  # noqa: E501  (the [dim] markup is not printed: the lines people see fit)


@app.command(epilog=DOCTOR_EXAMPLES)
def doctor(
    json_out: str = typer.Option(
        None, "--json", help="Write the report as JSON to PATH ('-' = stdout).", rich_help_panel=o.OUTPUT
    ),
    probe: bool = typer.Option(
        False,
        "--probe",
        help="If this llama.cpp has AMX kernels and they were never tried "
        "on this CPU, try them now in a child process (a few seconds).",
    ),
    measure: bool = typer.Option(
        False,
        "--measure",
        help="Measure the verify curve (ms of one target pass by batch "
        "size) of the default model now, and time flash attention on, off and phased (where "
        "this build can switch it) at 2,048 tokens of context; keep both (about two minutes; "
        "otherwise the first run measures the curve, and flash attention is phased where the "
        "build can switch it on a CPU, else llama.cpp's default).",
    ),
    plot: str = typer.Option(
        None,
        "--plot",
        help="Draw the verify curves to PATH (.png or .svg; needs pip install 'specdec-cli\\[plot]').",
        rich_help_panel=o.OUTPUT,
    ),
    target: o.Target = None,
    gpu_layers: o.GpuLayers = -1,
) -> None:
    """Show what this machine and its llama.cpp look like: versions, which llama.cpp build (PyPI's stock one or
    specdec's patched one: specdec install-llama-cpp), llama.cpp's system info, GPU offload (the backend, its devices
    and their memory, the layers a model would offload), threads, AMX, and how models will be loaded. Paste it into a
    bug report. --target: the model --measure times and the GPU lines size (default: the catalog's default target,
    else the smallest downloaded model).

    On Intel CPUs with AMX, a llama.cpp built by GCC < 13 without the patch `make` applies
    (specdec install-llama-cpp) crashes on the first decode in its AMX kernels (llama.cpp issue 20824). specdec
    tries them once in a child process and, where they crash, loads models with llama.cpp's extra buffer types off
    (slower, never a crash). SPECDEC_AMX=keep or off forces either choice. Flash attention: SPECDEC_FLASH_ATTN=on,
    off or phased when set; else as --measure chose; else phased (on for prefill, off for verify passes at long
    contexts) where this build can switch it between passes and runs on the CPU; else llama.cpp's default.
    """
    from specdec_cli.cli.commands.doctor import execute

    code = execute(json_path=json_out, probe=probe, measure=measure, plot=plot, target=target, gpu_layers=gpu_layers)
    if code:
        raise typer.Exit(code)


INSTALL_LLAMA_CPP_EXAMPLES = """
[bold]Examples[/bold]

  specdec install-llama-cpp --dry-run   [dim]# the backend and why, what it would do, what it costs[/dim]
  specdec install-llama-cpp             [dim]# Metal on Apple Silicon, CUDA with nvcc and a GPU, else CPU[/dim]
  specdec install-llama-cpp --backend cuda     [dim]# CUDA even where no driver answers (a container, say)[/dim]
  specdec install-llama-cpp --backend vulkan   [dim]# Vulkan (its SDK and glslc installed)[/dim]
  specdec install-llama-cpp --amx off   [dim]# x86: AMX compiled out instead[/dim]
  CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=89" specdec install-llama-cpp   [dim]# extra CMake flags, after ours[/dim]
  specdec doctor                        [dim]# then: "llama.cpp build: specdec's patched build"[/dim]

[bold]Exit codes[/bold]: 0 installed (or nothing to do), 2 a bad option, 8 the build failed (the lines above say why)
"""


@app.command("install-llama-cpp", epilog=INSTALL_LLAMA_CPP_EXAMPLES)
def install_llama_cpp(
    amx: str = typer.Option(
        "auto",
        "--amx",
        help="x86 CPUs with AMX: auto = build the AMX kernels with the patch "
        "that makes them run; off = compile AMX out. Elsewhere nothing changes.",
    ),
    backend: str = typer.Option(
        "auto",
        "--backend",
        help="llama.cpp's backend: auto (Metal on macOS on Apple "
        "Silicon, llama-cpp-python's default there; CUDA where nvcc is found and nvidia-smi "
        "lists a GPU; else the CPU), cpu, metal, cuda or vulkan.",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Say which backend and why, what would be done and what it costs; change nothing."
    ),
) -> None:
    """Build specdec's patched llama-cpp-python for this machine and install it into the Python specdec runs on.

    pip, pipx and uv install PyPI's stock llama-cpp-python. The patched build adds a flash-attention switch (flash
    attention on for prefill, off for long verify passes) and, on Intel CPUs with AMX, the fix that makes
    llama.cpp's AMX kernels run (llama.cpp issue 20824; a stock build there crashes or falls back to slower loading). It
    compiles the pinned sdist (0.3.36) with the patches shipped in this package, for the GPU it finds (--backend):
    minutes and some temporary disk the first time (it says how much before it starts); the wheel is kept in
    ~/.cache/specdec/wheels (SPECDEC_WHEELS), so another environment on this machine installs it in seconds.
    CMAKE_ARGS is appended to the build's CMake flags. Needs a C and C++ compiler (Windows: Visual Studio's C++ build
    tools); no bash, no make.
    """
    from specdec_cli.cli.commands.install_llama_cpp import execute
    from specdec_cli.errors import UsageError
    from specdec_cli.models.build import BACKENDS

    if amx not in ("auto", "off"):
        raise UsageError(f"--amx {amx!r} is not a choice.", "Use --amx auto or --amx off.")
    if backend not in BACKENDS:
        raise UsageError(f"--backend {backend!r} is not a choice.", f"Use one of: {', '.join(BACKENDS)}.")
    code = execute(amx=amx, dry_run=dry_run, backend=backend)
    if code:
        raise typer.Exit(code)


LEARN_EXAMPLES = """
[bold]Examples[/bold]

  specdec learn .                                 [dim]# this repository's tracked files (.gitignore honoured)[/dim]
  specdec learn ~/code/app --include '*.py' --include '*.md'   [dim]# only these[/dim]
  specdec learn ~/code/app --exclude 'tests/data/*' --name app
  specdec learn .                                 [dim]# again later: only changed files are tokenized again[/dim]
  specdec learn --list                            [dim]# every corpus: files, tokens, size on disk[/dim]
  specdec learn --forget ~/code/app/secrets.py    [dim]# or a corpus's name: forget it all[/dim]
  specdec run q.txt --corpus off                  [dim]# one run without it[/dim]
"""


@app.command(epilog=LEARN_EXAMPLES)
def learn(
    paths: list[Path] = typer.Argument(None, help="Folders and files to learn.", show_default=False),
    target: o.Target = None,
    name: str = typer.Option(
        None, "--name", help="The corpus's name (default: the git work tree's or the folder's name)."
    ),
    include: list[str] = typer.Option(
        None,
        "--include",
        help="Only files matching this glob (repeatable; "
        "matched against the path relative to the folder, or the file name).",
    ),
    exclude: list[str] = typer.Option(None, "--exclude", help="Leave out files matching this glob (repeatable)."),
    max_tokens: int = typer.Option(
        20_000_000,
        "--max-tokens",
        min=1,
        help="Size cap of the corpus, in tokens (7 bytes on disk each); files past it are skipped and counted.",
    ),
    max_file_bytes: int = typer.Option(
        1_000_000, "--max-file-bytes", min=1, help="Files larger than this are skipped as huge."
    ),
    list_: bool = typer.Option(False, "--list", help="List the corpora learnt: files, tokens, size, roots."),
    forget: str = typer.Option(
        None, "--forget", metavar="PATH|NAME", help="Forget the files learnt under PATH, or the whole corpus NAME."
    ),
) -> None:
    """Learn your code and documents once, so --method auto drafts from them before you ever paste them.

    Inside a git work tree it reads the tracked files (and new ones .gitignore does not exclude); elsewhere every
    file. Binary, huge and generated files are skipped and counted. The files are tokenized with the target's
    tokenizer into an index kept beside the suffix store (one per tokenizer and name, 7 bytes a token,
    memory-mapped). Run it again after changes: only the files that changed are tokenized, and deleted files are
    forgotten.
    """
    from specdec_cli.cli.commands.learn import execute
    from specdec_cli.learn import LearnOptions

    options = LearnOptions(
        name=name,
        include=tuple(include or ()),
        exclude=tuple(exclude or ()),
        max_tokens=max_tokens,
        max_file_bytes=max_file_bytes,
    )
    code = execute(paths or [], target=target, options=options, list_=list_, forget=forget)
    if code:
        raise typer.Exit(code)


SERVE_EXAMPLES = """
[bold]Examples[/bold]

  specdec serve                                   [dim]# default pair on http://127.0.0.1:8000/v1[/dim]
  specdec serve -t smollm2-135m --method suffix --port 0   [dim]# a free port; the URL is printed[/dim]
  specdec serve --host 0.0.0.0 --api-key-file ~/.specdec-key   [dim]# other machines too, Bearer key required[/dim]
  specdec serve --learn ~/code/app                [dim]# learns the repository in the background, drafts from it[/dim]
  specdec serve --parallel 2 --ctx 16384          [dim]# two lanes (an editor and an agent), less KV memory[/dim]
  ANTHROPIC_BASE_URL=http://127.0.0.1:8000 ANTHROPIC_API_KEY=unused claude -p "fix the bug in bug.py" \\
       --permission-mode acceptEdits              [dim]# Claude Code (docs/clients/claude-code.md)[/dim]
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "any", "messages": [{"role": "user", "content": "Hi"}]}'

[bold]From Python[/bold]: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused").chat.completions.create(...)
"""


@app.command(epilog=SERVE_EXAMPLES)
@o.grouped
def serve(
    target: o.Target = None,
    draft: o.DraftModel = None,
    spec: SpecOptions = o.group(_spec_options),
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help="Address to listen on (0.0.0.0: every interface; then give a key, or --insecure-no-api-key).",
        rich_help_panel="Server",
    ),
    port: int = typer.Option(
        8000,
        "--port",
        "-p",
        min=0,
        max=65535,
        help="TCP port (0 = a free one; the URL actually bound is printed).",
        rich_help_panel="Server",
    ),
    api_key: str = typer.Option(
        None,
        "--api-key",
        help="Require `Authorization: Bearer KEY` (or `x-api-key`) on "
        "/v1 routes (401 otherwise). Other users of this machine can read a command line: "
        "prefer --api-key-file or SPECDEC_SERVE_KEY.",
        rich_help_panel="Server",
    ),
    api_key_file: Path = typer.Option(
        None,
        "--api-key-file",
        help="Read the key from this file; one key per line "
        "(one per client: each key's conversations are cached apart).",
        rich_help_panel="Server",
    ),
    insecure_no_api_key: bool = typer.Option(
        False,
        "--insecure-no-api-key",
        help="Serve a --host other than loopback without a key: anyone who reaches the port uses the model.",
        rich_help_panel="Server",
    ),
    allowed_host: list[str] = typer.Option(
        [],
        "--allowed-host",
        help="Also answer requests for this Host name "
        "(repeatable; * = any). A loopback server answers only localhost, "
        "127.0.0.1 and [::1] otherwise: web pages cannot reach it by DNS "
        "rebinding.",
        rich_help_panel="Server",
    ),
    cors_origin: list[str] = typer.Option(
        [],
        "--cors-origin",
        help="Let browser pages of this origin use the "
        "server (repeatable; e.g. http://localhost:*; * = any). None by default: "
        "a request with an Origin header gets 403.",
        rich_help_panel="Server",
    ),
    timeout: float = typer.Option(
        1800,
        "--timeout",
        min=1,
        help="Seconds one request may hold the model (its prefill and reply) before it is stopped with 408.",
        rich_help_panel="Server",
    ),
    max_connections: int = typer.Option(
        128,
        "--max-connections",
        min=1,
        max=100_000,
        help="Open connections at once; beyond: 503.",
        rich_help_panel="Server",
    ),
    save_interval: float = typer.Option(
        300,
        "--save-interval",
        min=1,
        help="Save what was learnt (the suffix "
        "store, --k auto) this many seconds after the last save once a request was "
        "served (between two requests, or at once when idle), and after every 16 "
        "requests.",
        rich_help_panel="Server",
    ),
    queue: int = typer.Option(
        16,
        "--queue",
        min=0,
        max=100_000,
        help="Requests that may wait while every lane "
        "is busy (interactive ones first, then in arrival order); beyond it: 429.",
        rich_help_panel="Server",
    ),
    parallel: int = typer.Option(
        o.SERVE_PARALLEL,
        "--parallel",
        "-np",
        min=1,
        max=64,
        help="Requests generated at "
        "once (slots, llama-server's -np): an editor's completions while an agent works. "
        "One loop serves them all: each step it plans every slot's verify rows and prompt "
        "chunks (interactive requests first) and evaluates them in one llama_decode call "
        "(each slot has a KV stream of its own, so slots of equal rows share a call and the "
        "others get one per row count); each slot has its own --ctx of KV cache "
        "(Qwen2.5-Coder-1.5B: 28 KB a token, so 4 x 32768 = 3.7 GB, allocated at start; "
        "/health and the start-up line say how much). 1: one at a time.",
        rich_help_panel="Server",
    ),
    learn: list[Path] = typer.Option(
        None,
        "--learn",
        metavar="PATH",
        help="Learn PATH (as specdec learn does: "
        "only what changed) in the background at start-up; requests are served "
        "meanwhile, and drafted from it once it is learnt. Repeatable.",
        rich_help_panel=o.SPEC,
    ),
    max_tokens: int = typer.Option(
        None,
        "--max-tokens",
        "-n",
        min=1,
        max=1 << 20,
        help="Tokens per reply when a request sets no max_tokens (never more than the context). [default: 4096]",
        rich_help_panel=o.SAMPLING,
    ),
    temperature: o.Temperature = None,
    top_k: o.TopK = None,
    top_p: o.TopP = None,
    min_p: o.MinP = None,
    seed: o.Seed = None,
    ctx: int = typer.Option(
        o.SERVE_CTX,
        "--ctx",
        min=64,
        max=1 << 20,
        help="Context window in tokens: coding "
        "agents' prompts (Claude Code, Codex) are 6k-25k tokens; the KV cache takes ~28 KB a "
        "token for Qwen2.5-Coder-1.5B (0.9 GB at 32768).",
        rich_help_panel=o.MODELS,
    ),
    models: ModelOptions = o.group(_model_options),  # --target, --draft and --ctx declared above
    verbose: o.Verbose = False,
) -> None:
    """Serve OpenAI's API (chat and text completions) and Anthropic's Messages API (Claude Code) locally, with
    speculative decoding that learns from the traffic.

    One model pair is loaded and --parallel requests (4 by default) generate at once, each in a lane of its own: their
    verify passes and prompt pieces share one forward pass, interactive requests (FIM, short replies, deadlines) go
    first, and each lane's K is chosen with the others' rows priced on the verify curve. A request goes to the lane
    whose KV cache shares the longest prefix with it, so a resent conversation evaluates only its new tokens (a long one
    is parked in memory while a side request runs, and swapped back for its next turn); the suffix
    store and --k auto learn across requests and are saved as it serves (every 16 requests or --save-interval
    seconds) and when it stops (Ctrl-C or SIGTERM: the current step or prompt chunk finishes, exit 0). Responses
    carry OpenAI's usage and a `specdec` field with the speculation statistics;
    the `prediction` field (predicted outputs) is accepted. A request that leaves sampling out gets what its API
    documents (OpenAI's and Anthropic's temperature 1) unless a sampling option is given here: then that value. A
    reply without max_tokens stops at --max-tokens (4096 unless given), and none is longer than --max-tokens when it
    is given. One log line per request goes to stderr. Needs pip install 'specdec-cli[serve]'.

    Protected by default: it listens on 127.0.0.1, answers only local Host names (no DNS rebinding) and no browser
    origin (--allowed-host, --cors-origin open it), stops a request after --timeout, closes slow connections, and
    refuses to serve another --host without a key (--api-key-file, SPECDEC_SERVE_KEY; or --insecure-no-api-key).
    """
    from specdec_cli.cli.commands.serve import Access, execute, require_extra, server_key

    require_extra()  # one line with the pip command when the serve extra is missing
    from specdec_cli.server.request import Defaults

    code = execute(
        models=replace(models, lanes=parallel),
        spec=spec,
        defaults=Defaults(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, max_tokens=max_tokens
        ),
        host=host,
        port=port,
        api_key=server_key(api_key, api_key_file),
        queue=queue,
        access=Access(
            allowed_hosts=tuple(allowed_host),
            cors_origins=tuple(cors_origin),
            insecure_no_api_key=insecure_no_api_key,
            timeout=timeout,
            max_connections=max_connections,
            save_interval=save_interval,
        ),
        learn=tuple(learn or ()),
    )
    if code:
        raise typer.Exit(code)


def _mount_subcommands() -> None:
    from specdec_cli.cli.commands.cache import cache_app
    from specdec_cli.cli.commands.models import models_app

    app.add_typer(models_app, name="models", help="List and fetch the models in models.toml.")
    app.add_typer(
        cache_app,
        name="cache",
        help="The suffix drafter's stores of past outputs and the prompt cache (stats "
        "also lists the corpora specdec learn made).",
    )


def _reflow(doc: str | None) -> str | None:
    """Join the hard-wrapped lines of each docstring paragraph, so the terminal wraps help text at its own width."""
    if not doc:
        return doc
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def _reflow_help(typer_app: typer.Typer) -> None:
    for command in typer_app.registered_commands:
        if command.callback is not None:
            command.callback.__doc__ = _reflow(command.callback.__doc__)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _reflow_help(group.typer_instance)


_mount_subcommands()
_reflow_help(app)
