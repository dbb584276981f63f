"""Options shared by several commands, as `Annotated` aliases (one definition, one help text), and option groups
(`group`, `grouped`): one command parameter standing for several options and receiving the object they build.

Only command-line things live here; the domain types and their parsers (`Method`, K) are `specdec_cli.spec`'s."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar, cast

import typer

from specdec_cli.errors import UsageError
from specdec_cli.spec import METHOD_NAMES, Method, parse_method


def _method_option(text: str | Method) -> Method:
    """`--method`'s parser: `spec.parse_method`, its ValueError shown as Typer's usage error (exit 2)."""
    try:
        return parse_method(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


MODELS = "Models"
SPEC = "Speculation"
SAMPLING = "Sampling"
OUTPUT = "Output"


def _sampling(*flags: str, **kwargs: Any) -> Any:
    """A `typer.Option` shown in --help's Sampling panel."""
    return typer.Option(*flags, rich_help_panel=SAMPLING, **kwargs)


Target = Annotated[
    str | None,
    typer.Option(
        "--target",
        "-t",
        help="Target model: a name from models.toml, a path to a .gguf file, or a "
        "Hugging Face repo (owner/repo[:QUANT], hf.co/owner/repo[:QUANT]; fetched and verified once). "
        "[default: the catalog's default target]",
        rich_help_panel=MODELS,
    ),
]
DraftModel = Annotated[
    str | None,
    typer.Option(
        "--draft",
        "-d",
        help="Draft model: a name, a .gguf path or owner/repo[:QUANT]. --method auto "
        "includes it only where "
        "it pays (a GPU build) unless named here. [default: the catalog's draft for the target]",
        rich_help_panel=MODELS,
    ),
]
Ctx = Annotated[
    int, typer.Option("--ctx", min=64, max=1 << 20, help="Context window in tokens.", rich_help_panel=MODELS)
]
Threads = Annotated[
    int | None,
    typer.Option(
        "--threads",
        min=1,
        max=1024,
        help="CPU threads. [default: every usable CPU; the performance cores on Apple Silicon]",
        rich_help_panel=MODELS,
    ),
]
GpuLayers = Annotated[
    int,
    typer.Option(
        "--gpu-layers",
        min=-1,
        envvar="SPECDEC_GPU_LAYERS",
        help="Layers to offload with a Metal/CUDA "
        "build of llama-cpp-python (-1 = all that fit in the GPU's free memory; CPU builds ignore it).",
        rich_help_panel=MODELS,
    ),
]
MethodOpt = Annotated[
    Method,
    typer.Option(
        "--method",
        "-m",
        parser=_method_option,
        metavar="METHOD",
        help=f"Where drafts come from: {METHOD_NAMES}. auto: each step the "
        "source that pays on this machine (prompt lookup, past outputs, "
        "--predict, the code `specdec learn` indexed, a draft model on GPUs) "
        "or none.",
        rich_help_panel=SPEC,
    ),
]
CorpusOpt = Annotated[
    str,
    typer.Option(
        "--corpus",
        metavar="NAME|auto|off",
        help="--method auto also drafts from "
        "the code `specdec learn` indexed: auto = every corpus learnt for this "
        "model's tokenizer, a name = that one, off = none.",
        rich_help_panel=SPEC,
    ),
]
NoPromptCache = Annotated[
    bool,
    typer.Option(
        "--no-prompt-cache",
        help="Neither restore nor save prompts' KV states (the prompt cache in "
        "$SPECDEC_CACHE/prompts: a later run on the same long prompt starts in a second).",
        rich_help_panel=MODELS,
    ),
]
Predict = Annotated[
    str | None,
    typer.Option(
        "--predict",
        help="A file with the output you expect (e.g. the file you asked to edit): drafted "
        "from, never evaluated, so its length does not matter (predicted outputs). '-' = stdin.",
        rich_help_panel=SPEC,
    ),
]


def _k_option(default: str = ""):
    """--k, its help ending with `default` where the command's default needs saying."""
    return typer.Option(
        "--k",
        "-k",
        help="Draft length K: 'auto' (chosen each step from measured costs) or a fixed number 0-64." + default,
        rich_help_panel=SPEC,
    )


K = Annotated[
    str | None,
    _k_option(
        " [default: the setting `specdec tune --save` found best for these models, method and machine, else auto]"
    ),
]
KAuto = Annotated[str, _k_option()]  # a fixed default: auto
NgramMin = Annotated[
    int, typer.Option("--ngram-min", min=1, max=16, help="Shortest n-gram prompt lookup matches.", rich_help_panel=SPEC)
]
NgramMax = Annotated[
    int, typer.Option("--ngram-max", min=1, max=32, help="Longest n-gram prompt lookup matches.", rich_help_panel=SPEC)
]
Temperature = Annotated[
    float,
    _sampling(
        "--temperature",
        "--temp",
        min=0.0,
        max=5.0,
        help="0 = greedy. Above 0, the target's distribution is kept exactly (rejection sampling, or keyed by --seed).",
    ),
]
TopK = Annotated[int, _sampling("--top-k", min=0, help="Keep the k most likely tokens (0 = off).")]
TopP = Annotated[float, _sampling("--top-p", min=0.0, max=1.0, help="Nucleus sampling (1.0 = off).")]
MinP = Annotated[
    float,
    _sampling("--min-p", min=0.0, max=1.0, help="Drop tokens below min-p × the top probability (0 = off)."),
]
Seed = Annotated[
    int | None,
    _sampling("--seed", help="Seed of the random stream: the same seed gives the same text, speculative or not."),
]
MaxTokens = Annotated[
    int,
    _sampling("--max-tokens", "-n", min=1, max=1 << 20, help="Stop after this many tokens."),
]
Stop = Annotated[
    list[str] | None,
    _sampling("--stop", help="Stop string (repeatable); not included in the output."),
]
System = Annotated[str | None, typer.Option("--system", help="System prompt for the chat template.")]
Raw = Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the model's chat template.")]
Plain = Annotated[
    bool, typer.Option("--plain", help="No colours: print only the generated text.", rich_help_panel=OUTPUT)
]
Clean = Annotated[
    bool,
    typer.Option(
        "--clean",
        help="Hide rejected draft tokens in the stream (shown on one line otherwise; never part of the text).",
        rich_help_panel=OUTPUT,
    ),
]
JsonOut = Annotated[
    str | None,
    typer.Option(
        "--json", help="Write the text and every statistic as JSON to PATH ('-' = stdout).", rich_help_panel=OUTPUT
    ),
]
COMPARE_PAIRS = 3  # `--compare` without a number
IdleBaseline = Annotated[
    bool,
    typer.Option(
        "--idle-baseline",
        help="Before the run, measure a second of idle power from the same energy counters; the "
        "energy per token is then also given net of it (docs/energy.md).",
        rich_help_panel=OUTPUT,
    ),
]
Compare = Annotated[
    int,
    typer.Option(
        "--compare",
        metavar="[N]",
        min=0,
        help=f"Then measure the speedup over plain decoding in this process: after an untimed warm-up, N pairs "
        f"(default {COMPARE_PAIRS}) of this run replayed and plain decoding, interleaved, the order alternating; "
        f"prints the median speedup with its min-max, and how much of the output agrees.",
        rich_help_panel=OUTPUT,
    ),
]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's log.", rich_help_panel=OUTPUT)]
PromptDir = Annotated[list[Path] | None, typer.Argument(help="Prompt files or directories.")]
PromptFile = Annotated[str, typer.Argument(help="Prompt file (UTF-8 text), or - to read standard input.")]

STRUCTURE = "Structured output"
JsonObject = Annotated[
    bool,
    typer.Option(
        "--json-object",
        help="Constrain the reply to one JSON object (any keys), as OpenAI's response_format json_object.",
        rich_help_panel=STRUCTURE,
    ),
]
JsonSchema = Annotated[
    str | None,
    typer.Option(
        "--json-schema",
        metavar="FILE",
        help="Constrain the reply to JSON valid against the JSON Schema in FILE.",
        rich_help_panel=STRUCTURE,
    ),
]
GrammarFile = Annotated[
    str | None,
    typer.Option(
        "--grammar",
        metavar="FILE",
        help="Constrain the reply to the "
        "grammar in FILE: Lark (llguidance's dialect, `start:` first) or "
        "GBNF (llama.cpp's, `root ::=`).",
        rich_help_panel=STRUCTURE,
    ),
]
JsonLayoutOpt = Annotated[
    str,
    typer.Option(
        "--json-layout",
        help="How JSON is laid out with --json-object and "
        "--json-schema. inline: one line, ', ' and ': ' between items, so every "
        "key is forced and drafted free; free: any whitespace, as the model "
        "likes (keys after a newline are not forced).",
        rich_help_panel=STRUCTURE,
    ),
]
Logprobs = Annotated[
    int | None,
    typer.Option(
        "--logprobs",
        min=0,
        max=20,
        metavar="N",
        help="With --json: each "
        "emitted token's log-probability and its N most likely alternatives "
        "(0-20), read from the verify passes (no extra pass).",
        rich_help_panel=OUTPUT,
    ),
]


def grammar_option(
    json_object: JsonObject = False,
    json_schema: JsonSchema = None,
    grammar: GrammarFile = None,
    json_layout: JsonLayoutOpt = "inline",
):
    """The `constraint.Grammar` that --json-object, --json-schema FILE or --grammar FILE asks for (None: free text),
    read and validated before any model loads.

    Raises:
        UsageError: more than one of them, or an unknown --json-layout. GrammarError: a bad schema or grammar.
    """
    from specdec_cli.core import constraint

    given = [
        flag
        for flag, on in (
            ("--json-object", json_object),
            ("--json-schema", json_schema is not None),
            ("--grammar", grammar is not None),
        )
        if on
    ]
    if len(given) > 1:
        raise UsageError(
            f"{' and '.join(given)} both constrain the reply; give one.",
            'A JSON schema with {"type": "object"} is --json-object.',
        )
    if json_layout not in constraint.LAYOUTS:
        raise UsageError(
            f"--json-layout {json_layout!r} is not a layout.", f"Use one of: {', '.join(constraint.LAYOUTS)}."
        )
    layout = cast(constraint.JsonLayout, json_layout)
    if json_object:
        return constraint.json_object(layout=layout)
    if json_schema is not None:
        return constraint.load(json_schema, "json-schema", layout=layout)
    if grammar is not None:
        return constraint.load(grammar, "grammar")
    return None


@dataclass(frozen=True)
class Group:
    """The default of a command parameter that stands for several options: `build`'s parameters (option aliases),
    less `omit` (`build` gets their defaults), with `defaults` replacing some of their defaults. See `grouped`."""

    build: Callable[..., Any]
    omit: tuple[str, ...] = ()
    defaults: Mapping[str, Any] | None = None


def group(build: Callable[..., Any], *, omit: tuple[str, ...] = (), **defaults: Any) -> Any:
    """A `Group` for a command parameter's default: `models: ModelOptions = group(build, ctx=8192)`."""
    unknown = (set(omit) | set(defaults)) - set(inspect.signature(build).parameters)
    assert not unknown, f"{build.__name__} has no parameters {sorted(unknown)}"
    return Group(build, omit, defaults)


Command = TypeVar("Command", bound=Callable[..., Any])


def grouped(command: Command) -> Command:
    """Decorator (below `app.command`): each parameter of `command` whose default is a `group` is replaced, in the
    signature Typer reads, by its builder's parameters, so the options keep their place in `--help`; the command then
    receives what the builder returns. A builder parameter the command declares itself stays where the command
    declares it (its own type, default and help) and is passed to the builder as well."""
    signature = inspect.signature(command, eval_str=True)
    declared = set(signature.parameters)
    params: list[inspect.Parameter] = []
    groups: dict[str, tuple[Callable[..., Any], list[str]]] = {}
    for param in signature.parameters.values():
        if not isinstance(param.default, Group):
            params.append(param)
            continue
        g = param.default
        members = [p for p in inspect.signature(g.build, eval_str=True).parameters.values() if p.name not in g.omit]
        groups[param.name] = (g.build, [p.name for p in members])
        defaults = g.defaults or {}
        params += [p.replace(default=defaults.get(p.name, p.default)) for p in members if p.name not in declared]

    @functools.wraps(command)
    def call(**kwargs: Any) -> Any:
        for name, (build, members) in groups.items():
            kwargs[name] = build(**{m: kwargs[m] if m in declared else kwargs.pop(m) for m in members})
        return command(**kwargs)

    call.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    call.__annotations__ = {p.name: p.annotation for p in params}
    return cast(Command, call)


OPTIONAL_VALUES = {"--compare": COMPARE_PAIRS}  # options whose number may be left out


def expand_optional_values(argv: list[str]) -> list[str]:
    """`--compare` alone means `--compare 3`: an option of `OPTIONAL_VALUES` not followed by a whole number gets its
    default (Typer has no options with an optional value). `--compare 5` and `--compare=5` pass as they are."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg in OPTIONAL_VALUES and not (i + 1 < len(argv) and argv[i + 1].isdigit()):
            arg = f"{arg}={OPTIONAL_VALUES[arg]}"
        out.append(arg)
    return out


SERVE_PARALLEL = 4  # lanes: an editor and an agent (and two more) at once; 4 x 32768 tokens of KV = 3.7 GB for 1.5B
SERVE_CTX = 32768  # holds a coding agent's prompt (Claude Code's ~20k tokens) and its reply; llama-server's -c in the
# benchmarks. Every other command keeps 4096.
