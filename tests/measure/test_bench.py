"""`specdec bench`, the llama-cpp-python peer and the machine description.

The order of runs, the medians, paired speedups, agreement counts, the peer's derived acceptance and the Markdown
table are checked with literal numbers; Ctrl-C is checked with fake workers. The CLI test runs the real command on
the tiny model (SmolLM2-135M as its own draft) with two prompts and 8 tokens, and checks what it writes. One test
pins llama-cpp-python 0.3.36's broadcast error without logits_all, which the report tells users about. Nothing here
asserts a speed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from fakes import run
from specdec_cli.__main__ import main
from specdec_cli.cli.commands.bench_report import markdown_table
from specdec_cli.errors import BackendError, IncompatiblePairError, UsageError
from specdec_cli.measure import bench as B
from specdec_cli.measure import bench_process as bench_worker
from specdec_cli.measure.peer import lookup_acceptance
from specdec_cli.models.machine import model_file, physical_cores

ALL = ["none", "A/A", "auto", "ngram", "suffix", "draft", "peer-10", "peer-2"]


def cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# ---- what runs, in which order


def test_schedule_starts_each_first_repeat_block_with_cold_runs_and_rotates_the_order() -> None:
    plan = B.schedule(3, 2, 2)
    as_tuples = [(s.repeat, s.prompt, s.config, s.cold) for s in plan]
    assert as_tuples == [
        (0, 0, 0, True),
        (0, 0, 1, True),
        (0, 0, 2, True),  # repeat 0, prompt 0: cold runs first
        (0, 0, 0, False),
        (0, 0, 1, False),
        (0, 0, 2, False),
        (0, 1, 1, True),
        (0, 1, 2, True),
        (0, 1, 0, True),  # next block: one position later
        (0, 1, 1, False),
        (0, 1, 2, False),
        (0, 1, 0, False),
        (1, 0, 2, False),
        (1, 0, 0, False),
        (1, 0, 1, False),  # later repeats: warm cache, no cold runs
        (1, 1, 0, False),
        (1, 1, 1, False),
        (1, 1, 2, False),
    ]
    # every (prompt, config) has exactly one cold run, and `repeats` timed runs
    for p in range(2):
        for c in range(3):
            assert sum(s.cold for s in plan if (s.prompt, s.config) == (p, c)) == 1
            assert sum(not s.cold for s in plan if (s.prompt, s.config) == (p, c)) == 2


def test_methods_are_parsed_in_canonical_order_with_none_always_in() -> None:
    assert B.parse_methods("suffix, ngram") == ["none", "ngram", "suffix"]
    assert B.parse_methods("auto,none,draft,suffix,ngram") == ["none", "auto", "ngram", "suffix", "draft"]
    with pytest.raises(UsageError, match="Unknown method 'medusa' in --methods.*none, auto, ngram, suffix, draft"):
        B.parse_methods("ngram,medusa")
    assert [c.label for c in B.configs_for(["none", "ngram"], peer=True)] == [
        "none",
        "A/A",
        "ngram",
        "peer-10",
        "peer-2",
    ]
    assert [c.label for c in B.configs_for(["none", "draft"], peer=False)] == ["none", "A/A", "draft"]
    control = B.configs_for(["none"], peer=False)[1]
    assert (control.family, control.method, control.control, control.plain) == ("ours", "none", True, True)
    peer = B.configs_for(["none"], peer=True)[2]
    assert (peer.family, peer.num_pred_tokens, peer.title) == ("peer", 10, "llama-cpp-python lookup (N=10)")


def test_workload_configurations_warm_auto_native_names_and_their_labels_read_back() -> None:
    """--workload auto/verify: `auto-warm` keeps its controller, --native picks llama.cpp's configurations, and
    --from-json reads every label back to the configuration that made it."""
    assert B.parse_methods("auto-warm,none") == ["none", "auto-warm"]
    assert B.parse_native(" ngram-mod,plain,plain") == ("ngram-mod", "plain")
    with pytest.raises(UsageError, match="--native names no configuration"):
        B.parse_native(" , ")
    configs = B.configs_for(["none", "auto", "auto-warm"], peer=False, native=("ngram-mod",))
    assert [c.label for c in configs] == ["none", "A/A", "auto", "auto-warm", "native-ngram-mod"]
    warm, native = configs[3], configs[4]
    assert (warm.method, warm.warm, configs[2].warm, native.family, native.method) == (
        "auto",
        True,
        False,
        "native",
        "ngram-mod",
    )
    assert [B.config_from_label(c.label) for c in configs] == configs
    from specdec_cli.measure.bench_workloads import check_workload

    with pytest.raises(UsageError, match="Unknown workload 'chat'.*default, plain, auto, verify, predict"):
        check_workload("chat")


# ---- the summary, with literal numbers


def test_summary_medians_paired_speedups_geomeans_acceptance_ttft_rss_and_agreement() -> None:
    configs = [c for c in B.configs_for(["none", "ngram"], peer=True) if c.label in ("none", "ngram", "peer-10")]
    prompts = [("p", "edit"), ("q", "edit"), ("w", "write")]
    runs = [
        # cold runs: TTFT and RSS only; their tok/s must not count
        run("none", "p", 999, cold=True, ttft=900, rss=5000),
        run("ngram", "p", 999, cold=True, ttft=1100),
        run("none", "q", 999, kind="edit", cold=True, ttft=500),
        # prompt p: two repeats, plain 10 and 20 tok/s; ngram 30 and 20 → paired ratios 3.0 and 1.0
        run("none", "p", 10, repeat=0),
        run("none", "p", 20, repeat=1),
        run("ngram", "p", 30, repeat=0, drafted=10, accepted=8, spec_steps=4),
        run("ngram", "p", 20, repeat=1, drafted=10, accepted=2, spec_steps=4, tokens=(1, 2, 9)),
        # prompt q: ratio 4.0; prompt w (class write): ratio 0.5
        run("none", "q", 10),
        run("ngram", "q", 40),
        run("none", "w", 10, kind="write"),
        run("ngram", "w", 5, kind="write", tokens=(1, 7)),
        # the peer ran on p only, in repeat 0
        run("peer-10", "p", 5, drafted=6, accepted=3, spec_steps=3, rss=3000),
    ]
    none, ngram, peer = B.summarize(runs, configs, prompts)
    assert none.tps_by_prompt == {"p": 15.0, "q": 10.0, "w": 10.0}
    assert none.tokens_per_s == 10.0 and none.speedup == pytest.approx(1.0)
    assert none.ttft_ms == 700.0 and none.peak_rss_kib == 5000 and none.agree == (4, 4, None)
    assert ngram.tps_by_prompt == {"p": 25.0, "q": 40.0, "w": 5.0}
    assert ngram.speedup_by_prompt == {"p": 2.0, "q": 4.0, "w": 0.5}  # median of paired ratios 3.0 and 1.0
    assert ngram.speedup_spread_by_prompt["p"] == (1.0, 3.0)
    assert ngram.speedup == pytest.approx((2.0 * 4.0 * 0.5) ** (1 / 3))
    assert ngram.speedup_by_class == pytest.approx({"edit": (2.0 * 4.0) ** 0.5, "write": 0.5})
    assert ngram.speedup_range == (0.5, 4.0)
    assert ngram.tps_spread == pytest.approx(0.4)  # p: (30 - 20) / 25; q and w have one repeat
    assert (ngram.acceptance_rate, ngram.mean_accepted_length) == (0.5, 1.25)  # pooled: 10/20, 10/8
    assert ngram.ttft_ms == 1100 and ngram.runs == 4
    assert ngram.agree == (2, 4, 1)  # repeat 1 on p shares 2 tokens, w shares 1: the fewest is 1
    assert peer.speedup_by_prompt == {"p": 0.5} and peer.ttft_ms is None and peer.agree == (1, 1, None)
    assert peer.peak_rss_kib == 3000 and peer.acceptance_rate == 0.5
    d = ngram.to_dict()
    assert d["peak_rss_bytes"] == 1000 * 1024 and d["identical_to_none"] == 2 and d["compared_with_none"] == 4


def test_a_run_record_reads_as_a_frozen_bench_result() -> None:
    """The summary reads each --json run record as a `BenchResult`: what a worker did not report is 0 or None."""
    native = B.BenchResult.from_dict(
        {"config": "native-plain", "prompt": "p", "repeat": 1, "cold": False, "tokens_per_s": 21.0, "tokens": None}
    )
    assert (native.repeat, native.tokens_per_s, native.tokens, native.n_steps, native.verify_ms) == (
        1,
        21.0,
        None,
        0,
        0,
    )
    assert (native.ttft_ms, native.peak_rss_kib, native.n_drafted) == (None, None, 0)
    ours = B.BenchResult.from_dict(
        {
            **run("ngram", "p", 20, drafted=4, accepted=3, spec_steps=1, tokens=(1, 2), cold=True, ttft=80),
            "n_steps": 2,
            "verify_ms": 9.5,
        }
    )
    assert (ours.config, ours.cold, ours.tokens, ours.n_drafted, ours.n_accepted, ours.n_spec_steps) == (
        "ngram",
        True,
        (1, 2),
        4,
        3,
        1,
    )
    assert (ours.ttft_ms, ours.peak_rss_kib, ours.n_steps, ours.verify_ms) == (80, 1000, 2, 9.5)
    with pytest.raises(AttributeError):
        ours.n_drafted = 5  # frozen


def test_an_interrupted_bench_summarises_what_ran() -> None:
    configs = [c for c in B.configs_for(["none", "ngram"], peer=False) if not c.control]
    none, ngram = B.summarize([run("none", "p", 10)], configs, [("p", "edit"), ("q", "edit")])
    assert none.tokens_per_s == 10 and ngram.runs == 0 and ngram.speedup is None and ngram.tokens_per_s is None
    assert ngram.acceptance_rate is None and ngram.agree == (0, 0, None)


def test_markdown_table_has_a_column_per_class_and_a_row_per_configuration() -> None:
    configs = [c for c in B.configs_for(["none", "ngram"], peer=True) if not c.control]  # its row: test_compare.py
    prompts = [("p", "edit"), ("w", "write")]
    runs = [
        run("none", "p", 10),
        run("ngram", "p", 20, drafted=4, accepted=3, spec_steps=1),
        run("peer-10", "p", 5),
        run("peer-2", "p", 10),
        run("none", "w", 10, kind="write"),
        run("ngram", "w", 10, kind="write", tokens=(1, 2)),
        run("none", "p", 1, cold=True, ttft=1500, rss=2048),
    ]
    doc = {
        "target": "/m/t.gguf",
        "draft": None,
        "prompts": [{"name": n, "kind": k, "n_tokens": 9} for n, k in prompts],
        "settings": {"repeats": 1, "max_tokens": 96, "k": "auto"},
        "started_at": "now",
        "machine": {"cpu": "Test CPU", "cores": 2, "logical_cpus": 2, "threads": 2},
    }
    lines = markdown_table(doc, B.summarize(runs, configs, prompts)).splitlines()
    assert lines[0].startswith("<!-- specdec bench, now: t.gguf; 2 prompts") and "Test CPU" in lines[0]
    assert lines[1] == (
        "| configuration | decode tok/s | speedup | edit | write | acceptance | mean accepted length "
        "| TTFT | peak RSS | greedy = none |"
    )
    assert lines[3] == "| `none` | 10.0 | 1.00× |  |  |  |  | 1.50 s | 2 MiB |  |"
    assert lines[4] == "| `ngram` | 15.0 | 1.41× | 2.00× | 1.00× | 75% | 3.00 | – | 1 MiB | 1/2 ≥2 |"
    assert lines[5].startswith("| llama-cpp-python lookup (N=10) | 5.0 | 0.50× | 0.50× | – | n/a | n/a |")
    assert len(lines) == 3 + 4


# ---- the peer's derived acceptance


def test_lookup_acceptance_is_each_proposals_common_prefix_with_the_output() -> None:
    prompt = [7, 8, 9]
    output = [1, 2, 3, 4, 5, 6]
    context = np.array(prompt + output, dtype=np.int32)
    calls = [
        (4, np.array([2, 3, 0, 0], np.int32)),  # after token 1: 2, 3 accepted, then the target's 4 != 0
        (7, np.array([], np.int32)),  # no match: a plain step
        (8, np.array([6, 6, 6], np.int32)),  # only one position is left in the output: cut to [6], accepted
        (6, np.array([9], np.int32)),  # rejected at once
    ]
    st = lookup_acceptance(calls, context)
    assert (st.n_drafted, st.n_accepted, st.n_spec_steps, st.n_steps) == (4 + 1 + 1, 2 + 1, 3, 4)
    assert st.k_histogram == {4: 1, 0: 1, 1: 2}


# ---- the machine description


def test_model_digest_comes_from_the_resolver_marker_without_hashing(tmp_path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    assert model_file(model)["sha256"] is None
    assert model_file(model)["sha256_source"] == "not hashed (no resolver marker)"
    fake = "ab" * 32  # not the file's digest: proves the file was not hashed
    (tmp_path / "m.gguf.sha256").write_text(f"{fake}  m.gguf\n", encoding="ascii")
    d = model_file(model)
    assert (d["sha256"], d["size"], d["name"]) == (fake, 64, "m.gguf")
    (tmp_path / "m.gguf.sha256").write_text("not-a-digest  m.gguf\n", encoding="ascii")
    assert model_file(model)["sha256"] is None


def test_the_bench_worker_runs_without_resource_or_proc_and_reports_rss_as_missing(monkeypatch, tmp_path) -> None:
    """Windows has neither /proc nor the POSIX-only `resource` module: the worker's module imports and its RSS
    reader gives the figures it can (none here, on Linux without /proc) instead of raising ImportError."""
    import importlib

    monkeypatch.setitem(sys.modules, "resource", None)  # `import resource` raises ImportError
    monkeypatch.delitem(sys.modules, "specdec_cli.measure.bench_process")
    monkeypatch.setattr(sys.modules["specdec_cli.measure"], "bench_process", bench_worker)  # restored after
    fresh = importlib.import_module("specdec_cli.measure.bench_process")
    monkeypatch.setattr(fresh, "_PROC_STATUS", str(tmp_path / "no-proc" / "status"))
    assert fresh._rss_kib() == (None, None)
    monkeypatch.setattr(sys, "platform", "win32")  # Windows' own counters: not callable on this Linux, so n/a
    assert fresh._rss_kib() == (None, None)


@pytest.mark.parametrize(
    "sysctl, threads, why",
    [
        ({"hw.perflevel0.physicalcpu": "8\n", "hw.physicalcpu": "12\n"}, 8, "the performance cores"),
        ({"hw.physicalcpu": "10\n"}, 10, "the physical cores"),  # a macOS without performance levels
        ({}, 12, "the CPUs this process may use"),
    ],
)  # sysctl says nothing
def test_threads_default_to_the_performance_cores_on_apple_silicon(monkeypatch, sysctl, threads, why) -> None:
    import platform
    import subprocess

    from specdec_cli.models import machine

    def fake_sysctl(args, **kw):  # macOS's sysctl; any other command fails
        found = args[:2] == ["sysctl", "-n"] and args[2] in sysctl
        return subprocess.CompletedProcess(args, 0 if found else 1, sysctl[args[2]] if found else "", "")

    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    monkeypatch.setattr(subprocess, "run", fake_sysctl)
    monkeypatch.setattr(machine, "usable_cpus", lambda: 12)  # 8 performance + 4 efficiency cores
    n, reason = machine.default_threads()
    assert n == threads and reason.startswith(why)
    assert machine.describe(None, system_info="", load_plan=None)["threads"] == threads
    pytest.importorskip("llama_cpp")
    from specdec_cli.models import llama

    assert llama.default_threads() == threads
    from rich.console import Console

    from specdec_cli.cli.commands import doctor
    from specdec_cli.cli.console import THEME

    console = Console(width=200, record=True, theme=THEME)
    console.print(doctor.table(doctor.report()))  # doctor shows the choice and why
    assert f"{threads} by default: {why}" in console.export_text()
    monkeypatch.setattr(platform, "system", lambda: "Linux")  # every usable CPU elsewhere
    assert llama.default_threads() == 12


def test_physical_cores_counts_distinct_package_and_core_ids() -> None:
    block = "processor\t: {i}\nphysical id\t: {p}\ncore id\t\t: {c}\n"
    text = "\n".join(block.format(i=i, p=p, c=c) for i, (p, c) in enumerate([(0, 0), (0, 0), (0, 1), (1, 0)]))
    assert physical_cores(text) == 3
    assert physical_cores("processor\t: 0\nmodel name\t: x\n") is None


# ---- errors


def test_plot_needs_png_or_svg_and_matplotlib(capsys, monkeypatch, tmp_path) -> None:
    code, _, err = cli(capsys, "bench", "--plot", str(tmp_path / "chart.gif"), "--no-peer")
    assert code == 2 and "unknown image format" in err and ".png or .svg" in err
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    code, _, err = cli(capsys, "bench", "--plot", str(tmp_path / "chart.png"), "--no-peer")
    assert code == 2 and "--plot needs matplotlib" in err and "pip install 'specdec-cli[plot]'" in err


def test_usage_errors_are_one_line_with_the_fix(capsys, tmp_path) -> None:
    code, _, err = cli(capsys, "bench", "--methods", "none,eagle")
    assert code == 2 and "Unknown method 'eagle'" in err
    code, _, err = cli(capsys, "bench", "--k", "99", "--no-peer")
    assert code == 2 and "--k must be between 0 and 64" in err
    code, _, err = cli(capsys, "bench", "--json", "-", "--markdown")
    assert code == 2 and "both want stdout" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 99}', encoding="utf-8")
    code, _, err = cli(capsys, "bench", "--from-json", str(bad))
    assert code == 2 and "not a specdec bench --json file" in err


def test_worker_errors_come_back_as_the_same_error_type() -> None:
    e = bench_worker._remote_error(
        {"type": "IncompatiblePairError", "message": "Vocabularies differ.", "fix": "Pass --draft X."}
    )
    assert (
        isinstance(e, IncompatiblePairError) and str(e) == "Vocabularies differ. Pass --draft X." and e.exit_code == 4
    )
    e = bench_worker._remote_error({"type": "KeyError", "message": "'x'"})
    assert isinstance(e, BackendError) and "a bug in specdec" in str(e)


# ---- Ctrl-C, with fake workers


class FakeWorker:
    """Stands in for a worker process: canned replies; the `interrupt_at`-th run raises KeyboardInterrupt."""

    interrupt_at = 5
    calls = 0
    closed: list[tuple[str, bool]] = []

    def __init__(self, family, init):
        self.family = family
        self.info = (
            {
                "tokens": [[1, 2, 3]] * len(init["prompts"]),
                "warmup_tokens": [1],
                "threads": 2,
                "suffix_store_tokens": None,
                "rss_after_load_kib": 10,
            }
            if family == "ours"
            else {"scores_bytes": 4, "n_vocab": 1, "rss_after_load_kib": 10}
        )

    def call(self, msg):
        FakeWorker.calls += 1
        if FakeWorker.calls == FakeWorker.interrupt_at:
            raise KeyboardInterrupt
        return {
            "tokens_per_s": 10.0,
            "n_tokens": 4,
            "ttft_ms": 5.0 if msg["cold"] else None,
            "n_drafted": 0,
            "n_accepted": 0,
            "n_spec_steps": 0,
            "peak_rss_kib": 100,
            "tokens": [5, 6, 7, 8],
        }

    def close(self, *, kill=False):
        FakeWorker.closed.append((self.family, kill))


def test_ctrl_c_stops_the_workers_reports_and_writes_the_runs_so_far(
    smollm2_path, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setattr(B, "BenchProcess", FakeWorker)
    FakeWorker.calls, FakeWorker.closed = 0, []
    p = tmp_path / "a.txt"
    p.write_text("Say something.", encoding="utf-8")
    out_json = tmp_path / "b.json"
    code, out, _ = cli(
        capsys, "bench", str(p), "-t", "smollm2-135m", "--methods", "none,ngram", "--json", str(out_json)
    )
    assert code == 130
    assert sorted(FakeWorker.closed) == [("ours", True), ("peer", True)]  # killed, not waited for
    assert "Interrupted after 4 of 10 runs" in out  # none, A/A, ngram, peer-10, peer-2: 5 cold + 5 timed
    doc = json.loads(out_json.read_text(encoding="utf-8"))
    assert doc["interrupted"] is True and len(doc["runs"]) == 4 and doc["schedule_runs"] == 10
    assert all(r["cold"] for r in doc["runs"])  # four of the block's five cold runs ran, no timed run did


# ---- the real command on the tiny model


@pytest.fixture
def two_prompts(tmp_path) -> list[Path]:
    a = tmp_path / "copy.txt"
    a.write_text("Repeat this list exactly: apples, pears, plums, cherries, grapes, figs.", encoding="utf-8")
    b = tmp_path / "sea.txt"
    b.write_text("Write one sentence about the sea.", encoding="utf-8")
    return [a, b]


def test_bench_cli_runs_every_configuration_and_writes_json_png_and_markdown(
    smollm2_path, two_prompts, tmp_path, capsys
) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "out.png"
    code, out, err = cli(
        capsys,
        "bench",
        *map(str, two_prompts),
        "-t",
        "smollm2-135m",
        "-d",
        "smollm2-135m",
        "-n",
        "8",
        "--repeats",
        "1",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
    )
    assert code == 0, err
    doc = json.loads(out_json.read_text(encoding="utf-8"))
    assert doc["configs"] == ALL and doc["interrupted"] is False
    assert [p["name"] for p in doc["prompts"]] == ["copy", "sea"]
    # every configuration ran on every prompt: one cold run (with TTFT) and one timed run
    for label in ALL:
        for prompt in ("copy", "sea"):
            mine = [r for r in doc["runs"] if (r["config"], r["prompt"]) == (label, prompt)]
            assert sorted(r["cold"] for r in mine) == [False, True], (label, prompt)
            cold = next(r for r in mine if r["cold"])
            timed = next(r for r in mine if not r["cold"])
            assert cold["ttft_ms"] > 0 and timed["ttft_ms"] is None
            assert 1 <= timed["n_tokens"] <= 8 and len(timed["tokens"]) == timed["n_tokens"]
            assert timed["tokens_per_s"] > 0 and timed["peak_rss_kib"] > 0
    assert len(doc["runs"]) == doc["schedule_runs"] == 2 * 2 * len(ALL)
    summary = {s["config"]: s for s in doc["summary"]}
    assert set(summary) == set(ALL)
    for label in ALL:
        s = summary[label]
        assert s["tokens_per_s"] > 0 and s["speedup"] > 0 and s["ttft_ms"] > 0 and s["peak_rss_bytes"] > 0
        assert s["compared_with_none"] == 2
    assert summary["none"]["speedup"] == pytest.approx(1.0)
    # the machine description and the models, digest from the resolver's marker
    m = doc["machine"]
    assert m["cpu"] and m["logical_cpus"] >= 1 and m["threads"] >= 1 and m["system_info"]
    import llama_cpp

    assert m["llama_cpp_python"] == llama_cpp.__version__
    marker = Path(str(smollm2_path) + ".sha256").read_text(encoding="ascii").split()[0]
    assert [x["sha256"] for x in m["models"]] == [marker, marker]
    assert doc["peer"]["calls"][0].endswith(
        "logits_all=True, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))"
    )
    assert doc["peer"]["scores_buffer_bytes"] == 4096 * doc["peer"]["n_vocab"] * 4
    # the report, and a PNG
    for label in ALL:
        assert label in out
    assert "logits_all=True is what makes it work" in " ".join(out.split())  # Rich wraps long lines
    data = out_png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    # the Markdown table from the saved run, without measuring
    code, md, _ = cli(capsys, "bench", "--from-json", str(out_json), "--markdown")
    assert code == 0
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| -")]
    assert len(rows) == 1 + len(ALL)  # header + one row per configuration
    assert rows[1].startswith("| `none` |") and rows[-1].startswith("| llama-cpp-python lookup (N=2) |")


def test_peer_needs_logits_all_past_n_batch_tokens(smollm2_path) -> None:
    """The report says Llama(draft_model=...) fails without logits_all=True once the context passes n_batch (512);
    if a llama-cpp-python release fixes that, this test fails and the note must change."""
    from specdec_cli.measure.peer import PeerModel

    prompt = [int(t) for t in np.resize(np.arange(100, 200), 520)]  # 520 tokens > n_batch
    broken = PeerModel(smollm2_path, n_ctx=1024, logits_all=False)
    try:
        with pytest.raises(ValueError, match="broadcast"):
            broken.generate(prompt, num_pred_tokens=10, max_tokens=2, cold=True)
    finally:
        broken.close()
    working = PeerModel(smollm2_path, n_ctx=1024, logits_all=True)
    try:
        r = working.generate(prompt, num_pred_tokens=10, max_tokens=2, cold=True)
        assert len(r.tokens) == 2 or r.finish_reason == "eog"
    finally:
        working.close()


def test_native_runner_reports_the_tools_decode_rate_and_is_not_compared_with_none(monkeypatch, tmp_path):
    import specdec_cli.measure.native as native

    seen = []

    def fake(kind):
        def run(job, text, **kw):
            n = job.n_tokens
            seen.append((kind, text, n, job.threads, job.ctx, kw.get("spec_type")))
            return native.NativeResult(
                name=kind,
                decode_tok_s=41.5,
                n_decoded=n,
                decode_s=n / 41.5,
                n_drafted=10 if kind != "plain" else None,
                n_accepted=7 if kind != "plain" else None,
                acceptance=None,
                prefill_ms=900.0,
                n_prompt=5,
                text="x",
                command=("llama-x",),
            )

        return run

    monkeypatch.setattr(native, "run_plain", fake("plain"))
    monkeypatch.setattr(native, "run_speculative", fake("spec"))
    runner = B.NativeRunner(object(), tmp_path / "m.gguf", ["<rendered 0>", "<rendered 1>"], 2, 4096)
    cold = runner.call({"op": "run", "prompt": 1, "cold": True, "max_tokens": 8, "method": "plain"})
    timed = runner.call({"op": "run", "prompt": 0, "cold": False, "max_tokens": 96, "method": "ngram-simple"})
    assert seen == [("plain", "<rendered 1>", 8, 2, 4096, None), ("spec", "<rendered 0>", 96, 2, 4096, "ngram-simple")]
    assert cold["ttft_ms"] == 900.0 and timed["ttft_ms"] is None and timed["tokens_per_s"] == 41.5
    assert (timed["n_drafted"], timed["n_accepted"]) == (10, 7) and timed["tokens"] is None
    assert [c.label for c in B.configs_for(["none", "auto"], peer=False, native=True)] == [
        "none",
        "A/A",
        "auto",
        "native-plain",
        "native-ngram-simple",
    ]
    runs = [
        {
            "config": "none",
            "prompt": "p",
            "repeat": 0,
            "cold": False,
            "tokens_per_s": 20.0,
            "tokens": [1, 2],
            "n_drafted": 0,
            "n_accepted": 0,
            "n_spec_steps": 0,
        },
        {
            "config": "native-plain",
            "prompt": "p",
            "repeat": 0,
            "cold": False,
            "tokens_per_s": 21.0,
            "tokens": None,
            "n_drafted": 0,
            "n_accepted": 0,
            "n_spec_steps": 0,
        },
    ]
    configs = [c for c in B.configs_for(["none"], peer=False, native=True) if not c.control][:2]
    (_, nat) = B.summarize(runs, configs, [("p", "edit")])
    assert nat.speedup == pytest.approx(21.0 / 20.0) and nat.agree == (0, 0, None)


def test_the_draft_method_is_left_out_with_a_line_for_a_target_no_draft_model_goes_with(tmp_path):
    from specdec_cli.spec import ModelOptions

    options = B.BenchOptions(methods=B.parse_methods("none,ngram,draft"))
    kept, note = B.without_unpaired_draft(options, ModelOptions(target=str(tmp_path / "lfm2-tiny.gguf")))
    assert B.Method.draft not in kept.methods and B.Method.ngram in kept.methods
    assert note and "--draft" in note
    for models in (
        ModelOptions(target=None),
        ModelOptions(target=str(tmp_path / "x.gguf"), draft="qwen2.5-coder-0.5b"),
    ):
        assert B.without_unpaired_draft(options, models) == (options, None)  # the default pair, or a named draft


def test_a_workload_of_its_own_is_summarised_as_the_bench_is(monkeypatch) -> None:
    """--workload predict|suffix|edits: what a workload emits becomes bench's run dicts, configurations (in the order
    they first ran, none first) and prompts (their token counts from ours), so the same summary reads them."""
    from types import SimpleNamespace

    from specdec_cli.measure import bench_workloads as W
    from specdec_cli.prompts import PromptCase

    p, q = PromptCase("p", "pass 1", "x"), PromptCase("p (pass 2)", "pass 2", "x")

    def fake(emit, info, models, options, reporter):
        info["threads"] = 2
        for case, tps in ((p, 10.0), (q, 12.0)):
            emit("native-ngram-mod", case, 0, {"tokens_per_s": 30.0, "tokens": None})
            emit("none", case, 0, {"tokens_per_s": tps, "tokens": [1, 2], "n_prompt": 7})
            emit("suffix-fresh", case, 0, {"tokens_per_s": 2 * tps, "tokens": [1, 2], "n_prompt": 7})
        return Path("/models/m.gguf")

    monkeypatch.setattr(W, "_suffix", fake)
    notes: list[str] = []
    sitting = W.run_workload(
        "suffix",
        models=SimpleNamespace(threads=2, target=None),
        options=None,
        reporter=SimpleNamespace(note=notes.append),
    )
    assert [c.label for c in sitting.configs] == ["none", "native-ngram-mod", "suffix-fresh"]
    assert sitting.configs[1].family == "native" and sitting.configs[2].family == "ours"
    assert [(c.name, c.kind) for c in sitting.prompts] == [("p", "pass 1"), ("p (pass 2)", "pass 2")]
    assert [len(t) for t in sitting.bench.tokens] == [7, 7] and len(sitting.bench.runs) == len(notes) == 6
    summaries = B.summarize(sitting.bench.runs, sitting.configs, [(c.name, c.kind) for c in sitting.prompts])
    assert summaries[2].speedup_by_class == {"pass 1": pytest.approx(2.0), "pass 2": pytest.approx(2.0)}
    assert summaries[2].agree == (2, 2, None)
