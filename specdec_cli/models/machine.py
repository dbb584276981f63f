"""A description of this machine and of the model files, for `specdec bench --json` and its report.

    describe(threads, model_paths) -> {
        "cpu": "AMD EPYC 7B13",            # /proc/cpuinfo "model name" (sysctl on macOS)
        "cores": 1, "logical_cpus": 2,     # physical cores (distinct (package, core id) pairs), os.cpu_count()
        "usable_cpus": 2, "threads": 2,    # CPUs this process may run on; llama.cpp threads used (default_threads)
        "memory_bytes": 25275486208,       # MemTotal (None when unknown)
        "os": "Linux-6.8…", "python": "3.11.7",
        "llama_cpp_python": "0.3.36",      # the installed distribution's version (no import)
        "system_info": "CPU : SSE3 = 1 | AVX2 = 1 | …",   # llama.cpp's build and CPU feature line
        "load_plan": {"path": "as built", "reason": …},  # how models were loaded (models.host: the AMX guard)
        "models": [{"path", "name", "size", "sha256", "sha256_source"}, …]}

Model digests come from the `<file>.sha256` marker the resolver writes next to every model it downloaded and
verified (sha256sum format); files are never rehashed here (a 1 GB model takes seconds). A model without a marker
(a path the user gave) has "sha256": null and "sha256_source": "not hashed (no resolver marker)".
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, sysctl's brand string on macOS, else platform's guess)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")) and ":" in line:
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    if platform.system() == "Darwin":
        import subprocess

        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=2, check=False
            ).stdout.strip()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown CPU"


def physical_cores(cpuinfo: str | None = None) -> int | None:
    """Physical cores: distinct (physical id, core id) pairs in /proc/cpuinfo (`cpuinfo` = its text, for tests).

    None when /proc/cpuinfo is unreadable or lists no core ids (some ARM and virtual machines).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
    cores = set()
    for block in cpuinfo.split("\n\n"):
        fields = dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in block.splitlines()) if _)
        if "core id" in fields:
            cores.add((fields.get("physical id", "0"), fields["core id"]))
    return len(cores) or None


def memory_bytes() -> int | None:
    """Total RAM in bytes (MemTotal in /proc/meminfo), None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; all CPUs where there is none, e.g. macOS), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def default_threads() -> tuple[int, str]:
    """(llama.cpp threads when --threads is not given, why), so every machine description agrees with the run
    (`llama.default_threads`, `describe`, tuned.json's key). On Apple Silicon the performance cores
    (`sysctl -n hw.perflevel0.physicalcpu`, else hw.physicalcpu, as llama.cpp's `cpu_get_num_physical_cores` in
    common/common.cpp): a thread on an efficiency core finishes its share of a pass last, and the pass waits for it.
    Elsewhere every usable CPU (`usable_cpus`). Never raises."""
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        for key, what in (("hw.perflevel0.physicalcpu", "performance cores"), ("hw.physicalcpu", "physical cores")):
            n = _sysctl_int(key)
            if n:
                return min(n, usable_cpus()), f"the {what} (sysctl {key})"
    return usable_cpus(), "the CPUs this process may use"


def _sysctl_int(key: str) -> int | None:
    """`sysctl -n key` as a positive int (macOS), None where it fails or says something else."""
    import subprocess

    try:
        out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=2, check=False).stdout
        return int(out.strip()) if out.strip().isdigit() and int(out.strip()) > 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def package_version(dist: str = "llama_cpp_python") -> str | None:
    """The installed version of a distribution, without importing it (None when it is not installed)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def marker_path(path: Path) -> Path:
    """`<file>.sha256`: where the resolver records a model file's verified digest."""
    return path.with_name(path.name + ".sha256")


def model_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """{"path", "name", "size", "sha256", "sha256_source"} for a model file; the digest is read from the resolver's
    `<file>.sha256` marker, never computed (see the module docstring)."""
    p = Path(path)
    try:
        size: int | None = p.stat().st_size
    except OSError:
        size = None
    digest = None
    try:
        fields = marker_path(p).read_text(encoding="ascii").split()
        if fields and _HEX64.match(fields[0]):
            digest = fields[0]
    except (OSError, UnicodeDecodeError):
        pass
    return {
        "path": str(p),
        "name": p.name,
        "size": size,
        "sha256": digest,
        "sha256_source": "resolver marker (verified at download)" if digest else "not hashed (no resolver marker)",
    }


def describe(
    threads: int | None,
    model_paths: Sequence[str | os.PathLike[str]] = (),
    *,
    system_info: str,
    load_plan: dict[str, Any] | None,
) -> dict[str, Any]:
    """The machine description (see the module docstring). `threads`: llama.cpp threads (None = `default_threads`);
    `system_info`: llama.cpp's (`llama.system_info()`); `load_plan`: how this process loads models
    (`host.current_plan().to_dict()`, None before the first load)."""
    return {
        "cpu": cpu_model(),
        "cores": physical_cores(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "threads": int(threads or default_threads()[0]),
        "memory_bytes": memory_bytes(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp_python": package_version(),
        "system_info": system_info,
        "load_plan": load_plan,
        "models": [model_file(p) for p in model_paths],
    }


def one_line(desc: dict[str, Any]) -> str:
    """ "AMD EPYC 7B13, 1 core / 2 threads used, 23.5 GiB RAM, llama-cpp-python 0.3.36" for report headers."""
    cores = desc.get("cores")
    parts = [
        desc.get("cpu") or "unknown CPU",
        (f"{cores} core{'s' * (cores != 1)}, " if cores else "") + f"{desc.get('logical_cpus')} logical CPUs, "
        f"{desc.get('threads')} threads used",
    ]
    if desc.get("memory_bytes"):
        parts.append(f"{desc['memory_bytes'] / 2**30:.1f} GiB RAM")
    if desc.get("llama_cpp_python"):
        parts.append(f"llama-cpp-python {desc['llama_cpp_python']}")
    return ", ".join(parts)
