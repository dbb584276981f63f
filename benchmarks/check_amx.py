"""Is the AMX build's greedy output the non-AMX output, up to near-ties? (issue 34)

For each prompt, plain greedy decoding runs in a child with `SPECDEC_AMX=off` (llama.cpp's extra buffer types off:
no AMX kernels, no repacked weights: other kernels, other summation orders), then this process, with the AMX kernels
in use, re-scores that output one token at a time (`measure.audit.audit_output`, what `specdec check` does) and
judges every position where its own argmax differs by the margin in logits: below 1.0 a numerical near-tie, above it
a divergence (a kernel bug). Run it on a CPU with AMX after `specdec install-llama-cpp` (or `make`).

    python benchmarks/check_amx.py                 # the edits and the free-text prompts, 128 tokens each
    python benchmarks/check_amx.py -n 32 --prompts edit/textwrap_rename.txt
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "specdec_cli" / "prompts"
PROMPTS = [
    "edit/textwrap_rename.txt",
    "edit/bisect_rename.txt",
    "edit/posixpath_rename.txt",
    "edit/genericpath_type_hints.txt",
    "explain/shlex_quote.txt",
    "write/lighthouse_story.txt",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--target")
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    args = ap.parse_args()
    from specdec_cli.measure.audit import audit_output
    from specdec_cli.models import host
    from specdec_cli.session import open_session
    from specdec_cli.spec import ModelOptions

    rows = []
    with open_session(ModelOptions(target=args.target, prompt_cache=False), method="none") as session:
        plan = host.current_plan()
        if plan is None or not (plan.amx_build and plan.extra_bufts):
            raise SystemExit(f"the AMX kernels are not in use here ({plan}): nothing to check")
        for rel in args.prompts.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "off.json"
                cmd = [
                    sys.executable,
                    "-m",
                    "specdec_cli",
                    "run",
                    str(ROOT / rel),
                    "--method",
                    "none",
                    "-n",
                    str(args.max_tokens),
                    "--no-prompt-cache",
                    "--json",
                    str(out),
                    *(["-t", args.target] if args.target else []),
                ]
                subprocess.run(
                    cmd,
                    env={**os.environ, "SPECDEC_AMX": "off"},
                    check=True,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=1800,
                )
                off = json.loads(out.read_text())
            prompt = session.prompt_tokens((ROOT / rel).read_text(encoding="utf-8"))
            report = audit_output(session.target, prompt, off["tokens"], ended_with_eog=off["finish_reason"] == "eog")
            first = report.flags[0] if report.flags else None
            rows.append(
                (
                    rel,
                    report.n_checked,
                    len(report.flags),
                    report.near_ties,
                    report.divergences,
                    report.largest_margin,
                    first,
                )
            )
            print(
                f"{rel}: {report.n_checked} tokens, {len(report.flags)} positions where the AMX argmax differs "
                f"({report.near_ties} near-ties, {report.divergences} divergences), largest margin "
                f"{report.largest_margin:.3f}",
                file=sys.stderr,
                flush=True,
            )
    print("\n| prompt | tokens | AMX argmax differs | near-ties | divergences | largest margin (logits) | first |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for rel, n, f, nt, dv, lm, first in rows:
        where = (
            "–"
            if first is None
            else f"#{first.position}: {first.token_text!r} vs {first.argmax_text!r} ({first.margin:.3f})"
        )
        print(f"| {rel} | {n} | {f} | {nt} | {dv} | {lm:.3f} | {where} |")
    sys.exit(0 if all(r[4] == 0 for r in rows) else 7)


if __name__ == "__main__":
    main()
