"""The seam between the speculative engine and a language model.

Everything above this module works on token ids (int) and numpy arrays. `specdec_cli.models.llama` implements `Backend`
with llama.cpp (it is the only module that imports `llama_cpp`, besides `specdec_cli.measure.peer`, which drives
llama-cpp-python's own `Llama` on purpose: the peer `specdec bench` compares against); `tests/fakes.py` implements
it with a table of
logits so the engine can be tested exactly.

A backend owns one sequence and its KV cache. `tokens` is what the KV cache holds, in position order; `decode`
appends, `truncate` rolls back. A backend with `branches` can also score a second branch in the same pass
(`decode_branches`: a token tree of two paths after the newest token, sharing the cache of the committed prefix) and
then keep either branch (`truncate(n, branch=...)`). `sync` brings the cache to a given context with the least work
(longest common prefix kept), which is what makes draft-model catch-up and multi-turn chat prefix reuse the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from llguidance import LLTokenizer


@dataclass(frozen=True, slots=True)
class VocabInfo:
    """What two models must share to speculate for each other.

    Attributes:
        vocab_type: llama.cpp vocab type (1 = SPM, 2 = BPE, ...).
        n_vocab: number of tokens.
        bos: BOS token id (-1 when none).
        eos: EOS token id (-1 when none).
        fingerprint: sha256 hex of all token texts in id order; equal fingerprints = identical vocabularies.
    """

    vocab_type: int
    n_vocab: int
    bos: int
    eos: int
    fingerprint: str


@dataclass(frozen=True)
class FimTokens:
    """A model's fill-in-the-middle token ids (llama.cpp's `llama_vocab_fim_pre/suf/mid/pad/rep/sep`, which it finds
    by name at load even when the GGUF has no `tokenizer.ggml.fim_*` keys, e.g. Qwen2.5-Coder's `<|fim_prefix|>`);
    None where the model has none.

    Attributes:
        pre, suf, mid: prefix, suffix and middle markers (all three needed to fill in the middle).
        pad: padding. rep: the repository-name marker. sep: the file separator (repo-level FIM, with `rep`).
    """

    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    @property
    def usable(self) -> bool:
        """The model can fill in the middle (it has prefix, suffix and middle tokens)."""
        return None not in (self.pre, self.suf, self.mid)


@runtime_checkable
class Backend(Protocol):
    """A causal LM with a KV cache for one sequence (seq_id 0)."""

    path: str

    @property
    def n_vocab(self) -> int: ...

    @property
    def n_ctx(self) -> int: ...

    @property
    def n_batch(self) -> int: ...

    @property
    def n_threads(self) -> int:
        """CPU threads llama.cpp generates with (the default, all usable CPUs, resolved to its number)."""
        ...

    @property
    def tokens(self) -> np.ndarray:
        """int32 [n]: the tokens held in the KV cache, positions 0..n-1 (a read-only view)."""
        ...

    @property
    def draft_limit(self) -> int:
        """The most draft tokens one verify pass should carry: n_batch - 1 (one llama.cpp batch), or less where a
        recurrent state rolls back only so far (`rollback.draft_limit`)."""
        ...

    @property
    def shared_rows(self) -> int:
        """Rows other sequences had in this backend's last forward pass (0: it ran alone; `server.lanes`)."""
        ...

    kind: str
    """"transformer", "hybrid" or "recurrent" (a recurrent state cannot be cut at any position)."""

    rollback: str
    """"kv" (any prefix can be kept), "snapshots" (a verify pass's own tokens, at most `draft_limit`), "checkpoints"
    (the state saved before a verify pass restored and the kept tokens evaluated again) or "none". With anything but
    "kv", `truncate` outside a verify pass may clear the sequence: keep only whole saved states (prompt cache,
    parking) and re-read `tokens` after a truncate."""

    def decode(self, tokens: Sequence[int] | np.ndarray, n_logits: int = 0) -> np.ndarray:
        """Append `tokens` at positions len(tokens).. and evaluate them in one forward pass per n_batch chunk.

        Returns float32 [n_logits, n_vocab]: the logits after each of the last `n_logits` tokens, row i predicting the
        token after tokens[len - n_logits + i]. It is a view into the backend's buffer, valid until the next call;
        copy it to keep it. Raises `DecodeError` (cache left as before the call) or `ContextOverflowError`.
        """
        ...

    def truncate(self, n: int, *, branch: bool = False) -> None:
        """Keep the first `n` tokens of the KV cache and drop the rest. Raises `CacheTrimError` if refused. A
        recurrent state (`rollback` not "kv") that cannot keep exactly n tokens is cleared instead: `tokens` is then
        shorter than n (callers re-read it).

        After `decode_branches`, every call drops the branch that is not kept: `branch=False` keeps the first n
        tokens of `tokens` (the main path), `branch=True` makes the cache tokens[:start + 1] + branch[:n - start - 1]
        (start: len(tokens) before the call), i.e. keeps the second branch's first tokens instead."""
        ...

    @property
    def branches(self) -> bool:
        """True when `decode_branches` works (llama.cpp: two sequences over one unified KV cache)."""
        ...

    def decode_branches(self, tokens: Sequence[int] | np.ndarray, branch: Sequence[int] | np.ndarray) -> np.ndarray:
        """One forward pass over a tree of two branches after the cache: `tokens` = [t_0, a_1..a_m] appended like
        `decode`, and `branch` = [b_1..b_n], a second continuation after t_0 at the same positions as a_1.. (sharing
        the cache of the committed prefix, t_0 and the common prefix of a and b).

        Returns float32 [R, n_vocab] logits for every row of the tree, R = 1 + m + n - c (c = the common prefix of a
        and b), in the order of `branch_rows`: t_0, a_1..a_m, then b_(c+1)..b_n. A view valid until the next call.
        Afterwards `tokens` holds the main path (tokens appended) until `truncate` keeps one branch. Raises what
        `decode` raises, `ValueError` for more than one llama.cpp batch, `NotImplementedError` without `branches`.
        """
        ...

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]: ...

    def piece(self, token: int) -> bytes:
        """The bytes token `token` renders as (may be a partial UTF-8 sequence)."""
        ...

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, <|im_end|>, ...)."""
        ...

    def vocab_info(self) -> VocabInfo: ...

    def token_text(self, token: int) -> str:
        """The vocabulary entry of `token` as stored in the model (not detokenized), for vocabulary checks."""
        ...

    def lltokenizer(self) -> LLTokenizer:
        """The vocabulary as an llguidance tokenizer, for grammars (`specdec_cli.core.constraint`): built on first use
        (it walks the whole vocabulary), then cached. Its end-of-sequence tokens are the model's end-of-generation
        tokens."""
        ...

    def chat_template(self) -> str | None:
        """The model's chat template (Jinja text, the GGUF's `tokenizer.chat_template`), None when it has none: the
        server reads its tool-call format from it (`server.tool_formats.detect`)."""
        ...

    def format_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render `messages` ({"role", "content"}, plus `name`, `reasoning_content`, `tool_calls` / `tool_call_id`)
        with the model's own chat template (sandboxed Jinja); `tools` (OpenAI's tool dicts) are passed to the template
        as `tools`, `template_kwargs` as variables of their own (e.g. `enable_thinking`).
        Raises ToolsUnsupportedError when tools are given (or the messages carry tool turns) and the template never
        reads them."""
        ...

    def fim_tokens(self) -> FimTokens:
        """The model's fill-in-the-middle tokens (`FimTokens`; all None for a model without FIM)."""
        ...

    def synchronize(self) -> None:
        """Wait until the device finished the last pass (llama.cpp's `llama_synchronize`): a pass that reads no
        logits may return before a GPU finished it, so a timed pass calls this before its clock stops. The default
        does nothing (a backend that computes as it is called: the CPU, the test fakes)."""

    def close(self) -> None: ...


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays (vectorised; O(min(len)))."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


def branch_rows(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The logits rows of a two-branch pass (`Backend.decode_branches`) over [t_0, a] and [t_0, b].

    a: int [m], b: int [n]; c = their common prefix. Rows: 0 = t_0, 1..m = a_1..a_m, then m + 1.. = b_(c+1)..b_n.
    Returns (rows_a int64 [m + 1], rows_b int64 [n + 1]): the row after each prefix of a and of b (rows_a[i] predicts
    a_(i+1)); the shared prefix has the same rows in both.
    """
    c = common_prefix(np.asarray(a), np.asarray(b))
    m, n = len(a), len(b)
    rows_a = np.arange(m + 1, dtype=np.int64)
    rows_b = np.concatenate((np.arange(c + 1, dtype=np.int64), np.arange(m + 1, m + 1 + n - c, dtype=np.int64)))
    return rows_a, rows_b


def sync(backend: Backend, context: np.ndarray, interrupt: Callable[[], None] | None = None) -> int:
    """Make the KV cache hold exactly `context` (int32 [n]), reusing the longest common prefix.

    What is missing is evaluated in chunks of `backend.n_batch` tokens (a prompt of 20k tokens is minutes on a CPU),
    and `interrupt`, when given, is called before each chunk after the first: it raises to stop (a client gone, a
    deadline, a shutdown: the server's `Worker`), so a prefill stops within one chunk; the chunks evaluated stay in
    the cache, a prefix a retry reuses.

    Returns the number of tokens evaluated. Raises what `truncate`, `decode` and `interrupt` raise.
    """
    keep = common_prefix(backend.tokens, context)
    if keep < len(backend.tokens):
        backend.truncate(keep)
        keep = len(backend.tokens)  # a recurrent state that cannot keep `keep` tokens is cleared
    chunk = backend.n_batch if interrupt is not None else max(1, len(context))
    for c0 in range(keep, len(context), chunk):
        if interrupt is not None and c0 > keep:
            interrupt()
        backend.decode(context[c0 : c0 + chunk], n_logits=0)
    return len(context) - keep
