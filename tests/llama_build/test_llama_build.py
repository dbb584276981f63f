"""specdec_cli/llama_build/install.py, the one install route (issue 53): the platform it cannot see simulated (a PATH
without GNU tools, macOS's sysctl, Windows' registry, nvcc without a driver), the backend it picks and says, the
wheel's key, its strict patcher, and the build path with every subprocess stood in for. No compiler, no network."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from fakes import fake_sdist
from specdec_cli.llama_build import install as installer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "specdec_cli" / "llama_build" / "install.py"
AMX_OFF_ARGS = (
    "-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
    "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
)


@pytest.fixture
def wheels(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_WHEELS", str(tmp_path / "wheels"))
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.delenv("LLAMA_CPP_PYTHON_VERSION", raising=False)
    return tmp_path / "wheels"


def tools_dir(tmp_path: Path, **scripts: str) -> Path:
    """A folder of executable shell scripts, name -> body, to put on PATH."""
    d = tmp_path / "tools"
    d.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (d / name).write_text(f"#!/bin/sh\n{body}\n")
        (d / name).chmod(0o755)
    return d


def linux_x86(monkeypatch, tmp_path, flags: str = "fpu sse avx2") -> None:
    """This process sees an x86-64 Linux with `flags` in /proc/cpuinfo."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    monkeypatch.setattr(installer, "CPUINFO", cpuinfo)
    monkeypatch.setattr(installer.platform, "system", lambda: "Linux")
    monkeypatch.setattr(installer.platform, "machine", lambda: "x86_64")


# --------------------------------------------------------------------------------------------------------------------
# No GNU tools, no bash


def test_the_dry_run_is_the_same_plan_with_a_path_that_has_only_python(tmp_path):
    """macOS has no sha256sum, BSD paste needs a file, and nproc is GNU: the old bash installer exited 127 under this
    PATH before printing anything. The plan must not depend on any tool but the Python."""
    only = tmp_path / "only-python"
    only.mkdir()
    (only / "python").symlink_to(sys.executable)
    base = {"HOME": str(tmp_path), "SPECDEC_WHEELS": str(tmp_path / "wheels")}

    def dry_run(path: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(SCRIPT), "--dry-run", "--backend", "cpu"],
            capture_output=True,
            text=True,
            env={**base, "PATH": path},
            timeout=120,
            stdin=subprocess.DEVNULL,
        )

    bare = dry_run(str(only))
    assert bare.returncode == 0, bare.stderr
    full = dry_run(os.environ["PATH"])
    assert full.returncode == 0, full.stderr
    assert bare.stdout == full.stdout
    fields = dict(line.split("=", 1) for line in bare.stdout.splitlines())
    assert list(fields) == ["version", "python", "prefix", "backend", "patches", "cmake_args", "wheel_dir", "state"]
    assert fields["python"] == sys.executable and fields["backend"] == "cpu" and fields["state"] == "build"
    assert bare.stderr.strip().splitlines() == ["backend: cpu (asked for with --backend cpu)"]
    # the command says the same under that PATH
    cli = [sys.executable, "-m", "specdec_cli", "install-llama-cpp", "--dry-run", "--backend", "cpu"]
    env = {**base, "COLUMNS": "300", "NO_COLOR": "1"}
    bare_cli = subprocess.run(
        cli,
        capture_output=True,
        text=True,
        env={**env, "PATH": str(only)},
        cwd=ROOT,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    full_cli = subprocess.run(
        cli,
        capture_output=True,
        text=True,
        env={**env, "PATH": os.environ["PATH"]},
        cwd=ROOT,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert bare_cli.returncode == 0, bare_cli.stderr
    assert bare_cli.stdout == full_cli.stdout and fields["wheel_dir"] in bare_cli.stdout


def test_the_wheel_key_is_the_bash_installers_so_kept_wheels_stay_valid():
    """The same five lines, the same 16 hex digits as `printf '%s\\n' ... | sha256sum | cut -c1-16` gave."""
    patch_sum = installer.hashlib.sha256(b"abc").hexdigest()
    key = installer.cache_key(
        "0.3.36",
        AMX_OFF_ARGS,
        "cpython-311 linux-x86_64",
        "model name\t: Intel(R) Xeon(R) flags\t: fpu avx2",
        patch_sum,
    )
    assert key == "2b486d704fa712e1"


# --------------------------------------------------------------------------------------------------------------------
# The CPU, on each platform


def test_the_cpu_on_linux_is_its_name_and_flags_and_amx_picks_the_patch(monkeypatch, tmp_path, wheels):
    linux_x86(monkeypatch, tmp_path, "fpu avx2 amx_bf16 amx_tile amx_int8")
    assert installer.cpu_description() == "model name\t: Test CPU flags\t\t: fpu avx2 amx_bf16 amx_tile amx_int8"
    plan = installer.make_plan(sys.executable, backend="cpu")
    assert plan.patches == (installer.FA_PATCH, installer.AMX_PATCH) and plan.cmake_args == ""
    off = installer.make_plan(sys.executable, backend="cpu", amx="off")
    assert off.patches == (installer.FA_PATCH,) and off.cmake_args == AMX_OFF_ARGS
    assert off.wheel_dir != plan.wheel_dir


def test_the_cpu_on_macos_comes_from_sysctl(monkeypatch):
    asked = []
    monkeypatch.setattr(installer, "_output", lambda cmd, timeout=15: asked.append(cmd) or "Apple M2 Pro")
    assert installer.cpu_description("Darwin") == "Apple M2 Pro"
    assert asked == [["sysctl", "-n", "machdep.cpu.brand_string"]]


def test_the_cpu_on_windows_comes_from_the_registry(monkeypatch):
    opened = []

    class Key:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    winreg = types.SimpleNamespace(
        HKEY_LOCAL_MACHINE="HKLM",
        OpenKey=lambda root, path: opened.append((root, path)) or Key(),
        QueryValueEx=lambda key, name: (
            "Intel(R) Core(TM) Ultra 7 155H  " if name == "ProcessorNameString" else None,
            1,
        ),
    )
    monkeypatch.setitem(sys.modules, "winreg", winreg)
    assert installer.cpu_description("Windows") == "Intel(R) Core(TM) Ultra 7 155H"
    assert opened == [("HKLM", r"HARDWARE\DESCRIPTION\System\CentralProcessor\0")]
    monkeypatch.setitem(sys.modules, "winreg", None)  # no registry: platform's answer
    monkeypatch.setattr(installer.platform, "processor", lambda: "Intel64 Family 6 Model 170")
    assert installer.cpu_description("Windows") == "Intel64 Family 6 Model 170"


def test_windows_gets_no_gcc_amx_flags(monkeypatch, wheels):
    monkeypatch.setattr(installer.platform, "system", lambda: "Windows")
    monkeypatch.setattr(installer.platform, "machine", lambda: "AMD64")
    monkeypatch.setattr(installer, "_windows_cpu_name", lambda: "Intel(R) Core(TM) i7")
    plan = installer.make_plan(sys.executable, backend="cpu")
    assert plan.cmake_args == "" and plan.patches == (installer.FA_PATCH,)


# --------------------------------------------------------------------------------------------------------------------
# The backend


@pytest.fixture
def no_cuda_root(monkeypatch, tmp_path):
    monkeypatch.setattr(installer, "CUDA_DEFAULT_ROOT", str(tmp_path / "no-cuda"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)


def test_nvcc_without_a_driver_is_a_cpu_build_and_says_why(monkeypatch, tmp_path, wheels, no_cuda_root):
    """This project's machine has nvcc and no GPU, and CI runs `make` there: nvcc alone must not pick CUDA."""
    linux_x86(monkeypatch, tmp_path)
    monkeypatch.setenv("PATH", str(tools_dir(tmp_path, nvcc="exit 0", **{"nvidia-smi": "exit 9"})))
    plan = installer.make_plan(sys.executable)
    assert plan.backend == "cpu" and "-DGGML_CUDA" not in plan.cmake_args
    assert "nvcc at" in plan.backend_reason and "no NVIDIA GPU answers" in plan.backend_reason


def test_nvcc_and_a_gpu_pick_cuda_and_its_flag_is_in_the_key(monkeypatch, tmp_path, wheels, no_cuda_root):
    linux_x86(monkeypatch, tmp_path)
    smi = 'echo "GPU 0: NVIDIA H200 (UUID: GPU-1234)"'
    monkeypatch.setenv("PATH", str(tools_dir(tmp_path, nvcc="exit 0", **{"nvidia-smi": smi})))
    plan = installer.make_plan(sys.executable)
    assert plan.backend == "cuda" and plan.cmake_args == f"{AMX_OFF_ARGS} -DGGML_CUDA=on"
    assert "NVIDIA H200" in plan.backend_reason
    cpu = installer.make_plan(sys.executable, backend="cpu")
    assert cpu.cmake_args == AMX_OFF_ARGS and cpu.wheel_dir != plan.wheel_dir  # never the CPU wheel for CUDA


def test_no_nvcc_is_the_cpu(monkeypatch, tmp_path, wheels, no_cuda_root):
    linux_x86(monkeypatch, tmp_path)
    smi = 'echo "GPU 0: NVIDIA H200 (UUID: GPU-1234)"'
    monkeypatch.setenv("PATH", str(tools_dir(tmp_path, **{"nvidia-smi": smi})))
    backend = installer.choose_backend()
    assert backend.name == "cpu" and "no CUDA compiler (nvcc)" in backend.reason


def test_apple_silicon_is_metal_by_default_and_cpu_turns_metal_off():
    metal = installer.choose_backend(system="Darwin", machine="arm64")
    assert metal == installer.Backend("metal", "-DGGML_METAL=on", metal.reason)
    assert "llama-cpp-python's default" in metal.reason
    assert installer.choose_backend("cpu", system="Darwin", machine="arm64").flags == "-DGGML_METAL=off"
    assert installer.choose_backend(system="Darwin", machine="x86_64").name != "metal"  # an Intel Mac


def test_vulkan_only_when_asked_and_cmake_args_still_decides(monkeypatch, tmp_path, wheels, no_cuda_root):
    linux_x86(monkeypatch, tmp_path)
    monkeypatch.setenv("PATH", str(tools_dir(tmp_path)))
    assert installer.make_plan(sys.executable).backend == "cpu"
    vulkan = installer.make_plan(sys.executable, backend="vulkan")
    assert vulkan.cmake_args == f"{AMX_OFF_ARGS} -DGGML_VULKAN=on"
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=89")
    named = installer.make_plan(sys.executable)  # auto: the backend CMAKE_ARGS names, its flags theirs
    assert named.backend == "cuda" and "CMAKE_ARGS" in named.backend_reason
    assert named.cmake_args == f"{AMX_OFF_ARGS} -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=89"
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_VULKAN=off")  # appended after ours: CMake takes the last
    assert installer.make_plan(sys.executable, backend="vulkan").cmake_args.endswith(
        "-DGGML_VULKAN=on -DGGML_VULKAN=off"
    )
    with pytest.raises(installer.InstallError, match="--backend 'rocm' is not a choice"):
        installer.choose_backend("rocm")


# --------------------------------------------------------------------------------------------------------------------
# The patcher: exact or nothing


def write_patch(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "change.patch"
    p.write_text(text)
    return p


TWO_FILES = """diff -ru a/one.txt b/one.txt
--- a/one.txt\t2026-01-01 00:00:00
+++ b/one.txt\t2026-01-01 00:00:00
@@ -2,3 +2,4 @@
 b
 c
+c2
 d
diff -ru a/sub/two.txt b/sub/two.txt
--- a/sub/two.txt
+++ b/sub/two.txt
@@ -1,2 +1,2 @@
-x
+X
 y
"""


def tree(tmp_path: Path, one: str = "a\nb\nc\nd\ne\n", two: str = "x\ny\n") -> Path:
    root = tmp_path / "tree"
    (root / "sub").mkdir(parents=True)
    (root / "one.txt").write_text(one)
    (root / "sub" / "two.txt").write_text(two)
    return root


def test_a_patch_applies_at_its_exact_lines(tmp_path):
    root = tree(tmp_path)
    changed = installer.apply_patch(write_patch(tmp_path, TWO_FILES), root)
    assert changed == [root / "one.txt", root / "sub" / "two.txt"]
    assert (root / "one.txt").read_text() == "a\nb\nc\nc2\nd\ne\n"
    assert (root / "sub" / "two.txt").read_text() == "X\ny\n"


def test_a_hunk_that_does_not_match_fails_loudly_and_writes_nothing(tmp_path):
    root = tree(tmp_path, two="x2\ny\n")  # the second file changed: the first must stay as it was
    with pytest.raises(installer.PatchError, match=r"change.patch: hunk 1 of sub/two.txt does not match at line 1"):
        installer.apply_patch(write_patch(tmp_path, TWO_FILES), root)
    assert (root / "one.txt").read_text() == "a\nb\nc\nd\ne\n"


def test_no_offset_no_fuzz(tmp_path):
    root = tree(tmp_path, one="new first line\na\nb\nc\nd\ne\n")  # patch(1) would apply it with an offset of 1
    with pytest.raises(installer.PatchError, match="hunk 1 of one.txt does not match at line 2"):
        installer.apply_patch(write_patch(tmp_path, TWO_FILES), root)


def test_a_patch_applied_twice_says_so(tmp_path):
    root = tree(tmp_path)
    installer.apply_patch(write_patch(tmp_path, TWO_FILES), root)
    with pytest.raises(installer.PatchError, match="looks applied already"):
        installer.apply_patch(write_patch(tmp_path, TWO_FILES), root)


def test_a_missing_newline_at_the_end_and_a_malformed_patch(tmp_path):
    root = tree(tmp_path, two="x\ny")
    text = "--- a/sub/two.txt\n+++ b/sub/two.txt\n@@ -1,2 +1,2 @@\n x\n-y\n\\ No newline at end of file\n+z\n"
    installer.apply_patch(write_patch(tmp_path, text), root)
    assert (root / "sub" / "two.txt").read_text() == "x\nz\n"
    with pytest.raises(installer.PatchError, match="does not match its header's line counts|ends inside a hunk"):
        installer.apply_patch(write_patch(tmp_path, "--- a/one.txt\n+++ b/one.txt\n@@ -1,3 +1,3 @@\n a\n"), root)
    with pytest.raises(installer.PatchError, match="outside the tree"):
        installer.apply_patch(write_patch(tmp_path, "--- a/../x\n+++ b/../x\n@@ -1 +1 @@\n-a\n+b\n"), root)


# --------------------------------------------------------------------------------------------------------------------
# The build, every subprocess stood in for


class FakePip:
    """Stands in for `python -m pip ...` and for the compiler lookup: records each call, serves the sdist, checks that
    the build sees the patched source, and makes (or fails) the wheel."""

    def __init__(self, sdist: Path, wheel_exit: int = 0):
        self.sdist, self.wheel_exit, self.calls, self.envs = sdist, wheel_exit, [], []
        self.real = subprocess.run

    def __call__(self, cmd, **kw):
        assert isinstance(cmd, list) and not kw.get("shell")  # argument lists, never a shell
        if cmd[1:3] != ["-m", "pip"]:
            return self.real(cmd, **kw)  # the installer asking the Python for its tag and prefix
        self.calls.append(cmd)
        self.envs.append(kw.get("env"))
        verb = cmd[3] if cmd[1:3] == ["-m", "pip"] else None
        if verb == "download":
            dest = Path(cmd[cmd.index("-d") + 1])
            dest.mkdir(parents=True)
            (dest / self.sdist.name).write_bytes(self.sdist.read_bytes())
        elif verb == "wheel":
            source = Path(cmd[-3])
            assert "llama_set_flash_attn" in (source / "vendor/llama.cpp/include/llama.h").read_text()
            if self.wheel_exit:
                return subprocess.CompletedProcess(cmd, self.wheel_exit)
            out = Path(cmd[-1])
            out.mkdir(parents=True)
            (out / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel")
        return subprocess.CompletedProcess(cmd, 0, stdout=b"", stderr=b"")


def plan_for(tmp_path, monkeypatch, wheels) -> installer.Plan:
    linux_x86(monkeypatch, tmp_path)
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    return dataclasses.replace(installer.make_plan(sys.executable, backend="cpu"), prefix=str(prefix))


def test_a_build_downloads_patches_builds_moves_and_installs(tmp_path, monkeypatch, wheels):
    plan = plan_for(tmp_path, monkeypatch, wheels)
    pip = FakePip(fake_sdist(tmp_path, plan.version))
    monkeypatch.setattr(installer.subprocess, "run", pip)
    real_which = installer.shutil.which
    monkeypatch.setattr(
        installer.shutil,
        "which",
        lambda name: None if name in ("bash", "patch", "tar", "sha256sum", "paste", "nproc") else real_which(name),
    )
    monkeypatch.delenv("CMAKE_BUILD_PARALLEL_LEVEL", raising=False)
    installer.install(plan)
    py = [sys.executable, "-m", "pip"]
    verbs = [c[3] for c in pip.calls]
    assert verbs == ["--version", "download", "wheel", "install", "install"]
    assert pip.calls[1][:4] == [*py, "download"] and "llama-cpp-python==0.3.36" in pip.calls[1]
    build_env = pip.envs[2]
    assert build_env["CMAKE_ARGS"] == plan.cmake_args and build_env["CMAKE_BUILD_PARALLEL_LEVEL"] == str(
        os.cpu_count() or 2
    )
    wheel = Path(plan.wheel_dir) / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl"
    assert wheel.read_bytes() == b"wheel" and sorted(p.name for p in Path(plan.wheel_dir).iterdir()) == [wheel.name]
    assert pip.calls[3] == [*py, "install", "--force-reinstall", "--no-deps", str(wheel)]
    assert pip.calls[4] == [*py, "install", str(wheel)]
    assert (Path(plan.prefix) / installer.MARKER).read_text() == plan.wheel_dir + "\n"
    assert [p.name for p in wheels.iterdir()] == [Path(plan.wheel_dir).name]  # no .building.* left
    # a second environment reuses the kept wheel: no download, no build
    pip.calls.clear()
    again = installer.make_plan(sys.executable, backend="cpu")
    assert again.state == "cached"
    installer.install(dataclasses.replace(again, prefix=plan.prefix))
    assert [c[3] for c in pip.calls] == ["--version", "install", "install"]


def test_a_failed_build_leaves_no_half_wheel_and_names_the_step(tmp_path, monkeypatch, wheels):
    plan = plan_for(tmp_path, monkeypatch, wheels)
    monkeypatch.setattr(installer.subprocess, "run", FakePip(fake_sdist(tmp_path, plan.version), wheel_exit=3))
    with pytest.raises(installer.InstallError, match=r"Building llama-cpp-python \(pip wheel\) failed \(exit 3\)"):
        installer.install(plan)
    assert not Path(plan.wheel_dir).exists() and list(wheels.iterdir()) == []
    assert not (Path(plan.prefix) / installer.MARKER).exists()


def test_no_pip_gets_ensurepip_first(tmp_path, monkeypatch, wheels):
    plan = plan_for(tmp_path, monkeypatch, wheels)
    Path(plan.wheel_dir).mkdir(parents=True)
    (Path(plan.wheel_dir) / "llama_cpp_python-0.3.36-py3-none-any.whl").write_bytes(b"")
    calls = []

    def run(cmd, **kw):
        calls.append(cmd[1:4])
        return subprocess.CompletedProcess(cmd, 1 if cmd[1:4] == ["-m", "pip", "--version"] else 0)

    monkeypatch.setattr(installer.subprocess, "run", run)
    installer.install(plan)
    assert calls[:2] == [["-m", "pip", "--version"], ["-m", "ensurepip", "--upgrade"]]


def test_the_script_says_the_backend_and_fails_in_one_line(tmp_path, wheels):
    env = {**os.environ, "SPECDEC_WHEELS": str(wheels), "LLAMA_CPP_PYTHON_VERSION": "0.3.36"}
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--python", str(tmp_path / "no-python")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.strip().splitlines()[-1].startswith("install.py: error: ") and "--python" in bad.stderr
    choice = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "rocm"], capture_output=True, text=True, env=env, timeout=120
    )
    assert choice.returncode == 2 and "invalid choice: 'rocm'" in choice.stderr


# --------------------------------------------------------------------------------------------------------------------
# make checks the Python first


def test_make_with_an_old_python_stops_at_once_in_one_line(tmp_path):
    if subprocess.run(["make", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no make")
    shim = tmp_path / "python3"  # a Python that says it is 3.9, as macOS's command-line tools' python3 is
    shim.write_text(
        f"#!{sys.executable}\nimport sys\nsys.version_info = (3, 9, 6, 'final', 0)\n"
        "if sys.argv[1:2] != ['-c']:\n    sys.exit('the shim only runs -c')\nexec(sys.argv[2])\n"
    )
    shim.chmod(0o755)
    venv = tmp_path / "venv"
    # make as a user runs it from a shell: under `make test` the parent's MAKELEVEL and MAKEFLAGS would make the
    # child print "Entering directory" lines the user never sees.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    proc = subprocess.run(
        ["make", f"PYTHON={shim}", f"VENV={venv}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, lines
    assert f"specdec needs Python 3.11+; this is 3.9 ({shim}). Run: make PYTHON=python3.12" in lines[0]
    assert not venv.exists()
    missing = subprocess.run(
        ["make", "-n", f"PYTHON={tmp_path / 'nothing'}", f"VENV={venv}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=env,
    )
    assert missing.returncode != 0 and "did not run. Run: make PYTHON=python3.12" in missing.stderr
    fine = subprocess.run(
        ["make", "-n", f"PYTHON={sys.executable}", f"VENV={venv}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=env,
    )
    assert fine.returncode == 0 and "specdec_cli/llama_build/install.py --backend auto" in fine.stdout
    assert "nproc" not in (ROOT / "Makefile").read_text()
