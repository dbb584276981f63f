"""Offload by default (docs/gpu.md): on a GPU build the target and the draft model load with every layer offloaded
unless the user says otherwise or the GPU's memory cannot hold them, and auto keeps its paired draft model only
where its measured cost per token pays. A fake loader records what `open_session` asks llama.cpp for; the passes
run on the fake backend's virtual clock."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from fakes import Clock, FakeBackend
from specdec_cli import draft_policy
from specdec_cli.models import devices
from specdec_cli.spec import ModelOptions

GIB = 1 << 30


def random_gguf():
    """benchmarks/random_gguf.py as a module."""
    import importlib.util

    path = Path(__file__).parents[2] / "benchmarks" / "random_gguf.py"
    spec = importlib.util.spec_from_file_location("random_gguf", path)
    module = sys.modules["random_gguf"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_ms(b: int) -> float:
    return 6.0 + 0.02 * b  # a 1.5B target on a laptop GPU


@pytest.fixture
def gpu_build(monkeypatch, tmp_path):
    """A CUDA build as `open_session` sees it: llama_supports_gpu_offload, one GPU with `state["free"]` bytes free,
    models of `state["need"]` bytes and 28 layers; every load recorded as (file name, n_gpu_layers). The draft model
    costs `state["draft_ms"]` a token."""
    import specdec_cli.models.host as host
    import specdec_cli.models.llama as llama
    import specdec_cli.models.resolver as resolver
    import specdec_cli.models.vocab as vocab

    state = {"free": 24 * GIB, "need": 2 * GIB, "draft_ms": 0.6, "loaded": []}
    clock = Clock()

    def load(path, **kw):
        state["loaded"].append((Path(path).name, kw["n_gpu_layers"]))
        cost = gpu_ms if "1.5b" in Path(path).name else (lambda b: state["draft_ms"] * b)
        return FakeBackend(path=str(path), n_ctx=1024, n_batch=512, clock=clock, cost=cost)

    def resolve(name, catalog, reporter=None):
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(b"GGUF" + name.encode())
        return path

    monkeypatch.setenv("SPECDEC_VERIFY_CURVE", "on")
    monkeypatch.setattr(llama, "LlamaBackend", load)
    monkeypatch.setattr(llama, "gpu_offload_supported", lambda: True)
    monkeypatch.setattr(host, "probe_load", lambda path, reporter=None: None)
    monkeypatch.setattr(resolver, "resolve", resolve)
    monkeypatch.setattr(vocab, "check_compatible", lambda target, draft: None)
    monkeypatch.setattr(devices, "devices", lambda: [devices.Device("CUDA0", "a GPU", "GPU", state["free"], 24 * GIB)])
    monkeypatch.setattr(devices, "model_need", lambda path, n_ctx: (state["need"], 28))
    state["clock"] = clock
    return state


def open_auto(state, **options):
    from specdec_cli.session import open_session

    return open_session(ModelOptions(target="qwen2.5-coder-1.5b", **options), method="auto", clock=state["clock"])


def test_both_models_load_fully_offloaded_by_default(gpu_build) -> None:
    with open_auto(gpu_build) as session:
        assert gpu_build["loaded"] == [("qwen2.5-coder-1.5b.gguf", -1), ("qwen2.5-coder-0.5b.gguf", -1)]
        assert (
            session.offload["target"].layers == -1 and "needs 2.0 GiB of 24.0 GiB free" in session.offload["target"].why
        )


def test_the_users_layers_reach_the_loader(gpu_build) -> None:
    with open_auto(gpu_build, gpu_layers=7):
        assert gpu_build["loaded"] == [("qwen2.5-coder-1.5b.gguf", 7), ("qwen2.5-coder-0.5b.gguf", 7)]


def test_a_model_the_gpu_cannot_hold_loads_the_layers_that_fit(gpu_build) -> None:
    gpu_build["free"], gpu_build["need"] = 5 * GIB, 10 * GIB
    with open_auto(gpu_build) as session:
        name, layers = gpu_build["loaded"][0]
        assert name == "qwen2.5-coder-1.5b.gguf" and layers == int(28 * 4.5 / 9.5)
        assert "of 28 layers" in session.offload["target"].why


def test_a_draft_model_is_kept_where_its_measured_cost_pays(gpu_build) -> None:
    with open_auto(gpu_build) as session:
        assert session.draft is not None and session.draft_ms == pytest.approx(0.6)
        assert "0.10 x the target's pass" in session.draft_plan.reason


def test_a_draft_model_that_costs_too_much_per_token_is_closed_and_says_why(gpu_build) -> None:
    gpu_build["draft_ms"] = 5.0  # a draft token at 83 % of the target's pass: never pays
    with open_auto(gpu_build) as session:
        assert session.draft is None and not session.auto_draft
        assert "0.83 x the target's pass" in session.draft_plan.reason and "--draft NAME" in session.draft_plan.reason


def test_gpu_layers_0_on_a_gpu_build_runs_phased_flash_attention_as_the_cpu_does(gpu_build, monkeypatch) -> None:
    """Phased flash attention is the CPU's default where the build can switch it: it follows what this run offloads
    (--gpu-layers 0: nothing, the CPU's kernels), not whether the build could."""
    from specdec_cli.models import llama

    asked = []
    load = llama.LlamaBackend
    monkeypatch.setattr(llama, "LlamaBackend", lambda path, **kw: asked.append(kw["flash_attn"]) or load(path, **kw))
    monkeypatch.setattr(llama, "flash_attn_switch", lambda: True)
    with open_auto(gpu_build, gpu_layers=0):
        assert gpu_build["loaded"][0] == ("qwen2.5-coder-1.5b.gguf", 0) and asked[0] == llama.PHASED
    asked.clear()
    loads = len(gpu_build["loaded"])
    with open_auto(gpu_build):  # every layer on the GPU: its kernels, llama.cpp's auto
        assert gpu_build["loaded"][loads] == ("qwen2.5-coder-1.5b.gguf", -1) and asked[0] is None
    asked.clear()
    with open_auto(gpu_build, gpu_layers=7):  # some layers on the GPU: not the CPU's setting
        assert asked[0] is None


def test_a_curve_timed_with_no_layers_offloaded_does_not_price_a_fully_offloaded_run(gpu_build) -> None:
    # Issue 53: the curve was kept per model file, CPU, threads and build only, so a curve timed with --gpu-layers 0
    # priced a run with every layer on the GPU. The device and the layers offloaded are part of its key now.
    from specdec_cli.session import open_session

    def session(**options):
        return open_session(
            ModelOptions(target="qwen2.5-coder-1.5b", **options), method="ngram", clock=gpu_build["clock"]
        )

    with session(gpu_layers=0) as cpu:
        assert cpu.placement() == "CPU, 0 layers offloaded"
        assert "none kept" in cpu.verify_curve().measured_for
    with session() as gpu:
        assert gpu.placement() == "CUDA0 a GPU, 29 layers offloaded"
        assert gpu.verify_curve().measured_for == (
            "another device or offload (CUDA0 a GPU, 29 layers offloaded here, CPU, 0 layers offloaded kept)"
        )
    with session() as again:
        before = gpu_build["clock"]()
        assert again.verify_curve().to_dict() == gpu.verify_curve().to_dict()
        assert gpu_build["clock"]() == before  # kept under its own key: not measured again


def test_draft_pays_on_a_flat_curve_and_not_on_a_cpus() -> None:
    flat = [gpu_ms(b) for b in range(1, 18)]
    from fakes import CPU_B, CPU_MS, DRAFT_MODEL_MS

    cpu = np.interp(np.arange(1, 18), CPU_B, CPU_MS)  # a CPU's steep curve: v(2) = 1.8 v(1)
    assert draft_policy.draft_pays(0.6, flat)[0]
    assert not draft_policy.draft_pays(5.0, flat)[0]
    assert not draft_policy.draft_pays(DRAFT_MODEL_MS, cpu)[0]  # the 0.5B draft on that CPU
    assert not draft_policy.draft_pays(2.0, cpu)[0]  # there even a nearly free draft model loses at 70 %


def test_offload_decides_by_the_users_word_the_build_and_the_memory(tmp_path) -> None:
    pytest.importorskip("gguf")
    rg = random_gguf()
    model = rg.write(tmp_path / "tiny.gguf", rg.SHAPES["tiny"])
    need, layers = devices.model_need(model, 1024)
    assert layers == 2 and need > model.stat().st_size
    assert devices.offload(model, 5, gpu=True, free=0, n_ctx=1024).layers == 5
    assert devices.offload(model, -1, gpu=False, free=None, n_ctx=1024).why.startswith("none")
    assert devices.offload(model, -1, gpu=True, free=need, n_ctx=1024).layers == -1
    assert devices.offload(model, -1, gpu=True, free=need - 1, n_ctx=1024).layers in (0, 1)


def test_the_device_list_names_this_cpu() -> None:
    pytest.importorskip("llama_cpp")
    devs = devices.devices()
    assert devs is None or any(d.kind == "CPU" for d in devs)


class _Lib:
    """A loaded library as ctypes shows it: one attribute per exported function, each callable and typed."""

    def __init__(self, **exports) -> None:
        for name, fn in exports.items():
            setattr(self, name, type("Fn", (), {"__call__": staticmethod(fn), "restype": None, "argtypes": None})())


def _memory(dev, free, total) -> None:  # writes through the byref()s as ggml_backend_dev_memory does
    free._obj.value, total._obj.value = (8 * GIB, 24 * GIB) if dev == 2 else (1 * GIB, 2 * GIB)


_COUNT_GET = {"ggml_backend_dev_count": lambda: 2, "ggml_backend_dev_get": lambda i: i + 1}
_NAME_TYPE_MEMORY = {
    "ggml_backend_dev_name": lambda dev: [b"CPU", b"CUDA0"][dev - 1],
    "ggml_backend_dev_description": lambda dev: b"a device",
    "ggml_backend_dev_type": lambda dev: [0, 1][dev - 1],
    "ggml_backend_dev_memory": _memory,
}


@pytest.mark.parametrize(
    "exports",
    [
        {
            "ggml": _COUNT_GET,
            "ggml-base": _NAME_TYPE_MEMORY,
        },  # as the sources build them (ggml-backend-reg.cpp in ggml)
        {"ggml": {}, "ggml-base": {**_COUNT_GET, **_NAME_TYPE_MEMORY}},  # every function from ggml-base alone
    ],
)
def test_the_device_memory_is_found_where_llama_dll_does_not_export_ggml(monkeypatch, tmp_path, exports) -> None:
    """Windows: llama.dll exports none of ggml's device functions (a DLL exports only its own); they are looked up in
    ggml-base.dll and ggml.dll next to it, so the GPU's free memory decides the layers instead of "unknown"."""
    import types

    for name in exports:
        (tmp_path / f"{name}.dll").write_bytes(b"")
    opened: list[str] = []

    def open_library(path: str) -> _Lib:
        opened.append(Path(path).name)
        return _Lib(**exports[Path(path).stem])

    monkeypatch.setattr(devices, "_open_library", open_library)
    bindings = types.SimpleNamespace(_lib=_Lib(), _base_path=tmp_path, __file__=str(tmp_path / "llama_cpp.py"))
    monkeypatch.setitem(
        sys.modules, "llama_cpp", types.SimpleNamespace(llama_backend_init=lambda: None, llama_cpp=bindings)
    )
    devs = devices.devices()
    assert devs == [
        devices.Device("CPU", "a device", "CPU", 1 * GIB, 2 * GIB),
        devices.Device("CUDA0", "a device", "GPU", 8 * GIB, 24 * GIB),
    ]
    assert devices.gpu_free(devs) == 8 * GIB
    assert sorted(opened) == ["ggml-base.dll", "ggml.dll"]


def test_doctor_shows_the_backend_the_devices_their_memory_and_the_layers(monkeypatch, tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    import specdec_cli.models.llama as llama
    from specdec_cli.cli.app import app

    rg = random_gguf() if __import__("importlib").util.find_spec("gguf") else pytest.skip("needs gguf")
    model = rg.write(tmp_path / "tiny.gguf", rg.SHAPES["tiny"])
    monkeypatch.setattr(llama, "gpu_offload_supported", lambda: True)
    monkeypatch.setattr(llama, "system_info", lambda: "CUDA : ARCHS = 890 | USE_GRAPHS = 1 | CPU : AVX2 = 1 |")
    monkeypatch.setattr(
        devices,
        "devices",
        lambda: [
            devices.Device("CPU", "a CPU", "CPU", 8 * GIB, 16 * GIB),
            devices.Device("CUDA0", "RTX 4070 Laptop", "GPU", 7 * GIB, 8 * GIB),
        ],
    )
    result = CliRunner().invoke(app, ["doctor", "--target", str(model), "--json", "-"])
    assert result.exit_code == 0, result.output
    g = json.loads(result.stdout)["gpu"]
    assert g["backend"] == "CUDA" and g["layers"] == -1 and "of 7.0 GiB free" in g["why"]
    assert [d["name"] for d in g["devices"]] == ["CPU", "CUDA0"] and g["devices"][1]["free_mib"] == 7 * 1024
    table = CliRunner().invoke(app, ["doctor", "--target", str(model)]).stdout
    for text in ("GPU backend", "CUDA", "device CUDA0", "7,168 MiB free of 8,192 MiB", "layers offloaded", "all"):
        assert text in table, text


def test_doctor_says_n_a_on_a_cpu_build(monkeypatch) -> None:
    from typer.testing import CliRunner

    import specdec_cli.models.llama as llama
    from specdec_cli.cli.app import app

    monkeypatch.setattr(llama, "gpu_offload_supported", lambda: False)
    table = CliRunner().invoke(app, ["doctor"]).stdout
    assert "none: a CPU build" in table and "n/a" in table


@pytest.mark.real
def test_every_catalog_pair_shares_a_vocabulary_and_a_foreign_draft_is_refused_with_the_reason() -> None:
    from specdec_cli.config import load_catalog
    from specdec_cli.errors import IncompatiblePairError
    from specdec_cli.models.llama import LlamaBackend
    from specdec_cli.models.resolver import resolve
    from specdec_cli.models.vocab import check_compatible

    catalog = load_catalog()
    loaded: dict[str, LlamaBackend] = {}

    def backend(name: str) -> LlamaBackend:
        if name not in loaded:
            loaded[name] = LlamaBackend(resolve(name, catalog), n_ctx=64, n_batch=64, branches=False)
        return loaded[name]

    try:
        for pair in catalog.pairs.values():
            if not (catalog.models[pair.target].ci and catalog.models[pair.draft].ci):
                continue  # the 2026 families are not fetched in CI
            check_compatible(backend(pair.target), backend(pair.draft))
        with pytest.raises(IncompatiblePairError, match="cannot speculate for the target .*: vocab"):
            check_compatible(backend(catalog.default_target), backend("gemma3-270m"))
    finally:
        for b in loaded.values():
            b.close()


def test_doctor_names_the_backend_from_the_devices_where_the_system_info_lists_only_the_cpu(monkeypatch) -> None:
    """A Vulkan build's llama_print_system_info names only the CPU's features (ggml's backends are loaded
    dynamically): the backend comes from the device list, as the Vulkan build on lavapipe showed."""
    import specdec_cli.models.llama as llama
    from specdec_cli.cli.commands import doctor

    monkeypatch.setattr(llama, "gpu_offload_supported", lambda: True)
    monkeypatch.setattr(llama, "system_info", lambda: "CPU : SSE3 = 1 | AVX2 = 1 | OPENMP = 1 | REPACK = 1 |")
    monkeypatch.setattr(
        devices,
        "devices",
        lambda: [
            devices.Device("Vulkan0", "llvmpipe", "GPU", 2 * GIB, 2 * GIB),
            devices.Device("CPU", "AMD EPYC", "CPU", 8 * GIB, 16 * GIB),
        ],
    )
    monkeypatch.setattr(doctor, "_probe_model", lambda: None)
    assert doctor.gpu()["backend"] == "VULKAN"
    monkeypatch.setattr(devices, "devices", lambda: [devices.Device("CPU", "AMD EPYC", "CPU", 8 * GIB, 16 * GIB)])
    assert doctor.gpu()["backend"] == ""
