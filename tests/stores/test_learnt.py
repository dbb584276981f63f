"""What --k auto learnt, carried to the next run (specdec_cli.stores.learnt, AdaptiveK.state/restore, Session)."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fakes import FakeBackend, cpu, lookup_draft, step
from specdec_cli.assemble import Assembler
from specdec_cli.core.controller import AdaptiveK
from specdec_cli.session import Session
from specdec_cli.spec import SpecOptions
from specdec_cli.stores import learnt
from specdec_cli.stores.learnt import LearntWarning, learnt_path


def trained() -> AdaptiveK:
    """An AdaptiveK that has seen 20 long-match lookup drafts, all accepted, on a CPU curve."""
    ctrl = AdaptiveK()
    ctrl.observe(step(0, 0, 0, 0.0, cpu(1)))
    for _ in range(20):
        ctrl.next_k()
        keep = ctrl.trim(lookup_draft(40))
        ctrl.observe(replace(step(keep, keep, keep, 0.02, cpu(keep + 1)), source="ngram", match_len=40))
    return ctrl


def test_a_restored_controller_starts_where_the_last_one_left_off() -> None:
    old = trained()
    assert old.trim(lookup_draft(40)) >= 32
    state = json.loads(json.dumps(old.state()))  # as stored
    new, fresh = AdaptiveK(), AdaptiveK()
    new.restore(state, max_weight=8.0)
    assert new.model.measured(1) and new.next_k() == 0  # a reply's first pass is plain: its first token at once
    new.observe(step(0, 0, 0, 0.0, cpu(1)))
    assert new.next_k() == 64  # then no plain step to time v(1): free lookup drafts
    assert new.trim(lookup_draft(40)) >= 32  # long drafts at once ...
    assert fresh.next_k() == 0 and fresh.trim(lookup_draft(40)) <= 3  # ... where a fresh controller starts slow


def test_restored_evidence_is_capped_so_todays_measurements_outweigh_it() -> None:
    old = trained()
    new = AdaptiveK()
    new.restore(old.state(), max_weight=8.0)
    b = 6  # the bucket of 33+ token matches
    assert new.model._acc_b["ngram"][b, 1].max() <= 8.0 + 1e-9 and old.model._acc_b["ngram"][b, 1].max() > 8.0
    assert new.model.acceptance(b, "ngram")[0] == pytest.approx(old.model.acceptance(b, "ngram")[0], abs=0.02)
    for _ in range(8):  # today these matches are wrong at once
        keep = new.trim(lookup_draft(40))
        new.observe(replace(step(keep, keep, 0, 0.02, cpu(keep + 1)), source="ngram", match_len=40))
    assert new.model.acceptance(b, "ngram")[0] < 0.6


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: s | {"model": s["model"] | {"k_max": 16}},
        lambda s: s | {"model": s["model"] | {"acc": [[1.0], [2.0]]}},
        lambda s: s | {"model": s["model"] | {"verify": [[1, -5.0, 1, True]]}},
        lambda s: s | {"model": s["model"] | {"acc": np.full((2, 64), np.nan).tolist()}},
        lambda s: {"evidence": True},
    ],
    ids=["k_max", "shape", "negative-ms", "nan", "missing"],
)
def test_a_state_that_does_not_fit_is_refused_and_the_controller_unchanged(damage) -> None:
    ctrl = AdaptiveK()
    model = ctrl.model
    with pytest.raises((ValueError, TypeError, KeyError)):
        ctrl.restore(damage(trained().state()))
    assert ctrl.model is model and not ctrl.evidence


# -- across sessions (what one `specdec run` leaves for the next) ----------------------------------------------------


def session(tmp_path: Path, name: str = "target.gguf") -> Assembler:
    path = tmp_path / name
    if not path.exists():
        path.write_bytes(b"GGUF" + bytes(range(256)) * 64)  # model_id hashes the file's ends and size
    return Assembler(Session(target=FakeBackend(), target_path=path))


def feed(ctrl: AdaptiveK) -> None:
    ctrl.observe(step(0, 0, 0, 0.0, cpu(1)))
    for _ in range(20):
        ctrl.next_k()
        keep = ctrl.trim(lookup_draft(40))
        ctrl.observe(replace(step(keep, keep, keep, 0.02, cpu(keep + 1)), source="ngram", match_len=40))


def test_the_next_session_with_the_same_model_and_method_continues_from_the_last(tmp_path) -> None:
    first = session(tmp_path)
    feed(first.make_controller(SpecOptions(method="suffix")))
    first.close()
    path = learnt_path()
    assert path.exists() and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert entry["method"] == "suffix" and entry["target"] == "target.gguf"

    second = session(tmp_path)
    ctrl = second.make_controller(SpecOptions(method="suffix"))
    assert ctrl.model.measured(1) and ctrl.trim(lookup_draft(40)) >= 32
    for method in ("ngram", "draft"):  # another drafter learns on its own
        assert not second.make_controller(SpecOptions(method=method)).model.measured(1)
    assert not second.make_controller(SpecOptions(method="suffix"), fresh=True).model.measured(1)
    other = session(tmp_path, "other.gguf")  # another target model too
    assert not other.make_controller(SpecOptions(method="suffix")).model.measured(1)


def test_a_session_that_learnt_nothing_saves_nothing(tmp_path) -> None:
    s = session(tmp_path)
    s.make_controller(SpecOptions(method="suffix"))
    s.make_controller(SpecOptions(method="suffix", k="4"))
    s.close()
    assert not learnt_path().exists()


@pytest.mark.parametrize(
    "text, reason",
    [
        ("{not json", "cannot read"),
        ('{"version": 99, "entries": {}}', "not a version-1 learnt.json"),
        ("[]", "not a version-1 learnt.json"),
    ],
)
def test_a_broken_learnt_file_warns_starts_afresh_and_is_replaced_on_save(tmp_path, text, reason) -> None:
    path = learnt_path()
    path.parent.mkdir(parents=True)
    path.write_text(text)
    s = session(tmp_path)
    with pytest.warns(LearntWarning, match=reason) as caught:
        ctrl = s.make_controller(SpecOptions(method="suffix"))
    assert str(path) in str(caught[0].message) and "Delete" in str(caught[0].message)
    assert not ctrl.model.measured(1)
    feed(ctrl)
    with pytest.warns(LearntWarning, match="Set aside as learnt.json.corrupt-") as saved:  # not lost (issue 35)
        s.close()
    assert len(saved) == 1
    assert [p.read_text() for p in path.parent.glob("learnt.json.corrupt-*")] == [text]
    assert json.loads(path.read_text())["version"] == 1


def test_an_entry_that_does_not_fit_warns_and_is_ignored(tmp_path) -> None:
    first = session(tmp_path)
    feed(first.make_controller(SpecOptions(method="suffix")))
    first.close()
    doc = json.loads(learnt_path().read_text())
    for entry in doc["entries"].values():
        entry["state"]["model"]["acc"] = [[1.0]]
    learnt_path().write_text(json.dumps(doc))
    with pytest.warns(LearntWarning, match="does not fit"):
        ctrl = session(tmp_path).make_controller(SpecOptions(method="suffix"))
    assert not ctrl.model.measured(1)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to a read-only directory")
def test_a_save_into_a_read_only_directory_warns_and_does_not_raise(tmp_path) -> None:
    s = session(tmp_path)
    feed(s.make_controller(SpecOptions(method="suffix")))
    learnt_path().parent.mkdir(parents=True)
    learnt_path().parent.chmod(0o500)
    try:
        with pytest.warns(LearntWarning, match="Could not save"):
            s.close()
    finally:
        learnt_path().parent.chmod(0o700)


def test_a_save_that_fails_warns_and_does_not_raise(tmp_path, monkeypatch) -> None:
    s = session(tmp_path)
    feed(s.make_controller(SpecOptions(method="suffix")))

    def full(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("specdec_cli.files.write_atomic", full)
    with pytest.warns(LearntWarning, match="No space left on device"):
        assert learnt.save({"k": s.make_controller(SpecOptions(method="suffix"))}) is None
    s.close()  # warns again, never raises
