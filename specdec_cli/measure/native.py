"""The native llama.cpp peer for `specdec bench`: runs a llama.cpp build's `llama-completion` (plain decoding) and
`llama-speculative-simple` (ngram-simple / ngram-mod / draft-simple speculation) and parses what they print.

Written against the llama.cpp vendored in llama-cpp-python 0.3.36 (`vendor/llama.cpp`, built with
`cmake --build build --target llama-completion llama-speculative-simple`). The lines parsed, from stderr:

`llama-completion` (`tools/completion/completion.cpp` → `common_perf_print`, `common/sampling.cpp`)::

    common_perf_print: prompt eval time =   123.45 ms /    87 tokens (   1.42 ms per token,  704.74 tokens per second)
    common_perf_print:        eval time =  8123.45 ms /   127 runs   (  63.96 ms per token,   15.63 tokens per second)

`llama-speculative-simple` (`examples/speculative-simple/speculative-simple.cpp`)::

    encoded   87 tokens in    0.123 seconds, speed:  704.740 t/s
    decoded  128 tokens in    3.098 seconds, speed:   41.317 t/s
    n_drafted = 150
    n_accept  = 110
    accept    = 73.333%

What the numbers mean, so they compare with specdec's `tokens_per_s` (output tokens / decode-loop time):
plain `llama-completion` samples the first output token from the prompt pass, then makes one `eval` run per further
token, so decode = eval runs / eval time (the tokens those runs produced) and prefill = prompt eval time.
`llama-speculative-simple` evaluates all prompt tokens but the last as "encoded", then its decode loop starts from
the last prompt token, so "decoded N tokens" counts every output token and its time covers all of them.
`llama-speculative-simple` stops only once it has decoded *more* than `-n` tokens (one step past the budget), so we
pass it `-n n_tokens - 1`. It caps each draft to the budget left, except when that is 0 (its `n_max > 0` check in
`common_speculative_draft`): a lookup draft found at the last step or two is verified whole (ngram-simple: up to 48
tokens), so a copy-heavy run can decode more than `n_tokens` (recorded: 176 for `-n 127`). The rate stays
tokens / decode time; read `NativeResult.n_decoded` before comparing totals. `n_drafted`/`n_accept` count the draft
tokens of verified drafts (`accept` = n_accept / n_drafted).
Every stderr line carries a `M.SS.mmm.uuu I ` time/level prefix in this version; the patterns are not anchored.

The prompt is the chat-templated TEXT our engine renders (`Backend.format_chat`), written to a temporary file and
passed with `-bf` (read verbatim: `-f` would drop one trailing newline, and Qwen's template ends with
"<|im_start|>assistant\\n") and `--no-escape` (else `\\n` in quoted source code would become a newline);
`llama-completion` also gets `-no-cnv` so it does not apply the GGUF's chat template a second time. Both tools
tokenize it with `add_special=true, parse_special=true`, our session with `add_special=False, parse_special=True`:
the same ids for vocabularies that add no BOS (checked: Qwen2.5-Coder, SmolLM2 give the same counts); where the
GGUF sets `add_bos_token`, the tools prepend a BOS our chat path does not. `NativeResult.n_prompt` is the tool's own
count, for the caller to compare with ours.
Greedy: `--temp 0 --top-k 1`. Environment variables `LLAMA_ARG_*` (which llama.cpp reads as flags) are dropped.

This is the second exception to the rule "only `specdec_cli.models.llama` imports `llama_cpp`" in name only: it imports
nothing from `llama_cpp` (nor ctypes); it runs separately built binaries as subprocesses (argument lists, no shell,
stdin closed, a timeout) and reads their text output.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from specdec_cli.errors import NativeToolError, UsageError

COMPLETION = "llama-completion"
SPECULATIVE = "llama-speculative-simple"
SPEC_TYPES = ("ngram-simple", "ngram-mod", "ngram-map-k", "ngram-map-k4v", "draft-simple")
# The flag that caps one draft's length, per --spec-type (common/arg.cpp); defaults: draft 3, ngram-simple 48,
# ngram-mod 64, ngram-map-k/k4v 48.
N_MAX_FLAG = {
    "draft-simple": "--spec-draft-n-max",
    "ngram-simple": "--spec-ngram-simple-size-m",
    "ngram-mod": "--spec-ngram-mod-n-max",
    "ngram-map-k": "--spec-ngram-map-k-size-m",
    "ngram-map-k4v": "--spec-ngram-map-k4v-size-m",
}
BUILD_HINT = (
    "Build one: pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36, unpack it, then in "
    "vendor/llama.cpp run `cmake -B build -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF && "
    "cmake --build build -j2 --target llama-completion llama-speculative-simple` and pass its build/bin."
)
DEFAULT_TIMEOUT_S = 900.0

_FLOAT = r"([0-9]+(?:\.[0-9]*)?)"
_PROMPT_EVAL = re.compile(r"prompt eval time\s*=\s*" + _FLOAT + r"\s*ms\s*/\s*(\d+)\s+tokens")
_EVAL = re.compile(r":\s*eval time\s*=\s*" + _FLOAT + r"\s*ms\s*/\s*(\d+)\s+runs")
_ENCODED = re.compile(r"encoded\s+(\d+)\s+tokens in\s+" + _FLOAT + r"\s+seconds")
_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+" + _FLOAT + r"\s+seconds")
_N_DRAFTED = re.compile(r"\bn_drafted\s*=\s*(\d+)")
_N_ACCEPT = re.compile(r"\bn_accept\s*=\s*(\d+)")


@dataclass(frozen=True)
class NativeTools:
    """Paths of a llama.cpp build's two binaries."""

    completion: Path
    speculative: Path


@dataclass(frozen=True)
class NativeJob:
    """What every native run of a sitting shares: the build (`tools`), the target GGUF (`model_path`), the output
    budget (`n_tokens`, tokens), the CPU threads and the context (`ctx`, tokens)."""

    tools: NativeTools
    model_path: str | os.PathLike[str]
    n_tokens: int
    threads: int
    ctx: int


@dataclass(frozen=True)
class NativeStats:
    """What one tool printed. Times in ms / s as named; counts in tokens; draft fields None for plain decoding.

    n_prompt: prompt tokens as the tool tokenized them. prefill_ms: prompt pass time (ms).
    n_decoded: tokens produced by decode passes. decode_s: their time (s).
    n_drafted / n_accepted: draft tokens verified / accepted (speculative only).
    """

    n_prompt: int
    prefill_ms: float
    n_decoded: int
    decode_s: float
    n_drafted: int | None = None
    n_accepted: int | None = None


@dataclass(frozen=True)
class NativeResult:
    """One native run, ready for a bench table.

    name: "native plain" or "native <spec-type>". decode_tok_s: n_decoded / decode_s (tok/s, prefill excluded).
    acceptance: n_accepted / n_drafted (0..1), None when nothing was drafted or for plain decoding.
    n_prompt: the tool's prompt token count (compare with ours). text: the generated text from stdout (best effort:
    the tools print token pieces, special tokens included). command: the argument list run (the prompt file it
    names was temporary).
    """

    name: str
    decode_tok_s: float
    n_decoded: int
    decode_s: float
    n_drafted: int | None
    n_accepted: int | None
    acceptance: float | None
    prefill_ms: float | None
    n_prompt: int | None
    text: str | None
    command: tuple[str, ...]


# -- finding a build -----------------------------------------------------------------------------------------
def find_tools(directory: str | os.PathLike[str]) -> NativeTools:
    """The binaries in `directory`, or in its `bin/`, `build/bin/` (a llama.cpp checkout or its build dir).

    Raises UsageError (one line with the fix) when the directory does not exist or lacks either binary.
    """
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise UsageError(f"--llama-cpp {directory}: no such directory.", BUILD_HINT)
    for d in (root, root / "bin", root / "build" / "bin"):
        comp, spec = d / COMPLETION, d / SPECULATIVE
        if _is_exe(comp) and _is_exe(spec):
            return NativeTools(comp.resolve(), spec.resolve())
    missing = [
        n
        for n in (COMPLETION, SPECULATIVE)
        if not any(_is_exe(d / n) for d in (root, root / "bin", root / "build" / "bin"))
    ]
    raise UsageError(
        f"--llama-cpp {directory}: no executable {' or '.join(missing)} in it, bin/ or build/bin/.", BUILD_HINT
    )


def _is_exe(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


# -- parsing -------------------------------------------------------------------------------------------------
def parse_completion(stderr_text: str) -> NativeStats:
    """Prefill and decode timing from `llama-completion`'s stderr (its `common_perf_print` lines).

    Raises NativeToolError when either line is missing (the tool failed, or prints another format).
    """
    pe = _last(_PROMPT_EVAL, stderr_text)
    ev = _last(_EVAL, stderr_text)
    if pe is None or ev is None:
        raise _unparsed(COMPLETION, "prompt eval time / eval time", stderr_text)
    return NativeStats(
        n_prompt=int(pe.group(2)),
        prefill_ms=float(pe.group(1)),
        n_decoded=int(ev.group(2)),
        decode_s=float(ev.group(1)) / 1000.0,
    )


def parse_speculative(stderr_text: str) -> NativeStats:
    """Prefill, decode and draft counts from `llama-speculative-simple`'s stderr.

    Raises NativeToolError when the encoded / decoded / n_drafted / n_accept lines are missing.
    """
    enc = _last(_ENCODED, stderr_text)
    dec = _last(_DECODED, stderr_text)
    drafted = _last(_N_DRAFTED, stderr_text)
    accepted = _last(_N_ACCEPT, stderr_text)
    if enc is None or dec is None or drafted is None or accepted is None:
        raise _unparsed(SPECULATIVE, "encoded / decoded / n_drafted / n_accept", stderr_text)
    return NativeStats(
        n_prompt=int(enc.group(1)),
        prefill_ms=float(enc.group(2)) * 1000.0,
        n_decoded=int(dec.group(1)),
        decode_s=float(dec.group(2)),
        n_drafted=int(drafted.group(1)),
        n_accepted=int(accepted.group(1)),
    )


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    matches = list(pattern.finditer(text))
    return matches[-1] if matches else None


def _unparsed(tool: str, lines: str, stderr_text: str) -> NativeToolError:
    tail = next((ln.strip() for ln in reversed(stderr_text.splitlines()) if ln.strip()), "(no output)")
    return NativeToolError(
        f"{tool} printed no {lines} line (last line: {tail[:200]!r}).",
        "Use a llama.cpp build of the version llama-cpp-python 0.3.36 vendors, or run the command by hand.",
    )


# -- command lines -------------------------------------------------------------------------------------------
def _common_args(job: NativeJob, prompt_file: str, n_predict: int) -> list[str]:
    return [
        "-m",
        str(job.model_path),
        "-bf",
        prompt_file,  # verbatim prompt (no trailing-newline strip)
        "--no-escape",  # no \n processing inside the prompt
        "-n",
        str(n_predict),
        "-t",
        str(job.threads),
        "-tb",
        str(job.threads),
        "-c",
        str(job.ctx),
        "--temp",
        "0",
        "--top-k",
        "1",  # greedy
        "--seed",
        "0",
    ]


def completion_command(job: NativeJob, prompt_file: str, schema_file: str | None = None) -> list[str]:
    """The `llama-completion` argument list: plain greedy decoding of `job.n_tokens`, no chat template, no prompt
    echo; constrained by the JSON schema in `schema_file` when given (`-jf`: llama.cpp's own schema-to-grammar)."""
    return [
        str(job.tools.completion),
        *_common_args(job, prompt_file, job.n_tokens),
        "-no-cnv",
        "--no-display-prompt",
        *(("-jf", schema_file) if schema_file is not None else ()),
    ]


def speculative_command(
    job: NativeJob,
    prompt_file: str,
    *,
    spec_type: str = "ngram-simple",
    draft_model: Path | None = None,
    n_max: int | None = None,
) -> list[str]:
    """The `llama-speculative-simple` argument list (`-n job.n_tokens - 1`: see the module docstring).

    n_max: longest draft (tokens), through the spec type's own flag (`N_MAX_FLAG`); None = the tool's default.
    Raises UsageError for an unknown spec type, or draft-simple without a draft model.
    """
    if spec_type not in SPEC_TYPES:
        raise UsageError(f"Unknown llama.cpp --spec-type {spec_type!r}.", f"Use one of: {', '.join(SPEC_TYPES)}.")
    if (spec_type == "draft-simple") != (draft_model is not None):
        raise UsageError(
            "llama.cpp draft-simple needs a draft model, and only it takes one.",
            "Pass draft_model with spec_type='draft-simple'.",
        )
    cmd = [
        str(job.tools.speculative),
        *_common_args(job, prompt_file, max(job.n_tokens - 1, 0)),
        "--spec-type",
        spec_type,
    ]
    if draft_model is not None:
        cmd += ["-md", str(draft_model), "-td", str(job.threads), "-tbd", str(job.threads)]
    if n_max is not None:
        cmd += [N_MAX_FLAG[spec_type], str(n_max)]
    return cmd


# -- running -------------------------------------------------------------------------------------------------
def run_plain(
    job: NativeJob,
    prompt_text: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    json_schema: dict | None = None,
) -> NativeResult:
    """Plain greedy decoding with `llama-completion` on the rendered prompt text, constrained by `json_schema` when
    given (llama.cpp's `-jf`, its own JSON-schema grammar: "native constrained").

    Raises UsageError (bad model path, bad budget), NativeToolError (non-zero exit, timeout, unparsable output).
    """
    import json

    job = _checked(job)
    with _prompt_file(prompt_text) as pf, _prompt_file(json.dumps(json_schema) if json_schema else "") as sf:
        cmd = completion_command(job, pf, sf if json_schema else None)
        out, err = _run(cmd, timeout_s)
    stats = parse_completion(err)
    return _result("native constrained" if json_schema else "native plain", stats, _completion_text(out), cmd)


def run_speculative(
    job: NativeJob,
    prompt_text: str,
    spec_type: str = "ngram-simple",
    draft_model: str | os.PathLike[str] | None = None,
    n_max: int | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> NativeResult:
    """Greedy speculative decoding with `llama-speculative-simple --spec-type spec_type` on the rendered prompt.

    draft_model: the draft GGUF for spec_type "draft-simple". n_max: see `speculative_command`.
    Raises UsageError (bad model path, bad budget, bad spec type), NativeToolError (exit, timeout, output).
    """
    job = _checked(job)
    draft = _model_file(draft_model) if draft_model is not None else None
    with _prompt_file(prompt_text) as pf:
        cmd = speculative_command(job, pf, spec_type=spec_type, draft_model=draft, n_max=n_max)
        out, err = _run(cmd, timeout_s)
    stats = parse_speculative(err)
    return _result(f"native {spec_type}", stats, _speculative_text(out, prompt_text), cmd)


def _checked(job: NativeJob) -> NativeJob:
    """`job` with its model path resolved. Raises UsageError for a budget under 1 token or a missing model file."""
    if job.n_tokens < 1:
        raise UsageError(f"A native run needs at least 1 token, not {job.n_tokens}.", "Give a positive token budget.")
    return replace(job, model_path=_model_file(job.model_path))


def _model_file(model_path: str | os.PathLike[str]) -> Path:
    p = Path(model_path)
    if not p.is_file():
        raise UsageError(f"Model file {p} does not exist.", "Pull it first: specdec models pull NAME.")
    return p.resolve()


@contextmanager
def _prompt_file(text: str) -> Iterator[str]:
    """A temporary file holding the prompt's UTF-8 bytes, removed afterwards."""
    fd, path = tempfile.mkstemp(prefix="specdec-native-", suffix=".txt")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
        yield path
    finally:
        Path(path).unlink(missing_ok=True)


def _run(cmd: list[str], timeout_s: float) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    try:
        proc = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        raise NativeToolError(
            f"{Path(cmd[0]).name} did not finish within {timeout_s:.0f} s (killed).",
            "Use a smaller token budget or context.",
        ) from None
    except OSError as e:
        raise NativeToolError(f"{cmd[0]} could not be started: {e.strerror}.", BUILD_HINT) from None
    out = proc.stdout.decode("utf-8", "replace")
    err = proc.stderr.decode("utf-8", "replace")
    if proc.returncode != 0:
        raise _failed(cmd, proc.returncode, err)
    return out, err


def _failed(cmd: list[str], code: int, err: str) -> NativeToolError:
    tail = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), "(no output)")
    return NativeToolError(
        f"{Path(cmd[0]).name} exited with code {code}: {tail[:200]}", "Run the command by hand to see its full output."
    )


def _completion_text(stdout: str) -> str:
    """`llama-completion --no-display-prompt` prints the output, " [end of text]\\n" at an end-of-generation token,
    then "\\n\\n"."""
    return stdout.removesuffix("\n\n").removesuffix(" [end of text]\n")


def _speculative_text(stdout: str, prompt_text: str) -> str | None:
    """`llama-speculative-simple` prints "\\n\\n", the prompt's token pieces, the output, then "\\n\\n"."""
    body = stdout.removeprefix("\n\n").removesuffix("\n\n")
    at = body.find(prompt_text)
    return body[at + len(prompt_text) :] if at >= 0 else None


def _result(name: str, s: NativeStats, text: str | None, cmd: list[str]) -> NativeResult:
    acceptance = s.n_accepted / s.n_drafted if s.n_drafted and s.n_accepted is not None else None
    return NativeResult(
        name=name,
        decode_tok_s=s.n_decoded / s.decode_s if s.decode_s > 0 else 0.0,
        n_decoded=s.n_decoded,
        decode_s=s.decode_s,
        n_drafted=s.n_drafted,
        n_accepted=s.n_accepted,
        acceptance=acceptance,
        prefill_ms=s.prefill_ms,
        n_prompt=s.n_prompt,
        text=text,
        command=tuple(cmd),
    )
