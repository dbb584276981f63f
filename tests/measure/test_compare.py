"""`run --compare N` you can trust, and the A/A control of `specdec bench`.

The paired measurement: a warm-up before either side is timed, the order of the sides alternating pair by pair, and
the speedup as the median of the per-pair ratios with their min and max; checked exactly with a fake clock through the
real `specdec run` on a fake session. The bench's A/A row: plain decoding timed against plain decoding.
"""

from __future__ import annotations

import json

import pytest

from fakes import FakeBackend, bench_doc, hashed_logits, run, wants_draft
from specdec_cli.__main__ import main
from specdec_cli.cli.commands.bench_report import markdown_table
from specdec_cli.cli.options import COMPARE_PAIRS, expand_optional_values
from specdec_cli.measure import bench as B
from specdec_cli.measure.paired import measure
from specdec_cli.session import Session

# ---- paired.measure, with recording sides


def recorder(events, name, rates):
    rates = iter(rates)

    def side():
        events.append(name)
        return next(rates), name

    return side


def test_the_warm_up_runs_once_before_either_side():
    events = []
    measure(recorder(events, "a", [1, 1]), recorder(events, "b", [1, 1]), 2, warmup=lambda: events.append("warm"))
    assert events[0] == "warm" and events.count("warm") == 1


def test_the_order_of_the_sides_alternates_pair_by_pair():
    events = []
    r = measure(recorder(events, "a", [1] * 4), recorder(events, "b", [1] * 4), 4)
    assert events == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [p.a_first for p in r.pairs] == [True, False, True, False]


def test_the_median_and_spread_are_of_the_per_pair_ratios():
    # side a: 30, 10, 40 tok/s; side b: 10, 10, 10 → ratios 3, 1, 4. The ratio of the medians would be 3.0 too, so
    # b varies as well: b = 10, 5, 20 → ratios 3, 2, 2; median 2, not median(a) / median(b) = 30 / 10 = 3
    r = measure(recorder([], "a", [30, 10, 40]), recorder([], "b", [10, 5, 20]), 3)
    assert r.ratios == [3.0, 2.0, 2.0]
    assert (r.median, r.low, r.high) == (2.0, 2.0, 3.0)
    assert r.to_dict()["each"][1] == {"a": 10, "b": 5, "ratio": 2.0, "first": "b"}
    with pytest.raises(ValueError):
        measure(recorder([], "a", []), recorder([], "b", []), 0)


def test_compare_alone_means_the_default_number_of_pairs():
    assert expand_optional_values(["run", "p.txt", "--compare"]) == ["run", "p.txt", f"--compare={COMPARE_PAIRS}"]
    assert expand_optional_values(["run", "p.txt", "--compare", "-n", "4"])[2] == f"--compare={COMPARE_PAIRS}"
    assert expand_optional_values(["run", "p.txt", "--compare", "5"]) == ["run", "p.txt", "--compare", "5"]
    assert expand_optional_values(["run", "p.txt", "--compare=2"]) == ["run", "p.txt", "--compare=2"]
    assert expand_optional_values(["run", "--", "--compare"]) == ["run", "--", "--compare"]


# ---- specdec run --compare N, on a fake session with a fake clock


@pytest.fixture
def fake_session(monkeypatch, tmp_path):
    def open_session(options, *, method=None, need_draft=False, reporter=None):
        s = Session(
            target=FakeBackend(hashed_logits, n_ctx=options.ctx), target_path=tmp_path / "target.gguf", options=options
        )
        if wants_draft(options, method, need_draft):
            s.draft = FakeBackend(hashed_logits, n_ctx=options.ctx)
            s.draft_path = tmp_path / "draft.gguf"
        return s

    monkeypatch.setattr("specdec_cli.cli.commands.run.open_session", open_session)
    monkeypatch.setattr("specdec_cli.models.llama.system_info", lambda: "fake")


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text("w5 w9 w3 w17 w4 w22 w8", encoding="utf-8")
    return p


@pytest.fixture
def clock(monkeypatch):
    """The driver's decode time, scripted: the n-th generation to finish took durations[n] seconds."""
    from specdec_cli.driver import Drive

    def install(durations):
        durations = list(durations)

        def decode_ms(self):
            if "_scripted_s" not in self.__dict__:
                self._scripted_s = durations.pop(0)
            return self._scripted_s * 1e3

        monkeypatch.setattr(Drive, "decode_ms", property(decode_ms))

    return install


@pytest.fixture
def generations(monkeypatch):
    """Each generation the comparison drives, in order: ("spec" or "plain", max_tokens)."""
    import specdec_cli.measure.comparison as comparison

    seen = []
    real = comparison.generate

    def spy(engine, prompt, config, on_step=None):
        seen.append(("spec" if engine.drafter is not None else "plain", config.max_tokens))
        return real(engine, prompt, config, on_step)

    monkeypatch.setattr(comparison, "generate", spy)
    return seen


def run_json(capsys, *args):
    code = main(["run", *map(str, args), "--json", "-"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out), err


def test_compare_warms_up_then_interleaves_the_pairs_alternating(fake_session, prompt_file, capsys, generations):
    doc, _ = run_json(capsys, prompt_file, "--method", "ngram", "--k", "3", "-n", "20", "--compare", "4")
    assert generations[0] == ("plain", 8)  # the untimed warm-up, before either side is timed
    assert generations[1:] == [
        ("spec", 20),
        ("plain", 20),
        ("plain", 20),
        ("spec", 20),
        ("spec", 20),
        ("plain", 20),
        ("plain", 20),
        ("spec", 20),
    ]
    assert doc["compare"]["pairs"] == 4
    assert [p["first"] for p in doc["compare"]["each_pair"]] == ["speculative_tokens_per_s", "plain_tokens_per_s"] * 2


def test_the_speedup_is_the_median_of_the_pairs_with_its_spread_exactly(fake_session, prompt_file, capsys, clock):
    # decode times, in order: the shown run 1 s; the warm-up 100 s (untimed: it must not count);
    # pair 1 (speculative first) 1 s, 2 s → 20 / 10 tok/s = 2.0; pair 2 (plain first) 2.5 s, 1 s → 20 / 8 = 2.5;
    # pair 3 (speculative first) 0.8 s, 2 s → 25 / 10 = 2.5
    clock([1.0, 100.0, 1.0, 2.0, 2.5, 1.0, 0.8, 2.0])
    doc, err = run_json(capsys, prompt_file, "--method", "ngram", "--k", "3", "-n", "20", "--compare")
    c = doc["compare"]
    assert c["pairs"] == COMPARE_PAIRS == 3
    assert [p["ratio"] for p in c["each_pair"]] == pytest.approx([2.0, 2.5, 2.5])
    assert (c["speedup"], c["speedup_min"], c["speedup_max"]) == pytest.approx((2.5, 2.0, 2.5))
    assert c["plain_tokens_per_s"] == pytest.approx(10.0) and c["speculative_tokens_per_s"] == pytest.approx(20.0)
    assert c["identical"] and c["shared_prefix_tokens"] == 20
    assert "2.50× speedup (median of 3 pairs, 2.00–2.50×)" in err


def test_method_none_compare_is_an_a_a_control(fake_session, prompt_file, capsys, generations):
    doc, err = run_json(capsys, prompt_file, "--method", "none", "-n", "12", "--compare", "2")
    assert generations == [("plain", 8)] + [("plain", 12)] * 4
    assert doc["compare"]["identical"] and doc["compare"]["pairs"] == 2
    assert "noise" in err


def test_a_compare_does_not_learn_from_its_replays(fake_session, prompt_file, capsys, monkeypatch):
    """The suffix store learns the shown run's reply once; the replays of --compare add nothing."""
    from specdec_cli.stores.suffix_store import SuffixStore

    learnt = []
    real = SuffixStore.extend
    monkeypatch.setattr(SuffixStore, "extend", lambda self, docs: (learnt.extend(docs), real(self, docs))[1])
    run_json(capsys, prompt_file, "--method", "suffix", "-n", "12", "--compare", "3")
    assert len(learnt) == 1


# ---- specdec bench: the A/A control


def test_the_control_row_is_plain_against_plain_with_its_range():
    configs = B.configs_for(["none", "ngram"], peer=False)
    prompts = [("p", "edit"), ("q", "edit")]
    runs = [
        run("none", "p", 10, tokens=(1, 2, 3), rss=100),
        run("A/A", "p", 9, tokens=(1, 2, 3), rss=100),
        run("ngram", "p", 20, tokens=(1, 2, 3), rss=100),
        run("none", "p", 10, repeat=1, tokens=(1, 2, 3), rss=100),
        run("A/A", "p", 10.5, repeat=1, tokens=(1, 2, 3), rss=100),
        run("ngram", "p", 20, repeat=1, tokens=(1, 2, 3), rss=100),
        run("none", "q", 20, tokens=(1, 2, 3), rss=100),
        run("A/A", "q", 21, tokens=(1, 2, 3), rss=100),
        run("ngram", "q", 30, tokens=(1, 2, 3), rss=100),
    ]
    none, control, ngram = B.summarize(runs, configs, prompts)
    assert control.config.method == "none" and control.speedup_by_prompt == pytest.approx({"p": 0.975, "q": 1.05})
    assert control.pair_range == pytest.approx((0.9, 1.05)) and control.agree == (3, 3, None)
    md = markdown_table(bench_doc(runs, configs, prompts), [none, control, ngram]).splitlines()
    assert md[4].startswith("| none again (A/A control) | 15.4 | 1.01× |")


def test_a_seeded_sampled_compare_finds_the_outputs_identical(fake_session, prompt_file, capsys):
    doc, err = run_json(
        capsys,
        prompt_file,
        "--method",
        "draft",
        "--k",
        "3",
        "-n",
        "30",
        "--compare",
        "1",
        "--temperature",
        "0.9",
        "--seed",
        "5",
    )
    assert doc["stats"]["n_drafted"] > 0
    assert doc["compare"]["identical"] and "outputs identical (30 tokens)" in err
    assert "different random numbers" not in err
