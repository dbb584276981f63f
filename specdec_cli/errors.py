"""Domain errors. Every user mistake raises one of these; `__main__.main` turns it into one line and an exit code.

Each error carries a message that says what went wrong and a `fix` that says what to do next. Library code never
prints and never calls `sys.exit`; the CLI's error table (`specdec_cli.__main__`) does both.

Exit codes (documented in docs/reference.md, "Exit codes"):

==== ===========================================================
 0   success
 1   unexpected internal error (a bug: run with SPECDEC_DEBUG=1)
 2   usage error (bad option, bad prompt file) — same as Typer's
 3   model error (unknown name, missing/corrupt GGUF, download)
 4   incompatible target/draft pair
 5   context overflow (prompt longer than the context)
 6   configuration error (malformed models.toml / user config)
 7   a losslessness check failed (`--strict`, `specdec check`)
 8   llama-cpp-python could not be built (`specdec install-llama-cpp`)
 130 interrupted (Ctrl-C)
==== ===========================================================
"""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class: a message for the user, an optional fix, and the process exit code."""

    exit_code: int = 1

    def __init_subclass__(cls, exit_code: int | None = None, **kwargs) -> None:
        """`class XError(SpecdecError, exit_code=N)`: a subclass's exit code said beside its name (else inherited)."""
        super().__init_subclass__(**kwargs)
        if exit_code is not None:
            cls.exit_code = exit_code

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message} {self.fix}"


class UsageError(SpecdecError, exit_code=2):
    """Bad arguments or input the user can correct (prompt file missing, empty, not UTF-8, ...)."""


class ToolsUnsupportedError(UsageError):
    """Tools were given, and the model's chat template has no place for them (it never reads `tools`)."""


class ModelError(SpecdecError, exit_code=3):
    """A model could not be resolved, fetched, verified or loaded."""


class ChecksumError(ModelError):
    """A fetched file's sha256 differs from the pinned one; the file has been deleted."""


class IncompatiblePairError(SpecdecError, exit_code=4):
    """Target and draft models do not share a vocabulary."""


class ContextOverflowError(SpecdecError, exit_code=5):
    """The prompt (or chat history) does not fit in the context window."""


class ConfigError(SpecdecError, exit_code=6):
    """models.toml or the user config is malformed."""


class CheckFailedError(SpecdecError, exit_code=7):
    """A losslessness check found a divergence that is not a numerical near-tie."""


class BuildError(SpecdecError, exit_code=8):
    """llama-cpp-python could not be built or installed (a tool is missing, or the build failed)."""


class BackendError(SpecdecError, exit_code=1):
    """llama.cpp refused an operation (decode failed, KV cache could not be trimmed, ...)."""


class DecodeError(BackendError):
    """`llama_decode` returned non-zero. 1 = no KV slot for the batch, 2 = aborted, < 0 = fatal error."""

    def __init__(self, code: int, n_tokens: int) -> None:
        reason = {1: "no free KV-cache slot for the batch (context full)", 2: "aborted"}.get(
            code, "fatal error in llama.cpp"
        )
        super().__init__(
            f"llama_decode failed with code {code} ({reason}) on a batch of {n_tokens} tokens.",
            "Try a larger --ctx or a smaller --k." if code == 1 else None,
        )
        self.code = code

    @staticmethod
    def of(code: int, n_tokens: int) -> DecodeError:
        """The error for `llama_decode`'s return code: `PassInterrupted` for 2 (aborted), else a DecodeError."""
        return PassInterrupted(code, n_tokens) if code == 2 else DecodeError(code, n_tokens)


class PassInterrupted(DecodeError):
    """`llama_decode` stopped between two graph nodes because `LlamaBackend.interrupt` was called (the server's
    scheduler preempting a long request's pass for an interactive one). The lanes' KV cells are as before the call:
    evaluate the same rows again."""


class CacheTrimError(BackendError):
    """`llama_memory_seq_rm` refused to remove a range (recurrent or hybrid models cannot roll back)."""


class StateError(BackendError):
    """llama.cpp could not save or restore a KV state (`llama_state_seq_save_file` / `load_file` returned 0)."""


class NativeToolError(UsageError):
    """A native llama.cpp binary (`specdec_cli.measure.native`, bench's --llama-cpp peer) failed, timed out, or printed
    output of another format than the llama.cpp version we parse."""


def reason(e: BaseException) -> str:
    """A short reason for an exception in a one-line message: an OSError's strerror, else its text or type name."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__
