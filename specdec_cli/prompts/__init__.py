"""Built-in prompt set for `specdec tune` and `specdec bench` (prompt files and directories of your own are read by
`specdec_cli.cli.inputs.from_paths`).

Classes (the directory names): `edit` (copy-heavy code editing), `explain` (code explanation quoting its input),
`summarize`, `write` (free writing), `rewrite` (a whole ~170-line file returned with a small change: 1,000+ output
tokens, nearly all copied; give it a budget of 512+ tokens). Sources and licences: LICENSES.md beside this file.

`predict/` holds edit prompts for predicted outputs (`--predict`): `NAME_prompt.txt` asks for a whole file back with
one edit, `NAME_original.py` is that file, the prediction (`predict_cases`). `builtin` does not list them.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from specdec_cli.errors import UsageError

CLASSES = ("edit", "explain", "summarize", "write", "rewrite")


@dataclass(frozen=True)
class PromptCase:
    """One prompt: `name` (file stem), `kind` (class: one of CLASSES or the parent directory), text."""

    name: str
    kind: str
    text: str


def builtin(kinds: tuple[str, ...] = CLASSES) -> list[PromptCase]:
    """The packaged prompts of the given classes, sorted by class then name."""
    root = resources.files(__name__)
    out = []
    for kind in kinds:
        if kind not in CLASSES:
            raise UsageError(f"Unknown prompt class {kind!r}.", f"Use one of: {', '.join(CLASSES)}.")
        for entry in sorted(root.joinpath(kind).iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".txt"):
                out.append(PromptCase(entry.name[:-4], kind, entry.read_text(encoding="utf-8")))
    return out


@dataclass(frozen=True)
class PredictCase:
    """An edit prompt and its prediction: `name` (e.g. "rename"), `prompt` text, `prediction` (the original file)."""

    name: str
    prompt: str
    prediction: str


def predict_cases() -> list[PredictCase]:
    """The packaged predicted-output prompts (`predict/NAME_prompt.txt` + `predict/NAME_original.py`), by name."""
    root = resources.files(__name__).joinpath("predict")
    out = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith("_prompt.txt"):
            name = entry.name.removesuffix("_prompt.txt")
            original = root.joinpath(f"{name}_original.py").read_text(encoding="utf-8")
            out.append(PredictCase(name, entry.read_text(encoding="utf-8"), original))
    return out
