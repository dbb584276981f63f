"""The patches apply cleanly to the pinned llama-cpp-python sdist, and the install script uses them: the AMX patch on
AMX CPUs, the flash-attention switch everywhere.

The sdist comes from PyPI (cached under the specdec cache: ~50 MB once); the test skips when it cannot be had.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "specdec_cli" / "llama_build"  # shipped in the package: `specdec install-llama-cpp` runs it
PATCH = BUILD / "patches" / "llama-cpp-python-amx-tileconfig.patch"
FA_PATCH = BUILD / "patches" / "llama-cpp-python-flash-attn-switch.patch"
FA_FILES = ("include/llama.h", "src/llama-context.h", "src/llama-context.cpp", "src/llama-graph.h", "src/llama-graph.cpp",
            "src/llama-cparams.h")
SCRIPT = BUILD / "install-llama-cpp.sh"


def pinned_version() -> str:
    return re.search(r'LLAMA_CPP_PYTHON_VERSION:-([0-9.]+)', SCRIPT.read_text()).group(1)


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    from specdec_cli.config import cache_dir

    version = pinned_version()
    where = cache_dir() / "sdist"
    found = sorted(where.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        where.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                               f"llama-cpp-python=={version}", "-d", str(where)], capture_output=True, text=True,
                              timeout=600)
        found = sorted(where.glob(f"llama_cpp_python-{version}.tar.gz"))
        if proc.returncode != 0 or not found:
            pytest.skip(f"the llama-cpp-python {version} sdist could not be downloaded: {proc.stderr[-300:]}")
    out = tmp_path_factory.mktemp("sdist")
    with tarfile.open(found[0]) as tar:
        for name in ("ggml/src/ggml-cpu/amx/mmq.cpp", *FA_FILES):
            tar.extract(f"llama_cpp_python-{version}/vendor/llama.cpp/{name}", out, filter="data")
    return out / f"llama_cpp_python-{version}"


def test_the_amx_patch_applies_cleanly_and_puts_the_barrier_before_the_tile_load(sdist):
    if shutil.which("patch") is None:
        pytest.skip("no patch(1)")
    proc = subprocess.run(["patch", "-p1", "--forward", "--fuzz=0", "-d", str(sdist), "-i", str(PATCH)], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "FAILED" not in proc.stdout and "offset" not in proc.stdout, proc.stdout
    text = (sdist / "vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp").read_text()
    init = text[text.index("inline void ggml_tile_config_init(void)"):]
    init = init[: init.index("\n}\n")]
    barrier = init.index('__asm__ __volatile__("" : : "r"(&tc) : "memory");')
    assert barrier < init.index("_tile_loadconfig(&tc);")
    assert barrier > init.index("tc.rows[7] = 16;")  # after every store it protects


def test_the_flash_attention_switch_applies_cleanly_and_rebuilds_the_graph_on_a_switch(sdist):
    if shutil.which("patch") is None:
        pytest.skip("no patch(1)")
    proc = subprocess.run(["patch", "-p1", "--forward", "--fuzz=0", "-d", str(sdist), "-i", str(FA_PATCH)],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "FAILED" not in proc.stdout and "offset" not in proc.stdout, proc.stdout
    src = sdist / "vendor/llama.cpp"
    assert "LLAMA_API bool llama_set_flash_attn(struct llama_context * ctx, bool flash_attn);" in (
        src / "include/llama.h").read_text()
    # a graph built for the other setting is never reused
    assert "cparams.flash_attn              == other.cparams.flash_attn" in (src / "src/llama-graph.h").read_text()
    graph = (src / "src/llama-graph.cpp").read_text()
    fa = graph[graph.index("if (use_flash_attn) {"):graph.index("ggml_flash_attn_ext(ctx0, q, k, v")]
    assert "if (cparams.flash_attn_v_cont) {" in fa and "ggml_cont(ctx0, v)" in fa  # V's rows contiguous for the CPU


def test_the_install_script_patches_and_keys_the_wheel_by_the_patches():
    script = SCRIPT.read_text()
    assert 'patches=("$fa_patch")' in script  # every build: the flash-attention switch
    assert 'grep -qw amx_tile <<<"$cpu"' in script and 'patches+=("$amx_patch")' in script  # AMX CPUs: the barrier
    assert 'cat "${patches[@]}" | sha256sum' in script
    assert '"$patch_sum"' in script.split("key=")[1].splitlines()[0]  # the wheel's cache key includes the patches
    assert "-mno-amx-tile" in script  # CPUs without AMX (and SPECDEC_AMX=off) build as before
