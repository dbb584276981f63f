"""Host work per target pass: the Python that runs between `llama_decode` calls, by the depth of the pass.

On this CPU a verify pass costs 86 ms (b = 1) to 684 ms (b = 64), so host work hides in it; on a GPU a pass of a
1.5B model costs a few ms and the host's share is as large as the pass. Two measurements, printed as tables:

(a) fake: the real engine, drafters (`--method auto`'s `AutoDrafter` over a suffix store in a temporary directory),
    K controller, driver and Rich renderer (styled, into a null terminal, as `specdec run` renders) driven by a
    scripted backend whose passes cost nothing but writing one logit per returned row into a float32 [rows, 151,936]
    buffer (Qwen2.5's vocabulary). The output copies the prompt, so every draft is right and a pass under `--k N`
    verifies N + 1 rows. Host ms per pass = (wall from the prefill's record to the end of the stream - time inside
    the backend's decode) / passes, in CPU time of this thread (`time.thread_time`, also the engine's clock here, so the
    steps' draft_ms are CPU ms), which other jobs on a shared machine inflate far less than wall time. "auto (edit)" is `--k auto` on a flat (GPU-shaped) measured curve over a copy
    with a word renamed every ~40 tokens (rejections, realigned copies). Budget: 1 ms + 0.1 ms per verified row
    (issue 46: the rows of logits must be read; everything else is overhead).
(b) real (`--real`): `specdec run`'s generation of a copy-heavy edit (default model, prompt
    specdec_cli/prompts/edit/textwrap_rename.txt, -n 128), each repeat split by the run's own clock: wall (the
    driver's decode_ms plus the renderer's end), the target's `llama_decode` calls (every one timed by wrapping
    `llama_cpp.llama_decode`), drafting (the steps' draft_ms) and the rest: host work. Also "host CPU": the CPU time
    of the main thread outside `llama_decode` (drafting included), which a busy machine inflates far less than wall
    time. CPU-heavy: run it alone.

Both print the median of interleaved repeats with their spread (min-max). Timings on a shared machine are noisy:
the load average is printed with them.

Run:
    python benchmarks/bench_host.py                      # fake only, 7 repeats
    python benchmarks/bench_host.py --real --real-repeats 3
    python benchmarks/bench_host.py --profile 16         # cProfile of one fake run at K = 16, top 30 functions
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 151_936
EOS = 1
FAKE_KS = (1, 4, 8, 16, 32)
CLOCK = time.thread_time  # the fake's clock: CPU seconds of this thread, which other jobs on the machine do not inflate


# -- (a) the scripted, zero-cost backend ---------------------------------------------------------------------------


class ScriptedBackend:
    """`models.backend.Backend` whose greedy model follows a script: the token after position p is script[p + 1],
    whatever the context (so a wrong draft is rejected where it leaves the script). A pass writes one 1.0 per
    returned row into a zero float32 [n_batch, vocab] buffer and returns a read-only view of its rows, as llama.cpp's
    logits buffer is read; `decode_s` sums the seconds spent inside decode calls (the "pass", zero-cost here)."""

    _shared: dict[tuple[int, int], np.ndarray] = {}  # (n_batch, vocab) -> the logits buffer, reused as llama.cpp's is

    def __init__(self, script: np.ndarray, pieces: list[bytes], *, vocab: int = VOCAB, n_ctx: int = 8192,
                 n_batch: int = 128) -> None:
        self.script = np.asarray(script, dtype=np.int32)
        self.pieces = pieces
        self._vocab, self._n_ctx, self._n_batch = vocab, n_ctx, n_batch
        buf = self._shared.get((n_batch, vocab))
        if buf is None:  # every page written once now: a fresh buffer's first reads would time page faults
            buf = self._shared[(n_batch, vocab)] = np.full((n_batch, vocab), 0.0, dtype=np.float32)
        buf[:] = 0.0
        self._buf = buf
        self._set: tuple[np.ndarray, np.ndarray] | None = None  # (rows, tokens) holding a 1.0
        self._tokens = np.zeros(n_ctx, dtype=np.int32)
        self._n = 0
        self._branch: tuple[int, np.ndarray] | None = None
        self.decode_s = 0.0
        self.passes = 0
        self.path = "scripted.gguf"

    n_vocab = property(lambda self: self._vocab)
    n_ctx = property(lambda self: self._n_ctx)
    n_batch = property(lambda self: self._n_batch)
    n_threads = property(lambda self: 1)
    branches = property(lambda self: True)

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[: self._n]

    def _rows(self, positions: np.ndarray) -> np.ndarray:
        """float32 [len(positions), V]: row i's argmax is the script's token after positions[i]."""
        if self._set is not None:
            self._buf[self._set] = 0.0
        r = np.arange(len(positions))
        nxt = self.script[np.minimum(positions + 1, len(self.script) - 1)]
        self._buf[r, nxt] = 1.0
        self._set = (r, nxt)
        view = self._buf[: len(positions)]
        view.flags.writeable = False
        return view

    def decode(self, tokens, n_logits: int = 0) -> np.ndarray:
        t0 = CLOCK()
        self._branch = None
        toks = np.asarray(tokens, dtype=np.int32)
        m, start = len(toks), self._n
        self._tokens[start : start + m] = toks
        self._n = start + m
        out = self._rows(np.arange(start + m - n_logits, start + m)) if n_logits else np.zeros((0, self._vocab),
                                                                                              np.float32)
        self.passes += 1
        self.decode_s += CLOCK() - t0
        return out

    def decode_branches(self, tokens, branch) -> np.ndarray:
        from specdec_cli.models.backend import common_prefix

        t0 = CLOCK()
        toks, alt = np.asarray(tokens, dtype=np.int32), np.asarray(branch, dtype=np.int32)
        m, c, start = len(toks), common_prefix(toks[1:], alt), self._n
        self._tokens[start : start + m] = toks
        self._n = start + m
        pos = np.concatenate((np.arange(start, start + m), np.arange(start + 1 + c, start + 1 + len(alt))))
        out = self._rows(pos)
        self._branch = (start, alt)
        self.passes += 1
        self.decode_s += CLOCK() - t0
        return out

    def truncate(self, n: int, *, branch: bool = False) -> None:
        if branch:
            start, alt = self._branch
            self._tokens[start + 1 : n] = alt[: n - start - 1]
            self._n = n
        else:
            self._n = min(self._n, n)
        self._branch = None

    def piece(self, token: int) -> bytes:
        return self.pieces[token]

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def token_text(self, token: int) -> str:
        return self.pieces[token].decode("utf-8", "replace")

    def lltokenizer(self):  # grammars only: none here
        raise NotImplementedError

    def close(self) -> None:
        pass


class NullTerminal(io.TextIOBase):
    """A terminal that shows nothing: Rich renders to it as to a real one (colours, styles), the text is dropped."""

    def write(self, s: str) -> int:
        return len(s)

    def isatty(self) -> bool:
        return True

    def flush(self) -> None:
        pass


def make_script(n_prompt: int, n_out: int, edit_every: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(prompt int32 [n_prompt], script int32 [n_prompt + n_out]): the output copies the prompt from its start; with
    `edit_every`, a token that occurs every ~`edit_every` tokens of the prompt is renamed in the copy (an edit)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(2, VOCAB, size=n_prompt, dtype=np.int32)
    out = np.resize(prompt, n_out).copy()
    if edit_every:
        word, renamed = 7, 9
        prompt[edit_every // 2 :: edit_every] = word
        out = np.resize(prompt, n_out).copy()
        out[out == word] = renamed
    return prompt, np.concatenate((prompt, out))


def pieces_table(vocab: int = VOCAB) -> list[bytes]:
    """Token i's bytes: a short word with a space, a newline every 16th token (code's line breaks)."""
    return [b"" if i == EOS else (f"t{i}\n" if i % 16 == 0 else f"t{i} ").encode() for i in range(vocab)]


def flat_curve():
    from specdec_cli.core.verify_curve import B_MAX, VerifyCurve

    return VerifyCurve(ms=tuple(5.0 + 0.01 * b for b in range(1, B_MAX + 1)))  # a GPU: v(65) = 1.1 v(1)


def fake_run(k: int | None, script: np.ndarray, prompt: np.ndarray, pieces: list[bytes], n_out: int,
             tmp: Path) -> dict:
    """One `specdec run`-shaped generation on the scripted backend; k None = `--k auto` on the flat curve."""
    from specdec_cli.cli.render import StreamRenderer
    from specdec_cli.core.controller import AdaptiveK, FixedK
    from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
    from specdec_cli.core.records import Prefill, Step
    from specdec_cli.driver import stream
    from specdec_cli.drafters.auto import AutoDrafter
    from specdec_cli.drafters.suffix import SuffixDrafter
    from specdec_cli.stores.suffix_store import SuffixStore

    backend = ScriptedBackend(script, pieces)
    curve = flat_curve()
    store = SuffixStore(tmp / "store.sfx", fingerprint="scripted", lock_timeout=1.0)
    drafter = AutoDrafter(SuffixDrafter(store, preload=False))
    controller = FixedK(k, curve) if k is not None else AdaptiveK(curve=curve)
    engine = SpeculativeEngine(backend, drafter, controller, curve=curve, clock=CLOCK)
    renderer = StreamRenderer(NullTerminal(), styled=True)
    drive = stream(engine, prompt, GenerationConfig(max_tokens=n_out))
    t0 = None
    rows = passes = 0
    draft_ms = 0.0
    for record in drive:
        if isinstance(record, Prefill):
            backend.decode_s, t0 = 0.0, CLOCK()
        elif isinstance(record, Step):
            renderer.step(record)
            rows += record.batch_size
            passes += 1
            draft_ms += record.draft_ms
    renderer.end()
    cpu = CLOCK() - t0
    host_ms = (cpu - backend.decode_s) * 1e3
    text = drive.result().text
    return {"host_ms": host_ms / passes, "draft_ms": draft_ms / passes, "rows": rows / passes, "passes": passes,
            "text": text}


def fake_table(repeats: int, n_prompt: int, n_out: int) -> list[dict]:
    """Interleaved repeats of every configuration; returns one row per configuration with medians and spreads."""
    pieces = pieces_table()
    copy = make_script(n_prompt, n_out, 0)
    edit = make_script(n_prompt, n_out, 40)
    configs = [(f"--k {k}", k, copy) for k in FAKE_KS] + [("auto (edit)", None, edit)]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    with tempfile.TemporaryDirectory() as d:
        os.environ["SPECDEC_HOME"] = d  # nothing of the user's is read or written
        tmp = Path(d)
        fake_run(4, copy[1], copy[0], pieces, n_out, tmp)  # warm up: imports, caches
        for rep in range(repeats):
            order = configs if rep % 2 == 0 else configs[::-1]
            for name, k, (prompt, script) in order:
                runs[name].append(fake_run(k, script, prompt, pieces, n_out, tmp))
    table = []
    for name, k, _ in configs:
        rs = runs[name]
        texts = {r["text"] for r in rs}
        assert len(texts) == 1, f"{name}: the output changed between repeats"
        host = [r["host_ms"] for r in rs]
        table.append({"config": name, "text": texts.pop(), "rows": statistics.median(r["rows"] for r in rs),
                      "passes": statistics.median(r["passes"] for r in rs), "host": host,
                      "draft": statistics.median(r["draft_ms"] for r in rs)})
    return table


def print_fake(table: list[dict], repeats: int, n_prompt: int, n_out: int) -> None:
    print(f"\n(a) fake backend, zero-cost passes at V = {VOCAB:,}: prompt {n_prompt} tokens, -n {n_out}, "
          f"median of {repeats} interleaved repeats (min-max), CPU time")
    print(f"{'config':<12} {'rows/pass':>9} {'passes':>6} {'host ms/pass':>22} {'of it drafting':>14} "
          f"{'budget':>7} {'within':>6}")
    for r in table:
        med, lo, hi = statistics.median(r["host"]), min(r["host"]), max(r["host"])
        budget = 1.0 + 0.1 * r["rows"]
        print(f"{r['config']:<12} {r['rows']:>9.1f} {r['passes']:>6.0f} {med:>8.3f} ({lo:.3f}-{hi:.3f}) "
              f"{r['draft']:>14.3f} {budget:>7.2f} {'yes' if med <= budget else 'NO':>6}")
    outputs = hashlib.sha256("".join(r["text"] for r in table).encode()).hexdigest()[:16]
    print(f"outputs sha256 {outputs} (the same before and after a change that keeps greedy output)")


def profile(k: int, n_prompt: int, n_out: int, top: int = 30) -> None:
    """cProfile of one fake run at K = k (0 = auto on the edit script), sorted by own time."""
    import cProfile
    import pstats

    pieces = pieces_table()
    prompt, script = make_script(n_prompt, n_out, 40 if k == 0 else 0)
    with tempfile.TemporaryDirectory() as d:
        os.environ["SPECDEC_HOME"] = d
        fake_run(k or None, script, prompt, pieces, n_out, Path(d))
        prof = cProfile.Profile(CLOCK)  # CPU time: the machine may be shared
        prof.enable()
        fake_run(k or None, script, prompt, pieces, n_out, Path(d))
        prof.disable()
    pstats.Stats(prof).sort_stats(os.environ.get("SORT", "tottime")).print_stats(top)


# -- (b) real runs, split by the run's own clock --------------------------------------------------------------------


def real_table(args) -> None:
    import llama_cpp

    from specdec_cli.assemble import Assembler
    from specdec_cli.cli.render import StreamRenderer
    from specdec_cli.core.engine import GenerationConfig
    from specdec_cli.core.records import Prefill, Step
    from specdec_cli.driver import stream
    from specdec_cli.models import host
    from specdec_cli.models.llama import system_info
    from specdec_cli.session import open_session
    from specdec_cli.spec import ModelOptions, SpecOptions

    clock = {"s": 0.0, "cpu": 0.0, "calls": 0}
    inner = llama_cpp.llama_decode

    def timed_decode(ctx, batch):  # every llama_decode of this process (no draft model is loaded on a CPU build)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return inner(ctx, batch)
        finally:
            clock["s"] += time.perf_counter() - t0
            clock["cpu"] += time.thread_time() - c0  # this thread's share of the pass (it computes too)
            clock["calls"] += 1

    llama_cpp.llama_decode = timed_decode
    prompt_text = Path(args.prompt).read_text()
    print(host.describe_build(system_info()))
    spec = SpecOptions()
    runs = []
    with open_session(ModelOptions(target=args.model, prompt_cache=False), method=spec.method) as session, \
            Assembler(session) as assembler:
        prompt = session.prompt_tokens(prompt_text)
        target = session.target
        for name in ("decode", "decode_branches", "truncate"):  # the backend's own CPU time (llama_decode included)
            setattr(target, name, _cpu_timed(getattr(target, name), clock))
        curve = session.verify_curve(measure=False)  # a kept one
        if curve is None and not args.measure:
            os.environ["SPECDEC_VERIFY_CURVE"] = "off"  # the engine would measure one now (~70 s for 1.5B alone)
        curve = session.verify_curve(measure=args.measure)
        print(f"target: {session.target_path.name}, {session.target.n_threads} threads, prompt {len(prompt)} tokens, "
              f"verify curve: {'measured' if curve is not None else 'none kept (--measure to measure it)'}")
        for rep in range(args.real_repeats):
            # a fresh controller and a drafter of its own per repeat, neither saved: every repeat starts alike
            drafter = assembler.make_drafter(spec)
            engine = assembler.engine(spec, fresh=True, drafter=drafter)
            renderer = StreamRenderer(NullTerminal(), styled=True)
            drive = stream(engine, prompt, GenerationConfig(max_tokens=args.n))
            t0, passes, rows, draft_ms = None, 0, 0, 0.0
            for record in drive:
                if isinstance(record, Prefill):
                    clock["s"], clock["cpu"], clock["calls"], clock["backend"] = 0.0, 0.0, 0, 0.0
                    t0, c0 = time.perf_counter(), time.thread_time()
                    last = (c0, 0.0)
                    per_pass = []  # host CPU ms of each pass: since the last record, outside llama_decode
                elif isinstance(record, Step):
                    now = time.thread_time()
                    per_pass.append((now - last[0] - (clock["cpu"] - last[1])) * 1e3)
                    last = (now, clock["cpu"])
                    renderer.step(record)
                    passes += 1
                    rows += record.batch_size
                    draft_ms += record.draft_ms
            renderer.end()
            wall = (time.perf_counter() - t0) * 1e3
            cpu = (time.thread_time() - c0 - clock["cpu"]) * 1e3  # this thread outside llama_decode: host work
            target_ms = clock["s"] * 1e3
            backend = (clock["backend"] - clock["cpu"]) * 1e3  # in the backend's methods, outside llama_decode
            runs.append({"wall": wall, "target": target_ms, "draft": draft_ms, "host": wall - target_ms - draft_ms, "cpu": cpu,
                         "backend": backend, "cpu_median": statistics.median(per_pass),
                         "passes": passes, "rows": rows / passes, "calls": clock["calls"],
                         "tokens": len(drive.result().tokens), "text": drive.result().text})
    llama_cpp.llama_decode = inner
    print(f"\n(b) real: specdec run --method auto -n {args.n} {Path(args.prompt).name} (prompt cache off; median of "
          f"{len(runs)} repeats, min-max)")
    print(f"{'':<16} {'median':>9} {'min-max':>19}")

    def row(label: str, xs: Sequence[float], fmt: str = "{:.1f}") -> None:
        print(f"{label:<16} {fmt.format(statistics.median(xs)):>9} "
              f"{(fmt.format(min(xs)) + '-' + fmt.format(max(xs))):>19}")

    row("wall ms", [r["wall"] for r in runs])
    row("target ms", [r["target"] for r in runs])
    row("drafting ms", [r["draft"] for r in runs])
    row("host ms", [r["host"] for r in runs])
    row("passes", [r["passes"] for r in runs], "{:.0f}")
    row("rows/pass", [r["rows"] for r in runs])
    row("host ms/pass", [r["host"] / r["passes"] for r in runs], "{:.2f}")
    row("host CPU ms/pass", [r["cpu"] / r["passes"] for r in runs], "{:.2f}")  # drafting included
    row("  median pass", [r["cpu_median"] for r in runs], "{:.2f}")  # without the first steps' one-off costs
    row("  in the backend", [r["backend"] / r["passes"] for r in runs], "{:.2f}")  # models/llama.py's Python
    row("budget ms/pass", [1.0 + 0.1 * r["rows"] for r in runs], "{:.2f}")
    print(f"tokens: {sorted({r['tokens'] for r in runs})}; output sha256 "
          f"{sorted({hashlib.sha256(r['text'].encode()).hexdigest()[:16] for r in runs})}")


def _cpu_timed(fn, clock: dict):
    """`fn` adding this thread's CPU seconds in it to clock["backend"]."""
    def timed(*args, **kwargs):
        c0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            clock["backend"] = clock.get("backend", 0.0) + time.thread_time() - c0
    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7, help="fake: interleaved repeats (default 7)")
    ap.add_argument("--prompt-tokens", type=int, default=1500, help="fake: prompt length (default 1500)")
    ap.add_argument("-n", type=int, default=128, help="output tokens of each run (default 128)")
    ap.add_argument("--fake-n", type=int, default=512, help="fake: output tokens (default 512)")
    ap.add_argument("--no-fake", action="store_true", help="skip the fake table")
    ap.add_argument("--real", action="store_true", help="also the real runs (CPU-heavy: run alone)")
    ap.add_argument("--real-repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="real: target (default: the catalog's default)")
    ap.add_argument("--prompt", default=str(ROOT / "specdec_cli/prompts/edit/textwrap_rename.txt"))
    ap.add_argument("--measure", action="store_true", help="real: measure the verify curve when none is kept")
    ap.add_argument("--profile", type=int, default=None, metavar="K", help="cProfile one fake run at K (0 = auto)")
    args = ap.parse_args()
    os.environ.setdefault("TERM", "xterm-256color")  # the null terminal is rendered to in colour
    os.environ.pop("NO_COLOR", None)
    if args.profile is not None:
        profile(args.profile, args.prompt_tokens, args.fake_n)
        return
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"host: {platform.node()} {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs; "
          f"python {platform.python_version()}, numpy {np.__version__}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if not args.no_fake:
        table = fake_table(args.repeats, args.prompt_tokens, args.fake_n)
        print_fake(table, args.repeats, args.prompt_tokens, args.fake_n)
    if args.real:
        real_table(args)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
