"""What hybrid and recurrent targets cost to speculate on (issue 54): at LFM2-1.2B's and Qwen3.5-2B's published shapes
and a Mamba2-1.3B's (random weights, `benchmarks/random_gguf.py`, written once into a cache directory), beside the
dense Qwen2.5-Coder-1.5B (the catalog's `qwen2.5-coder-1.5b`, resolved as specdec resolves it), in one table, in one
sitting:

- v(1), v(4), v(16), v(64): one pass over that many rows after `--depth` tokens of context, logits for every row (a
  verify pass), ms. A hybrid model is timed twice: in a context without snapshots (n_rs_seq 0) and in one granted
  `--rs` snapshots per sequence, whose passes copy the recurrent state once per row.
- state and snapshots: the recurrent state of one sequence (`llama_state_seq_get_size_ext` with
  LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, after the prefill), and what the snapshots add per sequence: n_rs_seq such
  states (llama-memory-recurrent.cpp allocates mem_size x (1 + n_rs_seq) state rows; `llama_state_seq_get_size` is
  the same with and without snapshots, so it cannot show them), MiB.
- rollback by snapshot, r = 1 and 3: after a verify pass of 4 rows, `llama_memory_seq_rm` of its last r tokens and the
  next pass (the correction token, 1 row), ms. For the dense model the same with its KV cache trimmed.
- rollback by checkpoint and replay, r = 1 and 3 (a context without snapshots, as llama-server does when a draft is
  longer than its snapshots): the checkpoint taken before the verify pass (`llama_state_seq_get_data_ext`,
  PARTIAL_ONLY), and after it the checkpoint restored (`llama_state_seq_set_data_ext`, then `llama_memory_seq_rm` of
  the pass's cells) and one pass over the 4 - r accepted tokens and the correction token, ms (get + set + replay).
- MTP: for a model with nextn layers, one draft token of its MTP block (an MTP context against the target:
  `llama_context_params.ctx_type` LLAMA_CONTEXT_TYPE_MTP, `ctx_other`, the target's hidden state in through
  `llama_cpp_ext.llama_set_embeddings_nextn` and `llama_batch_ext_set_embd_token`, as llama.cpp's
  common/speculative.cpp `common_speculative_impl_draft_mtp` does), ms, against a target pass of 1 row with the
  nextn output on.

Each figure: the median of `--repeats` interleaved repeats after one unmeasured round, with min-max. Between repeats the
state is put back untimed (a partial checkpoint for recurrent state, the KV cells trimmed). Calls llama-cpp-python's
low-level API directly: specdec's LlamaBackend has no n_rs_seq or partial checkpoint to offer, and one code path for
every model keeps the rows comparable. CPU-heavy and several GB of random GGUFs at the published shapes: run it alone.
Random weights give what a pass costs, not what a draft is accepted at.

    python benchmarks/bench_hybrid.py                   # the published shapes (writes the GGUFs once, f16)
    python benchmarks/bench_hybrid.py --shape tiny      # a smoke test of the tiny shapes, in seconds
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import random_gguf  # noqa: E402  (benchmarks/ is on sys.path)

WIDTHS = (1, 4, 16, 64)
DROPS = (1, 3)  # tokens a rollback drops from a verify pass of VERIFY rows
VERIFY = 4
_QUIET = None  # the ctypes log callback that silences llama.cpp
# (label, arch or "catalog", shape or catalog name) per --shape
MODELS = {
    "real": [
        ("Qwen2.5-Coder-1.5B", "catalog", "qwen2.5-coder-1.5b"),
        ("LFM2-1.2B", "lfm2", "lfm2-1.2b"),
        ("Qwen3.5-2B", "qwen35", "qwen3.5-2b"),
        ("Mamba2-1.3B", "mamba2", "mamba2-1.3b"),
    ],
    "tiny": [
        ("qwen2 tiny", "qwen2", "tiny"),
        ("lfm2 tiny", "lfm2", "tiny"),
        ("qwen35 tiny", "qwen35", "tiny"),
        ("mamba2 tiny", "mamba2", "tiny"),
    ],
}


def cache_dir() -> Path:
    """Where the random GGUFs are kept: $SPECDEC_CACHE (else ~/.cache/specdec)/random-gguf."""
    base = os.environ.get("SPECDEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specdec"
    )
    return Path(base) / "random-gguf"


def model_file(arch: str, shape: str, dtype: str, cache: Path) -> Path:
    """The GGUF of a row: the catalog's file for "catalog", else a random one written once into `cache`."""
    if arch == "catalog":
        from specdec_cli.config import load_catalog
        from specdec_cli.models.resolver import resolve

        return Path(resolve(shape, load_catalog()))
    path = cache / f"{arch}-{shape}-{dtype}-seed0.gguf"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(".part")
        print(f"writing {path} ...", file=sys.stderr, flush=True)
        random_gguf.write(part, random_gguf.ARCH_SHAPES[arch][shape], dtype=dtype)
        part.rename(path)
    return path


def spread(xs: list[float]) -> str:
    """'median (min-max)' of ms figures."""
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


class Ctx:
    """One llama.cpp context over `model` with one sequence (0) and a batch filled through numpy views."""

    def __init__(self, L, model, *, n_ctx: int, n_batch: int, threads: int, rs: int = 0, mtp_of=None) -> None:
        self.L = L
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = threads
        cp.n_rs_seq = rs
        cp.no_perf = True
        if mtp_of is not None:
            cp.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
            cp.ctx_other = mtp_of.ctx
        self.ctx = L.llama_init_from_model(model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)))
        self.n_batch = n_batch
        self.rs = int(L.llama_n_rs_seq(self.ctx))
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        b = self.batch
        self.tok = np.ctypeslib.as_array(b.token, shape=(n_batch,))
        self.pos = np.ctypeslib.as_array(b.pos, shape=(n_batch,))
        self.nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(n_batch,))
        self.out = np.ctypeslib.as_array(ctypes.cast(b.logits, ctypes.POINTER(ctypes.c_int8)), shape=(n_batch,))
        self.nseq[:] = 1
        for i in range(n_batch):
            b.seq_id[i][0] = 0
        self.n = 0  # tokens in the sequence

    def decode(self, toks: np.ndarray, *, all_rows: bool = True) -> None:
        """Evaluate `toks` after the sequence in chunks of n_batch; logits for every row (or the last only)."""
        for c0 in range(0, len(toks), self.n_batch):
            part = toks[c0 : c0 + self.n_batch]
            m = len(part)
            self.tok[:m] = part
            self.pos[:m] = np.arange(self.n, self.n + m, dtype=np.int32)
            self.out[:m] = 1 if all_rows else 0
            self.out[m - 1] = 1
            self.batch.n_tokens = m
            rc = self.L.llama_decode(self.ctx, self.batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            self.n += m

    def logits(self, i: int = -1) -> np.ndarray:
        return np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))

    def seq_rm(self, p0: int) -> bool:
        ok = bool(self.L.llama_memory_seq_rm(self.mem, 0, p0, -1))
        if ok:
            self.n = min(self.n, p0)
        return ok

    def checkpoint(self) -> tuple[ctypes.Array, int]:
        """The partial state (recurrent state; nothing of a KV cache) of sequence 0, and its length."""
        L, flags = self.L, self.L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(L.llama_state_seq_get_size_ext(self.ctx, 0, flags))
        buf = (ctypes.c_uint8 * max(size, 1))()
        L.llama_state_seq_get_data_ext(self.ctx, buf, size, 0, flags)
        return buf, self.n

    def restore(self, ckpt: tuple[ctypes.Array, int]) -> None:
        """Back to `ckpt`: the partial state set, then the cells after it dropped (llama-server's rollback)."""
        buf, n = ckpt
        if len(buf) > 1:
            if not self.L.llama_state_seq_set_data_ext(
                self.ctx, buf, len(buf), 0, self.L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
            ):
                raise RuntimeError("llama_state_seq_set_data_ext refused the checkpoint")
        if not self.L.llama_memory_seq_rm(self.mem, 0, n, -1):
            raise RuntimeError(f"llama_memory_seq_rm({n}, -1) refused after the checkpoint's restore")
        self.n = n

    def partial_bytes(self) -> int:
        return int(self.L.llama_state_seq_get_size_ext(self.ctx, 0, self.L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)


@dataclass
class Row:
    """One line of the table: a model in one context configuration."""

    label: str
    kind: str
    rs: int
    v: dict[int, list[float]] = field(default_factory=lambda: {b: [] for b in WIDTHS})
    state_mib: float | None = None
    snap_mib: float | None = None
    snap: dict[int, list[float]] | None = None
    ckpt: dict[int, list[float]] | None = None
    mtp: str = ""


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure_ctx(
    L,
    model,
    row: Row,
    *,
    rs: int,
    depth: int,
    repeats: int,
    threads: int,
    rng,
    recurrent: bool,
    snapshots: bool,
    replay: bool,
) -> bool:
    """Fill `row` from one context: the verify curve, the state sizes, and the rollbacks asked for. False (nothing
    measured) where snapshots were asked (`rs` > 0) and llama.cpp granted none."""
    c = Ctx(L, model, n_ctx=depth + 256, n_batch=max(WIDTHS), threads=threads, rs=rs)
    row.rs = c.rs
    if rs > 0 and c.rs == 0:
        c.close()
        return False
    prompt = rng.integers(3, c.n_vocab, depth).astype(np.int32)
    c.decode(prompt, all_rows=False)
    base = c.checkpoint() if recurrent else (None, depth)
    reset = (lambda: c.restore(base)) if recurrent else (lambda: c.seq_rm(depth))
    if recurrent:
        row.state_mib = c.partial_bytes() / 2**20
        row.snap_mib = row.state_mib * c.rs
    if snapshots:
        row.snap = {r: [] for r in DROPS}
    if replay:
        row.ckpt = {r: [] for r in DROPS}
    for rep in range(repeats + 1):
        keep = rep > 0  # the first round warms up
        for b in WIDTHS:
            ms = timed(lambda: c.decode(rng.integers(3, c.n_vocab, b).astype(np.int32)))
            reset()
            if keep:
                row.v[b].append(ms)
        for r in DROPS:
            draft = rng.integers(3, c.n_vocab, VERIFY + 1).astype(np.int32)  # 4 verify rows, then the correction
            if snapshots:
                c.decode(draft[:VERIFY])

                def rollback() -> None:
                    if not c.seq_rm(depth + VERIFY - r):
                        raise RuntimeError(f"llama_memory_seq_rm of {r} tokens refused (n_rs_seq {c.rs})")
                    c.decode(draft[VERIFY:])

                ms = timed(rollback)
                reset()
                if keep:
                    row.snap[r].append(ms)
            if replay:
                got: list = []
                ms = timed(lambda: got.append(c.checkpoint()))
                c.decode(draft[:VERIFY])

                def replay_() -> None:
                    c.restore(got[0])
                    c.decode(np.concatenate([draft[: VERIFY - r], draft[VERIFY:]]))

                ms += timed(replay_)
                reset()
                if keep:
                    row.ckpt[r].append(ms)
    c.close()
    return True


def measure_mtp(L, model, *, rs: int, depth: int, repeats: int, threads: int, rng) -> str:
    """One MTP draft token's ms against a target pass of 1 row (nextn output on), 'n/a: why' where it cannot run."""
    try:
        from llama_cpp import llama_cpp_ext as ext
    except (ImportError, AttributeError) as e:  # a build without the staging API's symbols
        return f"n/a: llama_cpp_ext unavailable ({e})"
    tgt = Ctx(L, model, n_ctx=depth + 256, n_batch=max(depth, 64), threads=threads, rs=rs)
    dft = Ctx(L, model, n_ctx=depth + 256, n_batch=max(depth, 64), threads=threads, mtp_of=tgt)
    n_embd = int(L.llama_model_n_embd(model))
    ext.llama_set_embeddings_nextn(tgt.ctx, True, False)  # the target's hidden state for every row
    ext.llama_set_embeddings_nextn(dft.ctx, True, True)
    prompt = rng.integers(3, tgt.n_vocab, depth).astype(np.int32)
    tgt.decode(prompt, all_rows=False)
    h = np.ctypeslib.as_array(ext.llama_get_embeddings_nextn(tgt.ctx), shape=(depth, n_embd)).copy()
    base = tgt.checkpoint()
    xb = L.llama_batch_ext_init(dft.ctx)
    keep_alive: list[np.ndarray] = []

    def add(tok: int, pos: int, row: np.ndarray, out: bool) -> int:
        row = np.ascontiguousarray(row, dtype=np.float32)
        keep_alive.append(row)
        idx = L.llama_batch_ext_add_token(xb, 0, int(tok))
        L.llama_batch_ext_set_pos(xb, idx, (L.llama_pos * 4)(pos, 0, 0, 0))
        embd = L.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd)
        if not L.llama_batch_ext_set_embd_token(xb, idx, embd):
            raise RuntimeError("llama_batch_ext_set_embd_token refused the hidden state")
        if out:
            L.llama_batch_ext_set_output_logits(xb, idx, True)
        return idx

    try:
        # the MTP block sees token k with the target's hidden state of row k - 1 (common_speculative's process())
        L.llama_batch_ext_clear(xb)
        for k in range(depth):
            add(prompt[k], k, h[k - 1] if k else np.zeros(n_embd, np.float32), False)
        rc = L.llama_process(dft.ctx, L.LLAMA_PROCESS_TYPE_DECODE, xb)
        if rc != 0:
            return f"n/a: the MTP context's prefill returned {rc}"
        last = int(np.argmax(tgt.logits()))
        mtp_ms: list[float] = []
        tgt_ms: list[float] = []
        for rep in range(repeats + 1):
            keep_alive.clear()
            hid = h[-1]
            for step in range(3):  # three chained draft tokens, each from the block's own hidden state

                def draft_one() -> None:
                    nonlocal hid, last
                    L.llama_batch_ext_clear(xb)
                    add(last, depth + step, hid, True)
                    rc = L.llama_process(dft.ctx, L.LLAMA_PROCESS_TYPE_DECODE, xb)
                    if rc != 0:
                        raise RuntimeError(f"llama_process(MTP) returned {rc}")
                    last = int(
                        np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(dft.ctx, 0), shape=(dft.n_vocab,)))
                    )
                    hid = np.ctypeslib.as_array(ext.llama_get_embeddings_nextn_ith(dft.ctx, 0), shape=(n_embd,)).copy()

                ms = timed(draft_one)
                if rep:
                    mtp_ms.append(ms)
            L.llama_memory_seq_rm(dft.mem, 0, depth, -1)
            ms = timed(lambda: tgt.decode(np.array([last], np.int32)))
            tgt.restore(base)
            if rep:
                tgt_ms.append(ms)
        ratio = statistics.median(mtp_ms) / statistics.median(tgt_ms)
        return f"{spread(mtp_ms)} vs v(1) {spread(tgt_ms)}: {ratio:.2f}x"
    finally:
        L.llama_batch_ext_free(xb)
        dft.close()
        tgt.close()


def host_lines(threads: int, L) -> list[str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return [
        f"command: python {' '.join(sys.argv)}",
        f"host: {cpu}, {os.cpu_count()} logical CPUs, {threads} threads; Python {platform.python_version()}",
        f"build: llama-cpp-python {L.__version__}; {L.llama_print_system_info().decode(errors='replace').strip()}",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shape",
        choices=sorted(MODELS),
        default="real",
        help="real: the published shapes beside the catalog model; tiny: a smoke test",
    )
    ap.add_argument("--type", dest="dtype", choices=("f16", "q8_0"), default="f16", help="the random weights' type")
    ap.add_argument("--cache", type=Path, help="where the random GGUFs are kept")
    ap.add_argument("--depth", type=int, help="tokens of context before the passes (real 512, tiny 64)")
    ap.add_argument("--rs", type=int, default=16, help="recurrent-state snapshots asked per sequence")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, help="default: specdec's (the CPUs this process may use)")
    ap.add_argument("--only", help="comma-separated labels of the rows to run (default: all)")
    a = ap.parse_args(argv)
    if a.rs < max(DROPS):
        ap.error(f"--rs {a.rs}: at least {max(DROPS)} (the rollbacks drop up to that many tokens)")
    import llama_cpp as L

    from specdec_cli.models.llama import default_threads

    L.llama_backend_init()
    global _QUIET
    _QUIET = L.llama_log_callback(lambda *_: None)  # kept alive: llama.cpp calls it for the whole run
    L.llama_log_set(_QUIET, None)
    threads = a.threads or default_threads()
    depth = a.depth or (512 if a.shape == "real" else 64)
    cache = a.cache or cache_dir()
    rng = np.random.default_rng(0)
    head = host_lines(threads, L)
    head.append(
        f"depth {depth} tokens, verify pass of {VERIFY} rows for the rollbacks, n_rs_seq asked {a.rs}, "
        f"{a.repeats} repeats; ms: median (min-max)"
    )
    print("\n".join(head), flush=True)
    rows: list[Row] = []
    for label, arch, shape in MODELS[a.shape]:
        if a.only and label not in a.only.split(","):
            continue
        path = model_file(arch, shape, a.dtype, cache)
        mp = L.llama_model_default_params()
        mp.load_mtp = True
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            print(f"{label}: llama.cpp could not load {path}", file=sys.stderr)
            continue
        hybrid, recurrent = bool(L.llama_model_is_hybrid(model)), bool(L.llama_model_is_recurrent(model))
        nextn = int(L.llama_model_n_layer_nextn(model))
        kind = "hybrid" if hybrid else "recurrent" if recurrent else "transformer"
        stateful = hybrid or recurrent
        for rs in [0, a.rs] if stateful else [0]:
            row = Row(label, kind + (f", {nextn} MTP" if nextn else ""), rs)
            if not measure_ctx(
                L,
                model,
                row,
                rs=rs,
                depth=depth,
                repeats=a.repeats,
                threads=threads,
                rng=rng,
                recurrent=stateful,
                snapshots=rs > 0 or not stateful,
                replay=stateful and rs == 0,
            ):
                rows[-1].kind += f"; n_rs_seq {rs} asked, none granted"
                continue
            if nextn and (rs > 0 or not stateful):
                row.mtp = measure_mtp(L, model, rs=row.rs, depth=depth, repeats=a.repeats, threads=threads, rng=rng)
            rows.append(row)
            print(f"  done: {row.label} n_rs_seq {row.rs}", file=sys.stderr, flush=True)
        L.llama_model_free(model)
    cols = (
        ["model", "kind", "n_rs_seq"]
        + [f"v({b})" for b in WIDTHS]
        + ["state MiB/seq", "snapshots MiB/seq"]
        + [f"rollback snapshot r={r}" for r in DROPS]
        + [f"rollback ckpt+replay r={r}" for r in DROPS]
        + ["MTP draft token"]
    )
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        cells = [r.label, r.kind, str(r.rs)] + [spread(r.v[b]) for b in WIDTHS]
        cells += [
            "-" if r.state_mib is None else f"{r.state_mib:.3g}",
            "-" if r.snap_mib is None else f"{r.snap_mib:.3g}",
        ]
        cells += [spread(r.snap[d]) if r.snap else "-" for d in DROPS]
        cells += [spread(r.ckpt[d]) if r.ckpt else "-" for d in DROPS]
        cells.append(r.mtp or "-")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
