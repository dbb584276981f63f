"""Build llama-cpp-python for this machine, patched, and install it into a Python: specdec's one install route.

Standard library only, so that it runs the same on Linux, macOS and Windows before specdec is installed (no bash, no
GNU tools): `make` runs it as a script with the venv's Python, and `specdec install-llama-cpp` imports it
(`specdec_cli.models.build`).

    python specdec_cli/llama_build/install.py                   # build (or reuse the kept wheel) for this Python
    python specdec_cli/llama_build/install.py --dry-run         # the plan, one name=value line each; changes nothing
    python specdec_cli/llama_build/install.py --backend cuda    # auto (default), cpu, metal, cuda or vulkan
    python specdec_cli/llama_build/install.py --amx off         # x86: AMX compiled out (default: $SPECDEC_AMX)
    python specdec_cli/llama_build/install.py --python PATH     # install into another interpreter (default: this one)

Backend (`choose_backend`): auto is Metal on macOS on Apple Silicon (llama-cpp-python's own default there), CUDA where
`nvcc` is found and an NVIDIA driver lists a GPU (`nvidia-smi -L`; the toolkit alone, e.g. in a container without the
card, is not enough), else the CPU; Vulkan only when asked. A backend named in `CMAKE_ARGS` wins over auto. One line
on stderr says which backend and why.

AMX: llama-cpp-python builds llama.cpp with GGML_NATIVE, which compiles llama.cpp's AMX kernels in on Intel CPUs that
have AMX (Sapphire Rapids and later). Built by GCC < 13 those kernels segfault on the first decode (llama.cpp issue
20824): GCC drops the stores that fill the tile configuration before `_tile_loadconfig` reads it. On an x86 CPU with
AMX the build applies patches/llama-cpp-python-amx-tileconfig.patch (a compiler barrier before the load); elsewhere on
x86 (and with --amx off) AMX is compiled out with -mno-amx-*. Not on Windows, whose compiler (MSVC) takes no such flags.

Flash attention by phase: every build gets patches/llama-cpp-python-flash-attn-switch.patch, which adds
`llama_set_flash_attn(ctx, on)`, so specdec can switch flash attention between passes (on for prefill, off for long
verify passes on the CPU).

The wheel is kept under $SPECDEC_WHEELS (default $XDG_CACHE_HOME/specdec/wheels, else ~/.cache/specdec/wheels) in a
folder keyed by the version, the CMake arguments (the backend's included), the Python tag, the CPU and the patches:
pip's own wheel cache is keyed by version only, and the build uses -march=native. A marker in the Python's
`sys.prefix` names the wheel installed there, so a second run costs a second.

Environment: LLAMA_CPP_PYTHON_VERSION (default 0.3.36, the release the patches are made for), SPECDEC_AMX (auto, off;
the script's default for --amx), SPECDEC_WHEELS, CMAKE_ARGS (appended to ours, so it overrides them),
CMAKE_BUILD_PARALLEL_LEVEL (default: every CPU). Exit codes: 0 done (or nothing to do), 1 a step failed (one line
with the fix), 2 a bad option.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

if __name__ == "__main__" and sys.version_info < (3, 11):  # before anything that needs a newer Python
    sys.exit(
        f"specdec needs Python 3.11+; this is {sys.version_info[0]}.{sys.version_info[1]} ({sys.executable}). "
        "Run it with a newer one (python3.12 specdec_cli/llama_build/install.py)."
    )

VERSION = "0.3.36"
PATCH_DIR = Path(__file__).resolve().parent / "patches"
FA_PATCH = "llama-cpp-python-flash-attn-switch.patch"
AMX_PATCH = "llama-cpp-python-amx-tileconfig.patch"
# Vulkan: ggml-vulkan uses VK_EXT_layer_settings (the validation layer's best-practice switch, a debugging aid), which
# Vulkan headers before 1.3.261 lack (Debian 12 ships 1.3.239): compiled only where the headers have it
VK_PATCH = "llama-cpp-python-vulkan-layer-settings.patch"
PATCHES = (FA_PATCH, AMX_PATCH)
BACKENDS = ("auto", "cpu", "metal", "cuda", "vulkan")
BACKEND_FLAGS = {"cpu": "", "metal": "-DGGML_METAL=on", "cuda": "-DGGML_CUDA=on", "vulkan": "-DGGML_VULKAN=on"}
# the GPU backends a user's CMAKE_ARGS may switch on; auto then leaves the choice to them
_CMAKE_BACKEND = re.compile(
    r"-DGGML_(CUDA|METAL|VULKAN|HIP|SYCL|MUSA|OPENCL)(?::BOOL)?=(ON|1|TRUE|YES)\b", re.IGNORECASE
)
AMX_OFF = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
MARKER = ".llama-cpp-python-wheel"  # in sys.prefix: the wheel folder installed there
CPUINFO = Path("/proc/cpuinfo")
CUDA_DEFAULT_ROOT = "/usr/local/cuda"  # where CMake looks for the toolkit by default on Linux
_X86 = ("x86_64", "amd64", "i686", "i386", "x86")
# In the target Python: its wheel tag and prefix (the key and the marker), and whether llama_cpp is a patched build.
_PROBE = (
    "import json, sys, sysconfig; print(json.dumps({'tag': sys.implementation.cache_tag + ' ' + "
    "sysconfig.get_platform(), 'prefix': sys.prefix}))"
)
_PATCHED = "import sys, llama_cpp; sys.exit(0 if hasattr(llama_cpp.llama_cpp._lib, 'llama_set_flash_attn') else 1)"


class InstallError(Exception):
    """A step of the install failed: a message, and the fix (None when the message says it)."""

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.fix = fix


class PatchError(InstallError):
    """A patch does not apply exactly (the sdist changed, or the patch is malformed)."""


# --------------------------------------------------------------------------------------------------------------------
# The machine


def cpu_description(system: str | None = None) -> str:
    """One string naming this CPU, part of the wheel's key: on Linux the first `model name`/`Hardware` line and the
    first `flags`/`Features` line of /proc/cpuinfo, joined by a space (the AMX flags are read from it); on macOS
    `sysctl -n machdep.cpu.brand_string`; on Windows the registry's ProcessorNameString. Falls back to
    `platform.processor()`, then `platform.machine()`; never raises."""
    system = system or platform.system()
    if system == "Darwin":
        return _output(["sysctl", "-n", "machdep.cpu.brand_string"]) or platform.machine()
    if system == "Windows":
        return _windows_cpu_name() or platform.processor() or platform.machine()
    try:
        lines = CPUINFO.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((ln for ln in lines if ln.startswith(("model name", "Hardware"))), "")
    flags = next((ln for ln in lines if ln.startswith(("flags", "Features"))), "")
    return f"{name} {flags}"


def _windows_cpu_name() -> str:
    try:
        import winreg

        reg: Any = winreg  # its stub is empty off Windows, where the tests put a fake in its place
        with reg.OpenKey(reg.HKEY_LOCAL_MACHINE, r"HARDWARE\DESCRIPTION\System\CentralProcessor\0") as key:
            return str(reg.QueryValueEx(key, "ProcessorNameString")[0]).strip()
    except (ImportError, OSError):
        return ""


def has_amx(cpu: str) -> bool:
    """Whether the CPU's flags (from `cpu_description`) name AMX tiles and AMX int8."""
    words = cpu.split()
    return "amx_tile" in words and "amx_int8" in words


def cpu_patches_and_flags(
    cpu: str, amx: str = "auto", system: str | None = None, machine: str | None = None
) -> tuple[list[str], str]:
    """The patches (names in PATCH_DIR) and the CMake flags a build for this CPU gets: the flash-attention switch
    always; on x86 (not Windows) with `amx` "auto" and AMX in `cpu`'s flags the AMX tile fix, else AMX compiled out
    (-mno-amx-* in CMAKE_C_FLAGS and CMAKE_CXX_FLAGS); elsewhere no flags."""
    system = system or platform.system()
    machine = (machine or platform.machine()).lower()
    if machine not in _X86 or system == "Windows":  # MSVC takes no -m flags; other architectures have no AMX
        return [FA_PATCH], ""
    if amx == "auto" and has_amx(cpu):
        return [FA_PATCH, AMX_PATCH], ""  # the AMX kernels, with the barrier that makes them run
    return [FA_PATCH], f"-DCMAKE_C_FLAGS='{AMX_OFF}' -DCMAKE_CXX_FLAGS='{AMX_OFF}'"


def _output(cmd: list[str], timeout: float = 15) -> str:
    """`cmd`'s stripped stdout, or "" when it is missing, fails or hangs."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def find_nvcc() -> str | None:
    """CUDA's compiler where CMake would find it: on PATH, in $CUDA_PATH/bin or $CUDA_HOME/bin, or
    /usr/local/cuda/bin. None when there is none."""
    if found := shutil.which("nvcc"):
        return found
    exe = "nvcc.exe" if os.name == "nt" else "nvcc"
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), CUDA_DEFAULT_ROOT]
    return next((str(p) for r in roots if r and (p := Path(r) / "bin" / exe).is_file()), None)


def nvidia_gpus() -> list[str]:
    """The GPUs an NVIDIA driver answers for (`nvidia-smi -L`: "GPU 0: NAME (UUID: ...)" lines); [] without one."""
    return [ln.strip() for ln in _output(["nvidia-smi", "-L"]).splitlines() if ln.strip().startswith("GPU ")]


@dataclass(frozen=True, slots=True)
class Backend:
    """The backend a build is for: its name (cpu, metal, cuda, vulkan, or one named in CMAKE_ARGS), the CMake flags
    that select it (before the user's CMAKE_ARGS) and why it was chosen, one sentence."""

    name: str
    flags: str
    reason: str


def _apple_silicon(system: str, machine: str) -> bool:
    return system == "Darwin" and machine.lower() in ("arm64", "aarch64")


def choose_backend(
    requested: str = "auto", *, user_args: str = "", system: str | None = None, machine: str | None = None
) -> Backend:
    """The backend for `requested` (one of BACKENDS). auto: a GPU backend that `user_args` (CMAKE_ARGS) switches on;
    else Metal on macOS on Apple Silicon; else CUDA where `nvcc` is found and `nvidia-smi -L` lists a GPU; else the
    CPU. Raises InstallError for a name not in BACKENDS."""
    system = system or platform.system()
    machine = machine or platform.machine()
    if requested not in BACKENDS:
        raise InstallError(f"--backend {requested!r} is not a choice.", f"Use one of: {', '.join(BACKENDS)}.")
    if requested != "auto":
        flags = BACKEND_FLAGS[requested]
        if requested == "cpu" and _apple_silicon(system, machine):
            flags = "-DGGML_METAL=off"  # Metal is llama-cpp-python's default there
        return Backend(requested, flags, f"asked for with --backend {requested}")
    if m := _CMAKE_BACKEND.search(user_args):
        return Backend(m.group(1).lower(), "", f"CMAKE_ARGS switches it on ({m.group(0)})")
    if _apple_silicon(system, machine):
        return Backend(
            "metal",
            BACKEND_FLAGS["metal"],
            "macOS on Apple Silicon: Metal, llama-cpp-python's default there (--backend cpu for none)",
        )
    nvcc = find_nvcc()
    if nvcc and (gpus := nvidia_gpus()):
        return Backend("cuda", BACKEND_FLAGS["cuda"], f"nvcc at {nvcc} and an NVIDIA GPU ({gpus[0]})")
    if nvcc:
        return Backend(
            "cpu",
            "",
            f"nvcc at {nvcc}, but no NVIDIA GPU answers (nvidia-smi -L lists none); "
            "--backend cuda builds for CUDA anyway",
        )
    return Backend(
        "cpu",
        "",
        "no CUDA compiler (nvcc) found, not macOS on Apple Silicon; --backend vulkan or cuda to build for a GPU",
    )


# --------------------------------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True, slots=True)
class Plan:
    """What an install would do for one Python (`--dry-run` prints it).

    Attributes:
        version: the llama-cpp-python release it builds.
        python, prefix: the interpreter it installs into and its `sys.prefix`.
        backend, backend_reason: the backend built for, and why (`choose_backend`).
        patches: the patch files it applies, by name (in PATCH_DIR), in order.
        cmake_args: the CMake arguments it passes (AMX flags, the backend's, then $CMAKE_ARGS).
        wheel_dir: where the wheel is (or will be) kept.
        state: "installed" (nothing to do), "cached" (a reinstall from the kept wheel: seconds) or "build".
    """

    version: str
    python: str
    prefix: str
    backend: str
    backend_reason: str
    patches: tuple[str, ...]
    cmake_args: str
    wheel_dir: str
    state: str

    def lines(self) -> str:
        """The plan as name=value lines in field order, the backend's reason aside (it goes to stderr)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "backend_reason"}
        values["patches"] = " ".join(self.patches)
        return "".join(f"{k}={v}\n" for k, v in values.items())


def wheels_root() -> Path:
    """$SPECDEC_WHEELS, else $XDG_CACHE_HOME/specdec/wheels, else ~/.cache/specdec/wheels."""
    if root := os.environ.get("SPECDEC_WHEELS"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec" / "wheels"


def cache_key(version: str, cmake_args: str, tag: str, cpu: str, patch_sum: str) -> str:
    """16 hex digits of the sha256 of the lines that decide the wheel: version, CMake arguments, Python tag
    ("cpython-311 linux-x86_64"), CPU and the patches' sha256."""
    text = f"{version}\n{cmake_args}\n{tag}\n{cpu}\n{patch_sum}\n"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _probe(python: str) -> dict:
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise InstallError(f"{python} could not be run: {e}.", "Pass a Python 3.11+ with --python.") from e
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise InstallError(
            f"{python} failed to report its version and prefix: {last}", "Pass a Python 3.11+ with --python."
        )
    return json.loads(proc.stdout)


def loads_patched_build(python: str) -> bool:
    """Whether `python` imports a llama-cpp-python that has specdec's `llama_set_flash_attn` (a child process)."""
    try:
        return (
            subprocess.run(
                [python, "-c", _PATCHED], capture_output=True, timeout=120, stdin=subprocess.DEVNULL
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


def wheels_in(folder: Path) -> list[Path]:
    return sorted(folder.glob("llama_cpp_python-*.whl"))


def make_plan(python: str | None = None, *, backend: str = "auto", amx: str = "auto") -> Plan:
    """What an install into `python` (default: this interpreter) would do, reading nothing but this machine and the
    environment (CMAKE_ARGS, LLAMA_CPP_PYTHON_VERSION, SPECDEC_WHEELS). `amx`: "auto" (the tile fix on CPUs with AMX)
    or "off" (compiled out). Raises InstallError for a bad choice or a Python that cannot be run."""
    if amx not in ("auto", "off"):
        raise InstallError(f"--amx {amx!r} is not a choice.", "Use --amx auto or --amx off.")
    python = python or sys.executable
    version = os.environ.get("LLAMA_CPP_PYTHON_VERSION") or VERSION
    user_args = os.environ.get("CMAKE_ARGS", "")
    system, machine = platform.system(), platform.machine()
    chosen = choose_backend(backend, user_args=user_args, system=system, machine=machine)
    cpu = cpu_description(system)
    patches, amx_flags = cpu_patches_and_flags(cpu, amx, system, machine)
    if chosen.name == "vulkan":
        patches = [*patches, VK_PATCH]
    args = " ".join(a for a in (amx_flags, chosen.flags, user_args) if a)
    patch_sum = hashlib.sha256(b"".join((PATCH_DIR / p).read_bytes() for p in patches)).hexdigest()
    info = _probe(python)
    wheel_dir = wheels_root() / f"llama-cpp-python-{version}-{cache_key(version, args, info['tag'], cpu, patch_sum)}"
    # Installed from this very wheel, and still a patched build: a reinstall in place (`uv tool install --reinstall`,
    # `pip install --force-reinstall`) brings back PyPI's stock build but keeps the marker.
    marker = Path(info["prefix"]) / MARKER
    try:
        marked = marker.read_text(encoding="utf-8").strip() == str(wheel_dir)
    except OSError:
        marked = False
    if marked and loads_patched_build(python):
        state = "installed"
    elif wheels_in(wheel_dir):
        state = "cached"
    else:
        state = "build"
    return Plan(
        version, python, info["prefix"], chosen.name, chosen.reason, tuple(patches), args, str(wheel_dir), state
    )


# --------------------------------------------------------------------------------------------------------------------
# Patching: strict unified diffs, zero fuzz


@dataclass(frozen=True, slots=True)
class _Hunk:
    old_start: int  # 1-based line in the original file (for an empty old side: the line after which it inserts)
    old: list[bytes]
    new: list[bytes]


def _parse_patch(text: bytes, name: str) -> list[tuple[str, list[_Hunk]]]:
    """[(path with its first component stripped, hunks)] from a unified diff (-p1). Raises PatchError when malformed."""
    lines = text.splitlines(keepends=True)
    files: list[tuple[str, list[_Hunk]]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(b"--- ") and i + 1 < len(lines) and lines[i + 1].startswith(b"+++ "):
            target = lines[i + 1][4:].split(b"\t")[0].strip().decode()
            parts = target.split("/")[1:]
            if target == "/dev/null" or not parts or target.startswith("/") or ".." in parts:
                raise PatchError(f"{name}: cannot apply a patch to {target!r} (new, deleted or outside the tree).")
            files.append(("/".join(parts), []))
            i += 2
        elif line.startswith(b"@@ "):
            if not files:
                raise PatchError(f"{name}: a hunk before any file header (line {i + 1}).")
            m = re.match(rb"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", line)
            if not m:
                raise PatchError(f"{name}: a malformed hunk header at line {i + 1}: {line.decode(errors='replace')!r}")
            n_old = int(m.group(2)) if m.group(2) is not None else 1
            n_new = int(m.group(4)) if m.group(4) is not None else 1
            hunk = _Hunk(int(m.group(1)), [], [])
            i += 1
            while len(hunk.old) < n_old or len(hunk.new) < n_new:
                if i >= len(lines):
                    raise PatchError(f"{name}: the patch ends inside a hunk of {files[-1][0]}.")
                body, kind = lines[i][1:], lines[i][:1]
                if kind in (b" ", b"\n", b"\r"):  # a context line (an empty one may have lost its space)
                    body = body if kind == b" " else lines[i]
                    hunk.old.append(body)
                    hunk.new.append(body)
                elif kind == b"-":
                    hunk.old.append(body)
                elif kind == b"+":
                    hunk.new.append(body)
                elif kind != b"\\":
                    raise PatchError(f"{name}: an unexpected line {i + 1} in a hunk of {files[-1][0]}.")
                i += 1
                if i < len(lines) and lines[i].startswith(b"\\"):  # "\ No newline at end of file"
                    prev = lines[i - 1][:1]
                    sides = (hunk.old,) if prev == b"-" else (hunk.new,) if prev == b"+" else (hunk.old, hunk.new)
                    for side in sides:
                        side[-1] = side[-1].rstrip(b"\r\n")
                    i += 1
            if len(hunk.old) != n_old or len(hunk.new) != n_new:
                raise PatchError(f"{name}: a hunk of {files[-1][0]} does not match its header's line counts.")
            files[-1][1].append(hunk)
        else:
            i += 1  # "diff ..." lines and other prose between files
    if not files or not any(h for _, h in files):
        raise PatchError(f"{name}: no hunks found (not a unified diff?).")
    return files


def apply_patch(patch: Path, root: Path) -> list[Path]:
    """Apply the unified diff `patch` under `root` like `patch -p1 --forward --fuzz=0`, stricter: every hunk must
    match at exactly its line numbers (no offset, no fuzz), and nothing is written unless every hunk of every file
    matches. Returns the files changed. Raises PatchError naming the file, hunk and line that do not match (a
    changed sdist fails here, not at run time), and says so when the patch looks applied already."""
    name = patch.name
    results: list[tuple[Path, bytes]] = []
    for rel, hunks in _parse_patch(patch.read_bytes(), name):
        path = root / rel
        try:
            original = path.read_bytes().splitlines(keepends=True)
        except OSError as e:
            raise PatchError(f"{name}: {rel} cannot be read: {e}.") from e
        out: list[bytes] = []
        pos = 0
        for n, hunk in enumerate(hunks, 1):
            start = hunk.old_start if not hunk.old else hunk.old_start - 1
            found = original[start : start + len(hunk.old)]
            if start < pos or found != hunk.old:
                applied = original[start : start + len(hunk.new)] == hunk.new
                raise PatchError(
                    f"{name}: hunk {n} of {rel} does not match at line {hunk.old_start}"
                    + (" (the patch looks applied already)." if applied else "."),
                    "The sdist is not the one the patch was made for: check LLAMA_CPP_PYTHON_VERSION.",
                )
            out += original[pos:start] + hunk.new
            pos = start + len(hunk.old)
        results.append((path, b"".join(out + original[pos:])))
    for path, data in results:
        path.write_bytes(data)
    return [p for p, _ in results]


# --------------------------------------------------------------------------------------------------------------------
# Building and installing


def missing_tools() -> list[str]:
    """The tools a build needs that are not on PATH: a C and a C++ compiler (CMake and Ninja come from PyPI through
    pip). On Windows none: CMake finds Visual Studio's compiler itself."""
    if os.name == "nt":
        return []
    out = []
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        out.append("a C compiler (cc)")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        out.append("a C++ compiler (c++)")
    return out


def check_tools() -> None:
    """Raises InstallError naming what `missing_tools` found missing, and how to install it."""
    if missing := missing_tools():
        raise InstallError(
            f"Building llama-cpp-python needs {', '.join(missing)}, not found on PATH.",
            "Install them (Debian/Ubuntu: apt-get install build-essential; Fedora: dnf install gcc-c++; "
            "macOS: xcode-select --install) and run it again.",
        )


def _run(step: str, cmd: list[str], *, out=None, env: dict | None = None, fix: str | None = None) -> None:
    """Run `cmd` (an argument list, never a shell), its output to `out` (None: this process's stdout). Raises
    InstallError naming `step` and the exit code when it fails."""
    try:
        code = subprocess.run(cmd, stdout=out, env=env, stdin=subprocess.DEVNULL).returncode
    except OSError as e:
        raise InstallError(f"{step} could not run: {e}.", fix) from e
    if code != 0:
        raise InstallError(
            f"{step} failed (exit {code}); the lines above say where.", fix or "Fix what they name and run it again."
        )


def _ensure_pip(python: str, out=None) -> None:
    """An environment made by `uv tool install` (or `uv venv`) has no pip: Python's own ensurepip adds it, offline."""
    if subprocess.run([python, "-m", "pip", "--version"], capture_output=True, stdin=subprocess.DEVNULL).returncode:
        print("This Python has no pip; adding it with ensurepip", file=sys.stderr)
        _run("ensurepip", [python, "-m", "ensurepip", "--upgrade", "--default-pip"], out=subprocess.DEVNULL)


def _extract(tarball: Path, dest: Path) -> None:
    with tarfile.open(tarball) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python < 3.11.4: an sdist from PyPI, checked by pip's hash of it
            tar.extractall(dest)


def build_wheel(plan: Plan, *, out=None) -> Path:
    """Download the sdist, apply the patches, build the wheel and move it into `plan.wheel_dir` in one rename (a
    half-built wheel never has the final name). Returns the wheel. Raises InstallError (PatchError) on a failed step."""
    python, wheel_dir = plan.python, Path(plan.wheel_dir)
    wheel_dir.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".building.", dir=wheel_dir.parent))
    tmp: Path | None = building  # None once moved into place
    try:
        src = building / "src"
        print(f"Building llama-cpp-python {plan.version} from its sdist with {' '.join(plan.patches)}", file=sys.stderr)
        _run(
            "Downloading the llama-cpp-python sdist",
            [
                python,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={plan.version}",
                "-d",
                str(src),
            ],
            out=out,
            fix="Check the network (or a pip index: PIP_INDEX_URL) and run it again.",
        )
        tarballs = sorted(src.glob("llama_cpp_python-*.tar.gz"))
        if len(tarballs) != 1:
            raise InstallError(f"pip download left {len(tarballs)} llama-cpp-python sdists in {src}, not one.")
        _extract(tarballs[0], src)
        folders = [p for p in src.iterdir() if p.is_dir()]
        if len(folders) != 1:
            raise InstallError(f"{tarballs[0].name} unpacked into {len(folders)} folders, not one.")
        source = folders[0]
        for name in plan.patches:
            apply_patch(PATCH_DIR / name, source)
        print(
            f"Building llama-cpp-python {plan.version} for {plan.backend} (~10 min on 2 cores; CMake's steps "
            f"follow); CMAKE_ARGS={plan.cmake_args}",
            file=sys.stderr,
        )
        env = {**os.environ, "CMAKE_ARGS": plan.cmake_args}
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        # --verbose: CMake's configuration and every compile step ([n/N] ...) are printed: a long build shows progress
        _run(
            "Building llama-cpp-python (pip wheel)",
            [
                python,
                "-m",
                "pip",
                "wheel",
                "--verbose",
                "--no-cache-dir",
                "--no-deps",
                str(source),
                "-w",
                str(building / "wheel"),
            ],
            out=out,
            env=env,
            fix="Fix what they name and run it again (a GPU backend needs its SDK: docs/install.md).",
        )
        shutil.rmtree(src)
        built = wheels_in(building / "wheel")
        if not built:
            raise InstallError("pip wheel finished but left no llama_cpp_python wheel.")
        for whl in built:
            whl.replace(building / whl.name)
        (building / "wheel").rmdir()
        shutil.rmtree(wheel_dir, ignore_errors=True)
        os.replace(building, wheel_dir)  # atomic
        tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return wheels_in(wheel_dir)[-1]


def install(plan: Plan, *, out=None) -> None:
    """Carry out `plan`: nothing when installed; else build the wheel unless it is kept, install it with
    --force-reinstall --no-deps (a build with other flags is replaced), then its dependencies, and write the marker.
    Subprocess output goes to `out` (None: this process's stdout). Raises InstallError on a failed step."""
    if plan.state == "installed":
        return
    wheels = wheels_in(Path(plan.wheel_dir))
    if not wheels:
        check_tools()
    _ensure_pip(plan.python, out)
    if wheels:
        print(f"Using the llama-cpp-python wheel built earlier with the same flags: {plan.wheel_dir}", file=sys.stderr)
        wheel = wheels[-1]
    else:
        wheel = build_wheel(plan, out=out)
    pip = [plan.python, "-m", "pip", "install"]
    _run("pip install (the wheel)", [*pip, "--force-reinstall", "--no-deps", str(wheel)], out=out)
    _run("pip install (its dependencies)", [*pip, str(wheel)], out=out)  # numpy, jinja2, diskcache, ...
    (Path(plan.prefix) / MARKER).write_text(f"{plan.wheel_dir}\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """The script: print the backend line, then the plan (--dry-run) or carry it out. Returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="install.py",
        description="Build specdec's patched llama-cpp-python for this machine and install it into a Python.",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan (name=value lines); change nothing")
    parser.add_argument("--backend", default="auto", choices=BACKENDS, help="the llama.cpp backend (default: auto)")
    parser.add_argument(
        "--amx",
        default="off" if os.environ.get("SPECDEC_AMX") == "off" else "auto",
        choices=("auto", "off"),
        help="x86 CPUs with AMX: patch the kernels (auto) or compile them out",
    )
    parser.add_argument("--python", default=sys.executable, help="the interpreter to install into (default: this one)")
    a = parser.parse_args(argv)
    try:
        plan = make_plan(a.python, backend=a.backend, amx=a.amx)
        print(f"backend: {plan.backend} ({plan.backend_reason})", file=sys.stderr)
        if a.dry_run:
            sys.stdout.write(plan.lines())
            return 0
        if plan.state == "installed":
            print(
                f"llama-cpp-python {plan.version} is installed from the wheel built for this machine: {plan.wheel_dir}",
                file=sys.stderr,
            )
            return 0
        install(plan)
    except InstallError as e:
        print(f"install.py: error: {e}" + (f" {e.fix}" if e.fix else ""), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
