"""`SPECDEC_PASS_LOG`: every forward pass the serving loop makes, appended to a file as it is made.

One JSON line a pass, `{"t": its end (Unix time, s), "ms": its wall time, "parts": [[slot, rows, rows that want
logits], ...]}`: a verify step's rows all want logits, a prefill piece's none. What
`benchmarks/bench_serve.py` reads to see where a workload's time goes; for a user, how `--parallel` shares the passes.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import TextIO

from specdec_cli.errors import UsageError

PASS_LOG_ENV = "SPECDEC_PASS_LOG"


class PassFile(deque):
    """`Scheduler.log` (its last 256 passes, (ms, parts) each) that also appends each pass to `path`, line-buffered
    (a line is on disk once its pass is, so a reply's passes are all there when its last token was sent).

    Raises UsageError where `path` cannot be opened for appending."""

    def __init__(self, path: Path) -> None:
        super().__init__(maxlen=256)
        try:
            self._file: TextIO | None = path.open("a", encoding="utf-8", buffering=1)
        except OSError as e:
            raise UsageError(
                f"{PASS_LOG_ENV}={path}: cannot append to it ({e.strerror}); name a writable file, or unset it"
            ) from e

    def append(self, item: tuple[float, tuple[tuple[int, int, int], ...]]) -> None:
        """Keep `item` (ms, parts) and write its line; a write that fails (a full disk) ends the file, never a pass."""
        super().append(item)
        if self._file is None:
            return
        ms, parts = item
        try:
            self._file.write(json.dumps({"t": round(time.time(), 4), "ms": round(ms, 3), "parts": parts}) + "\n")
        except OSError:
            self._file = None


def pass_log() -> PassFile | None:
    """The file `SPECDEC_PASS_LOG` names as the scheduler's log, or None where it is unset or empty."""
    path = os.environ.get(PASS_LOG_ENV, "")
    return PassFile(Path(path).expanduser()) if path else None
