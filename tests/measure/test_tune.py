"""`specdec tune` and the saved settings (tuned.json).

The order of runs, the medians, speedups and the choice of the best setting are checked with literal numbers; the
CLI test runs the real command on the tiny model (SmolLM2-135M as its own draft) with 16 tokens per run and checks
what it writes and that a following `run` uses the saved setting. Nothing here asserts a speed.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import warnings
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from specdec_cli.cli.app import app
from specdec_cli.cli.commands.tune_report import report
from specdec_cli.cli.console import THEME
from specdec_cli.errors import UsageError
from specdec_cli.measure import tune as T
from specdec_cli.measure.tune import Measurement, TuneConfig
from specdec_cli.stores import tuned

runner = CliRunner()


def m(
    config: str,
    prompt: str,
    tps: float,
    *,
    repeat: int = 0,
    drafted: int = 0,
    accepted: int = 0,
    spec_steps: int = 0,
    khist: dict[int, int] | None = None,
    verify=(),
    drafts=(),
) -> Measurement:
    return Measurement(
        config=config,
        prompt=prompt,
        repeat=repeat,
        tokens_per_s=tps,
        n_tokens=16,
        n_drafted=drafted,
        n_accepted=accepted,
        n_spec_steps=spec_steps,
        mean_k=0.0,
        k_histogram=khist or {},
        decode_ms=1000.0,
        prefill_ms=0.0,
        n_prefill_evaluated=0,
        finish_reason="length",
        verify=list(verify),
        drafts=list(drafts),
    )


# ---- what runs, in which order


def test_schedule_interleaves_configs_and_rotates_the_order_every_block() -> None:
    assert [(s.repeat, s.prompt, s.config, s.cold) for s in T.schedule(3, 2, 2)] == [
        (0, 0, 0, False),
        (0, 0, 1, False),
        (0, 0, 2, False),  # repeat 0, prompt 0
        (0, 1, 1, False),
        (0, 1, 2, False),
        (0, 1, 0, False),  # repeat 0, prompt 1: one later
        (1, 0, 2, False),
        (1, 0, 0, False),
        (1, 0, 1, False),
        (1, 1, 0, False),
        (1, 1, 1, False),
        (1, 1, 2, False),
    ]
    plan = T.schedule(4, 1, 4)
    for position in range(4):  # over n_configs blocks every configuration takes every position once
        assert sorted(s.config for s in plan[position::4]) == [0, 1, 2, 3]


def test_configs_and_k_parsing() -> None:
    assert [c.label for c in T.configs_for([2, 4])] == ["none", "2", "4", "auto"]
    assert [(c.mode, c.k, c.title, c.saved_k) for c in T.configs_for([8])] == [
        ("none", None, "plain", 0),
        ("fixed", 8, "K=8", 8),
        ("auto", None, "auto", "auto"),
    ]
    assert T.parse_tune_k("4..16") == [4, 6, 8, 12, 16]
    assert T.parse_tune_k("8,2") == [2, 8]
    assert T.parse_tune_k(" Auto ") == []
    with pytest.raises(UsageError, match="runs backwards.*--k 4..16"):
        T.parse_tune_k("16..4")


# ---- medians, speedups, the best setting


def test_median_of_repeats_speedup_over_plain_and_geometric_mean() -> None:
    runs = [
        m("none", "edit", 10.0, repeat=0),
        m("none", "edit", 12.0, repeat=1),
        m("none", "edit", 20.0, repeat=2),
        m("4", "edit", 18.0, repeat=0, drafted=8, accepted=6, spec_steps=2, khist={4: 3}),
        m("4", "edit", 30.0, repeat=1, drafted=8, accepted=2, spec_steps=2, khist={4: 3}),
        m("4", "edit", 24.0, repeat=2, drafted=4, accepted=4, spec_steps=1, khist={4: 1, 2: 1}),
        m("none", "write", 10.0),
        m("4", "write", 5.0),
    ]
    configs = T.configs_for([4])
    plain, k4, auto = T.summarize(runs, configs, ["edit", "write"])
    assert plain.tokens_per_s == {"edit": 12.0, "write": 10.0}  # medians
    assert plain.speedup == {"edit": 1.0, "write": 1.0} and plain.speedup_geomean == pytest.approx(1.0)
    assert k4.tokens_per_s == {"edit": 24.0, "write": 5.0}
    assert k4.speedup == {"edit": 2.0, "write": 0.5}
    assert k4.speedup_geomean == pytest.approx(1.0)  # sqrt(2 × 0.5)
    assert k4.acceptance_rate == pytest.approx(12 / 20)  # pooled over runs, not a mean of rates
    assert k4.mean_accepted_length == pytest.approx(12 / 5)
    assert k4.k_histogram == {4: 7, 2: 1} and k4.mean_k == pytest.approx(30 / 8)
    assert k4.runs == 4
    assert auto.tokens_per_s == {} and auto.speedup_geomean is None and auto.runs == 0  # never ran


def summaries(speedups: dict[str, float]) -> list[T.ConfigSummary]:
    return [
        T.ConfigSummary(
            config=TuneConfig(label),
            tokens_per_s={"p": 10.0 * s},
            speedup={"p": s},
            speedup_geomean=s,
            acceptance_rate=0.5,
            mean_accepted_length=1.0,
            mean_k=0.0,
            k_histogram={},
            runs=1,
        )
        for label, s in speedups.items()
    ]


def test_choose_best_prefers_auto_within_the_margin() -> None:
    assert T.choose_best(summaries({"none": 1.0, "4": 1.50, "8": 1.40, "auto": 1.30})).label == "4"
    assert T.choose_best(summaries({"none": 1.0, "4": 1.50, "8": 1.40, "auto": 1.46})).label == "auto"  # 2.7 % off
    assert T.choose_best(summaries({"none": 1.0, "4": 0.80, "auto": 0.90})).label == "none"  # plain wins: K = 0
    assert T.choose_best(summaries({"none": 1.0, "4": 0.80, "auto": 0.98})).label == "auto"
    assert T.choose_best([]) is None


def test_verify_cost_curve_and_draft_cost() -> None:
    runs = [
        m("none", "p", 1.0, verify=[(1, 50.0), (1, 70.0), (1, 60.0)]),
        m("4", "p", 1.0, verify=[(5, 200.0), (3, 120.0), (5, 220.0)], drafts=[(4, 40.0), (2, 30.0), (4, 48.0)]),
    ]
    assert T.verify_curve(runs) == [(1, 60.0, 3), (3, 120.0, 1), (5, 210.0, 2)]
    assert T.draft_cost(runs) == pytest.approx(12.0)  # median of 10, 15, 12 ms per drafted token
    assert T.draft_cost(runs[:1]) is None


def test_report_shows_the_table_the_chart_and_the_cost_curve() -> None:
    runs = [
        m("none", "edit", 10.0, verify=[(1, 50.0)]),
        m("4", "edit", 20.0, drafted=4, accepted=3, spec_steps=1, verify=[(5, 100.0)], drafts=[(4, 8.0)]),
        m("auto", "edit", 15.0, khist={0: 2, 3: 1}),
    ]
    configs = T.configs_for([4])
    s = T.summarize(runs, configs, ["edit"])
    best = T.choose_best(s)
    buf = io.StringIO()
    Console(file=buf, width=100, color_system=None, theme=THEME).print(
        report(s, ["edit"], best, T.verify_curve(runs), T.draft_cost(runs))
    )
    text = buf.getvalue()
    assert re.search(r"K=4\s+20\.0 2\.00×\s+2\.00×\s+75%\s+3\.00", text)
    assert "speedup over plain decoding" in text and "█" in text
    assert re.search(r"^\s*5\s+100\.0\s+20\.0\s+2\.00\s+1\s*$", text, re.M)  # batch 5: 100 ms, 20 ms/token, 2× b=1
    assert "2.00 ms per drafted token" in text
    assert "auto chose K = 1.0 on average (steps by K: K=0:2  K=3:1)" in text
    assert "best K=4: 2.00× plain decoding" in text


# ---- tuned.json


@pytest.fixture
def models(tmp_path) -> tuple[Path, Path]:
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    target.write_bytes(b"T" * (3 << 20))
    draft.write_bytes(b"D" * 1000)
    return target, draft


MACHINE = {"cpu": "Test CPU", "threads": 2, "system_info_sha256": "abc", "key": "Test CPU|2|abc"}


@pytest.fixture
def fixed_machine(monkeypatch):
    monkeypatch.setattr(
        tuned,
        "machine",
        lambda threads, placement="": {
            **MACHINE,
            "threads": threads or 2,
            "placement": placement,
            "key": f"Test CPU|{threads or 2}|abc" + (f"|{placement}" if placement else ""),
        },
    )


def test_tuned_round_trip(models, fixed_machine) -> None:
    target, draft = models
    assert tuned.lookup(target, draft, "draft", 2) is None  # no file yet
    path = tuned.save(target, draft, "draft", MACHINE, 6, {"speedup": 1.3})
    assert path == tuned.tuned_path() and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    tuned.save(target, None, "ngram", MACHINE, "auto")
    assert tuned.lookup(target, draft, "draft", 2) == 6
    assert tuned.lookup(target, draft, "draft", None) == 6  # None threads = the default (2 here)
    assert tuned.lookup(target, None, "ngram", 2) is None  # saved "auto" means AdaptiveK
    assert tuned.lookup(target, draft, "draft", 4) is None  # another thread count is another machine
    assert tuned.lookup(target, draft, "ngram", 2) is None
    assert tuned.lookup(draft, target, "draft", 2) is None
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and len(doc["settings"]) == 2  # the second save kept the first entry
    saved = sorted(doc["settings"].values(), key=lambda e: str(e["k"]))
    assert [e["k"] for e in saved] == [6, "auto"] and saved[0]["speedup"] == 1.3  # the details kept beside K
    # a different file under the same name and size is not the tuned model
    with open(target, "r+b") as f:
        f.seek((3 << 20) - 1)
        f.write(b"X")
    assert tuned.lookup(target, draft, "draft", 2) is None


def test_model_id_reads_both_ends(tmp_path) -> None:
    a = tmp_path / "m.gguf"
    a.write_bytes(b"\0" * (4 << 20))
    before = tuned.model_id(a)
    assert before.startswith(f"m.gguf:{4 << 20}:")
    with open(a, "r+b") as f:
        f.seek(2 << 20)
        f.write(b"middle")
    assert tuned.model_id(a) == before  # the middle is not hashed (documented)
    with open(a, "r+b") as f:
        f.write(b"head")
    assert tuned.model_id(a) != before


@pytest.mark.parametrize(
    "content, says",
    [
        ("{not json", "not valid JSON"),
        ('{"version": 2, "settings": {}}', "not a version-1 tuned.json"),
        ("[1, 2]", "not a version-1 tuned.json"),
        (b"\xff\xfe", "cannot read"),
    ],
)
def test_a_corrupt_tuned_json_is_ignored_with_a_warning(models, fixed_machine, content, says) -> None:
    target, draft = models
    path = tuned.tuned_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.warns(tuned.TunedWarning, match=says):
        assert tuned.lookup(target, draft, "draft", 2) is None
    with pytest.warns(tuned.TunedWarning):
        tuned.save(target, draft, "draft", MACHINE, 3)  # replaces the broken file
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuned.lookup(target, draft, "draft", 2) == 3


def test_an_invalid_entry_is_ignored_with_a_warning(models, fixed_machine) -> None:
    target, draft = models
    path = tuned.save(target, draft, "draft", MACHINE, 3)
    doc = json.loads(path.read_text())
    for entry in doc["settings"].values():
        entry["k"] = 99
    path.write_text(json.dumps(doc))
    with pytest.warns(tuned.TunedWarning, match='"k" must be "auto" or a whole number'):
        assert tuned.lookup(target, draft, "draft", 2) is None
    with pytest.raises(ValueError):
        tuned.save(target, draft, "draft", MACHINE, 65)


# ---- the command on the tiny model


def test_tune_cli_writes_every_run_and_run_uses_the_saved_setting(smollm2_path, tmp_path) -> None:
    prompt = tmp_path / "short_edit.txt"
    prompt.write_text("Count from 1 to 30, separated by commas.\n", encoding="utf-8")
    out = tmp_path / "tune.json"
    models = ["-t", "smollm2-135m", "-d", "smollm2-135m", "--method", "draft"]  # (the default is auto)
    result = runner.invoke(
        app, ["tune", str(prompt), *models, "--k", "2,4", "--max-tokens", "16", "--json", str(out), "--save"]
    )
    assert result.exit_code == 0, result.output
    assert "speedup over plain decoding" in result.stdout and "target forward pass by batch size" in result.stdout
    doc = json.loads(out.read_text())
    assert doc["configs"] == ["none", "2", "4", "auto"] and doc["k_values"] == [2, 4]
    assert doc["prompts"][0]["name"] == "short_edit" and doc["prompts"][0]["n_tokens"] > 10
    assert doc["interrupted"] is False and doc["method"] == "draft"
    assert {"cpu", "threads", "system_info", "key"} <= doc["machine"].keys()
    assert sorted(r["config"] for r in doc["runs"]) == ["2", "4", "auto", "none"]
    by = {r["config"]: r for r in doc["runs"]}
    for r in doc["runs"]:
        assert r["prompt"] == "short_edit" and r["repeat"] == 0
        assert r["tokens_per_s"] > 0 and r["verify_ms_by_batch"]
    assert len({r["n_tokens"] for r in doc["runs"]}) == 1  # greedy and lossless: the same output every time
    # the draft model is the target: greedy drafts are always accepted
    assert by["4"]["acceptance_rate"] == 1.0 and by["4"]["mean_accepted_length"] > 1.0
    assert by["none"]["n_drafted"] == 0 and by["none"]["verify_ms_by_batch"][0][0] == 1
    assert {b for b, _, _ in by["4"]["verify_ms_by_batch"]} >= {5}
    assert by["auto"]["controller"]["mode"] == "auto"
    # only the first run of the prompt paid its prefill (the warm-up did): later runs reuse the KV cache
    assert all(r["n_prefill_evaluated"] == 0 for r in doc["runs"])
    assert {s["config"] for s in doc["summary"]} == {"none", "2", "4", "auto"}
    assert doc["best"] in {"none", "2", "4", "auto"}

    # --save wrote the best configuration for this pair, method and machine
    saved = json.loads(Path(doc["saved"]).read_text())["settings"]
    ((key, entry),) = saved.items()
    assert entry["k"] == TuneConfig(doc["best"]).saved_k and entry["method"] == "draft"
    assert key.startswith(f"{smollm2_path.name}:") and "|draft|" in key

    # a following run without --k uses the saved K (set to 3 here, so the check does not depend on timing)
    saved[key]["k"] = 3
    Path(doc["saved"]).write_text(json.dumps({"version": 1, "settings": saved}))
    r = runner.invoke(app, ["run", str(prompt), *models, "--max-tokens", "12", "--json", "-"])
    assert r.exit_code == 0, r.output
    run_doc = json.loads(r.stdout)
    assert run_doc["config"]["k"] == "3" and run_doc["config"]["k_source"] == "tuned"
    ks = [s["k"] for s in run_doc["steps"]]
    assert ks[0] == 3 and set(ks) <= {3, 2, 1, 0}  # only the last steps are cut by --max-tokens
    assert "K = 3 from specdec tune" in r.stderr
    # an explicit --k auto still means auto (its first step is a plain one that measures the cost of a pass)
    r = runner.invoke(app, ["run", str(prompt), *models, "--max-tokens", "4", "--k", "auto", "--json", "-"])
    run_doc = json.loads(r.stdout)
    assert run_doc["config"]["k"] == "auto" and run_doc["config"]["k_source"] == "option"
    assert run_doc["steps"][0]["k"] == 0


def test_ctrl_c_reports_and_writes_the_runs_so_far_and_saves_nothing(smollm2_path, tmp_path, monkeypatch) -> None:
    from specdec_cli import driver

    real = driver.generate
    calls = []

    def generate(engine, prompt, config, on_step=None):
        calls.append(1)
        g = real(engine, prompt, config, on_step)
        if len(calls) == 3:  # warm-up, one run, then Ctrl-C during the second run
            g.interrupted = True
        return g

    monkeypatch.setattr(driver, "generate", generate)
    prompt = tmp_path / "p.txt"
    prompt.write_text("Say hello.", encoding="utf-8")
    out = tmp_path / "tune.json"
    result = runner.invoke(
        app,
        [
            "tune",
            str(prompt),
            "-t",
            "smollm2-135m",
            "-d",
            "smollm2-135m",
            "--k",
            "2",
            "--max-tokens",
            "4",
            "--json",
            str(out),
            "--save",
        ],
    )
    assert result.exit_code == 130
    assert "Interrupted after 1 of 3 runs" in result.stdout
    assert "Not saved" in result.stderr and not tuned.tuned_path().exists()
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and [r["config"] for r in doc["runs"]] == ["none"] and doc["best"] is None


def test_tune_usage_errors(tmp_path) -> None:
    for args, says in [(["--method", "none"], "--method none has no K to tune"), (["--k", "x"], "whole numbers")]:
        result = runner.invoke(app, ["tune", "-t", "smollm2-135m", *args])
        assert isinstance(result.exception, UsageError) and says in str(result.exception)
