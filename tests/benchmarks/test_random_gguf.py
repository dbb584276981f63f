"""The suite's tiny hybrid and recurrent models (issue 54, item 7): benchmarks/random_gguf.py writes an lfm2, a qwen35
with one MTP block and a mamba2 that llama.cpp loads as the kind of model each architecture is, and that decode."""

from __future__ import annotations

import numpy as np
import pytest

from random_models import random_gguf

KINDS = {  # fixture: (llama_model_is_hybrid, llama_model_is_recurrent, nextn layers)
    "lfm2_tiny": (True, False, 0),
    "qwen35_tiny": (True, False, 1),
    "mamba2_tiny": (False, True, 0),
}


@pytest.mark.parametrize("fixture", sorted(KINDS))
def test_a_tiny_model_loads_as_its_kind(fixture, request) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    path = request.getfixturevalue(fixture)
    params = llama_cpp.llama_model_default_params()
    params.load_mtp = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp refused {path.name}"
    try:
        kind = (
            bool(llama_cpp.llama_model_is_hybrid(model)),
            bool(llama_cpp.llama_model_is_recurrent(model)),
            int(llama_cpp.llama_model_n_layer_nextn(model)),
        )
    finally:
        llama_cpp.llama_model_free(model)
    assert kind == KINDS[fixture]


@pytest.mark.parametrize("fixture", sorted(KINDS))
def test_a_tiny_model_decodes_and_greedy_decoding_repeats(fixture, request) -> None:
    pytest.importorskip("llama_cpp")
    from specdec_cli.models.llama import LlamaBackend

    path = request.getfixturevalue(fixture)

    def greedy() -> list[int]:
        backend = LlamaBackend(path, n_ctx=256, n_threads=1)
        try:
            assert not backend.branches  # a recurrent state cannot branch
            logits = backend.decode(backend.tokenize("def add(a, b): return a + b"), 1)
            out = []
            for _ in range(8):
                assert np.isfinite(logits).all()
                out.append(int(np.argmax(logits[-1])))
                logits = backend.decode([out[-1]], 1)
            return out
        finally:
            backend.close()

    assert greedy() == greedy()


def test_the_qwen35_file_has_its_mtp_block_as_the_converter_writes_it(qwen35_tiny) -> None:
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(qwen35_tiny)
    shape = random_gguf().ARCH_SHAPES["qwen35"]["tiny"]
    assert reader.fields["qwen35.nextn_predict_layers"].contents() == 1
    assert reader.fields["qwen35.block_count"].contents() == shape.n_layer + 1
    names = {t.name for t in reader.tensors}
    mtp = f"blk.{shape.n_layer}.nextn."
    assert {mtp + n for n in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head_norm.weight")} <= names


def test_a_shape_of_another_architecture_is_refused_with_the_ones_it_has(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        random_gguf().main([str(tmp_path / "x.gguf"), "--arch", "lfm2", "--shape", "qwen3.5-2b"])
    assert e.value.code == 2
    assert "use one of lfm2-1.2b, tiny" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
