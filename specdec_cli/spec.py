"""What a generation is asked to be: which models (`ModelOptions`) and how to speculate (`SpecOptions`: the
`Method`, K, whether K came from the user). Built and validated once, by whichever front end parsed the request
(the CLI's options, a server's flags); everything below reads these types and never re-parses them.

No typer here: the CLI's `Annotated` options (`specdec_cli.cli.options`) wrap these parsers, and turn their
ValueError into Typer's usage error.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from specdec_cli.core.cost_model import K_LIMIT
from specdec_cli.errors import UsageError


class Method(StrEnum):
    """How drafts are made (`SpecOptions.method`). A StrEnum: it prints, formats and serialises as its value."""

    auto = "auto"  # every step, whatever pays here: prompt lookup, the suffix store, a prediction, a draft model
    none = "none"  # plain decoding through the same engine (the baseline)
    draft = "draft"  # a small draft model
    mtp = "mtp"  # the target's own MTP block (multi-token prediction), where the model has one
    ngram = "ngram"  # prompt lookup
    suffix = "suffix"  # suffix tree over the context and past outputs (learns)
    predict = "predict"  # the predicted output (--predict FILE) alone

    @classmethod
    def _missing_(cls, value: object) -> Method | None:
        """Case, `_`/space for `-`, and the field's names for the sources (`METHOD_ALIASES`): `Method("prompt-lookup")`
        is `Method.ngram`. Unknown names still raise ValueError."""
        name = str(value).strip().lower().replace("_", "-").replace(" ", "-")
        name = METHOD_ALIASES.get(name, name)
        return cls._value2member_map_.get(name)  # type: ignore[return-value]


# The field's terms for each method's source (records.Source's labels), accepted wherever a method is named
# (--method, bench's --methods, chat's /method, SpecOptions); the short names stay the canonical spelling (tuned.json,
# learnt.json and bench labels are keyed by them).
METHOD_ALIASES = {
    "prompt-lookup": "ngram",
    "prompt": "ngram",
    "lookup": "ngram",
    "past-outputs": "suffix",
    "store": "suffix",
    "suffix-decoding": "suffix",
    "prediction": "predict",
    "predicted-outputs": "predict",
    "draft-model": "draft",
    "mtp-head": "mtp",
    "draft-mtp": "mtp",
    "nextn": "mtp",
    "plain": "none",
}
METHOD_NAMES = (
    "auto, none (plain), ngram (prompt-lookup), suffix (past-outputs), predict (prediction), "
    "draft (draft-model), mtp (mtp-head)"
)
NEEDS_DRAFT_MODEL = {Method.draft}  # methods that cannot run without a draft model (auto includes one where it pays)
USES_DRAFT_MODEL = {Method.draft, Method.auto}  # methods that may draft with a loaded draft model
USES_PREDICTION = {Method.auto, Method.predict}  # methods that draft from a predicted output (--predict)


def parse_method(text: str | Method) -> Method:
    """A method's name or one of its field-term aliases (`METHOD_ALIASES`). Raises ValueError whose message names
    the choices (the CLI shows it as a usage error, exit 2)."""
    try:
        return Method(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a method. Use one of {METHOD_NAMES}.") from None


# --------------------------------------------------------------------------------------------------------------
# K values

GRID = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the values a `k_values` range keeps


def parse_k(text: str) -> int | None:
    """`--k`: "auto" → None (the adaptive controller), "0".."64" → that fixed K. Raises ValueError otherwise."""
    s = text.strip().lower()
    if s == "auto":
        return None
    try:
        k = int(s)
    except ValueError:
        raise ValueError(f"--k must be 'auto' or a whole number 0..{K_LIMIT}, got {text!r}.") from None
    if not 0 <= k <= K_LIMIT:
        raise ValueError(f"--k must be between 0 and {K_LIMIT} (0 = plain decoding), got {k}.")
    return k


def parse_k_option(text: str) -> int | None:
    """`parse_k` for a command: a bad value is a UsageError that says the fix."""
    try:
        return parse_k(text)
    except ValueError as e:
        raise UsageError(str(e), "Use --k auto or a number from 0 to 64.") from None


class K(str):
    """K as asked once parsed: "auto" (the adaptive controller chooses it each step) or a fixed number "0".."64"
    (0 = plain decoding), whatever spelling came in (" AUTO", 8). A str, so it prints, compares and serialises as
    "auto" or the number (chat's status line, --json's `k`); `fixed` is the number, None for auto.

    Raises UsageError (the message says the fix) for anything else."""

    __slots__ = ()

    def __new__(cls, value: str | int = "auto") -> K:
        fixed = parse_k_option(str(value))
        return super().__new__(cls, "auto" if fixed is None else str(fixed))

    @property
    def fixed(self) -> int | None:
        """The fixed K; None for auto."""
        return None if self == "auto" else int(self)


def k_values(spec: str) -> list[int]:
    """The K values `specdec tune --k SPEC` measures, sorted and without duplicates.

    SPEC is a comma-separated list of values ("2,4,8") and ranges ("4..16"). A range keeps its two ends and the
    values of the grid 0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64 between them, because every K costs a full tune
    run and throughput changes slowly with K: "4..16" → [4, 6, 8, 12, 16], "0..4" → [0, 1, 2, 3, 4]. List the
    values to measure all of them ("4,5,6,7,8"). Every value must be 0..64. Raises ValueError otherwise.
    """
    out: set[int] = set()
    items = [p.strip() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in items):
        raise ValueError(f"--k needs values like '8', '2,4,8' or '4..16', got {spec!r}.")
    for item in items:
        if ".." in item:
            lo_s, _, hi_s = item.partition("..")
            lo, hi = _k_value(lo_s, spec), _k_value(hi_s, spec)
            if lo > hi:
                raise ValueError(f"--k range {item!r} runs backwards; write it as '{hi}..{lo}'.")
            out.update({lo, hi}, (g for g in GRID if lo <= g <= hi))
        else:
            out.add(_k_value(item, spec))
    return sorted(out)


def _k_value(text: str, spec: str) -> int:
    try:
        k = int(text.strip())
    except ValueError:
        raise ValueError(f"--k needs whole numbers like '8', '2,4,8' or '4..16', got {spec!r}.") from None
    if not 0 <= k <= K_LIMIT:
        raise ValueError(f"--k values must be between 0 and {K_LIMIT}, got {k} in {spec!r}.")
    return k


# --------------------------------------------------------------------------------------------------------------
# The options


@dataclass(frozen=True)
class ModelOptions:
    """Which models to load and how. `target`/`draft`: catalog names or .gguf paths (None = catalog default)."""

    target: str | None = None
    draft: str | None = None
    ctx: int = 4096
    threads: int | None = None
    gpu_layers: int = -1
    n_batch: int = 512
    verbose: bool = False
    prompt_cache: bool = True  # restore and save prompts' KV states across runs (`--no-prompt-cache`: off)
    lanes: int = 1  # sequences generated at once, each with `ctx` tokens of KV (`specdec serve --parallel`)


@dataclass(frozen=True)
class SpecOptions:
    """How to speculate: the drafter (`Method`; its name is accepted too) and K (`K`: "auto" or a number 0..64,
    parsed once, here; `fixed_k` is the number or None for auto).

    `k_given`: the user chose K (`--k`, chat's /k). When False, the K `specdec tune --save` found best for these
    models, method and machine applies where there is one (`tuned_k`); the default True leaves K as `k` says.

    Raises ValueError for an unknown method name, UsageError for a bad K or (`ngram`) an --ngram-min above
    --ngram-max (the message says the fix)."""

    method: Method = Method.auto
    k: K = K()
    ngram_min: int = 2
    ngram_max: int = 4
    k_max: int = 16
    k_given: bool = True
    corpus: str = "auto"  # `--corpus`: "auto" (every corpus `specdec learn` made for this tokenizer), "off", or a name

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method(self.method))
        object.__setattr__(self, "k", K(self.k))
        if self.method is Method.ngram and self.ngram_min > self.ngram_max:
            raise UsageError(f"--ngram-min {self.ngram_min} is larger than --ngram-max {self.ngram_max}.", "Swap them.")

    @property
    def fixed_k(self) -> int | None:
        """The fixed K; None for auto."""
        return self.k.fixed

    @property
    def wants_tuned_k(self) -> bool:
        """The tuned-K rule: the K saved by `specdec tune --save` applies when the user gave no K and the method
        drafts (plain decoding has no K). `assemble.tuned_k` looks it up."""
        return not self.k_given and self.method is not Method.none
