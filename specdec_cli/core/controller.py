"""How many tokens to draft per step: `--k N` (`FixedK`) and the cost-aware `--k auto` (`AdaptiveK`, the default).

`KController` states every hook the engine calls, each with its no-op default. `AdaptiveK` re-chooses K before
every step from a `cost_model.CostModel` learnt from the `Step` records: the K with the highest expected tokens/s,
K = 0 (a plain step) unless drafting beats plain decoding by 3 %; probes at K = 3 while plain decoding wins; a free
lookup draft is asked for up to 64 tokens and trimmed by how this run's drafts of its source went (before any, by
the acceptance measured for its match length), deep on a steep curve only behind a long match or run. Why each rule
is there (the formulas, the CPU's verify curve, the back-off schedules) is explained in docs/design.md.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from specdec_cli.core.cost_model import (
    BUCKET_EDGES,
    DEFAULT_K_MAX,
    K_LIMIT,
    MARGIN,
    REJECTION_DECAY,
    SOURCE_PRIOR,
    CostModel,
    CostPrior,
    best_k,
    bucket_of,
    expected_ms,
    expected_tokens,
)
from specdec_cli.core.draft import Draft, cut
from specdec_cli.models.backend import common_prefix

if TYPE_CHECKING:
    from specdec_cli.core.records import Step
    from specdec_cli.core.verify_curve import VerifyCurve

PROBE_K = 3  # K of a probe step taken from K = 0
MAX_BACKOFF = 4  # failed probes stretch the probe interval to at most probe_every x this
EXPLORE_K = (1, 2, 4, 8, 16, 32, 64)  # at K* > 0, each of these above K* is tried once to measure v(K + 1)
LOOKUP_K_MAX = 64  # longest draft a lookup drafter is asked for under --k auto (then trimmed by its match)
FRONTIER_ACCEPTANCE = 0.9  # a bucket whose verified positions all accept this often grows its K (slow start)
EARLY_PROBE_MATCH = 5  # buckets of matches this long are probed on their first draft
CHEAP_DRAFT = 0.1  # a lookup drafter is "free" when one call costs < this x v(1)
BRANCH_PRIOR = 2.0  # pseudo-counts behind a second branch's prior chance of being right where the first is wrong
# The run model (`_RunModel`): how runs of accepted tokens continue, learnt from this controller's own steps
RUN_HALF_LIFE = 16.0  # steps of a class after which its run evidence weighs half: a copy that ends is noticed at once
RUN_PRIOR = (1.0, 2.0)  # pseudo-counts (breaks, verified positions): h = 0.5 before any evidence
RUN_WEIGHT = 64.0  # verified positions at most behind a class's h: a copy that ends is noticed within a few steps
CLASS_PRIOR = 2.0  # verified positions' worth of both classes' pooled h behind each class's own (a copy's edits)
# On a steep measured curve a draft longer than DEEP_K needs a match, or a run of tokens since the reply's last
# rejected draft, at least 1 / DEEP_EVIDENCE of its length: a deep pass that breaks early costs many plain steps there
DEEP_K = 8
DEEP_EVIDENCE = 2
RUN_LONG_MATCH = 5  # matches this long and longer are one class ("inside a copy"); shorter ones the other
SLOW_START_GROWTH = 4  # the cheapest size per token within this x the verified depth may be tried (see `trim`)
# A flat verify curve (a GPU's: v(64) <= FLAT x v(1)): a failed deep pass costs at most 1.3 plain steps, so lookup
# drafts are verified as deep as their match and acceptance allow from the first one (no slow start), and are asked
# for in full whatever a lookup call costs (it costs the same whatever its length). docs/gpu.md, "The flat curve".
FLAT = 1.3


class KController(Protocol):
    """Chooses K for each step. Every hook the engine calls, with its default: subclass this to inherit them.

    Attributes:
        asked_all: True when the last `next_k` asked a free lookup drafter for everything it finds (then `trim`
            chooses K); an empty draft after such an ask is recorded as a plain step (K = 0).
    """

    asked_all: bool = False

    def next_k(self) -> int:
        """K for the next step, 0..k_max (0 = a plain decoding step): how many tokens to ask the drafter for."""
        return 0

    def trim(self, draft: Draft) -> int:
        """How many of the draft's tokens to verify (0..len(draft)), decided from the draft alone (never from the
        target's logits, so verification stays lossless). Default: all of them."""
        return len(draft)

    def choose(self, drafts: Sequence[Draft], has_model: bool, k: int) -> tuple[int, Draft | None]:
        """The source of this step's draft, and its K, from the free lookup drafts found (each <= k tokens, possibly
        none) and whether a draft model is available (it costs a forward pass per token, so it drafts only when
        chosen). Returns (K, the lookup draft to verify, trimmed to K) or (K, None): the draft model drafts K tokens;
        K = 0 is a plain step. Decided from drafts and past steps only, never from the target's logits.

        Default: the draft with the longest match, trimmed by `trim`, else the draft model with K = k; nothing found
        after an ask for everything (`asked_all`) is a plain step (K = 0), else the ask stands (drafted empty)."""
        if drafts:
            draft = max(drafts, key=lambda d: (d.match_len, len(d)))
            keep = self.trim(draft)
            return (k, draft) if keep >= len(draft) else (keep, cut(draft, keep))
        return (0 if self.asked_all and not has_model else k), None

    def branch(self, draft: Draft, drafts: Sequence[Draft], room: int) -> Draft | None:
        """A second candidate to verify in the same pass as `draft` (the chosen lookup draft, already trimmed),
        taken from the other lookup drafts (`drafts`, each diverging from it somewhere) and cut so that the pass
        stays within `room` tokens: the free slots of the verify curve filled. None: no second branch. Decided
        from the drafts and past steps only, never from the target's logits. Default: none."""
        return None

    def expected(self, draft: Draft) -> np.ndarray | None:
        """E[tokens] of the step that verifies `draft` cut to its first j tokens, j = 0..len(draft): float64
        [len(draft) + 1] (`cost_model.expected_tokens`), so that a server may cut it to meet other sequences' passes
        (`cost_model.meet`). Default: None (no estimate: never cut)."""
        return None

    def observe_prefill(self, n_evaluated: int, ms: float, n_batch: int) -> None:
        """Learn from a prefill of `n_evaluated` tokens that took `ms` milliseconds (chunks of <= n_batch)."""

    def observe(self, step: Step) -> None:
        """Learn from the step just taken."""

    def end_reply(self) -> None:
        """The reply under way ended (finished, stopped or abandoned): what it taught becomes what every sequence
        of this controller starts its next reply from."""
        return None  # a body, so that the type checker does not count this default hook as abstract

    def sequence(self) -> KController:
        """The controller one sequence generates with (each lane of a server has its own): every hook above, on
        state of its own for the reply under way, sharing what is learnt across replies. Default: this controller
        itself (one without per-reply state)."""
        return self

    def snapshot(self) -> dict[str, Any]:
        """The current cost model and choice, JSON-serialisable (stats, tune, --json)."""
        return {}


class FixedK(KController):
    """`--k N`: always N. Still learns the cost model, so stats and tune can show what auto would have expected."""

    def __init__(self, k: int, curve: VerifyCurve | None = None) -> None:
        if not 0 <= k <= K_LIMIT:
            raise ValueError(f"K must be between 0 and {K_LIMIT}, got {k}.")
        self.k = k
        self.model = CostModel(max(k, DEFAULT_K_MAX), curve=curve)

    def next_k(self) -> int:
        return self.k

    def observe_prefill(self, n_evaluated: int, ms: float, n_batch: int) -> None:
        self.model.observe_prefill(n_evaluated, ms, n_batch)

    def observe(self, step: Step) -> None:
        self.model.observe(step)

    def snapshot(self) -> dict[str, Any]:
        return {"mode": "fixed", "k": self.k} | self.model.snapshot()


class AdaptiveK(KController):
    """`--k auto`: the K with the highest expected tokens/s under the learnt `CostModel` (docs/design.md).

    Args:
        k_max: the longest draft asked of a drafter without evidence (a draft model), 1..64.
        lookup_k_max: the longest draft asked of a free lookup drafter, then trimmed by its match (`trim`).
        probe_every: steps between probes (K = 3 while plain decoding wins; an unmeasured batch size otherwise).
        half_life: steps (observations of a bucket, for match-length evidence) after which evidence weighs half.
        prior: what the cost model assumes before measuring. margin: K > 0 must beat K = 0 by this fraction.
        curve: this machine's measured verify curve (`core.verify_timing.measure`), or None: then v(b) is learnt
            from the passes made, with probes of unmeasured sizes.

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(
        self,
        k_max: int = DEFAULT_K_MAX,
        *,
        lookup_k_max: int = LOOKUP_K_MAX,
        probe_every: int = 16,
        half_life: float = 32.0,
        prior: CostPrior | None = None,
        margin: float = MARGIN,
        curve: VerifyCurve | None = None,
    ) -> None:
        if not 1 <= k_max <= K_LIMIT:
            raise ValueError(f"k_max must be between 1 and {K_LIMIT}, got {k_max}.")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}.")
        if not half_life > 0.0:
            raise ValueError(f"half_life must be > 0 steps, got {half_life}.")
        if not 1 <= lookup_k_max <= K_LIMIT:
            raise ValueError(f"lookup_k_max must be between 1 and {K_LIMIT}, got {lookup_k_max}.")
        self.k_max = k_max
        self.lookup_k_max = max(k_max, lookup_k_max)
        self.probe_every = probe_every
        self.margin = margin
        # What is learnt across replies (a sequence's own copy while its reply is under way: `sequence`):
        self.model = CostModel(self.lookup_k_max, half_life, prior or CostPrior(), curve)
        self._branch_hits = np.zeros(2)  # decayed [right, tried]: a second branch right where the first was wrong
        self.evidence = False  # a draft with a match length was seen: ask for lookup_k_max, then trim
        self._evidence_ms: list[float] = []  # draft_ms of the last 8 steps whose draft had evidence
        self._runs: dict[str, _RunModel] = {}  # per lookup source: how this controller's runs of accepted tokens go
        self._version = 0  # bumped each time a sequence hands its reply's learning back (`end_reply`)
        self._last: AdaptiveK = self  # the sequence that last ended a reply (its choice is what `snapshot` shows)
        # A sequence's (`sequence`): the controller it shares its learning with (None: itself, learning in place),
        # the version of it this reply's copy was taken from, and what this reply learnt, in order
        self._root: AdaptiveK | None = None
        self._base = -1
        self._log: list[tuple] | None = None  # None: no reply under way on a copy
        self._begin_sequence()

    def _begin_sequence(self) -> None:
        """The per-sequence state, as a new sequence starts it: K, probe schedules and windows, the current run."""
        self.asked_all = False  # the last next_k was an ask for a whole lookup draft (empty: a plain step, K = 0)
        self._lookup: dict[str, _LookupState] = {}  # per lookup source: probe schedule and window by bucket
        self.k = 0  # the last K handed out
        self.best = 0  # the model's choice at that time
        self.failures = 0  # probes in a row that did not pay
        # steps since the last probe / exploration: the first probe comes at once, so that a drafter's free lookup
        # drafts with evidence are found on the reply's second step, not `probe_every` plain steps later
        self._since = self.probe_every - 1
        self._interval = self.probe_every
        self._burst = [0, 0.0]  # tokens and ms of the current burst of probes
        self._reply_started = False  # a step was taken since the last prefill (the first one after it is plain)
        self._run = 0  # tokens this reply made since its last rejected draft

    def next_k(self) -> int:
        """K for the next step. The first step of every reply is plain: its token comes at once after the prefill, as
        plain decoding's does, not after a verify pass over a draft (it also times v(1)); then a free lookup drafter
        with evidence is asked for `lookup_k_max` tokens (`choose` then picks and trims); otherwise the draft model's
        best K (`_model_k`)."""
        self.asked_all = False  # True: K is an ask for the whole lookup draft, which `trim` cuts
        first, self._reply_started = not self._reply_started, True
        if first or (not self.model.measured(1) and self.model.curve is None):  # a plain step measures v(1) first
            self.k = self.best = 0
            return 0
        self.asked_all = self.evidence and self._free_drafts()
        if self.asked_all:
            self.k = self.lookup_k_max  # a free lookup draft, as long as it goes: `trim` chooses K
            return self.k
        self.k = self._model_k()
        return self.k

    def _model_k(self) -> int:
        """The best K for a drafter without evidence (a draft model) under the pooled estimates. At K* = 0 a probe
        (K = 3) every `probe_every` steps while perfect drafts could still pay, the first at once (and, for a drafter
        without a model whose lookups found nothing yet, again the next step: `choose`), in bursts while probes pay
        and backing off to 4 x when they do not; at K* > 0 one step at each batch size not yet timed, and a plain step
        to refresh v(1) when it is 8 x `probe_every` steps old."""
        rates = self.model.rates()
        assert rates is not None  # (next_k comes here once v(1) is known)
        rates = rates[: self.k_max + 1]
        best = best_k(rates, self.margin)
        if (best > 0) != (self.best > 0):
            self._since = 0  # a regime change: no probe right away
        self.best = best
        self._since += 1
        k = best
        if best == 0:
            if self._since >= self._interval and self._could_pay():
                k, self._since = min(PROBE_K, self.k_max), 0
        else:
            self.failures, self._interval, self._burst = 0, self.probe_every, [0, 0.0]
            if self._since >= self.probe_every and self.model.curve is None:  # a measured curve knows every size
                self._since = 0
                grid = (best + 1, *EXPLORE_K)
                unmeasured = [j for j in grid if best < j <= self.k_max and not self.model.measured(j + 1)]
                if unmeasured:
                    k = unmeasured[0]  # the next batch size up, then the grid: a CPU's curve is concave
                elif self.model.steps - self.model.last_seen(1) >= 8 * self.probe_every:
                    k = 0  # refresh v(1)
        return k

    def choose(self, drafts: Sequence[Draft], has_model: bool, k: int) -> tuple[int, Draft | None]:
        """The draft with the highest expected tokens/s this step: the best free lookup draft trimmed to its best K
        (`trim`), the draft model at its best K, or a plain step (see `KController.choose`). Each lookup draft is
        valued by the acceptance its source has shown after matches of its length; the draft model by its pooled
        acceptance and measured cost per token. docs/design.md, "Choosing the source"."""
        lookup, k_lookup, rate_lookup = None, 0, 0.0
        if drafts:
            lookup = max(drafts, key=self._value) if len(drafts) > 1 else drafts[0]
            k_lookup = self.trim(lookup)  # the chosen lookup draft's K, with its bookkeeping (probes, windows)
            if has_model and k_lookup:  # what the draft model must beat
                rate_lookup = self._value(cut(lookup, k_lookup))
        if has_model and (self.asked_all or lookup is not None):
            k_model = min(self._model_k(), k) if self.asked_all else k  # without an ask-all, next_k was _model_k
            rates = self.model.rates()
            rate_model = float(rates[k_model]) / 1000.0 if k_model and rates is not None else 0.0
            if k_model and rate_model > (1.0 + self.margin) * rate_lookup:
                self.k = k_model
                return k_model, None
        elif has_model:
            return k, None  # next_k was the model's K
        if lookup is None:
            if not has_model and not self.evidence:
                self._since = self._interval - 1  # a lookup drafter's probe that found nothing cost nothing: again
            # nothing found: after an ask for everything, a plain step (K = 0); else the ask stands, drafted empty
            return (0 if self.asked_all else k), None
        if k_lookup == 0:
            return 0, cut(lookup, 0)  # a plain step; the empty draft tells `observe` its evidence
        return (k, lookup) if k_lookup >= len(lookup) else (k_lookup, cut(lookup, k_lookup))

    def _value(self, draft: Draft) -> float:
        """Expected tokens per ms of verifying `draft` (a lookup draft) at its best length, at its source's acceptance
        after matches of its length (0 without a verify curve). At its best length, not whole: a long draft from a
        source whose later positions are uncertain is worth what its first tokens are worth."""
        v = self.model.verify_curve()
        n = min(len(draft), self.model.k_max)
        if v is None or n == 0:
            return 0.0
        accept = self._accept(draft, n)  # [n]
        return float((expected_tokens(accept)[1:] / v[1 : n + 1]).max())  # [n] tokens per ms by K = 1..n

    def _could_pay(self) -> bool:
        """Would drafting beat plain decoding if every draft token were accepted, at the measured costs? When not
        (a draft model as slow as the target's per-token verify cost), probing for better acceptance is futile."""
        v = self.model.verify_curve()
        if v is None:
            return True
        # Only K whose verify batch lies within the sizes verify steps have timed: beyond them the curve is
        # interpolated towards the prefill's point, which is optimistic on a CPU and would keep futile probes alive.
        top = self.model.largest_verified() - 1 if self.model.curve is None else self.k_max
        k_top = min(self.k_max, max(PROBE_K, top))
        d, c = self.model.draft_cost()
        ms = expected_ms(v[: k_top + 1], d, c, np.ones(k_top))  # [k_top + 1]
        perfect = np.arange(1, k_top + 2) / ms  # tokens per ms by K, all accepted
        return bool(perfect[1:].max() > (1.0 + self.margin) * perfect[0])

    def _free_drafts(self) -> bool:
        """Lookup drafts cost the same per call whatever their length; the fastest of the last 8 calls (the first
        call of a process can be 40 x slower while numpy and the store warm up) decides whether they are free."""
        if not self._evidence_ms:
            return False
        v = self.model.verify_curve()
        assert v is not None  # (next_k comes here once v(1) is known)
        return flat(v) or min(self._evidence_ms) < CHEAP_DRAFT * float(v[0])

    def trim(self, draft: Draft) -> int:
        """K for a draft with evidence (`Draft.match_len` > 0): the best K <= len(draft) for its match-length
        bucket: the K with the highest expected tokens/s for the acceptance measured after matches of that length,
        at most twice the positions the bucket has been verified at (slow start) and its window (halved to twice the
        accepted length by a rejection, doubled by a draft accepted whole). Drafts without evidence are verified
        whole. docs/design.md, "Drafts with evidence"."""
        n = len(draft)
        if n == 0 or draft.match_len <= 0:
            return n
        self.evidence = True
        b = bucket_of(draft.match_len)
        state = self._lookup_state(draft.source)
        # Slow start: at most twice the positions this bucket has been verified at, or the size cheapest per token
        # within four times them, so a few lucky drafts do not send a 64-token pass on the strength of the prior
        # alone (on a steep CPU curve a failed deep pass costs dozens of plain steps), while a curve whose cheap size
        # lies past a dear stretch (b = 16 after 5..15) is reached in one jump, not crept towards through the dear
        # sizes.
        seen = self.model.verified_depth(b, draft.source)
        v = self.model.verify_curve()
        allowance = max(
            PROBE_K, 2 * seen, _cheapest_per_token(v, seen, self._known_k(SLOW_START_GROWTH * seen + PROBE_K))
        )
        if flat(v) and self.model.curve is not None:
            allowance = K_LIMIT  # a measured flat curve: a deep pass that fails costs little more than a plain step
        elif self.model.curve is not None:
            # deep only behind evidence of a long run: its match, or the tokens this reply has made since its last
            # rejected draft (on a steep curve a deep pass that fails early costs many plain steps)
            allowance = min(allowance, max(DEEP_K, DEEP_EVIDENCE * max(draft.match_len, self._run)))
        n = min(n, self.model.k_max, allowance, int(state.window[b]))
        if v is None:
            return n
        accept = self._accept(draft, n)  # [n]
        expected = expected_tokens(accept)  # [n + 1] tokens by K
        k = best_k(expected / v[: n + 1], self.margin)  # tokens per ms by K
        if (
            self.model.curve is None
            and seen
            and k < n
            and accept[:seen].min() >= FRONTIER_ACCEPTANCE
            and expected[n] >= FRONTIER_ACCEPTANCE * (n + 1)
        ):
            # Every verified position is nearly always right, and so is the whole draft expected to be: verify all
            # of it (at most twice the verified depth: slow start), to learn the positions and batch sizes beyond.
            # Without this the verify curve traps K: beyond the largest batch a verify step has timed, v(b) is
            # extrapolated, and a CPU's bumpy curve (b = 5 to 9 costs a plain step per token, b = 33 to 65 a third
            # of one) makes a local optimum (K = 2..4) look best, while a pass over tokens that will nearly all be
            # accepted costs little even where b turns out slow. (A measured curve knows every size: the K with the
            # best expected tokens per ms is taken as it is, on the curve's cheap sizes.)
            k = n
        state.since[b] += 1
        if k == 0:
            if state.since[b] >= state.interval[b]:
                # a probe of a short match verifies one token (on a CPU a failed 3-token pass costs more than a
                # plain step)
                probe = PROBE_K if BUCKET_EDGES[b] >= EARLY_PROBE_MATCH else 1
                k, state.since[b] = min(n, probe), 0  # since = 0: `observe` knows the step was this probe
        else:
            state.interval[b] = self.probe_every
        self.k = k
        return k

    def _known_k(self, k: int) -> int:
        """k, or less: the largest K whose pass cost is known, on the measured curve or timed by a verify step (past
        them a learnt curve is extrapolated, and its cost per token only falls)."""
        return k if self.model.curve is not None else min(k, self.model.largest_verified() - 1)

    def branch(self, draft: Draft, drafts: Sequence[Draft], room: int) -> Draft | None:
        """The second candidate that raises the pass's expected tokens per ms the most, cut to its best length, or
        None. A tree of `draft` (A, m tokens, acceptance a_i by its source and match) and a candidate B that shares
        its first c tokens yields (docs/design.md, "The free slots"):

            E = E_A + P(A_1..A_c accepted) (1 - a_(c+1)) beta sum_(j>=1) prod_(c+1 < i <= c+j) b_i

        where beta is the chance that B's token is right where A's is wrong (learnt from branch steps, prior b_(c+1):
        B's own acceptance by its source and match), against the pass's cost v(1 + m + j). B is cut to the j with
        the best E / v, kept only when that beats A alone by the margin: on a curve with free slots (v(8) = v(6)),
        B's tokens cost nothing and any chance pays; on a linear one they rarely do."""
        v = self.model.verify_curve()
        m = len(draft)
        if v is None or m == 0 or draft.match_len <= 0 or not drafts:
            return None
        room = min(room, self.model.k_max + 1, len(v))
        a = self._accept(draft, m)  # [m]
        e_a = float(expected_tokens(a)[m])
        best_rate, best = (1.0 + self.margin) * e_a / float(v[m]), None
        reach = np.concatenate(([1.0], np.cumprod(a)))  # [m + 1] P(A's first i tokens accepted)
        for alt in drafts:
            c = common_prefix(draft.tokens, alt.tokens)
            n_new = min(len(alt) - c, room - 1 - m)  # B's tokens after the shared prefix that fit
            if c >= m or n_new <= 0 or alt.match_len <= 0:
                continue
            b = self._accept(alt, c + n_new)[c:]  # [n_new] B's acceptance from its divergence on
            hits, tried = self._branch_hits
            beta = (hits + BRANCH_PRIOR * b[0]) / (tried + BRANCH_PRIOR)
            p_b = reach[c] * (1.0 - a[c]) * beta * np.concatenate(([1.0], np.cumprod(b[1:])))  # [n_new]
            rates = (e_a + np.cumsum(p_b)) / v[m + 1 : m + 1 + n_new]  # [n_new] tokens per ms by B's length j
            j = int(np.argmax(rates))
            if rates[j] > best_rate:
                best_rate, best = float(rates[j]), cut(alt, c + j + 1)
        return best

    def expected(self, draft: Draft) -> np.ndarray | None:
        """E[tokens] by how much of a lookup draft with evidence is verified, from `_accept`: float64 [len(draft) +
        1]; None for a draft without evidence (a draft model's) or longer than `k_max` (see `KController`)."""
        n = len(draft)
        if n == 0 or draft.match_len <= 0 or n > self.model.k_max:
            return None
        return expected_tokens(self._accept(draft, n))

    def _accept(self, draft: Draft, n: int) -> np.ndarray:
        """a_i of a lookup draft's first n tokens (n <= k_max). With a measured curve: what the run model says of
        this run (`_RunModel`: its evidence pooled over positions, since per-position estimates from a few drafts are
        noise that sends K up and down, and the chain past the last verified position only repeats that position's),
        raised to what earlier runs (a restored state) measured at positions this run has not verified. With a learnt
        one (whose slow start reads them): the source's acceptance after matches of its length at the positions this
        run verified, raised to the run model's past them. Before the run model has any evidence, the source's
        acceptance. Times the draft's own continuation probabilities where it has them (where past continuations part
        ways, the draft is a guess from there on). float [n]."""
        n = min(n, self.model.k_max)
        b = bucket_of(max(draft.match_len, 1))
        accept = np.maximum(self.model.acceptance(b, draft.source)[:n], self.model.run_acceptance(b, draft.source)[:n])
        run = self._runs.get(draft.source)
        if run is not None:
            p = run.continues(draft.match_len)
            depth = min(self.model.run_depth(b, draft.source), n)
            if self.model.curve is None:  # a learnt curve: its slow start reads the verified positions' own estimates
                accept[depth:] = np.maximum(accept[depth:], p)
            else:
                known = min(max(depth, self.model.verified_depth(b, draft.source)), n)
                accept[:depth] = p
                accept[depth:known] = np.maximum(accept[depth:known], p)
                accept[known:] = p
        return accept * draft.probs[:n] if draft.probs is not None else accept

    def _lookup_state(self, source: str) -> _LookupState:
        state = self._lookup.get(source)
        if state is None:
            state = self._lookup[source] = _LookupState.new(self.probe_every)
        return state

    # -- sequences: per-reply state of their own, learning shared across replies ---------------------------------

    def sequence(self) -> AdaptiveK:
        """A controller for one sequence (a lane of `specdec serve`) of this one: with the same settings, its own
        per-reply state (K, probe schedules and windows, the current run) and this controller's learning (the cost
        model, acceptance by source and match, draft costs, the run model). While a reply is under way it
        learns on a copy of that learning as the reply found it, which `end_reply` hands back, so sequences that
        generate at once never see each other's half-done replies; one sequence alone decides exactly as this
        controller would in place."""
        root = self._root or self
        seq = AdaptiveK(
            root.k_max,
            lookup_k_max=root.lookup_k_max,
            probe_every=root.probe_every,
            half_life=root.model.half_life,
            prior=root.model.prior,
            margin=root.margin,
            curve=root.model.curve,
        )
        seq._root = root
        seq._share(root)
        return seq

    def _share(self, root: AdaptiveK) -> None:
        """Take `root`'s learning as this sequence's (the same objects: nothing is copied until a reply begins)."""
        self.model, self.evidence, self._runs = root.model, root.evidence, root._runs
        self._evidence_ms, self._branch_hits, self._base = root._evidence_ms, root._branch_hits, root._version

    def _start_reply(self) -> None:
        """A sequence's reply begins: a copy of the shared learning as it is now (a verify curve is shared, not
        copied: it never changes) to learn on, and an empty log of what the reply teaches."""
        root = self._root
        if root is None:
            return
        self.end_reply()  # a reply abandoned without its end (a generator never closed): hand it back first
        self._share(root)
        self.model = copy.deepcopy(root.model, {id(root.model.curve): root.model.curve})
        self._evidence_ms, self._branch_hits = list(root._evidence_ms), root._branch_hits.copy()
        self._runs = {source: run.copy() for source, run in root._runs.items()}
        self._log = []

    def end_reply(self) -> None:
        """Hand this reply's learning back to the shared controller: its copy as it is when no other sequence
        handed one back since the copy was taken (one sequence alone: exactly what learning in place gives), else
        the reply's steps learnt again on top of what the others handed back. Nothing on the controller itself."""
        root, log = self._root, self._log
        if root is None or log is None:
            return
        self._log = None
        if root._version == self._base:
            root.model, root._evidence_ms, root._branch_hits = self.model, self._evidence_ms, self._branch_hits
            root._runs = self._runs
        else:
            for entry in log:
                if entry[0] == "prefill":
                    root.model.observe_prefill(*entry[1:])
                else:
                    root._learn(entry[1])
        root.evidence = root.evidence or self.evidence
        root._version += 1
        root._last = self
        self._share(root)

    def _learn(self, step: Step) -> int | None:
        """What a step teaches across replies: the lookup drafts' cost, the second branch's chance, the cost model,
        the run model. Returns the step's match-length bucket (None: no draft with evidence)."""
        if step.match_len > 0:  # a lookup draft with evidence was chosen (possibly trimmed to nothing)
            self._evidence_ms = [*self._evidence_ms[-7:], step.draft_ms]
        if step.branch:  # did the second branch have its token right where the first did not?
            self._observe_branch(step)
        bucket = bucket_of(step.match_len) if step.drafted and step.match_len > 0 else None
        self.model.observe(step, bucket, step.source)
        if bucket is not None:
            self._runs.setdefault(step.source, _RunModel(step.source)).observe(step)
        return bucket

    def observe_prefill(self, n_evaluated: int, ms: float, n_batch: int) -> None:
        self._start_reply()
        self._reply_started = False  # a new reply: its first step is plain (`next_k`)
        self._run = 0
        self.model.observe_prefill(n_evaluated, ms, n_batch)
        if self._log is not None:
            self._log.append(("prefill", n_evaluated, ms, n_batch))

    def observe(self, step: Step) -> None:
        """Learn from the step just taken. What it drafted from is in the record (`Step.source`, and the lookup
        draft's evidence `Step.match_len`); nothing is carried over from `choose` but the learnt statistics and the
        probe schedules: a bucket's probe is the one trim that sets its `since` to 0, and a draft without evidence
        verified while the draft model's best K is 0 is the model's probe."""
        self._reply_started = True
        self._run = 0 if step.rejected else self._run + len(step.emitted)
        bucket = self._learn(step)
        if self._log is not None:
            self._log.append(("step", step))
        if bucket is not None:
            state = self._lookup_state(step.source)
            if step.rejected:
                state.window[bucket] = max(PROBE_K, 2 * step.n_accepted)
            elif step.n_accepted == len(step.drafted):  # grows as the slow start does (`trim`)
                n = len(step.drafted)
                cheap = _cheapest_per_token(
                    self.model.verify_curve(), n, self._known_k(SLOW_START_GROWTH * n + PROBE_K)
                )
                state.window[bucket] = max(int(state.window[bucket]), 2 * n, cheap)
            if state.since[bucket] == 0:
                # A bucket's probe that did not beat plain decoding stretches that bucket's probe interval.
                v1 = self.model.verify_curve()
                paid = v1 is not None and (step.n_accepted + 1) * float(v1[0]) >= step.verify_ms
                state.interval[bucket] = (
                    self.probe_every if paid else min(2 * state.interval[bucket], MAX_BACKOFF * self.probe_every)
                )
            return
        if not step.drafted or self.best > 0:  # not a probe of the draft model (or it had nothing)
            return
        # A burst of probes continues (next probe 2 steps later) while its pooled tokens/s beat plain decoding;
        # pooling keeps one unlucky probe from ending a burst once drafts have improved.
        self._burst[0] += step.n_accepted + 1
        self._burst[1] += step.draft_ms + step.verify_ms
        v1 = self.model.verify_curve()
        plain_ms = float(v1[0]) if v1 is not None else 0.0
        if self._burst[0] * plain_ms >= self._burst[1]:
            self.failures, self._interval = 0, max(1, self.probe_every // 8)
        else:
            self._burst = [0, 0.0]
            self.failures += 1
            self._interval = self.probe_every * min(2**self.failures, MAX_BACKOFF)

    def _observe_branch(self, step: Step) -> None:
        """Count a branch step for beta (`branch`): at the node where the branches part (c shared tokens), was the
        second branch's token accepted, given the path reached the node and the first's was not? (Where the first's
        token was accepted the second could not be: that says nothing of beta.)"""
        first = step.branch if step.branch_won else step.drafted  # the controller's draft, A
        c = common_prefix(np.asarray(step.drafted), np.asarray(step.branch))
        self._branch_hits *= self.model.decay
        if step.branch_won and step.n_accepted > c:
            self._branch_hits += (1.0, 1.0)
        elif not step.branch_won and step.n_accepted == c and c < len(first) and step.target_token is not None:
            self._branch_hits += (0.0, 1.0)

    def state(self) -> dict[str, Any]:
        """What this controller learnt, for a later process (`specdec_cli.stores.learnt`): the cost model and whether
        its drafter's drafts are free lookup drafts with evidence."""
        return {"model": self.model.state(), "evidence": self.evidence, "evidence_ms": list(self._evidence_ms)}

    def restore(self, state: dict[str, Any], max_weight: float = 8.0) -> None:
        """Continue from `state()` of an earlier run (see `CostModel.restore`). Raises ValueError, TypeError or
        KeyError when `state` does not fit this controller; it is then unchanged."""
        evidence = bool(state["evidence"])
        evidence_ms = [float(x) for x in state["evidence_ms"]][-8:]
        model = CostModel(self.model.k_max, self.model.half_life, self.model.prior, self.model.curve)
        model.restore(state["model"], max_weight)
        self.model, self.evidence, self._evidence_ms = model, evidence, evidence_ms
        self._version += 1  # a reply under way on a copy of the old learning is learnt again on this one

    def snapshot(self) -> dict[str, Any]:
        """The learning, and the choice of the sequence that last ended a reply (this controller's own when none)."""
        seq = self._last
        return {
            "mode": "auto",
            "k": seq.k,
            "best_k": seq.best,
            "k_max": self.k_max,
            "probe_interval": seq._interval,
            "failed_probes": seq.failures,
            "steps": self.model.steps,
            "lookup_k_max": self.lookup_k_max,
            "trims_by_evidence": self.evidence,
            "branch_hits": [round(float(x), 3) for x in self._branch_hits],
        } | self.model.snapshot()


def flat(v: np.ndarray | None) -> bool:
    """A flat verify curve (a GPU's): v(b) at b = 64 (or the largest b it has, at least 33) <= `FLAT` x v(1).
    v: float [m], v(b) for b = 1..m, or None (False)."""
    if v is None or len(v) < 33:
        return False
    return bool(v[min(len(v), 64) - 1] <= FLAT * v[0])


def _cheapest_per_token(v: np.ndarray | None, seen: int, top: int) -> int:
    """The K in (seen, top] whose pass costs least per token, v(K + 1) / (K + 1) (0: no curve, nothing verified yet,
    or no such K). v: float [k_max + 1], v(b) for b = 1..k_max + 1."""
    if v is None or seen <= 0:
        return 0
    top = min(top, len(v) - 1)
    if top <= seen:
        return 0
    ks = np.arange(seen + 1, top + 1)  # [m] candidate K
    return int(ks[np.argmin(v[ks] / (ks + 1))])


class _RunModel:
    """How runs of accepted tokens continue, learnt from this controller's own steps (not restored from earlier
    prompts), for one lookup source: a geometric run whose every verified position breaks with hazard h, estimated
    from the steps of the draft's class (matches of >= 5 tokens: inside a copy; shorter ones) as (breaks + 2 h0) /
    (verified positions + 2), h0 both classes' pooled estimate (from the prior h = 0.5, or the source's own prior).
    Decayed with a half-life of `RUN_HALF_LIFE` steps of the class, halved by a rejection (as a bucket's evidence is)
    and held to `RUN_WEIGHT` verified positions, so a copy that ends is noticed within a few steps.

    With a measured curve every position of a draft is worth 1 - h (`AdaptiveK._accept`; with a learnt one, every
    position this run has not verified): where this run's drafts have nearly always been right, K can leave a local
    optimum of the verify curve (b = 4 cheap, 5..15 dear, 16 cheapest) that per-position estimates would hold it in,
    since positions past K are never verified and their prior never moves; where they break every few tokens, as in
    free text or a copy edited often, K stays short; and positions are pooled, since estimates per position from a
    few drafts are noise that sends K up and down. The short class borrowing from the pooled h lets the few tokens
    matched right after an edit go on as the copy does. docs/design.md, "K that cannot stick"."""

    __slots__ = ("counts", "prior")

    def __init__(self, source: str = "") -> None:
        self.counts = np.zeros((2, 2))  # [class: short, long][breaks, verified positions], decayed
        # h before any evidence: 0.5, or what a source whose drafts are right from the first token starts from
        self.prior = 1.0 - SOURCE_PRIOR.get(source, 1.0 - RUN_PRIOR[0] / RUN_PRIOR[1])

    def copy(self) -> _RunModel:
        run = _RunModel()
        run.counts, run.prior = self.counts.copy(), self.prior
        return run

    def observe(self, step: Step) -> None:
        c = self.counts[int(step.match_len >= RUN_LONG_MATCH)]
        c *= 0.5 ** (1.0 / RUN_HALF_LIFE) * (REJECTION_DECAY if step.rejected else 1.0)
        c += (1.0 if step.rejected else 0.0, step.n_accepted + (1 if step.rejected else 0))
        if c[1] > RUN_WEIGHT:
            c *= RUN_WEIGHT / c[1]

    def continues(self, match_len: int) -> float:
        """1 - h for a draft after a match of `match_len` tokens: the chance that a verified position is accepted.
        Each class's h starts from both classes' pooled (`CLASS_PRIOR`): in a copy, the few tokens matched right after
        an edit go on as the copy does; in free text neither class has runs."""
        breaks, verified = self.counts.sum(axis=0)
        h_all = (breaks + RUN_PRIOR[1] * self.prior) / (verified + RUN_PRIOR[1])
        breaks, verified = self.counts[int(match_len >= RUN_LONG_MATCH)]
        return 1.0 - (breaks + CLASS_PRIOR * h_all) / (verified + CLASS_PRIOR)


@dataclass(slots=True)
class _LookupState:
    """One lookup source's schedule, by match-length bucket (int64 [7] each).

    since: drafts since the bucket's last probe (a match of 5+ tokens is probed on its first draft: a copy run is
        worth finding early; once found, its drafts are long and right). interval: drafts between its probes while
        its trim is 0 (doubled by a probe that did not pay, up to 4 x). window: the longest K allowed now, cut to
        twice the accepted length by a rejection and doubled by a draft accepted whole (TCP's congestion window).
    """

    since: np.ndarray
    interval: np.ndarray
    window: np.ndarray

    @classmethod
    def new(cls, probe_every: int) -> _LookupState:
        return cls(
            since=np.where(BUCKET_EDGES >= EARLY_PROBE_MATCH, probe_every - 1, 0).astype(np.int64),
            interval=np.full(len(BUCKET_EDGES), probe_every, dtype=np.int64),
            window=np.full(len(BUCKET_EDGES), K_LIMIT, dtype=np.int64),
        )


__all__ = ["AdaptiveK", "FixedK", "KController", "flat"]
