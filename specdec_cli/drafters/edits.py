"""Learned edits: a copy of the prompt that carries the reply's repeated edits forward.

"Rename `a` to `items` everywhere, return the whole file": the reply copies the prompt's code, but writes ` items`
at every ` a`. Prompt lookup drafts the copy and breaks at each occurrence (the target writes the new name as the
bonus token of a failed pass), so such an edit never drafts further than the next occurrence. llama.cpp's n-gram
speculation and prompt lookup decoding (Saxena 2023) behave the same; OpenAI's predicted outputs reject those tokens
too. `CopyEdits` follows the reply's copy with a pointer into the prompt, as a streaming diff would
(`drafters/predict.py` does it over bytes for `--predict`), and learns each edit where the copy resumes:

    aligned     each output token that is the prompt token at the pointer advances it;
    divergence  another token: the pointer's position s and the output's o are kept;
    re-sync     on each later token, the smallest edit (j prompt tokens replaced by m output tokens, j, m <= `MAX_EDIT`)
                after which the output's tokens since o + m agree with the prompt's from s + j, at least `RESYNC`
                of them: the pointer goes on from there, and a replacement (j, m >= 1) is learnt, prompt[s:s+j] ->
                output[o:o+m]; an insertion (j = 0) is learnt with the prompt token before it, (t,) -> (t, inserted);
    applying    the draft copies the prompt from the pointer with every learnt edit applied where its old tokens
                occur (`apply`), and an output that writes an edit's new tokens where the prompt has its old ones
                keeps the pointer aligned;
    trust       an edit counts a hit each time the output writes it and a miss each time the copy passes its old
                tokens kept; it is applied once seen twice and while hits >= misses: a rename, made wherever its old
                word occurs, is applied from its third occurrence on; a line break moved once, or a change of a
                common token made here and there, is not (and a rename in the code but not in the prose stops being
                drafted where the reply keeps the old word).

Edits are learnt from the output only, never from the target's logits, so drafts stay lossless; they live for one
generation. Cost: O(1) per aligned output token; up to (`MAX_EDIT` + 1)^2 short comparisons per token while
re-syncing; `apply` walks the k drafted prompt tokens once (a dict lookup each).
"""

from __future__ import annotations

import numpy as np

MAX_EDIT = 4  # longest learnt edit, in prompt tokens replaced and in output tokens written
RESYNC = 2  # output tokens that must agree with the prompt after an edit before the copy resumes there
LOST = 16  # output tokens after a divergence without a re-sync: the copy is lost (prompt lookup re-anchors it)


class Edit:
    """One learnt edit: the prompt's `old` tokens are written as `new` (tuples of token ids); `hits`/`misses`."""

    __slots__ = ("old", "new", "insertion", "hits", "misses")

    def __init__(self, old: tuple[int, ...], new: tuple[int, ...]) -> None:
        self.old, self.new, self.hits, self.misses = old, new, 0, 0
        self.insertion = new[: len(old)] == old  # text added after `old`, which stays

    @property
    def trusted(self) -> bool:
        """Seen at two places at least (a one-off change, a comment's line break moved, is not an edit to repeat),
        and written as often as the old tokens were kept."""
        return self.hits >= max(2, self.misses)

    def __repr__(self) -> str:
        return f"Edit({self.old} -> {self.new}, {self.hits}/{self.misses})"


class CopyEdits:
    """The reply's copy pointer into the prompt and the edits learnt along it (see the module docstring).

    `begin(prompt)` starts a generation (int32 [n]); `update(context)` consumes the output tokens added since
    (`context` = prompt + output, int32); `anchor(pos)` aligns an unaligned pointer at prompt position `pos` (where
    prompt lookup found a long unique match); `draft(k)` is the copy from the pointer with the trusted edits applied
    (int32 [<= k]; empty when the copy is lost); `apply(tokens)` applies them to any drafted tokens.
    """

    def __init__(self) -> None:
        self.begin(np.zeros(0, dtype=np.int32))

    def begin(self, prompt: np.ndarray) -> None:
        self.prompt = np.asarray(prompt, dtype=np.int32)
        self.n_prompt = len(self.prompt)
        self.src: int | None = None  # prompt position the output continues with (None: not aligned)
        self.pending: list[int] = []  # the rest of an edit's new tokens the output is writing
        self.pending_edit: Edit | None = None
        self.run = 0  # output tokens since the last divergence (the copy's evidence)
        self.diverged: tuple[int, int] | None = None  # (prompt position s, output index o) of the last divergence
        self.out: list[int] = []  # the output tokens consumed
        self.one_for_one = [0, 0]  # divergences re-synced as one-for-one replacements, and the others (or lost)
        self.edits: dict[tuple[tuple[int, ...], tuple[int, ...]], Edit] = {}
        self.by_first: dict[int, list[Edit]] = {}  # old[0] -> the edits starting with it, longest old first

    # -- following the output -----------------------------------------------------------------------------------------
    def update(self, context: np.ndarray) -> None:
        new = context[self.n_prompt + len(self.out) :]
        for t in new.tolist():
            self.out.append(t)
            self._consume(t)

    def anchor(self, pos: int) -> None:
        """Align at prompt position `pos` when not aligned nor re-syncing (prompt lookup's unique long match)."""
        if self.src is None and self.diverged is None and 0 <= pos <= self.n_prompt:
            self.src, self.run = pos, 0

    def _consume(self, t: int) -> None:
        src, prompt = self.src, self.prompt
        if src is not None:
            if self.pending:
                if t == self.pending[0]:
                    self.pending.pop(0)
                    if not self.pending and self.pending_edit is not None:
                        self.pending_edit.hits += 1
                    self.run += 1
                    return
                if self.pending_edit is not None:  # the output left the edit's new tokens
                    self.pending_edit.misses += 1
                self.pending, self.pending_edit = [], None
                if src < self.n_prompt and prompt[src] == t:  # an insertion not made here: the copy goes on
                    self.src = src + 1
                    self.run += 1
                    return
            else:
                here = self._at(src, trusted=False)
                for e in here:
                    if e.trusted and e.new[0] == t:  # the output writes a learnt edit
                        self.pending, self.pending_edit = list(e.new[1:]), e
                        if not self.pending:
                            e.hits += 1
                        self.src = src + len(e.old)
                        self.run += 1
                        return
                if src < self.n_prompt and prompt[src] == t:
                    for e in here:  # the output kept what an edit would have replaced (trusted yet or not)
                        if e.new[0] != t:
                            e.misses += 1
                    self.src = src + 1
                    self.run += 1
                    return
            # divergence: the output wrote something else (inside an edit's new tokens too)
            self.diverged = (src, len(self.out) - 1)
            self.src, self.pending, self.pending_edit, self.run = None, [], None, 0
            return
        if self.diverged is not None:
            self._resync()

    def _resync(self) -> None:
        assert self.diverged is not None  # (called only while diverged)
        s, o = self.diverged
        out, prompt, n = self.out, self.prompt, len(self.out)
        since = n - o
        if since > LOST + MAX_EDIT:
            self.diverged = None  # lost: prompt lookup re-anchors
            self.one_for_one[1] += 1
            return
        best = None
        for size in range(1, 2 * MAX_EDIT + 1):  # the smallest edit first
            for m in range(max(0, size - MAX_EDIT), min(size, MAX_EDIT) + 1):
                j = size - m
                agree = since - m
                if agree < RESYNC or s + j + agree > self.n_prompt:
                    continue
                if out[o + m :] == prompt[s + j : s + j + agree].tolist():
                    best = (j, m, agree)
                    break
            if best:
                break
        if best is None:
            return
        j, m, agree = best
        self.one_for_one[j != m] += 1
        if j and m:
            self._learn(tuple(prompt[s : s + j].tolist()), tuple(out[o : o + m]))
        elif m and s > 0:  # an insertion, kept with the prompt token before it
            self._learn((int(prompt[s - 1]),), (int(prompt[s - 1]), *out[o : o + m]))
        self.src, self.run, self.diverged = s + j + agree, agree, None

    def _learn(self, old: tuple[int, ...], new: tuple[int, ...]) -> None:
        e = self.edits.get((old, new))
        if e is None:
            e = self.edits[(old, new)] = Edit(old, new)
            same = self.by_first.setdefault(old[0], [])
            same.append(e)
            same.sort(key=lambda x: -len(x.old))
        e.hits += 1

    def _at(self, pos: int, trusted: bool = True) -> list[Edit]:
        """The edits (only the trusted ones if `trusted`) whose old tokens occur at prompt position `pos`."""
        if pos >= self.n_prompt:
            return []
        cands = self.by_first.get(int(self.prompt[pos]))
        if not cands:
            return []
        return [
            e
            for e in cands
            if (e.trusted or not trusted) and self.prompt[pos : pos + len(e.old)].tolist() == list(e.old)
        ]

    # -- drafting -------------------------------------------------------------------------------------------------
    def draft(self, k: int) -> np.ndarray:
        """The copy from the pointer, learnt edits applied: int32 [<= k]. Re-syncing after a divergence, the copy
        from where a one-for-one replacement of the tokens written since would leave it (a renamed word of as many
        tokens), while what was written after the divergence's first token agrees with that and the reply's edits
        so far were one for one at least as often as not (type hints, inserted, are not); empty otherwise, when the
        copy is lost or `k` <= 0."""
        if k <= 0:
            return np.zeros(0, dtype=np.int32)
        if self.src is None:
            if self.diverged is None:
                return np.zeros(0, dtype=np.int32)
            s, o = self.diverged
            since = len(self.out) - o
            if (
                self.one_for_one[0] < self.one_for_one[1]
                or self.out[o + 1 :] != self.prompt[s + 1 : s + since].tolist()
            ):  # not one for one
                return np.zeros(0, dtype=np.int32)
            return np.asarray(self._copy(s + since, k), dtype=np.int32)
        out = list(self.pending[:k])
        out += self._copy(self.src, k - len(out))
        return np.asarray(out[:k], dtype=np.int32)

    def _copy(self, pos: int, k: int) -> list[int]:
        """Up to k tokens of the prompt from `pos`, the trusted edits applied."""
        prompt = self.prompt
        out: list[int] = []
        if not self.edits:  # nothing learnt yet (most steps of most replies): the prompt as it is
            return prompt[pos : pos + k].tolist()
        while len(out) < k and pos < self.n_prompt:
            edits = self._at(pos)
            if edits:
                e = edits[0]
                out.extend(e.new)
                pos += len(e.old)
            else:
                out.append(int(prompt[pos]))
                pos += 1
        return out[:k]

    def apply(self, tokens: np.ndarray) -> np.ndarray:
        """`tokens` (int32 [k]) with the trusted replacements applied where their old tokens occur; the same array
        when none applies. At most k tokens. Insertions are left to `draft`: `tokens` may come from the output,
        where they are already made. Only while the copy is aligned, where the output's keeping an old word counts
        against its edit (`Edit.trusted`)."""
        if not self.edits or not len(tokens) or self.src is None:
            return tokens
        toks = tokens.tolist()
        out: list[int] = []
        i, changed = 0, False
        while i < len(toks) and len(out) < len(toks):
            for e in self.by_first.get(toks[i], ()):
                if e.trusted and not e.insertion and tuple(toks[i : i + len(e.old)]) == e.old:
                    out.extend(e.new)
                    i += len(e.old)
                    changed = True
                    break
            else:
                out.append(toks[i])
                i += 1
        return np.asarray(out[: len(toks)], dtype=np.int32) if changed else tokens
