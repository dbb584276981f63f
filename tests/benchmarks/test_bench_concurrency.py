"""benchmarks/bench_serve.py's editor-during-agent and chats workloads (once bench_concurrency.py): their arithmetic
and request shapes (issue 44), without a model: the decode phase's aggregate tok/s counts overlapping replies' time
once, a reply is compared with its run alone character by character, both APIs' stream events are read, and the editor's
requests have llama.vim's shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_serve as bc  # noqa: E402  (a broken import fails here, it is not skipped)


def reply(sent: float, first: float, end: float, tokens: int, text: str = "") -> bc.Streamed:
    return bc.Streamed(sent=sent, first=first, end=end, text=text, tokens=tokens)


def test_decode_phase_tok_s_counts_the_time_overlapping_replies_share_once():
    serial = [reply(0, 2, 6, 9), reply(6, 8, 12, 9)]  # decoding 4 s each, one after another
    together = [reply(0, 3, 7, 9), reply(0, 4, 8, 9)]  # decoding 3-7 and 4-8: 5 s of wall time
    assert bc.union_s([(3, 7), (4, 8), (10, 11), (10.5, 10.7)]) == pytest.approx(6.0)
    s, t = bc.aggregate(serial), bc.aggregate(together)
    assert s["decode_tok_s"] == pytest.approx(16 / 8) and s["tok_s"] == pytest.approx(18 / 12)
    assert t["decode_tok_s"] == pytest.approx(16 / 5) and t["tok_s"] == pytest.approx(18 / 8)


def test_the_ceiling_of_chats_at_once_comes_from_the_prefills_and_the_verify_curve(tmp_path):
    """A CPU's prompt passes are as fast alone as beside another, and four lanes' decoding in shared passes is at most
    as much faster as the verify curve's best merge of four passes: at once / one after another cannot pass
    wall / (prefills + decoding / that)."""
    import json

    serial = bc.aggregate([reply(0, 10, 14, 9), reply(14, 24, 28, 9)])  # 20 s of prefill, 8 s of decoding
    assert serial["first_s"] == pytest.approx(20.0)
    assert bc.ceiling(serial, 2.0) == pytest.approx(28 / (20 + 8 / 2))
    ms = [40.0 + 12.0 * b for b in range(1, 65)]  # v(b) = 40 + 12 b ms: one-row passes merge best
    (tmp_path / "learnt.json").write_text(
        json.dumps(
            {
                "curves": {  # a stale curve and another model's are not it
                    "m.gguf:1:y|old": {"curve": {"ms": [1.0] * 64, "stale": True}},
                    "other.gguf:1:x|cpu": {"curve": {"ms": [1.0] * 64}},
                    "m.gguf:1:x|cpu": {"curve": {"ms": ms}},
                }
            }
        )
    )
    assert bc.sharing_gain(tmp_path, Path("/models/m.gguf"), 4) == pytest.approx(4 * 52 / 88)
    ms[31] = 100.0  # a cheap 32-row pass (a kernel tile): four passes of 32 rows in all merge best
    (tmp_path / "learnt.json").write_text(json.dumps({"curves": {"m.gguf:1:x|cpu": {"curve": {"ms": ms}}}}))
    assert bc.sharing_gain(tmp_path, Path("/models/m.gguf"), 4) == pytest.approx((4 * 40 + 12 * 32) / 100)
    assert bc.sharing_gain(tmp_path, Path("/models/none.gguf"), 4) is None
    stale_only = {"curves": {"m.gguf:1:x|cpu": {"curve": {"ms": ms, "stale": True}}}}
    (tmp_path / "learnt.json").write_text(json.dumps(stale_only))
    assert bc.sharing_gain(tmp_path, Path("/models/m.gguf"), 4) == pytest.approx((4 * 40 + 12 * 32) / 100)  # no other
    table = bc.chats_table(
        "specdec", [{"serial": serial, "together": serial, "same": ["equal", "equal"]}], None, gain=2.0
    )
    assert "| ceiling of at once / one after another here | 1.17 |" in table
    rows = {1: [300.0, 240.0], 16: [2400.0, 2300.0]}
    measured = {"gain": 1.25, "ratios": {1: 1.25, 16: 1.04}, "rows": rows, "depths": [600, 800]}
    table = bc.chats_table(
        "specdec", [{"serial": serial, "together": serial, "same": ["equal", "equal"]}], None, 2.0, measured
    )
    top = 28 / (20 + 8 / 1.25)  # the same prefills, decoding at most 1.25x as fast
    assert f"| ceiling here, passes shared by 4 KV streams as timed | {top:.2f} |" in table
    assert f"| at once / that ceiling | {1 / top:.2f} | |" in table  # for comparison: the target is the passes' own
    assert "1 rows 1.25x, 16 rows 1.04x" in table
    assert "own passes" not in table  # (no pass log: that line is left out)
    assert "the best pass shared" not in table  # (a timing without it: that line is left out)
    measured["best"] = {"gain": 1.1, "shared": 16, "apart": 16}
    table = bc.chats_table(
        "specdec", [{"serial": serial, "together": serial, "same": ["equal", "equal"]}], None, 2.0, measured
    )
    top = 28 / (20 + 8 / 1.1)  # decoding at most 1.1x as fast: the best shared rows per ms over the best apart
    assert f"| ceiling here, the best pass shared by 4 KV streams against the best apart | {top:.2f} |" in table
    assert f"| at once / that ceiling | {1 / top:.2f} | |" in table


def test_the_target_s_ceiling_shares_each_decode_pass_one_after_another_at_its_own_rows():
    """Each verify step the chats made one after another, but the one that gave a chat its first token (in its time
    to first token, with the prefills), is shared at its rows and saves what sharing saved there as timed: the
    ratio interpolated between the timed sizes, the largest's past it, none where sharing cost more."""
    serial = bc.aggregate([reply(0, 10, 14, 9), reply(14, 24, 28, 9)])  # 28 s of wall time
    ratios = {1: 0.9, 4: 1.5, 16: 1.2, 64: 1.1}
    passes = [
        (5000.0, [[0, 100, 0]]),  # a prefill piece
        (900.0, [[0, 4, 4]]),  # its first token: not decoding
        (1000.0, [[0, 4, 4]]),  # 1.5x
        (2000.0, [[0, 10, 10]]),  # 1.5 + (1.2 - 1.5) x 6 / 12 = 1.35x
        (3000.0, [[0, 100, 100]]),  # past 64 rows: 1.1x
        (500.0, [[0, 1, 1]]),  # 0.9x: alone instead, 1x
        (4000.0, [[1, 50, 0]]),  # the next chat's prefill
        (800.0, [[1, 1, 1]]),  # its first token
    ]
    saved = 1000 * (1 - 1 / 1.5) + 2000 * (1 - 1 / 1.35) + 3000 * (1 - 1 / 1.1)
    top = 28 / (28 - saved / 1e3)
    assert bc.passes_ceiling(serial, passes, ratios) == pytest.approx(top)
    assert bc.passes_ceiling(serial, [], ratios) is None
    measured = {"gain": 1.5, "ratios": ratios, "rows": {}, "depths": [600, 800]}
    rep = {"serial": serial, "together": serial, "same": ["equal", "equal"], "serial_passes": passes}
    table = bc.chats_table("specdec", [rep], None, None, measured)
    assert f"| ceiling here, these chats' own passes shared | {top:.2f} |" in table
    assert f"| at once / that ceiling | {1 / top:.2f} | ratio {1 / top:.2f} x >= 0.95 x: met |" in table


def test_a_reply_is_equal_or_says_where_it_diverges():
    assert bc.divergence("def f(x):", "def f(x):") == "equal"
    assert bc.divergence("def f(x):\n    return x", "def f(y):").startswith("diverges at char 6: 'x")
    assert bc.divergence("abc", "abcd").startswith("diverges at char 3")


def test_stream_events_of_both_apis_are_read():
    assert bc._piece({"choices": [{"delta": {"content": "hi"}}]}) == ("hi", None)
    assert bc._piece({"choices": [], "usage": {"completion_tokens": 5}}) == ("", {"completion_tokens": 5})
    assert bc._piece({"choices": [{"delta": {}}], "timings": {"predicted_n": 7}}) == ("", {"completion_tokens": 7})
    assert bc._piece({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x"}}) == ("x", None)
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 3, "cache_read_input_tokens": 4}}}
    assert bc._piece(start) == ("", {"input_tokens": 7})
    assert bc._piece({"type": "message_delta", "usage": {"output_tokens": 9}}) == ("", {"output_tokens": 9})


def test_the_editor_sends_llama_vim_s_requests_typing_one_character_further_each_time():
    editor = bc.Editor(
        lines=[f"line {i}\n" for i in range(400)],
        at=300,
        extra=[{"filename": "a.py", "text": "x"}],
        typed="    ",
        n_predict=128,
    )
    warm, first, second = editor.body(-1, warm_up=True), editor.body(1), editor.body(2)
    assert warm["n_predict"] == 0 and first["n_predict"] == 128
    assert first["input_prefix"] == "".join(f"line {i}\n" for i in range(44, 300))  # llama.vim's n_prefix 256
    assert first["input_suffix"] == "".join(f"line {i}\n" for i in range(301, 365))  # and n_suffix 64
    assert second["prompt"].startswith(first["prompt"]) and len(second["prompt"]) == len(first["prompt"]) + 1
    for key in ("input_extra", "cache_prompt", "t_max_prompt_ms", "t_max_predict_ms", "n_indent", "samplers"):
        assert key in first


def test_a_target_is_met_or_not_on_the_median():
    assert bc._target([0.05, 0.3, 0.08], 0.1, "latency", "s").endswith(": met")
    assert bc._target([1.2, 1.1, 1.0], 1.3, "ratio", "x", at_least=True).endswith("NOT met")
    assert bc.pct([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0


def test_the_agent_s_budget_counts_the_service_of_the_fims_answered_while_it_ran():
    fims = [
        bc.Fim(sent=1.0, latency=2.0, service_s=1.5, text=""),  # answered at 3: during the agent
        bc.Fim(sent=4.0, latency=9.0, service_s=1.0, text=""),  # queued behind it, answered at 13: after
        bc.Fim(sent=12.0, latency=1.0, service_s=0.5, text=""),
    ]  # sent after its end (10)
    latencies, service = bc.fim_costs(fims, agent_end=10.0)
    assert latencies == [2.0, 9.0] and service == pytest.approx(1.5)


def test_a_baseline_checkout_runs_its_own_code_not_the_working_directorys(tmp_path, monkeypatch):
    """`--baseline DIR` must serve DIR's specdec: run from this checkout, `python -m specdec_cli` found the working
    directory's package first, so the baseline of two sittings was this checkout (its log said "lanes: 4")."""
    pkg = tmp_path / "specdec_cli"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("print('an old serve --help without lanes')\n")
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # where the benchmark runs
    assert bc.lists_parallel(tmp_path) is False
    assert bc.lists_parallel(Path(__file__).resolve().parents[2]) is True


def test_a_stale_seed_curve_is_replaced_by_the_one_a_cell_measured(tmp_path):
    """The user's learnt.json held a curve marked stale: the first cell measures it again, and the next cells start
    from that measurement (each cell used to measure it again, a long wait before every cell). The server keeps it in
    its data_dir, $SPECDEC_HOME/data (the seed went to $SPECDEC_HOME itself, where no server looked)."""
    import json

    seed, home = tmp_path / "seed", tmp_path / "home"
    seed.mkdir(), (home / "data").mkdir(parents=True)  # the server's data_dir: $SPECDEC_HOME/data
    stale = {"curves": {"m|cpu": {"curve": {"ms": [9.0], "stale": True}}, "d|cpu": {"curve": {"ms": [1.0]}}}}
    (seed / "learnt.json").write_text(json.dumps({**stale, "entries": {}}))
    fresh = {
        "curves": {"m|cpu": {"curve": {"ms": [5.0], "stale": False}}, "d|cpu": {"curve": {"ms": [2.0]}}},
        "entries": {"x": 1},
    }
    (home / "data" / "learnt.json").write_text(json.dumps(fresh))
    bc.harvest(seed, home)
    kept = json.loads((seed / "learnt.json").read_text())
    assert kept["curves"]["m|cpu"]["curve"]["ms"] == [5.0]  # the stale one replaced
    assert kept["curves"]["d|cpu"]["curve"]["ms"] == [1.0]  # a good one kept
    assert kept["entries"] == {}


def test_the_editor_table_says_whether_the_agent_s_reply_during_the_fims_is_its_reply_alone():
    rep = {
        "fim_alone": [1.0, 2.0],
        "fim_during": [2.0, 3.0],
        "agent_alone": 10.0,
        "agent_during": 20.0,
        "fim_service": 9.0,
        "count_s": 0.05,
        "agent_prompt": 6000,
        "agent_out": 256,
        "agent_during_out": 66,
        "agent_text": "The request goes through",
        "agent_during_text": "The request passes",
    }
    table = bc.editor_table("specdec", [rep])
    assert "diverges at char 12" in table and "256 tokens alone, 66 during" in table


def test_the_agent_sends_one_prompt_alone_and_during_the_fims(tmp_path, monkeypatch):
    """The agent's reply during the FIMs is compared with its reply alone: both cells of a repeat send the same body
    (a nonce per cell made them different prompts, so the comparison said nothing)."""
    sent: dict[str, dict] = {}

    class FakeCell:
        def __init__(self, kind, args, work, seed, label):
            self.label, self.url = label, "http://x"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(bc, "Cell", FakeCell)
    monkeypatch.setattr(bc, "warm_fim", lambda url, editor: None)
    monkeypatch.setattr(bc, "fim_loop", lambda url, editor, until, out, start=0: None)
    monkeypatch.setattr(
        bc, "stream", lambda url, path, body: sent.setdefault("agent", body) and reply(0.0, 0.1, 1.0, 8, "same")
    )
    monkeypatch.setattr(bc, "_check", lambda s, what: None)
    monkeypatch.setattr(bc, "during", lambda url, editor, path, body: sent.setdefault("during", body) and {})
    args = type("Args", (), {"agent_prompt": 400, "agent_tokens": 8, "agent_body": None, "fim_alone": 1})()
    bc.editor_cells(bc.Kind("specdec"), args, tmp_path, tmp_path, 0, None)
    assert sent["agent"] == sent["during"]


def test_the_workload_picks_the_sitting_and_passes_the_rest_of_the_command_line_on(monkeypatch):
    """bench_serve.py --workload: the two scenarios of bench_concurrency.py run together, with its own options; an
    unknown workload or an impossible pair is one error line."""
    calls = []
    monkeypatch.setattr(bc, "concurrency_main", lambda argv, workloads: calls.append(("c", argv, workloads)) or 0)
    monkeypatch.setattr(bc, "fim_main", lambda argv: calls.append(("fim", argv)) or 0)
    assert bc.main(["--workload", "editor-during-agent,chats", "--quick", "--repeats", "1"]) == 0
    assert bc.main(["-w", "fim", "--repeats", "3"]) == 0
    assert calls == [
        ("c", ["--quick", "--repeats", "1"], {"editor-during-agent", "chats"}),
        ("fim", ["--repeats", "3"]),
    ]
    for bad in (["--workload", "chat,fim"], ["--workload", "agents"], []):
        with pytest.raises(SystemExit) as e:
            bc.main(bad)
        assert e.value.code == 2


@pytest.mark.real
def test_stream_gain_times_shared_passes_against_passes_apart_on_lanes_holding_the_prompts(smollm2_path):
    chats = [[{"role": "user", "content": "def f(x):\n    return x\n" * n}] for n in (3, 6)]
    got = bc.stream_gain(smollm2_path, chats, threads=1, rows=(1, 4), repeats=1, n_ctx=512)
    assert got["depths"][1] > got["depths"][0] > 20  # each lane held its own prompt
    assert set(got["rows"]) == {1, 4} and all(a > 0 and s > 0 for a, s in got["rows"].values())
    assert set(got["ratios"]) == {1, 4} and got["gain"] == max(got["ratios"].values())
    assert got["ratios"][4] == pytest.approx(got["rows"][4][0] / got["rows"][4][1])  # one repeat: its own ratio
    (apart1, shared1), (apart4, shared4) = got["rows"][1], got["rows"][4]
    assert got["best"]["gain"] == pytest.approx(max(1 / shared1, 4 / shared4) / max(1 / apart1, 4 / apart4))
    assert got["best"]["shared"] == (1 if 1 / shared1 > 4 / shared4 else 4)
