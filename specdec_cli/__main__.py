"""`python -m specdec_cli` and the `specdec` entry point: the command line, `specdec_cli.cli.main`."""

from specdec_cli.cli import entry, main

__all__ = ["entry", "main"]

if __name__ == "__main__":
    entry()
