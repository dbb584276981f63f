"""A fake backend: a deterministic toy language model over a small vocabulary.

Logits at position i are a pure function of the tokens held in the KV cache at positions 0..i, so batched and
one-token evaluation agree exactly (by construction), and a KV cache that was not rolled back correctly changes
the logits, which the engine tests then see as a different output.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from specdec_cli.core.controller import FixedK
from specdec_cli.core.draft import Draft
from specdec_cli.core.records import Step
from specdec_cli.errors import ContextOverflowError, StateError
from specdec_cli.models.backend import Backend, FimTokens, VocabInfo
from specdec_cli.models.rollback import CHECKPOINT, HYBRID, KV, SNAPSHOTS, TRANSFORMER, RecurrentGuard, draft_limit

V = 32
EOS = 1
# what `FakeBackend.chat_template` reports for its toy format (a Hermes-style template: `tool_formats.detect`)
TOY_TEMPLATE = "{# FakeBackend's toy format: the tools named on a <tool_call> line, then the contents #}"


def word(token: int) -> bytes:
    """Token i renders as a short word; a few tokens render as multi-byte UTF-8 split over two tokens."""
    if token == EOS:
        return b""
    if token == 30:
        return "é".encode()[:1]  # first byte of a 2-byte character
    if token == 31:
        return "é".encode()[1:]
    return f"w{token} ".encode()


def char_pieces() -> list[bytes]:
    """A byte-complete toy vocabulary for grammar tests (128 tokens): token 1 is EOS (renders as nothing), tokens
    32..126 are the printable ASCII characters, 9 and 10 tab and newline, and the other ids are multi-character
    merges, so forced text has more than one tokenization (as with a real BPE vocabulary)."""
    pieces = [b""] * 128
    for c in range(32, 127):
        pieces[c] = bytes([c])
    pieces[9], pieces[10] = b"\t", b"\n"
    merges = [
        b'{"',
        b'":',
        b'", "',
        b'"}',
        b'": "',
        b', "',
        b"true",
        b"false",
        b"null",
        b"name",
        b"age",
        b"  ",
        b"\n  ",
        b"Ann",
        b"Bob",
        b"er",
        b"in",
        b"on",
        b"an",
        b"12",
        b"00",
        b"ag",
        b"am",
        b'e"',
        b"me",
        b"}\n",
        b'":',
        b'"name',
        b'"age',
    ]
    free = [i for i in range(128) if i not in (1, 9, 10) and not 32 <= i <= 126]
    for i, m in zip(free, merges, strict=False):
        pieces[i] = m
    pieces[0] = b"\x00"
    return pieces


CHARS = char_pieces()


def hashed_logits(prefix: Sequence[int], vocab: int = V, seed: int = 0, peak: float = 4.0) -> np.ndarray:
    """float32 [vocab] logits from a hash of the whole prefix, with one clear favourite (margin ~peak)."""
    h = hashlib.blake2b(np.asarray(prefix, np.int32).tobytes() + seed.to_bytes(4, "little"), digest_size=8)
    rng = np.random.default_rng(int.from_bytes(h.digest(), "little"))
    logits = rng.normal(size=vocab).astype(np.float32)
    logits[EOS] -= 3.0  # end rarely
    logits[int(rng.integers(2, vocab))] += peak
    return logits


def bigram_logits(prefix: Sequence[int], vocab: int = V, table: np.ndarray | None = None) -> np.ndarray:
    """float32 [vocab]: depends on the last token only (a cyclic pattern), handy for literal expectations."""
    last = int(prefix[-1]) if len(prefix) else 0
    logits = np.zeros(vocab, np.float32)
    logits[(last % (vocab - 4)) + 2] = 5.0
    return logits


class FakeBackend(RecurrentGuard, Backend):
    """Implements `specdec_cli.models.backend.Backend` with `fn(prefix) -> logits`.

    Counts evaluated tokens and decode calls; records every truncate. Refuses what `LlamaBackend` refuses: more
    logits rows than one llama.cpp batch (n_logits > min(tokens, n_batch)) and a negative truncation (ValueError).
    With `clock` and `cost` (ms of a pass over b tokens) every pass advances the virtual clock by cost(b): a scripted
    verify curve. `branches`: whether `decode_branches` works (a second branch's rows are fn of its own prefix,
    exactly what a one-branch pass gives).

    `recurrent` ("snapshots" or "checkpoints") makes it a hybrid model as llama.cpp b11312 holds one: `truncate` goes
    through the same `rollback.RecurrentGuard` as `LlamaBackend`'s, over raw operations that follow llama.cpp's
    rules (`_seq_rm`): a partial trim drops the last 1..n_rs_seq tokens of the last decode call, once per call;
    without snapshots, or a second time, it is refused; dropping a token the last call did not hold (or all of its
    tokens) returns True and poisons the state: every later logits row is rolled by `poisoned` places, so an output
    built on it differs from plain greedy decoding (`n_poisoned` counts it). A checkpoint is the tokens and the
    poison; `save_state`/`load_state` write and read them as JSON (for the prompt cache).
    """

    kind = TRANSFORMER
    rollback = KV
    n_rs_seq = 0

    def __init__(
        self,
        fn: Callable[[Sequence[int]], np.ndarray] = hashed_logits,
        *,
        n_ctx: int = 512,
        n_batch: int = 64,
        vocab: int = V,
        path: str = "fake.gguf",
        eos: int = EOS,
        pieces: Sequence[bytes] | None = None,
        chat_template: str | None = None,
        clock: Clock | None = None,
        cost: Callable[[int], float] | None = None,
        branches: bool = True,
        recurrent: str | None = None,
        n_rs_seq: int = 4,
    ) -> None:
        """pieces: each token's bytes (e.g. `CHARS`, with vocab = len(pieces)); None = `word`. chat_template: a
        Jinja chat template `format_chat` renders (as `LlamaBackend` does); None = the toy format below. clock, cost:
        a virtual clock advanced by `cost(b)` ms per pass of b tokens. branches: `decode_branches` is available.
        recurrent: None (a transformer), "snapshots" (n_rs_seq of them) or "checkpoints" (none granted)."""
        if recurrent is not None:
            assert recurrent in (SNAPSHOTS, CHECKPOINT), recurrent
            self.kind, self.rollback, branches = HYBRID, recurrent, False
            self.n_rs_seq = n_rs_seq if recurrent == SNAPSHOTS else 0
        self._guard_reset()
        self.poisoned = 0  # places every logits row is rolled by: a state llama.cpp left wrong (0: clean)
        self.n_poisoned = 0
        self.n_loads = 0  # states loaded by `load_state`
        self._raw_last: int | None = None  # llama.cpp's view: the first position of the last decode call
        self._raw_rolled = False
        self.template = chat_template
        self.fn = fn
        self._clock, self._cost = clock, cost
        self._branches = branches
        self._branch: tuple[int, list[int]] | None = None  # (start, the second branch's tokens after t_0)
        self.branch_passes = 0
        self.pieces = list(pieces) if pieces is not None else None
        self._lltok = None
        self.path = path
        self._n_ctx = n_ctx
        self._n_batch = n_batch
        self._vocab = vocab
        self._eos = eos
        self._tokens: list[int] = []
        self.n_evaluated = 0
        self.n_decode_calls = 0
        self.truncations: list[int] = []
        self.max_logit_rows = 0

    n_vocab = property(lambda self: self._vocab)
    n_ctx = property(lambda self: self._n_ctx)
    n_batch = property(lambda self: self._n_batch)
    draft_limit = property(lambda self: draft_limit(self.rollback, self._n_batch, self.n_rs_seq))
    shared_rows = 0

    # -- lanes (`LlamaBackend.lane`, `decode_many`): sequences side by side, for `server.lanes` -----------------
    def lane(self, i: int) -> FakeBackend:
        """Lane i: lane 0 is this backend; others are fakes of the same model with their own tokens, made once. A
        shared pass (`decode_many`) is recorded in `passes` as the (lane, rows) of its parts."""
        lanes = self.__dict__.setdefault("_lanes", {0: self})
        if i not in lanes:
            import copy

            lane = copy.copy(self)
            lane._tokens, lane._branch, lane.truncations = [], None, []
            lane._guard_reset()
            lane.poisoned, lane._raw_last = 0, None
            lane.n_evaluated = lane.n_decode_calls = 0
            lane._root = self
            lanes[i] = lane
            lane.lane_index = i
        return lanes[i]

    def copy_prefix(self, rows, peers) -> int:
        """`LlamaBackend.copy_prefix`: the longest run of `rows` a peer holds after this lane's tokens (at least
        COPY_MIN beyond them) becomes this lane's without a pass; recorded in `copies` as (from lane, to lane, rows)."""
        from specdec_cli.models.backend import common_prefix
        from specdec_cli.models.llama import COPY_MIN

        if self.kind != TRANSFORMER:
            return 0
        want = [*self._tokens, *(int(t) for t in rows)]
        best, src = len(self._tokens) + COPY_MIN - 1, None
        for lane in peers:
            c = common_prefix(lane.tokens, np.asarray(want, dtype=np.int32))
            best, src = (c, lane) if lane is not self and c > best else (best, src)
        if src is None:
            return 0
        got, self._tokens, self._branch = best - len(self._tokens), want[:best], None
        root = self.__dict__.get("_root", self)
        pair = (src.__dict__.get("lane_index", 0), self.__dict__.get("lane_index", 0))
        root.__dict__.setdefault("copies", []).append((*pair, got))
        return got

    def decode_many(self, parts, calls=None) -> list[np.ndarray]:
        """One shared pass: each part (lane, tokens, n_logits) gets exactly what its own `decode` gives (logits are a
        function of the lane's own prefix), and the virtual clock advances once, by cost(rows of all parts). `calls`
        (a key per part, as `LlamaBackend.decode_many` takes them) are recorded in `calls`."""
        root = self.__dict__.get("_root", self)
        root.__dict__.setdefault("passes", []).append(
            tuple((getattr(lane, "lane_index", 0), len(t)) for lane, t, _ in parts)
        )
        root.__dict__.setdefault("calls", []).append(tuple(calls) if calls is not None else None)
        clock, cost = self._clock, self._cost
        out = []
        try:
            for lane, toks, n_logits in parts:
                lane._clock = None  # one clock advance for the whole pass, below
                out.append(lane.decode(toks, n_logits))
        finally:
            for lane, _, _ in parts:
                lane._clock = clock
        if clock is not None and cost is not None:
            clock.advance(cost(sum(len(t) for _, t, _ in parts)) / 1e3)
        return out

    @property
    def n_threads(self) -> int:  # as LlamaBackend's default: every CPU this process may use
        from specdec_cli.models.machine import usable_cpus

        return usable_cpus()

    @property
    def tokens(self) -> np.ndarray:
        return np.asarray(self._tokens, dtype=np.int32)

    @property
    def branches(self) -> bool:
        return self._branches

    def _pass(self, b: int) -> None:
        if self._clock is not None and self._cost is not None:
            self._clock.advance(self._cost(b) / 1e3)

    def decode(self, tokens, n_logits: int = 0) -> np.ndarray:
        self._branch = None
        toks = [int(t) for t in tokens]
        if n_logits > min(len(toks), self._n_batch):
            raise ValueError(f"n_logits={n_logits} exceeds the batch ({len(toks)} tokens, n_batch {self._n_batch})")
        if len(self._tokens) + len(toks) > self._n_ctx:
            raise ContextOverflowError("fake context full")
        start = len(self._tokens)
        if self.kind != TRANSFORMER:
            self._before_pass(start, len(toks), n_logits)
            self._after_call(start)
            self._raw_last, self._raw_rolled = start, False
        self._tokens.extend(toks)
        self.n_evaluated += len(toks)
        self.n_decode_calls += 1
        self.max_logit_rows = max(self.max_logit_rows, n_logits)
        rows = [self.fn(self._tokens[: start + i + 1]) for i in range(len(toks) - n_logits, len(toks))]
        if self.poisoned:
            rows = [np.roll(r, self.poisoned) for r in rows]
        out = np.stack(rows).astype(np.float32) if rows else np.zeros((0, self._vocab), np.float32)
        out.flags.writeable = False
        self._pass(len(toks))
        return out

    def decode_branches(self, tokens, branch) -> np.ndarray:
        if not self._branches:
            raise NotImplementedError("this fake backend has no branches")
        from specdec_cli.models.backend import common_prefix

        toks, alt = [int(t) for t in tokens], [int(t) for t in branch]
        c = common_prefix(np.asarray(toks[1:], np.int32), np.asarray(alt, np.int32))
        b = len(toks) + len(alt) - c
        if b > self._n_batch:
            raise ValueError(f"a tree of {b} tokens exceeds the batch (n_batch {self._n_batch})")
        if len(self._tokens) + 1 + max(len(toks) - 1, len(alt)) > self._n_ctx:
            raise ContextOverflowError("fake context full")
        main = self.decode(toks, n_logits=len(toks))  # advances the clock by len(toks): add the rest below
        start = len(self._tokens) - len(toks)
        path = self._tokens[: start + 1]
        extra = [self.fn(path + alt[: i + 1]) for i in range(c, len(alt))]
        self.n_evaluated += len(alt) - c
        self.max_logit_rows = max(self.max_logit_rows, b)
        self.branch_passes += 1
        if self._clock is not None and self._cost is not None:
            self._clock.advance((self._cost(b) - self._cost(len(toks))) / 1e3)
        self._branch = (start, alt)
        out = np.concatenate((main, np.stack(extra).astype(np.float32))) if extra else main.copy()
        out.flags.writeable = False
        return out

    def truncate(self, n: int, *, branch: bool = False) -> None:
        if n < 0:
            raise ValueError(f"truncate({n}): a negative length")
        pending, self._branch = self._branch, None
        self.truncations.append(n)
        if branch:
            if pending is None:
                raise ValueError("truncate(branch=True) without a pending branch")
            start, alt = pending
            self._tokens[start + 1 :] = alt[: n - start - 1]
            return
        if self.kind != TRANSFORMER:
            if n < len(self._tokens):
                self._truncate_recurrent(n)
            return
        del self._tokens[n:]

    # -- the raw operations of a recurrent state, as llama.cpp b11312 behaves (under `RecurrentGuard`) ------------
    def _seq_rm(self, n: int) -> bool:
        drop = len(self._tokens) - n
        if self.n_rs_seq == 0 or self._raw_rolled or drop > self.n_rs_seq:
            return False
        if self._raw_last is None or n <= self._raw_last:  # a token the last call did not hold: wrong, silently
            self.poisoned = 1 + self.poisoned % 3
            self.n_poisoned += 1
        del self._tokens[n:]
        self._raw_rolled = True
        return True

    def _seq_clear(self) -> None:
        self._tokens, self.poisoned, self._raw_last = [], 0, None

    def _state_save(self) -> tuple[tuple[int, ...], int]:
        return tuple(self._tokens), self.poisoned

    def _state_load(self, state: tuple[tuple[int, ...], int], at: int) -> bool:
        toks, poisoned = state
        assert len(toks) == at, "a checkpoint restored at another position than it was saved at"
        self._tokens, self.poisoned, self._raw_last = list(toks), poisoned, None
        return True

    def save_state(self, path) -> int:
        """The state as JSON (tokens and poison), for `stores.prompt_cache` tests."""
        data = json.dumps({"tokens": self._tokens, "poisoned": self.poisoned}).encode()
        with open(path, "wb") as f:
            f.write(data)
        return len(data)

    def load_state(self, path) -> int:
        try:
            doc = json.loads(open(path, "rb").read())
        except ValueError:
            self._seq_clear()
            raise StateError(f"not a fake state: {path}") from None
        self._tokens, self.poisoned, self._raw_last = list(doc["tokens"]), doc["poisoned"], None
        self._guard_reset()
        self.n_loads += 1
        return len(self._tokens)

    def state_key(self) -> dict:
        return {"fake": self.path, "kind": self.kind, "n_rs_seq": self.n_rs_seq}

    def snapshot(self) -> bytes:
        """The KV state: here the tokens themselves (4 bytes each), as `LlamaBackend.snapshot` copies the cells."""
        return np.asarray(self._tokens, dtype="<i4").tobytes()

    def restore_snapshot(self, data: bytes, tokens) -> None:
        held = np.frombuffer(data, "<i4").tolist()
        if held != [int(t) for t in tokens]:
            raise AssertionError("a snapshot restored with other tokens than it holds")
        self._tokens = held
        self.poisoned, self._raw_last = 0, None  # a whole state (a parked poisoned one is not modelled)
        self._guard_reset()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if self.pieces is not None:
            return greedy_tokenize(self.pieces, text.encode("utf-8"), {self._eos})
        # "w5 w7" -> [5, 7]; anything else: one token per character, folded into the vocabulary
        out = []
        for part in text.split():
            if part.startswith("w") and part[1:].isdigit():
                out.append(int(part[1:]) % self._vocab)
            else:
                out.extend(2 + (ord(c) % (self._vocab - 4)) for c in part)
        return out

    def piece(self, token: int) -> bytes:
        if self.pieces is not None:
            return b"" if int(token) == self._eos else self.pieces[int(token)]
        return word(int(token))

    def is_eog(self, token: int) -> bool:
        return int(token) == self._eos

    def token_text(self, token: int) -> str:
        return self.piece(int(token)).decode("utf-8", "replace")

    def lltokenizer(self):
        """An llguidance tokenizer over this vocabulary (greedy longest-match tokenization of forced text; grammars
        need a byte-complete vocabulary such as `CHARS`)."""
        if self._lltok is None:
            from llguidance import LLTokenizer, TokenizerWrapper

            pieces = self.pieces if self.pieces is not None else [word(t) for t in range(self._vocab)]
            eos = self._eos

            class Table:
                eos_token_id, bos_token_id, tokens, special_token_ids = eos, None, pieces, [eos]

                def __call__(self, data):
                    data = data.encode("utf-8") if isinstance(data, str) else data
                    return greedy_tokenize(pieces, data, {eos})

            self._lltok = LLTokenizer(TokenizerWrapper(Table()))
        return self._lltok

    def vocab_info(self) -> VocabInfo:
        return VocabInfo(vocab_type=2, n_vocab=self._vocab, bos=-1, eos=self._eos, fingerprint=f"fake-{self._vocab}")

    def chat_template(self) -> str | None:
        return self.template if self.template is not None else TOY_TEMPLATE

    def format_chat(self, messages, *, add_generation_prompt: bool = True, tools=None, template_kwargs=None) -> str:
        """The given chat template rendered (`render_chat_template`, no BOS/EOS text); without one, the toy format:
        the contents joined with spaces (a past call as its JSON); with tools, first a line that names them in the
        `<tool_call>` format (as Qwen2.5's template asks for it)."""
        if self.template is not None:
            from specdec_cli.models.llama import render_chat_template

            return render_chat_template(
                self.template,
                messages,
                bos_token="",
                eos_token="",
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                template_kwargs=template_kwargs,
            )
        parts = [f"<tool_call> {' '.join(t['function']['name'] for t in tools)}\n"] if tools else []
        for m in messages:
            parts.append(m.get("content") or "")
            parts.extend(json.dumps(c["function"]) for c in m.get("tool_calls") or ())
        return " ".join(parts)

    def fim_tokens(self) -> FimTokens:
        """No fill-in-the-middle tokens (tests/server/test_fim.py's backend has some)."""
        return FimTokens()

    def close(self) -> None:
        pass


class RecordingBackend(FakeBackend):
    """A FakeBackend that records what its chat template was given: `renders`, one (messages, tools, template
    variables) per call; `rendered`, the last call's (messages, tools)."""

    def __init__(self, fn: Callable[[Sequence[int]], np.ndarray] = hashed_logits, **kw) -> None:
        super().__init__(fn, **kw)
        self.renders: list[tuple[list[dict], list | None, dict]] = []

    @property
    def rendered(self) -> tuple[list[dict], list | None]:
        messages, tools, _ = self.renders[-1]
        return messages, tools

    def format_chat(self, messages, *, add_generation_prompt: bool = True, tools=None, template_kwargs=None) -> str:
        self.renders.append((messages, tools, dict(template_kwargs or {})))
        return super().format_chat(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, template_kwargs=template_kwargs
        )


# -- literal `specdec bench` JSON for the report tests ---------------------------------------------------------------
def run(
    config,
    prompt,
    tps,
    *,
    kind="edit",
    repeat=0,
    cold=False,
    tokens=(1, 2, 3, 4),
    drafted=0,
    accepted=0,
    spec_steps=0,
    ttft=None,
    rss=1000,
):
    """One run of `config` on `prompt` at `tps` decode tok/s, as bench's JSON records it."""
    return {
        "config": config,
        "prompt": prompt,
        "kind": kind,
        "repeat": repeat,
        "cold": cold,
        "tokens_per_s": tps,
        "tokens": list(tokens),
        "n_drafted": drafted,
        "n_accepted": accepted,
        "n_spec_steps": spec_steps,
        "ttft_ms": ttft,
        "peak_rss_kib": rss,
    }


def bench_doc(runs, configs, prompts):
    """A bench JSON document holding `runs` of `configs` (BenchConfig) on `prompts` ((name, kind) pairs)."""
    from specdec_cli.measure import bench as B

    return {
        "version": B.JSON_VERSION,
        "target": "/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "draft": None,
        "prompts": [{"name": n, "kind": k, "n_tokens": 612} for n, k in prompts],
        "settings": {"repeats": 2, "max_tokens": 128, "k": "auto", "ctx": 4096, "threads": 2},
        "started_at": "now",
        "configs": [c.label for c in configs],
        "runs": runs,
        "machine": {
            "cpu": "AMD EPYC 7B13 64-Core Processor",
            "cores": 1,
            "logical_cpus": 2,
            "threads": 2,
            "memory_bytes": 25 * 2**30,
            "llama_cpp_python": "0.3.36",
        },
    }


class Clock:
    """A virtual monotonic clock in seconds: `clock()` reads it, `advance(s)` moves it (the fake backend's passes)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


SGR = re.compile(r"\x1b\[([0-9;:]*)m")  # a Select Graphic Rendition escape: colours and attributes


def unstrike(screen: str) -> tuple[str, list[str]]:
    """Read a screen's escape codes as a terminal does: the text that is not struck through (SGR 9, which only the
    rejected drafts' style `spec.rejected` uses) with every escape code removed, and the struck-through runs, each
    within one row (a newline is a row's end, kept with the text).

    Follows ECMA-48's SGR: 9 starts striking, 29, 0 and an empty list end it; 38/48/58 colours' arguments
    (`5;N`, `2;R;G;B`) are skipped, so a colour index 9 is not read as a strike. Works on Rich's output and on
    `tmux capture-pane -e`'s alike."""
    kept: list[str] = []
    spans: list[str] = []
    struck = False
    pos = 0
    for m in [*SGR.finditer(screen), None]:
        chunk = screen[pos : m.start() if m else len(screen)]
        if chunk and struck:  # a newline ends a row: no cell, never struck (tmux keeps the state across rows)
            first, *rows = chunk.split("\n")
            spans[-1] += first
            for row in rows:
                kept.append("\n")
                spans.append(row)
        elif chunk:
            kept.append(chunk)
        if m is None:
            break
        pos = m.end()
        params = [p.split(":")[0] for p in m.group(1).split(";")]
        i = 0
        while i < len(params):
            p = params[i]
            if p in ("", "0", "29") and struck:
                struck = False
            elif p == "9" and not struck:
                struck = True
                spans.append("")
            elif p in ("38", "48", "58") and i + 1 < len(params):
                i += {"5": 2, "2": 4}.get(params[i + 1], 1)
            i += 1
    return "".join(kept), [s for s in spans if s]


def greedy_tokenize(pieces: Sequence[bytes], data: bytes, skip=frozenset()) -> list[int]:
    """Longest-match tokenization of `data` over `pieces` (ids in `skip` never used). ValueError at a byte no piece
    starts with."""
    out, i = [], 0
    while i < len(data):
        best = max(
            (t for t, p in enumerate(pieces) if p and t not in skip and data.startswith(p, i)),
            key=lambda t: len(pieces[t]),
            default=-1,
        )
        if best < 0:
            raise ValueError(f"no token for byte {data[i : i + 1]!r}")
        out.append(best)
        i += len(pieces[best])
    return out


def greedy_reference(fn, prompt: Sequence[int], max_tokens: int, eos: int = EOS) -> list[int]:
    """Plain greedy decoding by definition, without any engine: argmax of fn(prefix), one token at a time."""
    ctx = list(prompt)
    out = []
    for _ in range(max_tokens):
        tok = int(np.argmax(fn(ctx)))
        if tok == eos:
            break
        out.append(tok)
        ctx.append(tok)
    return out


def wants_draft(options, method: str | None, need_draft: bool) -> bool:
    """Whether a fake `open_session(options, method=..., need_draft=...)` loads a draft model, as the real one does
    on a CPU build (`draft_policy.plan`): for --method draft, or auto with --draft named."""
    return need_draft or method == "draft" or (method == "auto" and options.draft is not None)


def fake_sdist(folder: Path, version: str) -> Path:
    """A llama-cpp-python sdist tarball in `folder` holding, for each file the shipped patches touch, a file they apply
    to exactly (each hunk's old side at its line numbers, filler lines between): the installer's build path without
    the 77 MB sdist."""
    from specdec_cli.llama_build import install as installer

    top = f"llama_cpp_python-{version}"
    files: dict[str, list[bytes]] = {}
    for name in installer.PATCHES:
        for rel, hunks in installer._parse_patch((installer.PATCH_DIR / name).read_bytes(), name):
            lines = files.setdefault(rel, [])
            for hunk in hunks:
                while len(lines) < hunk.old_start - 1:
                    lines.append(f"// filler {len(lines) + 1}\n".encode())
                lines[hunk.old_start - 1 : hunk.old_start - 1 + len(hunk.old)] = hunk.old
    out = folder / f"{top}.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for rel, lines in files.items():
            data = b"".join(lines)
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def noisy(fn, flip_every=3):
    """A draft model over `fn` that proposes the target's second choice at some prefixes (a fixed pattern of them),
    so drafts are partly rejected; elsewhere it agrees with `fn`."""

    def draft_fn(prefix):
        logits = np.array(fn(prefix))
        if (sum(prefix) * 7 + len(prefix)) % flip_every == 0:
            logits[int(np.argmax(logits))] -= 100.0
        return logits

    return draft_fn


# -- the K controller's synthetic machines ---------------------------------------------------------------------------
# A CPU's steep verify curve (Qwen2.5-Coder-1.5B Q4_K_M): ms of one target pass over b tokens.
CPU_B = np.array([1, 2, 4, 8, 16, 32, 64], dtype=np.float64)
CPU_MS = np.array([58, 105, 180, 340, 500, 900, 1530], dtype=np.float64)
DRAFT_MODEL_MS = 28.0  # the 0.5B draft model, per drafted token


def cpu(b: int) -> float:
    return float(np.interp(b, CPU_B, CPU_MS))


def gpu(b: int) -> float:
    return 20.0  # a laptop GPU: flat up to b = 32


def step(k: int, n_drafted: int, n_accepted: int, draft_ms: float, verify_ms: float, source: str = "sim") -> Step:
    drafted = tuple(range(n_drafted))
    return Step(
        index=0,
        k=k,
        drafted=drafted,
        n_accepted=n_accepted,
        target_token=7,
        emitted=drafted[:n_accepted] + (7,),
        segments=(),
        draft_ms=draft_ms,
        verify_ms=verify_ms,
        source=source if k else "",
    )


def lookup_draft(match_len: int, n: int = 64):
    return Draft(tokens=np.arange(n, dtype=np.int32), source="ngram", match_len=match_len)


class EstimatingK(FixedK):
    """FixedK whose drafts carry an estimate (each token right 9 times in 10, `KController.expected`): a server's
    scheduler may cut them to meet other sequences' steps (`cost_model.meet`)."""

    def expected(self, draft):
        return np.concatenate(([1.0], 1.0 + np.cumsum(0.9 ** np.arange(1, len(draft) + 1))))
