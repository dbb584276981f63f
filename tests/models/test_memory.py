"""Memory: no n_ctx × n_vocab logits buffer, on the real tiny model.

llama-cpp-python's own draft path needs `logits_all=True`: an n_ctx × n_vocab float32 buffer (SmolLM2 at --ctx 4096:
4096 × 49,152 × 4 B = 805 MB; Qwen2.5 at 4096: 2.5 GB). specdec asks llama.cpp for logits only on the rows it
verifies (K + 1) and reads them as a view. Checked two ways: every `decode` call's requested rows, and the peak RSS of
a whole `specdec run` with a 3,000+ token prompt at --ctx 4096 (mapped weights, KV cache, llama.cpp's compute buffer
and Python fit well under the limit; a logits buffer of all rows would not).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec_cli.__main__ import main

pytestmark = pytest.mark.real

K = 8
LOGITS_ALL_BYTES = 4096 * 49_152 * 4  # 805 MB
RSS_LIMIT = 600 << 20  # bytes; room for a run, while a logits_all buffer (or any n_ctx x n_vocab copy) cannot fit


def long_prompt(path):
    path.write_text(
        "Summarize this text in one sentence.\n\n"
        + " ".join(f"The lighthouse keeper number {i} watched the sea and wrote down the ships." for i in range(190))
    )
    return path


def test_every_decode_asks_for_at_most_k_plus_1_rows_of_logits(smollm2_path, tmp_path, monkeypatch, capsys):
    from specdec_cli.models.llama import LlamaBackend

    calls: list[tuple[int, int, int]] = []  # (tokens in the batch, rows of logits asked, bytes returned)
    real = LlamaBackend.decode

    def recording(self, tokens, n_logits=0):
        out = real(self, tokens, n_logits)
        calls.append((len(tokens), n_logits, out.nbytes))
        return out

    monkeypatch.setattr(LlamaBackend, "decode", recording)
    prompt = long_prompt(tmp_path / "long.txt")
    code = main(
        [
            "run",
            str(prompt),
            "-t",
            str(smollm2_path),
            "-d",
            str(smollm2_path),
            "--method",
            "draft",
            "--ctx",
            "4096",
            "--k",
            str(K),
            "-n",
            "40",
            "--plain",
            "--json",
            str(tmp_path / "out.json"),
        ]
    )
    assert code == 0
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["stats"]["n_prompt"] > 3000 and doc["config"]["ctx"] == 4096
    assert max(n for _, n, _ in calls) <= K + 1
    assert max(b for _, _, b in calls) <= (K + 1) * 49_152 * 4  # <= 1.8 MB per call, never n_ctx rows
    prefills = [(m, n) for m, n, _ in calls if m > K + 1]
    assert prefills and all(n == 0 for _, n in prefills)  # the prompt is evaluated without any logits


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc/self/status")
def test_peak_rss_of_a_long_run_at_ctx_4096_is_far_below_a_logits_all_buffer(smollm2_path, tmp_path):
    prompt = long_prompt(tmp_path / "long.txt")
    out = tmp_path / "out.json"
    code = (
        "import sys\n"
        "from specdec_cli.__main__ import main\n"
        f"code = main(['run', {str(prompt)!r}, '-t', {str(smollm2_path)!r}, '--method', 'ngram', '--ctx', '4096', "
        f"'--k', '{K}', '-n', '32', '--plain', '--json', {str(out)!r}])\n"
        # VmHWM, the peak RSS of this program only (ru_maxrss would include the forked pytest process's own peak)
        "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0].split()[1]\n"
        "print('MAXRSS_KB', hwm, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak = int(proc.stderr.split("MAXRSS_KB")[-1].split()[0]) * 1024  # kB
    doc = json.loads(out.read_text())
    assert doc["stats"]["n_prompt"] > 3000 and doc["config"]["ctx"] == 4096
    print(
        f"peak RSS {peak / 1e6:.0f} MB (limit {RSS_LIMIT / 1e6:.0f} MB; "
        f"logits_all alone {LOGITS_ALL_BYTES / 1e6:.0f} MB)"
    )
    assert peak < RSS_LIMIT < LOGITS_ALL_BYTES
