"""benchmarks/gpu_check.py's build step without a GPU or a compiler: the trimmed sdist is patched by specdec's
installer (the shipped patches, its AMX choice) and built with the CUDA flags; every subprocess is stood in for."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

from fakes import fake_sdist
from specdec_cli.llama_build import install as installer

ROOT = Path(__file__).resolve().parents[2]


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_build_patches_the_sdist_with_the_shipped_patches_and_builds_for_cuda(tmp_path, monkeypatch):
    check = gpu_check()
    trimmed = fake_sdist(tmp_path, check.VERSION)
    monkeypatch.setattr(check, "TRIMMED", trimmed)
    monkeypatch.setattr(check, "WHEELS", tmp_path / "no-wheels")
    monkeypatch.setattr(installer, "cpu_description", lambda system=None: "model name\t: Xeon flags\t: fpu avx2")
    monkeypatch.setattr(installer.platform, "system", lambda: "Linux")
    monkeypatch.setattr(installer.platform, "machine", lambda: "x86_64")
    seen = {}

    def run(cmd, **kw):
        if cmd[1:4] == ["-m", "pip", "wheel"]:
            source = Path(cmd[-3])
            seen["header"] = (source / "vendor/llama.cpp/include/llama.h").read_text()
            seen["cmake_args"] = kw["env"]["CMAKE_ARGS"]
            out = Path(cmd[-1])
            out.mkdir(parents=True)
            (out / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(check.subprocess, "run", run)
    work = tmp_path / "work"
    work.mkdir()
    py, description = check.build(work, "90", work / "log")
    assert py == str(work / "venv" / "bin" / "python")
    assert "llama_set_flash_attn" in seen["header"]  # the flash-attention switch, applied
    assert seen["cmake_args"] == (
        installer.cpu_patches_and_flags("no amx", "auto", "Linux", "x86_64")[1]
        + " -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF"
    )
    assert "-mno-amx-tile" in seen["cmake_args"] and description.endswith(seen["cmake_args"])


def test_the_vulkan_mode_judges_where_the_device_leaves_the_cpu_builds_output() -> None:
    check = gpu_check()

    def lp(tok, p, other, q):
        return {
            "token": tok,
            "logprob": p,
            "top_logprobs": [{"token": tok, "logprob": p}, {"token": other, "logprob": q}],
        }

    cpu = {"tokens": [5, 6, 7], "logprobs": [lp(5, -0.1, 9, -3.0), lp(6, -0.6, 8, -0.9), lp(7, -0.2, 1, -4.0)]}
    assert check.cross_divergence(cpu, {"tokens": [5, 6, 7]}) == "identical"
    near = check.cross_divergence(cpu, {"tokens": [5, 8, 4]})
    assert "token 1 of 3" in near and "margin 0.300" in near and "near-tie" in near
    assert "DIVERGENCE" in check.cross_divergence(cpu, {"tokens": [9, 6, 7]})  # 2.9 logits apart
    assert "not in the CPU build's top 2" in check.cross_divergence(cpu, {"tokens": [5, 6, 3]})
