"""Can a draft model speculate for a target? Their vocabularies must agree token for token.

The rule follows llama.cpp's `common/speculative.cpp` (`common_speculative_are_compatible`): same vocab type, sizes
within 128 tokens, same BOS/EOS, and identical token texts for every shared id from 5 on.
"""

from __future__ import annotations

from pathlib import Path

from specdec_cli.errors import IncompatiblePairError
from specdec_cli.models.backend import Backend

MAX_SIZE_DIFFERENCE = 128
CHECK_START_ID = 5


def check_compatible(target: Backend, draft: Backend) -> None:
    """Raise `IncompatiblePairError` naming both files and the first difference; return None when compatible."""
    t, d = target.vocab_info(), draft.vocab_info()
    tn, dn = Path(target.path).name, Path(draft.path).name

    def fail(what: str) -> None:
        raise IncompatiblePairError(
            f"The draft model {dn} cannot speculate for the target {tn}: {what}.",
            "Pick a draft from the same model family (same tokenizer), or use --method ngram.",
        )

    if t.vocab_type != d.vocab_type:
        fail(f"vocab type {t.vocab_type} vs {d.vocab_type}")
    if abs(t.n_vocab - d.n_vocab) > MAX_SIZE_DIFFERENCE:
        fail(f"vocabulary sizes differ by more than {MAX_SIZE_DIFFERENCE} ({t.n_vocab} vs {d.n_vocab})")
    if t.bos != d.bos or t.eos != d.eos:
        fail(f"special tokens differ (BOS {t.bos} vs {d.bos}, EOS {t.eos} vs {d.eos})")
    if t.fingerprint == d.fingerprint:
        return
    for i in range(CHECK_START_ID, min(t.n_vocab, d.n_vocab)):
        a, b = target.token_text(i), draft.token_text(i)
        if a != b:
            fail(f"token {i} is {a!r} in the target but {b!r} in the draft")
