"""The patches apply exactly to the pinned llama-cpp-python sdist with the installer's own patcher (no patch(1)), and
the installer uses them: the AMX patch on AMX CPUs, the flash-attention switch everywhere.

The sdist: SPECDEC_TEST_SDIST (an unpacked llama_cpp_python-0.3.36 folder, or its .tar.gz) when set, else from PyPI
(cached under the specdec cache: ~50 MB once); the tests skip when it cannot be had. Only copies are patched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from specdec_cli.llama_build import install as installer

PATCH = installer.PATCH_DIR / installer.AMX_PATCH
FA_PATCH = installer.PATCH_DIR / installer.FA_PATCH
FA_FILES = (
    "include/llama.h",
    "src/llama-context.h",
    "src/llama-context.cpp",
    "src/llama-graph.h",
    "src/llama-graph.cpp",
    "src/llama-cparams.h",
)
VK_PATCH = installer.PATCH_DIR / installer.VK_PATCH
VK_FILE = "ggml/src/ggml-vulkan/ggml-vulkan.cpp"
FILES = ("ggml/src/ggml-cpu/amx/mmq.cpp", *FA_FILES, VK_FILE)


def pinned_version() -> str:
    return installer.VERSION


@pytest.fixture
def sdist(tmp_path) -> Path:
    """A copy of the files the patches touch, laid out as in the sdist (each test patches its own)."""
    version = pinned_version()
    out = tmp_path / f"llama_cpp_python-{version}"
    given = os.environ.get("SPECDEC_TEST_SDIST")
    if given and Path(given).is_dir():
        for name in FILES:
            dest = out / "vendor/llama.cpp" / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(given) / "vendor/llama.cpp" / name, dest)
        return out
    tarball = Path(given) if given else _downloaded(version)
    with tarfile.open(tarball) as tar:
        for name in FILES:
            tar.extract(f"llama_cpp_python-{version}/vendor/llama.cpp/{name}", tmp_path, filter="data")
    return out


def _downloaded(version: str) -> Path:
    from specdec_cli.config import cache_dir

    where = cache_dir() / "sdist"
    found = sorted(where.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        where.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={version}",
                "-d",
                str(where),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        found = sorted(where.glob(f"llama_cpp_python-{version}.tar.gz"))
        if proc.returncode != 0 or not found:
            pytest.skip(f"the llama-cpp-python {version} sdist could not be downloaded: {proc.stderr[-300:]}")
    return found[0]


def test_the_amx_patch_applies_exactly_and_puts_the_barrier_before_the_tile_load(sdist):
    assert installer.apply_patch(PATCH, sdist) == [sdist / "vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp"]
    text = (sdist / "vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp").read_text()
    init = text[text.index("inline void ggml_tile_config_init(void)") :]
    init = init[: init.index("\n}\n")]
    barrier = init.index('__asm__ __volatile__("" : : "r"(&tc) : "memory");')
    assert barrier < init.index("_tile_loadconfig(&tc);")
    assert barrier > init.index("tc.rows[7] = 16;")  # after every store it protects


def test_the_flash_attention_switch_applies_exactly_and_rebuilds_the_graph_on_a_switch(sdist):
    src = sdist / "vendor/llama.cpp"
    before = {name: (src / name).read_bytes() for name in FA_FILES}
    changed = installer.apply_patch(FA_PATCH, sdist)
    assert sorted(changed) == sorted(src / name for name in FA_FILES)
    # the patcher's output is what patch(1) makes of the same diff, byte for byte
    if shutil.which("patch"):
        ref = sdist.parent / "ref"
        for name, data in before.items():
            (ref / "vendor/llama.cpp" / name).parent.mkdir(parents=True, exist_ok=True)
            (ref / "vendor/llama.cpp" / name).write_bytes(data)
        subprocess.run(["patch", "-s", "-p1", "--fuzz=0", "-d", str(ref), "-i", str(FA_PATCH)], check=True)
        for name in FA_FILES:
            assert (src / name).read_bytes() == (ref / "vendor/llama.cpp" / name).read_bytes(), name
    with pytest.raises(installer.PatchError, match="looks applied already"):
        installer.apply_patch(FA_PATCH, sdist)
    assert (
        "LLAMA_API bool llama_set_flash_attn(struct llama_context * ctx, bool flash_attn);"
        in (src / "include/llama.h").read_text()
    )
    # a graph built for the other setting is never reused
    assert "cparams.flash_attn              == other.cparams.flash_attn" in (src / "src/llama-graph.h").read_text()
    graph = (src / "src/llama-graph.cpp").read_text()
    fa = graph[graph.index("if (use_flash_attn) {") : graph.index("ggml_flash_attn_ext(ctx0, q, k, v")]
    assert "if (cparams.flash_attn_v_cont) {" in fa and "ggml_cont(ctx0, v)" in fa  # V's rows contiguous for the CPU


def test_the_installer_patches_and_keys_the_wheel_by_the_patches(tmp_path, monkeypatch):
    """Every build gets the flash-attention switch, AMX CPUs the barrier too, and the wheel's key covers the patches'
    bytes: a changed patch is a new wheel, never the old one."""
    monkeypatch.setenv("SPECDEC_WHEELS", str(tmp_path / "wheels"))
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Xeon\nflags\t\t: fpu avx2 amx_tile amx_int8\n")
    monkeypatch.setattr(installer, "CPUINFO", cpuinfo)
    monkeypatch.setattr(installer.platform, "system", lambda: "Linux")
    monkeypatch.setattr(installer.platform, "machine", lambda: "x86_64")
    amx = installer.make_plan(sys.executable, backend="cpu")
    assert amx.patches == (installer.FA_PATCH, installer.AMX_PATCH)
    cpuinfo.write_text("model name\t: Xeon\nflags\t\t: fpu avx2\n")
    plain = installer.make_plan(sys.executable, backend="cpu")
    assert plain.patches == (installer.FA_PATCH,) and "-mno-amx-tile" in plain.cmake_args  # built as before
    patches = tmp_path / "patches"
    shutil.copytree(installer.PATCH_DIR, patches)
    monkeypatch.setattr(installer, "PATCH_DIR", patches)
    assert installer.make_plan(sys.executable, backend="cpu").wheel_dir == plain.wheel_dir
    (patches / installer.FA_PATCH).write_bytes((patches / installer.FA_PATCH).read_bytes() + b"\n")
    assert installer.make_plan(sys.executable, backend="cpu").wheel_dir != plain.wheel_dir


def test_the_vulkan_patch_applies_exactly_and_keeps_the_layer_settings_where_the_headers_have_them(sdist):
    assert installer.apply_patch(VK_PATCH, sdist) == [sdist / "vendor/llama.cpp" / VK_FILE]
    text = (sdist / "vendor/llama.cpp" / VK_FILE).read_text()
    start = text.index("#ifdef VK_EXT_layer_settings\n    VkBool32 enable_best_practice")
    block = text[start : text.index("#endif", start)]
    assert "vk::LayerSettingsCreateInfoEXT layer_setting_info(settings);" in block
    assert (
        "#else" in block and "instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions);" in block
    )


def test_a_vulkan_build_gets_the_layer_settings_patch_and_no_other_backend_does(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_WHEELS", str(tmp_path))
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    assert installer.VK_PATCH in installer.make_plan(backend="vulkan").patches
    assert installer.VK_PATCH not in installer.make_plan(backend="cpu").patches
