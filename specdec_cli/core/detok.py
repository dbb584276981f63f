"""Token bytes → text, one token at a time, with stop strings.

Tokens are byte pieces that may split a UTF-8 character; an incremental decoder holds partial characters back.
Text that could be the start of a stop string is held back too, so a stop string is never shown, and nothing past
it is ever emitted. Every released piece keeps the kind of the token it came from (accepted draft or target).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

from specdec_cli.core.records import Segment


class TextStream:
    """Incremental detokenizer for one generation.

    Args:
        piece: token id → its bytes (`Backend.piece`).
        stop: stop strings; generation ends before the first occurrence of any of them.
    """

    def __init__(self, piece: Callable[[int], bytes], stop: tuple[str, ...] = ()) -> None:
        self._piece = piece
        self._stop = tuple(s for s in stop if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending: list[Segment] = []  # decoded but held back (possible stop-string prefix)
        self._tail = ""  # the end of the released text, to find stop strings that straddle a release
        self._keep = max((len(s) for s in self._stop), default=1) - 1
        self.text_parts: list[str] = []  # everything released, in order
        self.hit: str | None = (
            None  # the stop string that ended the stream (the earliest in the text; ties: listed first)
        )

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def push(self, kind: str, token: int) -> tuple[list[Segment], bool]:
        """Add one output token. Returns (segments now safe to show, whether a stop string was hit).

        After a hit the stream is finished: the stop string and anything after it are dropped.
        """
        s = self._decoder.decode(self._piece(token))
        if not self._stop and not self._pending:  # nothing held back, nothing to hold: released as it comes
            if not s:
                return [], False
            self.text_parts.append(s)
            return [(kind, s)], False
        if s:
            self._pending.append((kind, s))
        pending = "".join(t for _, t in self._pending)
        if not self._stop:
            return self._release(len(pending)), False
        # Search the released tail plus the pending text, so a stop string split across tokens is found.
        window = self._tail + pending
        found = [(i, s) for s in self._stop if (i := window.find(s)) >= 0]
        if found:
            hit, self.hit = min(found, key=lambda f: f[0])  # min is stable: ties go to the first listed
            cut = max(0, hit - len(self._tail))
            out = self._release(cut)
            self._pending = []
            return out, True
        # Hold back the longest pending suffix that is a prefix of some stop string.
        hold = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(pending)), hold, -1):
                if pending.endswith(s[:n]):
                    hold = n
                    break
        return self._release(len(pending) - hold), False

    def flush(self) -> list[Segment]:
        """End of generation without a stop string: release what was held back."""
        tail = self._decoder.decode(b"", final=True)
        if tail:
            kind = self._pending[-1][0] if self._pending else "target"
            self._pending.append((kind, tail))
        return self._release(sum(len(t) for _, t in self._pending))

    def _release(self, n_chars: int) -> list[Segment]:
        """Release the first n_chars of the pending text, split by segment."""
        out: list[Segment] = []
        rest: list[Segment] = []
        left = n_chars
        for kind, t in self._pending:
            if left >= len(t):
                out.append((kind, t))
                left -= len(t)
            elif left > 0:
                out.append((kind, t[:left]))
                rest.append((kind, t[left:]))
                left = 0
            else:
                rest.append((kind, t))
        self._pending = rest
        released = "".join(t for _, t in out)
        if released:
            self.text_parts.append(released)
            self._tail = (self._tail + released)[-self._keep :] if self._keep else ""
        return out


def piece_text(piece: Callable[[int], bytes], tokens) -> str:
    """Text of tokens shown on their own (rejected drafts): invalid UTF-8 is replaced, never raised."""
    return b"".join(piece(int(t)) for t in tokens).decode("utf-8", "replace")
