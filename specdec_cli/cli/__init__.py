"""Entry point: runs the Typer app and turns every error into one line and an exit code.

The table below is the only place that maps exceptions to messages; SPECDEC_DEBUG=1 shows the traceback too.
"""

from __future__ import annotations

import errno
import os
import sys

from specdec_cli.errors import SpecdecError

INTERRUPTED = 130
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}


def _debug() -> bool:
    return os.environ.get("SPECDEC_DEBUG", "") not in ("", "0")


def _print_error(message: str) -> None:
    from rich.text import Text

    from specdec_cli.cli.console import err_console

    err_console().print(Text.assemble(("error: ", "bold red"), message))


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Library warnings (a suffix store set aside, a save that failed) as one line: `warning: ...`."""
    from rich.text import Text

    from specdec_cli.cli.console import err_console

    err_console().print(Text.assemble(("warning: ", "bold yellow"), str(message)))


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return (and exit with) its code. Domain errors → one line on stderr and `error.exit_code`."""
    import warnings

    from specdec_cli.cli.app import app
    from specdec_cli.cli.console import choose_encoding
    from specdec_cli.cli.options import expand_optional_values

    choose_encoding()  # stdout and stderr write any text (a Windows pipe would be cp1252), before any console exists
    if not _debug():
        warnings.showwarning = _show_warning

    try:
        # With standalone_mode=False Typer returns the exit code (typer.Exit, 130 for Ctrl-C) instead of exiting.
        rv = app(args=expand_optional_values(sys.argv[1:] if argv is None else argv), standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
        if code == INTERRUPTED:
            _print_error("Interrupted.")
    except SpecdecError as e:
        if _debug():
            import traceback

            traceback.print_exc()
        _print_error(str(e))
        code = e.exit_code
    except KeyboardInterrupt:
        if _debug():
            import traceback

            traceback.print_exc()
        _print_error("Interrupted.")
        code = INTERRUPTED
    except SystemExit as e:  # typer.Exit inside standalone_mode=False surfaces as an int return, but be safe
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # a bug: say so, show the traceback only when asked
        if _debug():
            raise
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            # A storage failure no command turned into a domain error: still one line that says where and what.
            where = f" ({e.filename})" if e.filename else ""
            _print_error(
                f"{e.strerror or e}{where}. Check free space and permissions there; SPECDEC_HOME and "
                "SPECDEC_CACHE move specdec's own files."
            )
            return 1
        # Typer's own usage errors (bad option values) carry an exit code and know how to show themselves.
        show = getattr(e, "show", None)
        exit_code = getattr(e, "exit_code", None)
        if callable(show) and isinstance(exit_code, int):
            show()
            code = exit_code
        else:
            _print_error(f"{type(e).__name__}: {e} (a bug in specdec; run with SPECDEC_DEBUG=1 for the traceback)")
            code = 1
    return code


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
