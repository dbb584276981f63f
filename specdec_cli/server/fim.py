"""Fill-in-the-middle prompts: the code before and after the cursor (and other files) laid out with the model's FIM
tokens, for `/v1/completions` with `suffix` and llama.cpp's `/infill` (editor autocomplete: llama.vim, llama.vscode,
Continue, Tabby).

Follows llama-server's `format_prompt_infill` (tools/server/server-common.cpp), repo-level FIM after Qwen2.5-Coder's
report (arXiv 2409.12186):

    [FIM_REP]myproject\\n [FIM_SEP]filename0\\n extra chunk 0 ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE]prefix+prompt [FIM_SUF]suffix [FIM_MID]

without the `FIM_REP`/`FIM_SEP` tokens the chunks are joined by "\\n\\n--- snippet ---\\n\\n". The prefix keeps its end
and the suffix its start, 3:1 within a window (llama-server's batch, here min(2048, n_ctx / 2) tokens); the extra chunks
fill what is left of the context from their end. Every piece is in the prompt, so prompt lookup drafts from the suffix
and the other files: completions often copy nearby code.
"""

from __future__ import annotations

from typing import Protocol

from specdec_cli.models.backend import FimTokens
from specdec_cli.server.request import Fim


class Vocabulary(Protocol):
    """What a FIM prompt needs of a model: `Backend`'s tokenizer and FIM tokens (a `Backend`, or the server's
    `session.PromptText`)."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]: ...

    def fim_tokens(self) -> FimTokens: ...


SNIPPET = "\n\n--- snippet ---\n\n"  # llama-server's chunk separator for models without FIM_SEP
MAX_WINDOW = 2048  # llama-server's default n_batch: the prefix+suffix window


def fim_prompt(backend: Vocabulary, fim: Fim, *, n_ctx: int, n_predict: int) -> list[int]:
    """Token ids of `fim` for `backend`'s model (its `fim_tokens()` must be usable: the caller checked).

    Args:
        n_ctx: the context window (tokens). n_predict: the reply's token limit (the extra context leaves room
            for twice that, as llama-server).

    Returns int ids [n], ending with the FIM middle token.
    """
    t = backend.fim_tokens()
    assert t.pre is not None and t.suf is not None and t.mid is not None  # (the caller checked)

    def tok(text: str) -> list[int]:
        return backend.tokenize(text, add_special=False, parse_special=False) if text else []

    extra: list[int] = []
    if fim.repo:
        if t.rep is not None:
            extra += [t.rep, *tok("myproject\n")]
        for filename, text in fim.extra:
            extra += [t.sep, *tok(f"{filename or 'tmp'}\n")] if t.sep is not None else tok(SNIPPET)
            extra += tok(text)
        if t.sep is not None:
            extra += [t.sep, *tok("filename\n")]
    window = min(MAX_WINDOW, n_ctx // 2)
    prompt = tok(fim.prompt)
    prefix, suffix = tok(fim.prefix), tok(fim.suffix)
    n_prefix = min(len(prefix), 3 * (window // 4))
    n_suffix = min(len(suffix), max(0, window // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - window - 2 * n_predict), len(extra))
    bos = backend.tokenize("", add_special=True, parse_special=False)  # [BOS] when the model wants one
    return [
        *extra[len(extra) - n_extra :],
        *bos,
        t.pre,
        *prefix[len(prefix) - n_prefix :],
        *prompt,
        t.suf,
        *suffix[:n_suffix],
        t.mid,
    ]
