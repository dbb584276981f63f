"""Sampling and verification math: pure numpy, no model.

Processing (`process`) turns one row of target logits into the distribution the target would sample from, in
llama.cpp's common-sampler order (`common_params_sampling::samplers` in `common/common.h`: penalties, dry,
top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature, then dist). specdec implements the subset
top-k → top-p → min-p → temperature, with llama.cpp's semantics:

- top-k keeps the k largest logits (k <= 0 or k >= V: off);
- top-p softmaxes the survivors at temperature 1 and keeps the smallest prefix (by logit, descending) whose
  cumulative probability reaches top_p, the crossing token included (top_p >= 1: off);
- min-p keeps tokens with logit >= max logit + log(min_p), i.e. p >= min_p × p_max (min_p <= 0: off);
- temperature divides the surviving logits, then softmax; temperature <= 0 is greedy (one-hot on the argmax).

Truncation happens at temperature 1 and temperature only reshapes the survivors, as in llama.cpp.

Greedy verification (temperature 0): accept the longest prefix of the draft on which the target's argmax agrees,
then take the target's own token at the first disagreement (the correction) or after the last draft token (the
bonus token). The output is the target's greedy decode by construction.

Stochastic verification (temperature > 0) is rejection sampling (Leviathan, Kalman, Matias 2023, "Fast Inference
from Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling"): accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
rejection emit a token from norm(max(0, p_i − q_i)). Every emitted token is then distributed exactly as the
target's processed distribution p_i, whatever the drafter: see `verify_stochastic`.

A seeded generation (`SamplingParams.seed` set) samples by position instead, so that its output is the same
whatever was drafted, with any drafter and any K, and equal to plain decoding's with the same seed: drafter-invariant
speculative decoding (Daliri et al. 2024, "Coupling without Communication and Drafter-Invariant Speculative
Decoding", arXiv 2411.18104). The token at sequence position i is the Gumbel-max draw
argmax_v(log p_i(v) + G(seed, i, v)) over p_i's candidates, with G standard Gumbel noise from a counter-based hash
(splitmix64: `exponential`, whose E = exp(−G) gives the same draw as argmin_v(E(v) / p_i(v)), one logarithm fewer),
so it depends only on (seed, i, p_i): an exact draw from p_i, independent across positions.
A draft token is accepted iff it equals that draw, and the first one that differs is replaced by it
(`verify_keyed`). Drafters with a distribution q (a draft model, an MTP block) draft argmax_v(log q_i(v) +
G(seed, i, v)) with the same noise (`sample_at`), which couples q's draw to p's: they agree with probability at least
(1 − TV) / (1 + TV). Rejection sampling's 1 − TV is higher, so an unseeded generation, which nobody can replay,
keeps rejection sampling; for a deterministic drafter the two accept a draft token equally often (p_i(d_i)).

Two drafts verified in one pass (a token tree: `verify_branches`) follow the multi-candidate rule of SpecInfer
(Miao et al. 2024, "SpecInfer: Accelerating Large Language Model Serving with Tree-based Speculative Inference and
Verification", multi-step speculative sampling) for deterministic candidates: at each node the distinct next tokens
of the branches still on the accepted path are tried in order, each accepted with probability r(x) / sum(r), where
the residual r starts as p and loses every rejected candidate; when none is accepted the token is drawn from r. For
one-hot drafters this is recursive rejection sampling (Jeon et al. 2024) and equals drawing y ~ p and following the
branch whose token is y, so every emitted token is distributed as p. Greedy: the branch the target's argmax follows
furthest wins.

Constrained generation (a grammar, `specdec_cli.core.constraint`) makes the target distribution the constrained one:
each verified row's logits are masked by the grammar's allowed tokens at that position (a bitmask, llguidance's layout:
int32 [rows, ceil(V/32)], token t allowed iff bit t % 32 of word t // 32 is set) before anything else, so greedy
verification takes the masked argmax and rejection sampling the masked, renormalised distribution. Both stay
lossless with respect to that distribution (the drafter's q is unchanged: a draft token it proposed outside the
grammar is cut before verification).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are chosen from the target's logits.

    Attributes:
        temperature: 0 = greedy (argmax). > 0 samples from softmax(logits / temperature) after truncation.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set whose probability reaches top_p (1.0 = off).
        min_p: drop tokens whose probability is below min_p × the top probability (0.0 = off).
        seed: seed of the random stream (None = from OS entropy).
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class Dist:
    """A processed (truncated, renormalised) distribution over a sparse candidate set.

    Attributes:
        ids: int32 [n] candidate token ids (distinct).
        probs: float64 [n] their probabilities, summing to 1.
    """

    ids: np.ndarray
    probs: np.ndarray

    def prob_of(self, token: int) -> float:
        """Probability of `token` (0.0 when it is not a candidate)."""
        hit = (self.ids == token).nonzero()[0]
        return float(self.probs[hit[0]]) if len(hit) else 0.0


def make_rng(seed: int | None) -> np.random.Generator:
    """The random stream of one generation: PCG64 seeded with `seed` (None = fresh OS entropy)."""
    return np.random.Generator(np.random.PCG64(seed))


# With top-k off, top-p is searched among this many best tokens first (then 16× more, then all), so a 152k
# vocabulary is sorted only when the nucleus really is that wide.
_TOP_P_POOL = 1024


def process(logits: np.ndarray, params: SamplingParams) -> Dist:
    """The target's processed distribution for one position: top-k → top-p → min-p → temperature.

    Never sorts the whole vocabulary unless the surviving set needs it: top-k is a partition (`_top_ids`), and
    the sort, cumulative sum and softmax run on the k candidates only, in float64. With top-k off, min-p and a
    growing partition bound the set that top-p has to sort (`_untruncated`).

    Args:
        logits: float32 [V] one row of target logits. May be a read-only view into llama.cpp's buffer: it is
            never written to. Must be finite (-inf is allowed for masked tokens as long as one token is finite).
        params: the sampling parameters; temperature <= 0 gives a one-hot Dist on the argmax.

    Returns:
        A `Dist` with int32 ids and float64 probs summing to 1. Ids are sorted by descending logit, except with
        top-k and top-p both off (then ascending ids). At least the most likely token always survives.

    Raises:
        ValueError: `logits` is not a non-empty 1-D array.
    """
    if logits.ndim != 1 or logits.shape[0] == 0:
        raise ValueError(f"process() takes one row of logits, shape [V]; got shape {logits.shape}")
    if params.greedy:
        return Dist(np.array([np.argmax(logits)], dtype=np.int32), np.ones(1))
    vocab = logits.shape[0]
    k = params.top_k if 0 < params.top_k < vocab else vocab
    if k < vocab:
        # top-k: the k largest, sorted by descending logit; nothing else is sorted
        ids, lk = _sorted_desc(logits, _top_ids(logits, k))  # ids: [k], lk: [k] float64
        # top-p: softmax over the k survivors at temperature 1, keep the prefix that reaches top_p
        e = np.exp(lk - lk[0])  # e: [k]
        n = _top_p_cut(np.cumsum(e) / e.sum(), params.top_p)
        # min-p: a threshold relative to the max logit, which every stage keeps
        if params.min_p > 0.0:
            n = min(n, int(np.count_nonzero(lk[:n] >= lk[0] + math.log(min(params.min_p, 1.0)))))
        ids, lk = ids[:n], lk[:n]
    else:
        ids, lk = _untruncated(logits, params.top_p, params.min_p)
    # temperature, then a stable softmax: probs [n]
    probs = np.exp((lk - lk.max()) / params.temperature)
    probs /= probs.sum()
    return Dist(ids.astype(np.int32, copy=False), probs)


def _top_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest of `logits` [n], in no particular order: [k] (all n when k >= n).

    On a large row, a strided sample gives a threshold first: the k-th largest of any subset is <= the k-th
    largest of the whole row, so every top-k token is >= it. The full partition then runs on ~16·k candidates
    instead of n, so a large vocabulary's row is never partitioned whole (exact whatever the row holds).
    """
    n = logits.shape[0]
    if k >= n:
        return np.arange(n)
    if n >= 64 * k:
        sub = logits[::16]  # sub: [n/16]
        threshold = np.partition(sub, len(sub) - k)[len(sub) - k]
        cand = np.flatnonzero(logits >= threshold)  # cand: [>= k], holds the whole top k
        return cand[np.argpartition(logits[cand], len(cand) - k)[len(cand) - k :]]
    return np.argpartition(logits, n - k)[n - k :]


def _sorted_desc(logits: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`ids` [n] sorted by descending logit, with their logits as float64 [n]."""
    lk = logits[ids].astype(np.float64)
    order = np.argsort(-lk)
    return ids[order], lk[order]


def _top_p_cut(cum: np.ndarray, top_p: float) -> int:
    """Length of the top-p prefix: the first index where the non-decreasing `cum` [n] reaches top_p, plus one."""
    if top_p >= 1.0:
        return len(cum)
    return min(int(np.searchsorted(cum, top_p, side="left")) + 1, len(cum))


def _untruncated(logits: np.ndarray, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """top-p then min-p over the whole vocabulary (top-k off), without a full sort in the usual cases.

    Both stages keep a prefix of the tokens sorted by logit, and min-p depends only on the max logit, so the
    min-p survivors bound the candidates top-p must sort. Top-p still normalises over all V tokens (one
    vectorised float32 exp). Returns (ids int64 [n], logits float64 [n]).
    """
    vocab = logits.shape[0]
    top = float(logits.max())
    pool = None  # pool: [m] ids of the min-p survivors (None: all V)
    if min_p > 0.0:
        # min-p: a threshold relative to the max logit, no sort needed. Compare in float32 against the threshold
        # rounded down, then exactly in float64 on the few survivors (as the top-k path does).
        threshold = top + math.log(min(min_p, 1.0))
        pool = (logits >= np.nextafter(np.float32(threshold), np.float32(-np.inf))).nonzero()[0]
        pool = pool[logits[pool].astype(np.float64) >= threshold]
    if top_p >= 1.0:
        if pool is None:
            return np.arange(vocab), logits.astype(np.float64)
        return pool, logits[pool].astype(np.float64)
    e = logits - np.float32(top)  # e: [V] float32, a new array: exp(l - max) in place below
    z_all = float(np.exp(e, out=e).sum(dtype=np.float64))  # top-p's normaliser over all V
    pool_logits = logits if pool is None else logits[pool]  # pool_logits: [m]
    m = pool_logits.shape[0]
    c = min(m, _TOP_P_POOL)
    while True:
        # the c best of the pool, sorted: [c]
        best, lc = _sorted_desc(pool_logits, _top_ids(pool_logits, c))
        cum = np.cumsum(np.exp(lc - top)) / z_all  # cum: [c]
        if c == m or cum[-1] >= top_p:
            n = _top_p_cut(cum, top_p)
            return (best[:n] if pool is None else pool[best[:n]]), lc[:n]
        c = min(m, 16 * c)


def allowed(masks: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """bool [n]: whether tokens[i] is allowed by the bitmask row masks[i] (masks: int32 [n, W]; tokens: int [n])."""
    t = np.asarray(tokens, dtype=np.int64)
    words = masks[np.arange(len(t)), t >> 5].astype(np.int64)  # [n]
    return ((words >> (t & 31)) & 1).astype(bool)


def apply_mask(row: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A new float32 [V] row: `row`'s logits where the bitmask `mask` (int32 [W], W >= V/32) allows the token,
    -inf elsewhere. `row` (float32 [V], possibly a read-only view) is not written to."""
    keep = np.unpackbits(mask.astype("<i4", copy=False).view(np.uint8), count=row.shape[0], bitorder="little")
    return np.where(keep.view(bool), row, np.float32(-np.inf))


def _row(logits: np.ndarray, masks: np.ndarray | None, i: int) -> np.ndarray:
    """Row i of the target's logits, masked by the grammar when there is one."""
    return logits[i] if masks is None else apply_mask(logits[i], masks[i])


def token_logprob(
    row: np.ndarray, token: int, n_top: int = 0, mask: np.ndarray | None = None
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of `token` under softmax(row) at temperature 1, masked by `mask` (int32 [W]) and
    renormalised when given, and the `n_top` most likely tokens as (token, logprob), most likely first.

    row: float32 [V] logits (not written to). Computed in float64. Returns (logprob <= 0, top).
    """
    x = row if mask is None else apply_mask(row, mask)
    m = float(x.max())
    log_z = m + math.log(float(np.exp(x - np.float32(m), dtype=np.float64).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:
        ids, lk = _sorted_desc(x, _top_ids(x, min(n_top, x.shape[0])))
        top = tuple((int(t), float(v - log_z)) for t, v in zip(ids, lk, strict=True) if v > -np.inf)
    return float(x[token]) - log_z, top


_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2^64 / golden ratio


def _mix64(z: int) -> int:
    """splitmix64's finaliser (Steele, Lea, Flood 2014; Vigna's `splitmix64.c`) on one Python int, mod 2^64."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def exponential(seed: int, position: int, ids: np.ndarray) -> np.ndarray:
    """Standard exponential noise E(seed, position, v) for each token id v in `ids` (int [n]): float64 [n] > 0.
    −log E is standard Gumbel noise, the G of Gumbel-max.

    Counter-based: element v + 1 of the splitmix64 stream whose state is a hash of (seed, position), so each value
    depends only on its three keys, whichever other ids are asked for and in whatever order. The uniform is the top
    53 bits plus half an ulp, in (0, 1); E = −log u. Any int seed (mod 2^64) and position >= 0.
    """
    state = _mix64((_mix64((seed + _GOLDEN) & _M64) + position * _GOLDEN) & _M64)
    z = np.asarray(ids, dtype=np.uint64) + np.uint64(1)  # [n]; stream element v + 1, as splitmix64 adds first
    z *= np.uint64(_GOLDEN)
    z += np.uint64(state)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    e = (z >> np.uint64(11)).astype(np.float64)
    e += 0.5
    e *= 2.0**-53  # [n] uniforms in (0, 1)
    np.log(e, out=e)
    return np.negative(e, out=e)


def sample_at(dist: Dist, seed: int, position: int) -> int:
    """The token at sequence `position` of a generation seeded with `seed`: argmax_v(log p(v) + G(seed, position,
    v)) over `dist`'s candidates, an exact draw from `dist` (Gumbel-max) that depends on nothing else. Computed as
    argmin_v(E(v) / p(v)), E = exp(−G) (`exponential`: the same token, without a logarithm per candidate)."""
    race = exponential(seed, position, dist.ids)  # [n]
    with np.errstate(divide="ignore"):  # a probability that underflowed to 0 is never drawn (E / 0 = inf)
        race /= dist.probs
    return int(dist.ids[int(race.argmin())])


def sample(dist: Dist, rng: np.random.Generator) -> int:
    """Draw one token id from `dist` (one uniform from `rng`)."""
    return _draw(dist.ids, dist.probs.cumsum(), rng)


def _draw(ids: np.ndarray, cum: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one of `ids` [n] by inverse CDF, given the cumulative weights `cum` [n] (non-decreasing, cum[-1] > 0)."""
    # array methods, not np.* wrappers: this runs once per step on small arrays
    i = int(cum.searchsorted(rng.random() * cum[-1], side="right"))
    if i >= len(ids):  # u × total rounded up to total: take the first token that reaches the total
        i = int(cum.searchsorted(cum[-1], side="left"))
    return int(ids[i])


def _acceptance(p_x: float, q_x: float) -> float:
    """Probability of accepting a draft token x: min(1, p(x) / q(x)). q(x) = 0 means x could not have been drawn
    from q (a drafter bug or mismatched truncation): reject it."""
    if q_x <= 0.0:
        return 0.0
    return min(1.0, p_x / q_x)


def _residual(p: Dist, q: Dist | None, token: int) -> np.ndarray:
    """Unnormalised residual max(0, p − q) over p's candidates: float64 [n] aligned with p.ids.

    q None is a deterministic drafter (q = one-hot on `token`): the residual is p with `token` removed.
    """
    if q is None:
        residual = p.probs.copy()
        residual[p.ids == token] = 0.0
        return residual
    # q's probability at each of p's candidates, 0 where q has none: q_at_p [n]
    if len(p.ids) * len(q.ids) <= 65_536:  # the usual case (top-k 40): one [n, m] comparison
        q_at_p = (p.ids[:, None] == q.ids) @ q.probs
    else:  # binary search in q's sorted ids
        order = q.ids.argsort()
        at = order[np.minimum(q.ids[order].searchsorted(p.ids), len(q.ids) - 1)]  # at: [n] index into q
        q_at_p = q.probs[at] * (q.ids[at] == p.ids)
    residual = p.probs - q_at_p
    return np.maximum(residual, 0.0, out=residual)


def verify_stochastic(
    draft_tokens: np.ndarray,
    draft_dists: tuple[Dist, ...] | None,
    logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    masks: np.ndarray | None = None,
) -> tuple[int, int]:
    """Rejection-sampling verification of one draft (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    For i = 1..k, with p_i = process(logits[i-1]): accept d_i with probability min(1, p_i(d_i) / q_i(d_i)). At
    the first rejection, emit a correction drawn from norm(max(0, p_i − q_i)) (from p_i when that residual is all
    zero). When all k are accepted, emit a bonus token drawn from p_{k+1}. Each emitted token is then distributed
    exactly as the target's processed distribution at its position.

    Deterministic drafters (draft_dists None) have q_i = one-hot on d_i: d_i is accepted with probability
    p_i(d_i), and the correction is drawn from p_i with d_i removed. A model draft token with q_i(d_i) = 0 cannot
    have been sampled from q_i, so it is rejected.

    Rows are processed lazily: rows after the first rejection are never processed.

    Args:
        draft_tokens: int [k] draft tokens d_1..d_k (k may be 0).
        draft_dists: the drafter's processed q_i for each draft token, or None for a deterministic drafter.
        logits: float32 [k+1, V] target logits; row i predicts the token after d_i (row 0: after the last committed
            token). Never written to.
        params: sampling parameters with temperature > 0 (at temperature 0 every p_i is one-hot, which makes this
            greedy verification, more slowly: use `verify`).
        rng: the generation's random stream.
        masks: int32 [k+1, W] the grammar's allowed tokens for each row, or None: p_i is then the processed
            distribution of the masked row (the constrained target distribution).

    Returns:
        (n_accepted, token): the accepted prefix length, and the correction (n_accepted < k) or bonus token.

    Raises:
        ValueError: `logits` has fewer than k+1 rows, or `draft_dists` does not have one Dist per draft token.
    """
    k = len(draft_tokens)
    if logits.ndim != 2 or logits.shape[0] < k + 1:
        raise ValueError(f"verifying {k} draft tokens needs logits of shape [{k + 1}, V]; got {logits.shape}")
    if draft_dists is not None and len(draft_dists) != k:
        raise ValueError(f"{k} draft tokens but {len(draft_dists)} draft distributions")
    for i in range(k):
        p = process(_row(logits, masks, i), params)  # p_i over its candidates: [n]
        q = None if draft_dists is None else draft_dists[i]
        token = int(draft_tokens[i])
        a = _acceptance(p.prob_of(token), 1.0 if q is None else q.prob_of(token))
        if a >= 1.0 or rng.random() < a:
            continue
        cum = _residual(p, q, token).cumsum()  # cum: [n] over p.ids
        if not cum[-1] > 0.0:  # p <= q everywhere (p == q, or q(d_i) = 0 with p one-hot): sample p_i
            cum = p.probs.cumsum()
        return i, _draw(p.ids, cum, rng)
    return k, sample(process(_row(logits, masks, k), params), rng)


def verify_keyed(
    draft_tokens: np.ndarray, logits: np.ndarray, params: SamplingParams, position: int, masks: np.ndarray | None = None
) -> tuple[int, int]:
    """Drafter-invariant verification of one draft under a seed (Daliri et al. 2024, arXiv 2411.18104).

    Row i's token is `sample_at(p_i, params.seed, position + i)`, p_i = process(logits[i]) (masked by masks[i] when
    given): d_(i+1) is accepted iff it equals that token, and the first that differs is replaced by it (or, all k
    accepted, the last row's token is the bonus). The emitted tokens are the ones plain decoding with the same seed
    emits, whatever was drafted. Rows after the first rejection are never processed.

    Args:
        draft_tokens: int [k] draft tokens d_1..d_k (k may be 0).
        logits: float32 [k+1, V] target logits; row i predicts the token at `position + i`. Never written to.
        params: temperature > 0 and a seed.
        position: the sequence position (tokens before it: prompt and output) of the token row 0 predicts.
        masks: int32 [k+1, W] the grammar's allowed tokens for each row, or None.

    Returns:
        (n_accepted, token): the accepted prefix length, and the correction or bonus token.

    Raises:
        ValueError: `logits` has fewer than k+1 rows, or `params` has no seed.
    """
    k = len(draft_tokens)
    if logits.ndim != 2 or logits.shape[0] < k + 1:
        raise ValueError(f"verifying {k} draft tokens needs logits of shape [{k + 1}, V]; got {logits.shape}")
    if params.seed is None:
        raise ValueError("keyed verification needs a seed (SamplingParams.seed)")
    for i in range(k + 1):
        token = sample_at(process(_row(logits, masks, i), params), params.seed, position + i)
        if i == k or token != int(draft_tokens[i]):
            return i, token
    raise AssertionError("unreachable")


class Proposal(Protocol):
    """What verification reads of a draft (`core.draft.Draft`): int32 [k] tokens, and q_i for each (None for a
    deterministic drafter: q = one-hot)."""

    @property
    def tokens(self) -> np.ndarray: ...

    @property
    def dists(self) -> tuple[Dist, ...] | None: ...


def verify(
    draft: Proposal,
    logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    masks: np.ndarray | None = None,
    position: int | None = None,
) -> tuple[int, int]:
    """Verify `draft` against target logits float32 [len(draft)+1, V], masked by the grammar's `masks` (int32
    [len(draft)+1, W]) when given: greedy at temperature 0; with a seed, keyed by `position` (that of the token row 0
    predicts: `verify_keyed`); else rejection sampling. Returns (n_accepted, correction or bonus token). Raises
    ValueError on shape mismatches, or a seed without a position."""
    if params.greedy:
        return verify_greedy(draft.tokens, logits, masks)
    if params.seed is not None:
        if position is None:
            raise ValueError("a seeded verification needs the position of the token row 0 predicts")
        return verify_keyed(draft.tokens, logits, params, position, masks)
    return verify_stochastic(draft.tokens, draft.dists, logits, params, rng, masks)


def verify_branches(
    drafts: Sequence[np.ndarray],
    logits: np.ndarray,
    rows: Sequence[np.ndarray],
    params: SamplingParams,
    rng: np.random.Generator,
    masks: np.ndarray | None = None,
    position: int | None = None,
) -> tuple[int, int, int]:
    """Verify deterministic drafts (q = one-hot) scored in one target pass, a token tree of a few branches.

    Args:
        drafts: int [k_j] the draft tokens of each branch (they may share a prefix: the tree's shared nodes).
        logits: float32 [R, V] the pass's rows; never written to.
        rows: int [k_j + 1] for each branch: the index in `logits` of the row after each of its prefixes
            (rows[j][0] predicts the first draft token; branches share the rows of their shared prefix:
            `backend.branch_rows`).
        params: greedy at temperature 0, else the multi-candidate rejection rule (module docstring: SpecInfer, Miao
            et al. 2024; Jeon et al. 2024), exact for the target's processed distribution p; with a seed, each node's
            token is `sample_at(p, seed, position + depth)` and the branches that drafted it stay on the path.
        masks: int32 [R, W] the grammar's allowed tokens by row, or None.
        position: the sequence position of the token the root row predicts; needed with a seed.

    Returns:
        (branch, n_accepted, token): the branch the accepted path follows (the first of those that agree on it),
        how many of its draft tokens were accepted, and the target's token after them (correction or bonus).

    Raises:
        ValueError: a branch whose rows do not fit its draft, rows outside `logits`, or a seed without a position.
    """
    if any(len(r) != len(d) + 1 for d, r in zip(drafts, rows, strict=True)):
        raise ValueError("each branch needs one row more than its draft tokens")
    if max(int(np.max(r)) for r in rows) >= logits.shape[0]:
        raise ValueError(f"rows beyond the {logits.shape[0]} logits rows of the pass")
    if params.greedy:
        best = argmax_rows(logits)  # [R] the target's token after every row
        if masks is not None:
            for row in np.flatnonzero(~allowed(masks, best)):
                best[row] = np.argmax(apply_mask(logits[row], masks[row]))
        agree = []
        for d, r in zip(drafts, rows, strict=False):
            miss = np.flatnonzero(best[r[:-1]] != d)
            agree.append(int(miss[0]) if len(miss) else len(d))
        j = int(np.argmax(agree))  # the first branch among the longest
        return j, agree[j], int(best[rows[j][agree[j]]])
    alive = list(range(len(drafts)))  # branches on the accepted path so far
    i = 0
    if params.seed is not None:  # keyed: the node's own token; the branches that drafted it go on
        if position is None:
            raise ValueError("a seeded verification needs the position of the token the root row predicts")
        while True:
            p = process(_row(logits, masks, int(rows[alive[0]][i])), params)
            token = sample_at(p, params.seed, position + i)
            on = [j for j in alive if len(drafts[j]) > i and int(drafts[j][i]) == token]
            if not on:
                return alive[0], i, token
            alive, i = on, i + 1
    while True:
        p = process(_row(logits, masks, int(rows[alive[0]][i])), params)  # the node's p over its candidates
        children = list(dict.fromkeys(int(drafts[j][i]) for j in alive if len(drafts[j]) > i))
        if not children:  # every branch on the path ends here: the bonus token
            return alive[0], i, sample(p, rng)
        accepted, r = _try_candidates(p, children, rng)
        if accepted is None:  # every candidate rejected: the correction comes from the residual
            cum = r.cumsum()
            if not cum[-1] > 0.0:
                cum = p.probs.cumsum()
            return alive[0], i, _draw(p.ids, cum, rng)
        alive = [j for j in alive if len(drafts[j]) > i and int(drafts[j][i]) == accepted]
        i += 1


def _try_candidates(p: Dist, children: list[int], rng: np.random.Generator) -> tuple[int | None, np.ndarray]:
    """One node of the multi-candidate rule: try the distinct deterministic candidates in order, each accepted with
    probability r(x) / sum(r), the residual r (float64 [n] over p.ids, from p.probs) losing each rejected one.
    Returns (the accepted candidate or None, r after the rejections)."""
    r = p.probs.copy()
    for x in children:
        hit = p.ids == x
        mass, r_x = float(r.sum()), float(r[hit].sum())
        if r_x > 0.0 and rng.random() * mass < r_x:
            return x, r
        r[hit] = 0.0
    return None, r


def verify_greedy(draft: np.ndarray, logits: np.ndarray, masks: np.ndarray | None = None) -> tuple[int, int]:
    """Greedy verification of one draft.

    Args:
        draft: int32 [k] draft tokens d_1..d_k.
        logits: float32 [k+1, V] target logits; row i predicts the token after d_i (row 0: after the last committed
            token). Never written to.
        masks: int32 [k+1, W] the grammar's allowed tokens for each row, or None. The masked argmax is the row's
            argmax when the grammar allows it (one bit test); only rows whose favourite is forbidden are masked.

    Returns:
        (n_accepted, token): how many draft tokens the target's argmax agrees with (a prefix), and the target's own
        token after them: the correction at the first disagreement, or the bonus token when all k were accepted.

    Rows after the first disagreement are never read: the rows are scanned in blocks of 4, 8, 16, ... rows.
    """
    k = len(draft)
    lo, block = 0, _FIRST_BLOCK
    while True:
        hi = min(k + 1, lo + block)  # rows [lo, hi) this block
        best = argmax_rows(logits[lo:hi])  # [hi - lo] the target's token after each row
        if masks is not None:
            for i in np.flatnonzero(~allowed(masks[lo:hi], best)):  # the model's favourite is outside the grammar
                best[i] = np.argmax(apply_mask(logits[lo + i], masks[lo + i]))
        top = min(hi, k)  # draft tokens d_(lo+1)..d_top are checked against rows lo..top-1
        disagree = np.flatnonzero(best[: top - lo] != draft[lo:top])
        if len(disagree):
            n = lo + int(disagree[0])
            return n, int(best[n - lo])
        if hi == k + 1:  # every draft token accepted: the last row's token is the bonus
            return k, int(best[k - lo])
        lo, block = hi, 2 * block


_FIRST_BLOCK = 4  # verify_greedy's first block of rows; each next one is twice as large
_CHUNK = 4096  # argmax_rows: a row's maximum is found chunk by chunk, then looked up within its chunk


def argmax_rows(logits: np.ndarray) -> np.ndarray:
    """int64 [R]: `np.argmax(logits, axis=1)` of float32 [R, V] logits, exactly (the first maximum of each row; a NaN
    counts as the maximum, as in numpy), without copying a read-only array.

    numpy's argmax copies an array that is not writeable before it scans it (`PyArray_ArgMax` asks for a C-contiguous,
    aligned, writeable array), and the backends' logits are read-only views of llama.cpp's buffer: at a large vocabulary
    the copy costs more than the scan (benchmarks/bench_host.py times both). Here each
    row's chunks of `_CHUNK` logits are reduced in place (`np.maximum.reduce`, a ufunc: no copy), and the argmax is
    taken within the first chunk that holds the row's maximum (a copy of 16 KB).
    """
    rows, vocab = logits.shape
    if logits.flags.writeable or not logits.flags.c_contiguous or vocab < 4 * _CHUNK or rows == 0:
        return np.argmax(logits, axis=1)
    n = vocab // _CHUNK
    peaks = np.maximum.reduce(logits[:, : n * _CHUNK].reshape(rows, n, _CHUNK), axis=2)  # [R, n] each chunk's max
    if n * _CHUNK < vocab:  # the tail that fills no whole chunk: one more peak
        peaks = np.concatenate((peaks, np.maximum.reduce(logits[:, n * _CHUNK :], axis=1)[:, None]), axis=1)
    first = np.argmax(peaks, axis=1).tolist()  # [R] the first chunk holding each row's maximum (or first NaN)
    out = np.empty(rows, dtype=np.int64)
    for i, j in enumerate(first):
        lo = j * _CHUNK
        out[i] = lo + int(logits[i, lo : lo + _CHUNK].argmax())
    return out
