"""Which llama.cpp build this Python loads, and the command that builds the patched one.

llama-cpp-python from PyPI (what `pip install specdec-cli`, `pipx install` and `uv tool install` give) is a *stock*
build. specdec's build (`specdec install-llama-cpp`, or `make` in a checkout) compiles the same pinned sdist with
two patches of ours, shipped as package data in `specdec_cli/llama_build/`:

* `patches/llama-cpp-python-flash-attn-switch.patch`, on every build: `llama_set_flash_attn(ctx, on)`, so flash
  attention can be switched between passes (prefill on, long verify passes off). Its symbol is how a build is told
  apart (`models.host.flash_attn_switch`).
* `patches/llama-cpp-python-amx-tileconfig.patch`, on x86 CPUs with AMX: the compiler barrier that makes llama.cpp's
  AMX kernels run when built by GCC < 13 (llama.cpp issue 20824). Elsewhere on x86 AMX is compiled out.

`llama_build/install.py` does the work (standard library only, so that `make` runs it as a script before specdec is
installed, on any platform); this module asks it what it would do (`install_plan`) and runs it for a given Python
(`install`), its errors turned into BuildError. It also finds the loaded build's shared libraries without importing
the binding (`library_files`), which `models.host` fingerprints so that a verdict about one build is never applied to
another.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from specdec_cli.errors import BuildError
from specdec_cli.llama_build import install as installer

INSTALL_COMMAND = "specdec install-llama-cpp"
PATCHES = installer.PATCHES
BACKENDS = installer.BACKENDS
InstallPlan = installer.Plan  # what an install would do for a Python (its --dry-run)
LIB_PATH_ENV = "LLAMA_CPP_LIB_PATH"  # llama-cpp-python loads its libraries from here when set
_LIB_SUFFIXES = (".so", ".dylib", ".dll")
# What a build costs, told before one starts so nobody takes a long compile for a hang (rough: the build's time
# depends on the cores free; the disk is the unpacked sdist and CMake's build folder)
BUILD_COST = "about 6 min on 2 free cores, up to 30 on a busy one, and ~0.4 GB of temporary disk"
WHEEL_SIZE = "24 MB"


def data_dir() -> Path:
    """The folder that holds install.py and patches/ (inside the installed package, or the checkout)."""
    return Path(str(importlib.resources.files("specdec_cli").joinpath("llama_build")))


def patch_paths() -> list[Path]:
    return [data_dir() / "patches" / name for name in PATCHES]


# --------------------------------------------------------------------------------------------------------------------
# The loaded build


def library_dir() -> Path | None:
    """Where llama-cpp-python loads its shared libraries from: `$LLAMA_CPP_LIB_PATH`, else the `lib/` folder of the
    installed `llama_cpp` package (found without importing it). None when llama-cpp-python is not installed."""
    if override := os.environ.get(LIB_PATH_ENV):
        return Path(override)
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent / "lib"


def library_files(folder: Path | None = None) -> list[Path]:
    """The llama.cpp and ggml shared libraries in `folder` (default: `library_dir()`), sorted by name; [] when none."""
    folder = library_dir() if folder is None else folder
    if folder is None:
        return []
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return []
    return [
        p
        for p in entries
        if p.is_file() and ("llama" in p.name or "ggml" in p.name) and any(s in p.name for s in _LIB_SUFFIXES)
    ]


def installed_from(python_prefix: str | None = None) -> str | None:
    """The wheel folder specdec's installer installed this environment's llama-cpp-python from (its marker in
    `sys.prefix`), or None when it did not."""
    marker = Path(python_prefix or sys.prefix) / installer.MARKER
    try:
        return marker.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class BuildInfo:
    """Which llama.cpp this Python loads.

    Attributes:
        patched: the build has specdec's flash-attention switch (`llama_set_flash_attn`), i.e. specdec built it.
        amx_kernels: llama.cpp's system info reports AMX kernels (`AMX_INT8 = 1`).
        library_dir: where its shared libraries are (None: not found).
        installed_from: the cached wheel folder specdec's installer installed it from (None: installed otherwise).
    """

    patched: bool
    amx_kernels: bool
    library_dir: str | None
    installed_from: str | None

    @property
    def name(self) -> str:
        """One line: "specdec's patched build (...)" or "stock build (...)"."""
        if self.patched:
            amx = "; AMX kernels with the tile fix" if self.amx_kernels else ""
            return f"specdec's patched build (flash-attention switch{amx})"
        return "stock build (no flash-attention switch" + ("; AMX kernels unpatched)" if self.amx_kernels else ")")

    @property
    def advice(self) -> str | None:
        """How to get the patched build (None when this is it)."""
        if self.patched:
            return None
        return f"{INSTALL_COMMAND} builds the patched one for this Python ({BUILD_COST})"

    def to_dict(self) -> dict:
        return {
            "patched": self.patched,
            "name": self.name,
            "amx_kernels": self.amx_kernels,
            "library_dir": self.library_dir,
            "installed_from": self.installed_from,
            "advice": self.advice,
        }


def describe(*, patched: bool, amx_kernels: bool) -> BuildInfo:
    """The loaded build, from what the caller read off it (`host.flash_attn_switch()`, `host.amx_build(info)`). The
    installer's marker names the wheel only while the build is patched: a reinstall in place of PyPI's build keeps
    it."""
    folder = library_dir()
    return BuildInfo(patched, amx_kernels, str(folder) if folder else None, installed_from() if patched else None)


# --------------------------------------------------------------------------------------------------------------------
# Building the patched one


def missing_tools() -> list[str]:
    """The tools the build needs that are not on PATH: a C and a C++ compiler (CMake and Ninja come from PyPI
    through pip; nothing on Windows, where CMake finds Visual Studio's compiler)."""
    return installer.missing_tools()


def install_plan(python: str = sys.executable, *, amx: str = "auto", backend: str = "auto") -> InstallPlan:
    """What the installer would do for `python` (its --dry-run: no download, no build). `amx`: "auto" (the AMX tile
    fix on CPUs with AMX) or "off" (AMX compiled out); `backend`: one of BACKENDS. The run-time SPECDEC_AMX (auto,
    keep, off) is not read. Raises BuildError when `python` cannot be run or a choice is bad."""
    try:
        return installer.make_plan(python, backend=backend, amx=amx)
    except installer.InstallError as e:
        raise BuildError(str(e), e.fix) from e


def install(plan: InstallPlan) -> None:
    """Carry out `plan` (build or reuse the kept wheel, install it into `plan.python`), every tool's output (CMake's
    steps) going to this process's stderr. Raises BuildError when a compiler is missing or a step fails (its own
    output says where)."""
    try:
        installer.install(plan, out=sys.stderr.fileno() if _has_fileno(sys.stderr) else None)
    except installer.InstallError as e:
        raise BuildError(str(e), e.fix) from e


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False
