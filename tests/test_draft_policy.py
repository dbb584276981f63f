"""Which draft model a generation loads (`specdec_cli.draft_policy`): catalog pairing, and auto's rule."""

from __future__ import annotations

import pytest

from specdec_cli import draft_policy as dp
from specdec_cli.config import load_catalog
from specdec_cli.errors import UsageError


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_paired_draft_follows_the_catalog(catalog):
    assert dp.paired_draft(None, catalog) == catalog.default_draft
    assert dp.paired_draft("qwen2.5-coder-1.5b", catalog) == "qwen2.5-coder-0.5b"
    assert dp.paired_draft("smollm2-135m", catalog) == "smollm2-135m"  # [pairs.tiny]
    assert dp.paired_draft("gemma3-270m", catalog) is None
    file = catalog.models["smollm2-135m"].file
    assert dp.paired_draft(f"/somewhere/{file}", catalog) == "smollm2-135m"  # a path to a catalog file
    assert dp.paired_draft("/somewhere/mine.gguf", catalog) is None


def test_method_draft_never_pairs_a_target_with_a_foreign_draft(catalog):
    # `specdec run p.txt -t smollm2-135m --method draft` used to load the default (Qwen) draft and fail with exit 4
    assert dp.plan("draft", "smollm2-135m", None, catalog, gpu_offload=False, tuned_pays=False).name == "smollm2-135m"
    with pytest.raises(UsageError, match="--draft NAME"):
        dp.plan("draft", "gemma3-270m", None, catalog, gpu_offload=False, tuned_pays=False)
    assert dp.plan("draft", "gemma3-270m", "x.gguf", catalog, gpu_offload=False, tuned_pays=False).name == "x.gguf"


def test_auto_on_a_cpu_loads_no_draft_model_and_says_why(catalog):
    p = dp.plan("auto", None, None, catalog, gpu_offload=False, tuned_pays=False)
    assert p.name is None and "CPU-only" in p.reason and "--draft" in p.reason


@pytest.mark.parametrize("gpu, tuned", [(True, False), (False, True)])
def test_auto_loads_the_paired_draft_where_it_can_pay(catalog, gpu, tuned):
    p = dp.plan("auto", None, None, catalog, gpu_offload=gpu, tuned_pays=tuned)
    assert p.name == catalog.default_draft and p.reason


def test_auto_takes_a_named_draft_and_no_unpaired_one(catalog):
    assert dp.plan("auto", None, "smollm2-135m", catalog, gpu_offload=False, tuned_pays=False).name == "smollm2-135m"
    p = dp.plan("auto", "gemma3-270m", None, catalog, gpu_offload=True, tuned_pays=False)
    assert p.name is None and "gemma3-270m" in p.reason


@pytest.mark.parametrize("method", ["none", "ngram", "suffix", "predict"])
def test_lookup_methods_load_no_draft_model(catalog, method):
    assert dp.plan(method, None, "smollm2-135m", catalog, gpu_offload=True, tuned_pays=True) == dp.DraftPlan(None)


@pytest.mark.parametrize("placement", ["", "CUDA0 a GPU, 29 layers offloaded"])
def test_a_saved_tune_where_the_draft_paid_counts_wherever_the_passes_ran(tmp_path, placement) -> None:
    # the tuned key ends with the placement on a build that offloads (`tuned.machine`): auto must still find it
    from specdec_cli.stores import tuned

    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    target.write_bytes(b"GGUF" + bytes(64))
    draft.write_bytes(b"GGUF" + bytes(32))
    tuned.save(target, draft, "draft", tuned.machine(None, placement), 8, {"speedup": 1.4})
    assert dp.tuned_draft_pays(target, None)
    tuned.save(target, draft, "draft", tuned.machine(None, placement), 0, {"speedup": 0.9})
    assert not dp.tuned_draft_pays(target, None)
