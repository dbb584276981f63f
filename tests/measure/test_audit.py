"""Losslessness audits: teacher forcing, first divergence, near-tie verdicts, `specdec check`, `run --compare`.

On the fake backend batched and one-token evaluation agree exactly, so a correct engine has no flagged position,
an injected engine bug (a skipped KV rollback, one draft token accepted too many) must fail the check, and a
simulated batch-size-dependent numeric flips only near-ties, which must pass. On the real tiny model the check
must pass for prompt lookup and for draft = target.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fakes import EOS, FakeBackend, V, greedy_reference, hashed_logits, noisy, wants_draft
from specdec_cli.__main__ import main
from specdec_cli.cli.commands.check import refuse_sampling
from specdec_cli.core import sampling
from specdec_cli.core.controller import FixedK
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.sampling import SamplingParams
from specdec_cli.drafters.model import ModelDrafter
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.driver import generate
from specdec_cli.errors import UsageError
from specdec_cli.measure.audit import (
    DIVERGENCE,
    END,
    NEAR_TIE,
    NEAR_TIE_THRESHOLD,
    FirstMismatchProbe,
    audit_output,
    classify,
    compare_divergence,
    first_divergence,
    teacher_force,
)
from specdec_cli.measure.comparison import against_plain
from specdec_cli.session import Session
from specdec_cli.spec import SpecOptions

PROMPT = [5, 9, 3, 17, 4, 22, 8]


def check_engine(engine, prompt, config, threshold=NEAR_TIE_THRESHOLD):
    """What `specdec check` does with an engine: generate (greedy only), then audit the output against the target's
    batch-1 argmax. Returns (the generation, the audit report)."""
    refuse_sampling(config)
    result = generate(engine, prompt, config)
    report = audit_output(
        engine.target, prompt, result.tokens, ended_with_eog=result.stats.finish_reason == "eog", threshold=threshold
    )
    return result, report


def engine(target=None, k=4, fn=hashed_logits):
    target = target if target is not None else FakeBackend(fn)
    return SpeculativeEngine(target, ModelDrafter(FakeBackend(noisy(fn))), FixedK(k))


# -- pure functions --------------------------------------------------------------------------------------------------


def test_first_divergence_literals():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([], []) is None
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([7], [8]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one ended first: a difference at its length
    assert first_divergence(np.array([1, 2, 3], np.int32), [1, 2]) == 2


def test_classify_uses_the_threshold_strictly():
    assert classify(0.0) == NEAR_TIE
    assert classify(0.28) == NEAR_TIE  # a flip margin like the largest docs/check.md records
    assert classify(NEAR_TIE_THRESHOLD) == DIVERGENCE
    assert classify(3.0) == DIVERGENCE
    assert classify(0.2, threshold=0.1) == DIVERGENCE


def table_fn(prefix):
    """Literal logits: after any prefix, token 4 leads token 5 by 0.25 and token 6 by 3.0."""
    logits = np.full(V, -10.0, np.float32)
    logits[4], logits[5], logits[6] = 2.0, 1.75, -1.0
    return logits


def test_teacher_force_returns_batch1_argmax_and_literal_margins():
    backend = FakeBackend(table_fn)
    backend.decode([9, 9, 9])  # stale cache content: teacher forcing starts from an empty cache
    argmax, margin = teacher_force(backend, [3, 2], [4, 5, 6, 4])
    assert argmax.dtype == np.int32 and margin.dtype == np.float32
    assert argmax.tolist() == [4, 4, 4, 4]
    assert margin.tolist() == pytest.approx([0.0, 0.25, 3.0, 0.0])
    assert backend.tokens.tolist() == [3, 2, 4, 5, 6]  # prompt + output[:-1]
    assert backend.max_logit_rows == 1  # one token per forward pass


def test_teacher_force_on_plain_output_agrees_everywhere():
    out = greedy_reference(hashed_logits, PROMPT, 40)
    argmax, margin = teacher_force(FakeBackend(hashed_logits), PROMPT, out)
    assert argmax.tolist() == out
    assert not margin.any()


def test_compare_verdict_from_literal_margins():
    backend = FakeBackend()

    class Probe:  # the plain run's logits row at the divergence, as FirstMismatchProbe keeps it
        position = 2
        row = np.array([0.0, -5.0, 1.5, 3.0, 2.9, -2.0] + [-9.0] * (V - 6), np.float32)

    near = compare_divergence([7, 8, 4], [7, 8, 3], Probe, backend)
    assert (near.position, near.spec_token, near.plain_token) == (2, 4, 3)
    assert near.margin == pytest.approx(0.1) and near.verdict == NEAR_TIE
    assert near.spec_text == repr("w4 ") and near.plain_text == repr("w3 ")
    far = compare_divergence([7, 8, 5], [7, 8, 3], Probe, backend)
    assert far.margin == pytest.approx(5.0) and far.verdict == DIVERGENCE
    # The speculative run stopped (end of generation, token 1) where plain decoding went on.
    ended = compare_divergence([7, 8], [7, 8, 3], Probe, backend)
    assert ended.spec_token is None and ended.spec_text == END
    assert ended.margin == pytest.approx(8.0) and ended.verdict == DIVERGENCE
    assert compare_divergence([7, 8], [7, 8], Probe, backend) is None
    # No row at that position: the margin is unknown and that is never called a near-tie.
    assert compare_divergence([7, 9], [7, 8], None, backend).verdict == DIVERGENCE


# -- the check on the fake backend -----------------------------------------------------------------------------------


def test_correct_engine_passes_the_check():
    result, report = check_engine(engine(), PROMPT, GenerationConfig(max_tokens=60))
    assert result.tokens == greedy_reference(hashed_logits, PROMPT, 60)
    assert any(s.n_accepted < len(s.drafted) for s in result.steps)  # rollbacks really happened
    assert report.passed and report.flags == () and report.n_checked == 60


def skip_one_rollback(backend, which=2):
    """Engine bug (a): the `which`-th truncate that should drop tokens is ignored (rejected drafts stay cached)."""
    real = backend.truncate
    seen = []

    def truncate(n):
        if n < len(backend.tokens):
            seen.append(n)
            if len(seen) == which:
                return
        real(n)

    backend.truncate = truncate
    return seen


def test_a_skipped_kv_rollback_fails_the_check():
    target = FakeBackend(hashed_logits)
    seen = skip_one_rollback(target)
    result, report = check_engine(engine(target), PROMPT, GenerationConfig(max_tokens=60))
    assert len(seen) >= 2
    assert not report.passed
    assert report.divergences >= 1 and report.largest_margin >= NEAR_TIE_THRESHOLD
    assert report.flags[0].verdict == DIVERGENCE


def test_accepting_one_draft_token_too_many_fails_the_check(monkeypatch):
    real = sampling.verify_greedy
    bugs = []

    def verify_greedy(draft, logits, masks=None):  # engine bug (b): once, accept the first rejected draft token too
        n, token = real(draft, logits, masks)
        if n < len(draft) and not bugs:
            bugs.append(n)
            return n + 1, int(np.argmax(logits[n + 1]))
        return n, token

    monkeypatch.setattr(sampling, "verify_greedy", verify_greedy)
    result, report = check_engine(engine(), PROMPT, GenerationConfig(max_tokens=60))
    assert bugs
    assert not report.passed
    bad = [f for f in report.flags if f.verdict == DIVERGENCE]
    assert len(bad) == 1 and bad[0].margin >= NEAR_TIE_THRESHOLD


def near_tie_fn(prefix):
    """hashed_logits, except that at every 4th position the runner-up trails the favourite by only 0.01."""
    logits = hashed_logits(prefix).copy()
    if len(prefix) % 4 == 0:
        order = np.argsort(logits)
        logits[order[-2]] = logits[order[-1]] - 0.01
    return logits


class BatchNumericsBackend(FakeBackend):
    """Batch-size-dependent numerics: rows of a multi-row (verify) batch are nudged by 0.03 towards the runner-up,
    which flips exactly the near-ties, as llama.cpp's batched kernels can."""

    def decode(self, tokens, n_logits=0):
        rows = super().decode(tokens, n_logits)
        if n_logits <= 1:
            return rows
        rows = rows.copy()
        for r in rows:
            order = np.argsort(r)
            r[order[-2]] += 0.03
        return rows


def test_batch_dependent_near_tie_flips_pass_the_check():
    target = BatchNumericsBackend(near_tie_fn)
    result, report = check_engine(engine(target, k=4, fn=near_tie_fn), PROMPT, GenerationConfig(max_tokens=60))
    assert result.tokens != greedy_reference(near_tie_fn, PROMPT, 60)  # the batch numerics did change the text
    assert report.passed
    assert report.near_ties >= 1 and report.divergences == 0
    assert all(f.margin == pytest.approx(0.01, abs=1e-5) for f in report.flags)


def test_check_includes_the_end_of_generation():
    def ends_fn(prefix):  # end of generation after 5 output tokens, by a wide margin
        logits = hashed_logits(prefix).copy()
        if len(prefix) == len(PROMPT) + 5:
            logits[EOS] = logits.max() + 5.0
        return logits

    out = greedy_reference(ends_fn, PROMPT, 50)
    assert len(out) == 5
    assert audit_output(FakeBackend(ends_fn), PROMPT, out, ended_with_eog=True).passed
    # Claiming the run stopped one token early: stopping there was not the target's choice.
    report = audit_output(FakeBackend(ends_fn), PROMPT, out[:4], ended_with_eog=True)
    assert report.n_checked == 5 and not report.passed
    assert report.flags[-1].position == 4 and report.flags[-1].token_text == END


def test_check_refuses_sampling_with_the_reason():
    with pytest.raises(UsageError, match="statistically"):
        check_engine(engine(), PROMPT, GenerationConfig(sampling=SamplingParams(temperature=0.7)))


# -- --compare: the plain run's own margin at the first divergence ---------------------------------------------------


def _plain_against(session, prompt, config, reference):
    """`run --compare`'s plain side (one A/A pair) against `reference`: (its first plain generation, divergence)."""
    c = against_plain(session, SpecOptions(method="none"), prompt, config, reference, 1, drafter=None, controller=None)
    return c.plain, c.divergence


def test_the_compared_plain_run_finds_the_first_divergence_with_its_own_margin():
    reference = greedy_reference(hashed_logits, PROMPT, 30)
    session = Session(target=FakeBackend(hashed_logits), target_path=Path("target.gguf"))
    plain, div = _plain_against(session, np.array(PROMPT, np.int32), GenerationConfig(max_tokens=30), reference)
    assert plain.tokens == reference and div is None
    wrong = reference.copy()
    wrong[12] = (wrong[12] + 1) % V or 2
    plain, div = _plain_against(session, np.array(PROMPT, np.int32), GenerationConfig(max_tokens=30), wrong)
    assert plain.tokens == reference  # the probe does not change plain decoding
    row = hashed_logits(PROMPT + reference[:12])
    assert div.position == 12 and div.plain_token == reference[12] and div.spec_token == wrong[12]
    assert div.margin == pytest.approx(float(row.max() - row[wrong[12]]))
    assert div.verdict == classify(div.margin)


def test_probe_is_transparent():
    inner = FakeBackend(hashed_logits)
    probe = FirstMismatchProbe(inner, len(PROMPT), [])
    list(SpeculativeEngine(probe, None).generate(PROMPT, GenerationConfig(max_tokens=5)))
    assert probe.position == 0  # the reference is empty: the first output row already leaves it
    assert probe.n_ctx == inner.n_ctx and probe.piece(3) == inner.piece(3)
    assert inner.tokens.tolist()[: len(PROMPT)] == PROMPT


# -- the CLI, on a fake session --------------------------------------------------------------------------------------


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text("w5 w9 w3 w17 w4 w22 w8", encoding="utf-8")
    return p


@pytest.fixture
def fake_sessions(monkeypatch, tmp_path):
    """`open_session` in check and run returns fake backends; `bug` = callable applied to each new target."""
    state = {"bug": None}

    def open_session(options, *, method=None, need_draft=False, reporter=None):
        need_draft = wants_draft(options, method, need_draft)
        target = FakeBackend(hashed_logits, n_ctx=options.ctx)
        if state["bug"] is not None:
            state["bug"](target)
        s = Session(target=target, target_path=tmp_path / "target.gguf", options=options)
        if need_draft:
            s.draft = FakeBackend(noisy(hashed_logits), n_ctx=options.ctx)
            s.draft_path = tmp_path / "draft.gguf"
        return s

    monkeypatch.setattr("specdec_cli.cli.commands.check.open_session", open_session)
    monkeypatch.setattr("specdec_cli.cli.commands.run.open_session", open_session)
    monkeypatch.setattr("specdec_cli.models.llama.system_info", lambda: "fake")
    return state


def cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_check_cli_passes_on_a_correct_engine(fake_sessions, prompt_file, capsys):
    code, out, _ = cli(capsys, "check", str(prompt_file), "--method", "draft", "--k", "4", "-n", "40")
    assert code == 0
    assert "40 positions re-scored" in out and "PASS" in out and "0 divergences" in out


def test_check_cli_exits_7_on_a_bug_and_lists_the_position(fake_sessions, prompt_file, capsys, tmp_path):
    fake_sessions["bug"] = skip_one_rollback
    report_path = tmp_path / "report.json"
    code, out, err = cli(
        capsys, "check", str(prompt_file), "--method", "draft", "--k", "4", "-n", "40", "--json", str(report_path)
    )
    assert code == 7
    assert DIVERGENCE in out and "FAIL" in out
    assert "not the target's batch-1 argmax" in err
    doc = json.loads(report_path.read_text())
    assert doc["check"]["passed"] is False and doc["check"]["divergences"] >= 1
    assert doc["check"]["flags"][0]["verdict"] == DIVERGENCE


def test_check_cli_refuses_temperature(prompt_file, capsys):
    code, _, err = cli(capsys, "check", str(prompt_file), "--temperature", "0.8")
    assert code == 2
    assert "greedy only" in err and "statistically" in err


def test_run_compare_json_reports_the_divergence(fake_sessions, prompt_file, capsys):
    code, out, err = cli(
        capsys, "run", str(prompt_file), "--method", "draft", "--k", "3", "-n", "20", "--compare", "--json", "-"
    )
    assert code == 0
    compare = json.loads(out)["compare"]
    assert compare["identical"] and compare["divergence"] is None and compare["verdict"] == "identical"


def test_run_strict_exits_7_when_the_speculative_run_has_a_bug(fake_sessions, prompt_file, capsys):
    seen = []

    def bug_in_first_target_only(target):  # the speculative run's target; the plain run reuses it
        if not seen:
            seen.append(skip_one_rollback(target))

    fake_sessions["bug"] = bug_in_first_target_only
    code, out, err = cli(
        capsys, "run", str(prompt_file), "--method", "draft", "--k", "4", "-n", "40", "--strict", "--json", "-"
    )
    assert code == 7
    compare = json.loads(out)["compare"]
    assert compare["verdict"] == DIVERGENCE and compare["divergence"]["margin"] >= NEAR_TIE_THRESHOLD
    assert "not a numerical near-tie" in err


def test_run_strict_refuses_sampling(prompt_file, capsys):
    code, _, err = cli(capsys, "run", str(prompt_file), "--strict", "--temperature", "0.5")
    assert code == 2 and "--strict" in err


# -- the real tiny model ---------------------------------------------------------------------------------------------

COPY_HEAVY = (
    "Repeat this list exactly, one item per line: apple, banana, cherry, date, elderberry, fig, grape, "
    "honeydew, kiwi, lemon, mango, nectarine."
)
FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@pytest.fixture(scope="module")
def tiny(smollm2_path):
    from specdec_cli.models.llama import LlamaBackend

    # one thread each: deterministic, and not slowed down by spinning threads on a busy machine
    target = LlamaBackend(smollm2_path, n_ctx=1024, n_batch=512, n_threads=1)
    draft = LlamaBackend(smollm2_path, n_ctx=1024, n_batch=512, n_threads=1)
    session = Session(target=target, target_path=smollm2_path, draft=draft, draft_path=smollm2_path)
    yield session
    session.close()


@pytest.mark.real
@pytest.mark.parametrize("text", [COPY_HEAVY, FREE], ids=["copy-heavy", "free"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_check_passes_on_the_tiny_model(tiny, method, text):
    prompt = tiny.prompt_tokens(text)
    drafter = NgramDrafter(2, 4) if method == "ngram" else ModelDrafter(tiny.draft)
    result, report = check_engine(
        SpeculativeEngine(tiny.target, drafter, FixedK(4)), prompt, GenerationConfig(max_tokens=48)
    )
    assert len(result.tokens) > 10
    assert report.passed, report.flags
    if method == "draft":
        assert result.stats.n_accepted > 0


@pytest.mark.real
def test_teacher_forcing_reproduces_plain_decoding_numerics_exactly(tiny):
    """Batch-1 teacher forcing from an empty cache is plain decoding's call sequence: same argmax everywhere."""
    prompt = tiny.prompt_tokens(FREE)
    tiny.target.truncate(0)
    plain = generate(SpeculativeEngine(tiny.target, None), prompt, GenerationConfig(max_tokens=48))
    argmax, margin = teacher_force(tiny.target, prompt, plain.tokens)
    assert argmax.tolist() == plain.tokens and not margin.any()
    again, div = _plain_against(tiny, prompt, GenerationConfig(max_tokens=48), plain.tokens)
    assert again.tokens == plain.tokens and div is None
