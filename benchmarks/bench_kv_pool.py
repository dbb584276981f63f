"""What a pass costs with lanes in one KV pool (`--kv-unified`, llama-server's `-kvu`) against a KV stream per lane
(`--kv-per-lane`, the default): the passes `specdec serve --parallel` makes, timed on the default model.

One context of 4 lanes (`LlamaBackend(n_lanes=4)`), phased flash attention as the server runs it, for each layout:
1. a lane 2,500 tokens deep verifies 8 rows while another lane holds 8,000 cells (an agent's prompt beside an
   editor's completion, or an idle lane keeping its prefix for the next request);
2. the same 8 rows sharing the pass with 256 prefill rows of the deep lane;
3. four lanes 1,000-2,500 deep verify 8 rows each (four chats decoding), and one of them alone;
4. three lanes' 8 rows with a fourth lane's 256 prefill rows;
5. four lanes' verify rows of unequal lengths (1, 4, 12, 2: chats decoding at once);
6. 64 prefill rows of one lane with another's 10 (an editor's completion and an agent's rows), and each alone.
With a stream per lane, `decode_many` puts unequal parts in descending sequence ids, so each is a ubatch of its own.
Each figure: the median of `--repeats` passes after one unmeasured (ms), with min-max; the two layouts run in
separate processes, alternately, `--rounds` times. CPU-heavy: run it alone.

    python benchmarks/bench_kv_pool.py                    # 2 rounds, 5 passes each
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ["8 rows, a lane of 8,000 beside", "8 rows + 256 prefill rows (8,000 deep)", "4 lanes x 8 rows",
         "1 lane x 8 rows, 3 lanes beside", "3 lanes x 8 rows + 256 prefill rows", "4 lanes x 1, 4, 12, 2 rows",
         "64 rows (2,500 deep) + 10 rows of another lane", "64 rows (2,500 deep) alone",
         "10 rows (1,500 deep) alone"]


def child(unified: bool, repeats: int, threads: int) -> list[list[float]]:
    """Run in a process of its own: the ms of each case's passes (one list per case, in CASES' order)."""
    import time

    import numpy as np

    sys.path.insert(0, str(ROOT))
    from agents_replay import model_path  # noqa: E402  (benchmarks/ is on sys.path)
    from specdec_cli.models.llama import PHASED, LlamaBackend

    rng = np.random.default_rng(0)
    be = LlamaBackend(str(model_path(None)), n_ctx=16384, n_batch=512, n_threads=threads, flash_attn=PHASED,
                      n_lanes=4, kv_unified=unified)
    lanes = [be.lane(i) for i in range(4)]

    def fill(lane, n: int) -> None:
        lane.truncate(0)
        toks = rng.integers(1000, 30000, n).astype(np.int32)
        for s in range(0, n, 512):
            be.decode_many([(lane, toks[s:s + 512], 0)])

    def timed(spec) -> list[float]:
        out = []
        for _ in range(repeats + 1):
            bases = [lane._n for lane, _ in spec]
            parts = [(lane, rng.integers(1000, 30000, r).astype(np.int32), min(r, 16)) for lane, r in spec]
            t0 = time.perf_counter()
            be.decode_many(parts)
            out.append((time.perf_counter() - t0) * 1e3)
            for (lane, _), b in zip(spec, bases):
                lane.truncate(b)
        return out[1:]

    fill(lanes[1], 2500)
    fill(lanes[0], 8000)
    res = [timed([(lanes[1], 8)]), timed([(lanes[1], 8), (lanes[0], 256)])]
    fill(lanes[0], 1500)
    fill(lanes[2], 1000)
    fill(lanes[3], 2000)
    res += [timed([(lane, 8) for lane in lanes]), timed([(lanes[1], 8)]),
            timed([(lanes[0], 8), (lanes[1], 8), (lanes[2], 8), (lanes[3], 256)]),
            timed([(lanes[0], 1), (lanes[1], 4), (lanes[2], 12), (lanes[3], 2)]),
            timed([(lanes[1], 64), (lanes[0], 10)]), timed([(lanes[1], 64)]), timed([(lanes[0], 10)])]
    be.close()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=["unified", "per-lane"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child == "unified", args.repeats, args.threads)))
        return 0
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    got: dict[str, list[list[float]]] = {"per-lane": [[] for _ in CASES], "unified": [[] for _ in CASES]}
    for _ in range(args.rounds):
        for layout in ("per-lane", "unified"):
            out = subprocess.run([sys.executable, __file__, "--child", layout, "--repeats", str(args.repeats),
                                  "--threads", str(args.threads)], capture_output=True, text=True, check=True)
            for acc, ms in zip(got[layout], json.loads(out.stdout.strip().splitlines()[-1])):
                acc.extend(ms)
    print("\n| pass (ms, median (min-max)) | KV stream per lane | one pool (-kvu) | pool / streams |\n|---|---|---|---|")
    for i, case in enumerate(CASES):
        a, b = got["per-lane"][i], got["unified"][i]
        cell = lambda v: f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})"  # noqa: E731
        print(f"| {case} | {cell(a)} | {cell(b)} | {statistics.median(b) / statistics.median(a):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
