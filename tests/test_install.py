"""Installing specdec as a tool (issue 43): the distribution's wheel carries the llama.cpp installer (a module, run by
`make` as a script) and its patches, `specdec install-llama-cpp` runs it for the Python specdec runs on, and every piece
of advice names a command the installed package has. No models, no compiler: the installer is asked for its plan, or
its subprocesses are stood in for (the installer itself: tests/llama_build/test_llama_build.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec_cli.models import build, host

ROOT = Path(__file__).resolve().parent.parent
AMX = "CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | REPACK = 1 |"


def command_names() -> set[str]:
    """The top-level commands of the installed `specdec` (Typer's registered names)."""
    from specdec_cli.cli.app import app

    names = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}
    return names | {g.name for g in app.registered_groups}


def named_commands(text: str) -> set[str]:
    """Every `specdec <command>` a piece of advice names."""
    return set(re.findall(r"\bspecdec ([a-z][a-z-]*)", text))


# --------------------------------------------------------------------------------------------------------------------
# The distribution


def test_the_distribution_name_is_ours_and_the_command_stays_specdec():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["name"] == "specdec-cli"  # "specdec" on PyPI is an unrelated project
    assert project["scripts"] == {"specdec": "specdec_cli.__main__:main"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel `pip wheel .` builds from a clean copy of this checkout (a few seconds; setuptools comes from the
    index). A copy, because setuptools packs whatever an earlier build left in build/ and *.egg-info/."""
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src") / "specdec"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "results"
        ),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0 and "No matching distribution found for setuptools" in proc.stderr:
        pytest.skip("setuptools cannot be had from the index here")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (found,) = out.glob("specdec_cli-*.whl")
    return zipfile.ZipFile(found)


def test_the_wheel_ships_the_installer_and_every_patch_it_applies(wheel):
    names = set(wheel.namelist())
    module = "specdec_cli/llama_build/install.py"
    assert module in names and "specdec_cli/llama_build/__init__.py" in names
    assert wheel.read(module) == (build.data_dir() / "install.py").read_bytes()
    assert "specdec_cli/llama_build/install-llama-cpp.sh" not in names  # no bash on the route
    for name in build.PATCHES:
        data = wheel.read(f"specdec_cli/llama_build/patches/{name}")
        assert data == (build.data_dir() / "patches" / name).read_bytes()  # byte for byte what the checkout applies
    assert "specdec_cli/models.toml" in names
    meta = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Name: specdec-cli" in meta


def test_make_runs_the_shipped_installer_as_a_script(tmp_path):
    assert "$(BIN)/python specdec_cli/llama_build/install.py" in (ROOT / "Makefile").read_text()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "specdec_cli" / "llama_build" / "install.py"), "--dry-run"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"python={sys.executable}" in proc.stdout and "state=" in proc.stdout and "backend=" in proc.stdout


# --------------------------------------------------------------------------------------------------------------------
# The command


def test_install_llama_cpp_answers_help_with_examples_and_exit_codes():
    from specdec_cli.cli.app import app

    result = CliRunner().invoke(app, ["install-llama-cpp", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for text in ("--dry-run", "--amx", "--backend", "CMAKE_ARGS", "Examples", "Exit codes", "specdec doctor"):
        assert text in result.stdout


@pytest.fixture
def wheels(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_WHEELS", str(tmp_path / "wheels"))
    return tmp_path / "wheels"


def test_the_dry_run_says_what_it_costs_and_reuses_a_kept_wheel(wheels, monkeypatch):
    monkeypatch.setenv("SPECDEC_AMX", "keep")  # the run-time setting; the build must not read it
    plan = build.install_plan(sys.executable)
    assert plan.python == sys.executable and plan.prefix == sys.prefix
    assert plan.state == "build" and Path(plan.wheel_dir).parent == wheels
    assert "llama-cpp-python-flash-attn-switch.patch" in plan.patches
    from specdec_cli.cli.commands.install_llama_cpp import describe

    assert "6 min on 2 free cores" in describe(plan) and "GB of temporary disk" in describe(plan)
    Path(plan.wheel_dir).mkdir(parents=True)
    (Path(plan.wheel_dir) / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl").write_bytes(b"")
    cached = build.install_plan(sys.executable)
    assert cached.state == "cached" and "a few seconds" in describe(cached)


def test_the_command_builds_for_this_python_and_a_failed_build_is_exit_8(wheels, monkeypatch, capfd):
    """Every subprocess of the installer stood in for: the sdist's download fails, and the command says so."""
    from specdec_cli.__main__ import main
    from specdec_cli.llama_build import install as installer

    real_run, calls = subprocess.run, []

    def run(cmd, **kw):
        if cmd[1:3] != ["-m", "pip"]:
            return real_run(cmd, **kw)  # the installer asking the Python for its tag and prefix
        calls.append((cmd, (kw.get("env") or {}).get("CMAKE_ARGS")))
        if cmd[3] == "download":
            print("the index said no", file=sys.stderr)
            return subprocess.CompletedProcess(cmd, 3)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(installer.subprocess, "run", run)
    monkeypatch.setattr(installer, "missing_tools", lambda: [])
    monkeypatch.setenv("SPECDEC_AMX", "keep")  # the run-time setting; the build must not read it
    assert main(["install-llama-cpp", "--amx", "off", "--backend", "cpu"]) == 8
    assert [c[0][0] for c in calls] == [sys.executable] * 2  # this Python: pip --version, then pip download
    assert [c[0][3] for c in calls] == ["--version", "download"]
    err = capfd.readouterr().err
    assert "Backend: cpu (asked for with --backend cpu)." in err
    assert "Building llama-cpp-python 0.3.36 (cpu)" in err and "the index said no" in err
    assert "error: Downloading the llama-cpp-python sdist failed (exit 3)" in err
    assert main(["install-llama-cpp", "--amx", "maybe"]) == 2
    assert main(["install-llama-cpp", "--backend", "rocm"]) == 2


def test_a_missing_compiler_is_one_line_with_the_fix_and_bash_patch_tar_are_not_needed(wheels, monkeypatch, capfd):
    import shutil

    from specdec_cli.__main__ import main

    real = shutil.which
    monkeypatch.setattr(
        shutil, "which", lambda name: None if name in ("bash", "patch", "tar", "c++", "g++", "clang++") else real(name)
    )
    assert main(["install-llama-cpp"]) == 8
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert "needs a C++ compiler (c++), not found on PATH" in err and "apt-get install build-essential" in err
    assert "bash" not in err and "patch" not in err


# --------------------------------------------------------------------------------------------------------------------
# Advice names what exists


def test_the_host_guards_advice_names_an_existing_command():
    plan = host.decide(AMX, "auto", lambda: "crash: SIGILL")
    message = host.warning_for(plan)
    assert build.INSTALL_COMMAND in message and "scripts/" not in message  # no path the installed package lacks
    assert named_commands(message) and named_commands(message) <= command_names()


@pytest.mark.parametrize("patched", [False, True])
def test_doctor_says_which_build_and_how_to_get_the_patched_one(monkeypatch, patched):
    import json

    import specdec_cli.models.llama as llama
    from specdec_cli.cli.app import app

    monkeypatch.setattr(llama, "system_info", lambda: AMX)
    monkeypatch.setattr(host, "flash_attn_switch", lambda: patched)
    monkeypatch.setenv(host.ENV, "off")  # no probe
    doc = json.loads(CliRunner().invoke(app, ["doctor", "--json", "-"]).stdout)
    assert doc["build"]["patched"] is patched
    table = CliRunner().invoke(app, ["doctor"], env={"COLUMNS": "250"}).stdout
    line = next(ln for ln in table.splitlines() if "llama.cpp build" in ln)
    assert doc["build"]["installed_from"] is None or patched  # a stock build never claims the patched wheel
    if patched:
        assert "specdec's patched build" in line and "AMX kernels with the tile fix" in line
        assert build.INSTALL_COMMAND not in line
    else:
        assert "stock build" in line and build.INSTALL_COMMAND in line
        assert named_commands(line) <= command_names()


@pytest.mark.parametrize("patched", [True, False])
def test_an_environment_is_done_only_while_it_still_loads_a_patched_build(tmp_path, wheels, patched):
    """The script's marker (the wheel it installed) survives `uv tool install --reinstall`, which brings back PyPI's
    stock llama-cpp-python: then the build must be installed again, not "nothing to do"."""
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = str(env / "bin" / "python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    fake = Path(site) / "llama_cpp"  # a binding whose library has (or lacks) specdec's symbol
    fake.mkdir()
    (fake / "__init__.py").write_text("from . import llama_cpp\n")
    (fake / "llama_cpp.py").write_text(
        "class _Lib:\n    pass\n_lib = _Lib()\n" + ("_lib.llama_set_flash_attn = print\n" if patched else "")
    )
    plan = build.install_plan(python)
    (env / ".llama-cpp-python-wheel").write_text(plan.wheel_dir + "\n")  # as after an install from that wheel
    assert build.install_plan(python).state == ("installed" if patched else "build")
