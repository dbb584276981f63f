"""Host quirks that must never become a crash: llama.cpp's AMX kernels on Intel CPUs.

llama-cpp-python builds llama.cpp with `GGML_NATIVE`, which on an Intel CPU with AMX (Sapphire Rapids and later,
common in cloud VMs and CI runners) compiles llama.cpp's AMX kernels in. Built by GCC < 13, llama-cpp-python 0.3.36's
AMX kernels fault on the first decode (`ggml_backend_amx_mul_mat`, at `ldtilecfg`: llama.cpp issue 20824): GCC does
not see that `_tile_loadconfig` reads the stack tile configuration and drops the stores that fill it. The whole
process dies with SIGSEGV (or SIGILL), no message. `specdec install-llama-cpp` (`models.build`; `make` in a
checkout) builds the sdist with the AMX tile patch (a compiler barrier before the load) on such CPUs, and the kernels
run, faster at prefill than with AMX compiled out.

Where an AMX build still crashes (a llama-cpp-python built elsewhere, without the patch), two ways around it:

* rebuild (`specdec install-llama-cpp`: the patched AMX kernels; `--amx off` compiles AMX out);
* load the model with llama.cpp's *extra buffer types* off (`llama_model_params.use_extra_bufts = false`: no AMX
  and no repacked weight layouts): it works, but plain decoding is slower, so it is the fallback, not the default.

`plan()` decides, once per process, how `LlamaBackend` loads models:

* the loaded llama.cpp has no AMX kernels (its system info lacks `AMX_INT8 = 1`): load as built;
* `SPECDEC_AMX=keep`: load as built (you know this build works on this CPU);
* `SPECDEC_AMX=off`: extra buffer types off;
* otherwise (`auto`, the default): a child process loads the model as built and decodes a few tokens
  (`llama.probe_main`); if it dies, only it dies. The verdict is remembered per build and CPU in
  `$SPECDEC_CACHE/host.json`, so this costs a few seconds once per build. A build is its llama-cpp-python version,
  llama.cpp's system info and its shared libraries themselves (name, size, mtime and sha256 of each file in
  `llama_cpp/lib`, hashed once per new file): a stock and a patched build of one version on one machine share the
  first two, and one must never inherit the other's verdict (the stock one would crash, or the patched one lose
  AMX). A crash (or a probe that could not give a verdict) means extra buffer types off, with one warning that says
  what it costs and the command that builds the patched llama-cpp-python.

`decide()` is the pure rule, unit-tested with made-up system-info strings; `plan()` feeds it the real ones.

The same kind of child process guards against a model file that would crash llama.cpp: `probe_load` loads a file
without a pinned sha256 once, in a child, before this process loads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specdec_cli.errors import ModelError
from specdec_cli.models import build

if TYPE_CHECKING:
    from specdec_cli.models.resolver import Reporter

ENV = "SPECDEC_AMX"
SETTINGS = ("auto", "keep", "off")
REBUILD = (
    f"{build.INSTALL_COMMAND} (it builds llama-cpp-python with the patch that makes the AMX kernels run; "
    "--amx off compiles them out), or by hand: f='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'; "
    "CMAKE_ARGS=\"-DCMAKE_C_FLAGS='$f' -DCMAKE_CXX_FLAGS='$f'\" pip install --force-reinstall --no-cache-dir "
    "llama-cpp-python==0.3.36"
)
PROBE_TIMEOUT = 180.0  # seconds; a probe that takes longer gives no verdict
LOAD_PROBE_TIMEOUT = 600.0  # seconds; a trial load of a model file that takes longer is not taken as a verdict
_HOST_FILE = "host.json"  # in cache_dir(): probe verdicts by build and CPU, and the sha256 of library files
_HASHES_MAX = 32  # library files whose sha256 host.json keeps, by (real path, size, mtime)
_PROBED_FILE = "probed.json"  # in cache_dir(): files that passed a trial load, by (real path, size, mtime)
_PROBED_MAX = 64
_FAILED_FILE = "probe_failed.json"  # in cache_dir(): files a trial load refused or crashed on, with the message
PROBE_REFUSED = 3  # a trial load's exit code when llama.cpp refused the file cleanly (its message is on stderr)
_AMX_BUILD = re.compile(r"\bAMX_INT8\s*=\s*1\b")


class HostWarning(UserWarning):
    """This host needs a slower way to run llama.cpp; shown as one `warning:` line by the CLI."""


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """How models are loaded on this host.

    Attributes:
        extra_bufts: load with llama.cpp's extra buffer types (AMX, repacked weights); False = the safe, slower path.
        amx_build: the loaded llama.cpp has AMX kernels compiled in.
        setting: the `SPECDEC_AMX` setting in force ("auto", "keep" or "off").
        verdict: the probe's verdict ("ok", "crash: SIGSEGV", "no verdict: ...") or None when none was needed.
        reason: one line: why this plan.
    """

    extra_bufts: bool
    amx_build: bool
    setting: str
    verdict: str | None
    reason: str

    @property
    def path(self) -> str:
        """ "as built" or "extra buffer types off" (for --json and reports)."""
        return "as built" if self.extra_bufts else "extra buffer types off"

    def to_dict(self) -> dict:
        return asdict(self) | {"path": self.path}


def amx_build(system_info: str) -> bool:
    """True when llama.cpp's system info line reports AMX kernels (`AMX_INT8 = 1`)."""
    return bool(_AMX_BUILD.search(system_info))


def cpu_has_amx(cpuinfo: str | None = None) -> bool | None:
    """True when the CPU advertises AMX (`amx_tile` in /proc/cpuinfo flags); None when unknown (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
    return bool(re.search(r"\bamx_tile\b", cpuinfo))


def setting(environ: dict[str, str] | None = None) -> str:
    """`SPECDEC_AMX` ("auto" when unset). Raises UsageError for another value."""
    from specdec_cli.errors import UsageError

    value = (environ if environ is not None else os.environ).get(ENV, "").strip().lower() or "auto"
    if value not in SETTINGS:
        raise UsageError(f"{ENV}={value!r} is not a setting.", f"Use {ENV}=auto, keep or off (or unset it).")
    return value


def decide(system_info: str, setting: str, probe: Callable[[], str]) -> LoadPlan:
    """The rule (see the module docstring). `probe()` returns "ok", "crash: ..." or "no verdict: ..."; it is called
    only when the build has AMX kernels and the setting is "auto"."""
    amx = amx_build(system_info)
    if not amx:
        return LoadPlan(True, False, setting, None, "this llama.cpp has no AMX kernels")
    if setting == "keep":
        return LoadPlan(True, True, setting, None, f"{ENV}=keep: loaded as built")
    if setting == "off":
        return LoadPlan(False, True, setting, None, f"{ENV}=off")
    verdict = probe()
    if verdict == "ok":
        return LoadPlan(True, True, setting, verdict, "a trial decode with AMX kernels passed on this CPU")
    return LoadPlan(False, True, setting, verdict, f"a trial decode with AMX kernels failed ({verdict})")


def warning_for(plan: LoadPlan) -> str | None:
    """The one-line warning for a plan that takes the slow path (None otherwise)."""
    if plan.extra_bufts:
        return None
    why = (
        "as SPECDEC_AMX=off asks"
        if plan.setting == "off"
        else f"because its AMX kernels crash on this CPU (llama.cpp issue 20824; {plan.verdict})"
    )
    return (
        f"This llama.cpp build has AMX kernels; models load with its extra buffer types off {why}: no AMX and no "
        f"repacked weights, so decoding is ~1.7x slower. Rebuild llama-cpp-python to avoid it: "
        f"{REBUILD}"
    )


_plan: LoadPlan | None = None


def current_plan() -> LoadPlan | None:
    """The plan this process loaded its models with (None before the first load)."""
    return _plan


def plan(
    model_path: str | os.PathLike[str],
    *,
    n_threads: int,
    system_info: str,
    status: Callable[[str], object] | None = None,
) -> LoadPlan:
    """The load plan for this process, decided on the first call (later calls return it): see the module docstring.

    `model_path` is the model about to be loaded (the probe loads it too, with `n_threads` threads, as the real load
    will); `system_info` is llama.cpp's (`llama.system_info()`: this module never imports the binding). A new warning
    is issued once, as a `HostWarning`. Raises UsageError for a bad `SPECDEC_AMX`.
    """
    global _plan
    if _plan is not None:
        return _plan
    info = system_info

    def probe() -> str:  # only for a build with AMX kernels under SPECDEC_AMX=auto
        key = _verdict_key(info)
        known = _verdicts().get(key)
        if known is not None:
            return known
        if status is not None:
            status("Checking llama.cpp's AMX kernels on this CPU (once)")
        verdict = probe_child(Path(model_path), n_threads)
        if not verdict.startswith("no verdict"):
            _remember(key, verdict)
        return verdict

    _plan = decide(info, setting(), probe)
    if (message := warning_for(_plan)) is not None:
        warnings.warn(message, HostWarning, stacklevel=2)
    return _plan


def probe_child(model_path: Path, n_threads: int) -> str:
    """Load `model_path` as built (extra buffer types on) in a child process and decode a prefill and a verify
    batch with `n_threads` threads. Returns "ok", "crash: SIGSEGV" (any death by a signal, or by an exception on
    Windows: `crash_name`) or "no verdict: ..."."""
    return _child_verdict([str(model_path), str(n_threads)], PROBE_TIMEOUT, "the trial decode")


def _child_verdict(args: list[str], timeout: float, what: str) -> str:
    """Run a probe child (`_probe_process`) and read its exit: "ok", "crash: SIGSEGV" (`crash_name`) or "no verdict:
    ..." (`what` names the trial in that message: timed out, could not start, or exited otherwise)."""
    try:
        proc = _probe_process(args, timeout)
    except subprocess.TimeoutExpired:
        return f"no verdict: {what} took over {timeout:.0f} s"
    except OSError as e:
        return f"no verdict: {e.strerror or e}"
    if proc.returncode == 0:
        return "ok"
    crash = crash_name(proc.returncode)
    if crash is not None:
        return f"crash: {crash}"
    return f"no verdict: {what} exited with {proc.returncode}"


def _probe_process(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run `llama.probe_main(args)` in a child process (an argument list, no shell; no gdb backtrace from
    ggml_abort). Raises OSError, subprocess.TimeoutExpired."""
    command = [
        sys.executable,
        "-c",
        "import sys; from specdec_cli.models.llama import probe_main; sys.exit(probe_main(sys.argv[1:]))",
        *args,
    ]
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    return subprocess.run(
        command, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace", env=env, timeout=timeout
    )


# NTSTATUS codes a Windows process dies with (ntstatus.h); any other code of severity "error" (0xC0000000 and up)
# is a crash too, named by its hex value.
_NTSTATUS = {
    0xC0000005: "STATUS_ACCESS_VIOLATION",
    0xC000001D: "STATUS_ILLEGAL_INSTRUCTION",
    0xC0000094: "STATUS_INTEGER_DIVIDE_BY_ZERO",
    0xC00000FD: "STATUS_STACK_OVERFLOW",
    0xC0000374: "STATUS_HEAP_CORRUPTION",
    0xC0000409: "STATUS_STACK_BUFFER_OVERRUN",
}


def crash_name(returncode: int) -> str | None:
    """What killed a child, from its exit code, or None for an ordinary exit: "SIGSEGV" for a POSIX signal
    (`subprocess`'s returncode -11); "STATUS_ACCESS_VIOLATION (0xC0000005)" for a Windows exception (an NTSTATUS of
    severity error, >= 0xC0000000, seen as the unsigned exit code `subprocess` gives or as its negative int32)."""
    if -256 < returncode < 0:
        return _signal_name(returncode)
    code = returncode & 0xFFFFFFFF
    if code >= 0xC0000000:
        return f"{_NTSTATUS.get(code, 'NTSTATUS')} (0x{code:08X})"
    return None


def _signal_name(returncode: int) -> str:
    """ "SIGSEGV" for a child killed by signal 11 (returncode -11)."""
    import signal

    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


# --------------------------------------------------------------------------------------------------------------------
# A trial load of a model file


def probe_load(path: Path, *, reporter: Reporter | None = None) -> None:
    """Load a model file we have no pinned sha256 for once in a child process before this process loads it.

    `check_gguf` catches files that are not GGUF or are truncated, but a header can be well-formed and still make
    llama.cpp abort the whole process (a GGML_ASSERT on `block_count = 0`, a norm weight stored as F16, ...). The child
    (`llama.probe_main`) loads the file on the CPU and decodes a few tokens; if it dies, only it dies. A file that
    passed is remembered in cache_dir()/probed.json by real path, size and mtime, so it is probed once. Catalog files
    (their sha256 verified at fetch: `resolver.is_catalog_file`) are never probed. `reporter` shows a spinner.

    Raises ModelError when llama.cpp crashed on the file or refused it; that failure is remembered in
    cache_dir()/probe_failed.json for this file, specdec and llama-cpp-python, so a later run raises it again without
    a trial load. A probe that cannot run or times out is not a verdict: the load then goes ahead in this process.
    """
    from specdec_cli.models.resolver import is_catalog_file

    key = _probe_key(path)
    if key is None or is_catalog_file(path) or key in _probed():
        return
    failed = _failed().get(_failed_key(key))
    if failed is not None:  # this file failed a trial load with this specdec and llama-cpp-python: not again
        raise ModelError(failed[0], failed[1] or None)
    try:
        with reporter.status(f"Trial load of {path.name}") if reporter is not None else nullcontext():
            proc = _probe_process([str(path)], LOAD_PROBE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return
    if proc.returncode == 0:
        _remember_probed(key)
        return
    if proc.returncode == PROBE_REFUSED:  # refused cleanly: the child's last line is our own one-line message
        last = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        message = last[-1][:300] if last else f"llama.cpp could not load {path}."
        _remember_failed(key, message, "")
        raise ModelError(message)
    detail = _probe_detail(proc.stderr)
    crash = crash_name(proc.returncode)
    if crash is not None:
        message = f"llama.cpp crashed ({crash}) on a trial load of {path}" + (f": {detail}" if detail else "") + "."
        hint = "The file is corrupt or not supported by this llama-cpp-python: fetch or convert it again."
        _remember_failed(key, message, hint)
        raise ModelError(message, hint)
    # Any other exit (the child's own Python failed): no verdict on the file; the real load reports what it finds.


# --------------------------------------------------------------------------------------------------------------------
# Flash attention on an offloading device


def device_flash_attn(path: Path, gpu_layers: int, n_ctx: int, *, reporter: Reporter | None = None) -> str:
    """Whether llama.cpp's flash attention survives a verify pass on the device this run offloads to: "ok",
    "crash: SIGSEGV" or "no verdict: ...".

    A device's flash-attention kernel can die on the multi-row passes speculation makes while one-token decoding works
    (Mesa's lavapipe through ggml-vulkan: docs/gpu.md), and a kernel that dies takes the whole process with it. So once
    per build, device, model file, layer count and context size, a child process (`llama.probe_main`'s "device" mode)
    loads the model as this run will, with llama.cpp's flash attention, and runs verify passes of several sizes. The
    verdict is remembered in host.json beside the AMX verdicts; a probe that could not run or timed out gives no verdict
    and is tried again next time. `reporter` shows a spinner."""
    key = _device_key(path, gpu_layers, n_ctx)
    if key is None:
        return "no verdict: the model file cannot be keyed"
    known = _verdicts().get(key)
    if known is not None:
        return known
    with reporter.status("Checking flash attention on this device (once)") if reporter else nullcontext():
        verdict = _child_verdict(
            [str(path), "device", str(gpu_layers), str(n_ctx)], LOAD_PROBE_TIMEOUT, "the trial passes"
        )
    if verdict.startswith("no verdict"):
        return verdict
    _remember(key, verdict)
    return verdict


def known_device_flash_attn(path: Path, gpu_layers: int, n_ctx: int) -> str | None:
    """The verdict `device_flash_attn` remembered for this build, device, model file and layers, or None (never
    probed); it probes nothing."""
    key = _device_key(path, gpu_layers, n_ctx)
    return None if key is None else _verdicts().get(key)


def _device_key(path: Path, gpu_layers: int, n_ctx: int) -> str | None:
    """The key of a device verdict: "fa:" + a hash of the build (`build_id`), the devices (`devices.devices`), the
    model file (`_probe_key`), the layers offloaded and the context size; None for a file that cannot be keyed."""
    from specdec_cli.models import devices
    from specdec_cli.models.machine import package_version

    model = _probe_key(path)
    if model is None:
        return None
    devs = "; ".join(f"{d.name} {d.description}" for d in (devices.devices() or []))
    text = f"{package_version()}|{build_id()}|{devs}|{model}|{gpu_layers}|{n_ctx}"
    return "fa:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _probe_key(path: Path) -> str | None:
    try:
        st = path.stat()
        return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        return None


def _probed() -> list[str]:
    from specdec_cli.config import cache_dir

    try:
        data = json.loads((cache_dir() / _PROBED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [k for k in data if isinstance(k, str)] if isinstance(data, list) else []


def _failed_key(key: str) -> str:
    """A failed trial load is remembered for this file (`_probe_key`) with this specdec and llama-cpp-python: an
    upgrade of either tries the file again."""
    from specdec_cli import __version__
    from specdec_cli.models.machine import package_version

    return f"{key}|specdec {__version__}|llama_cpp_python {package_version()}"


def _failed() -> dict[str, list[str]]:
    from specdec_cli.config import cache_dir

    try:
        data = json.loads((cache_dir() / _FAILED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v)}


def _remember_failed(key: str, message: str, hint: str) -> None:
    """Best effort, like `_remember_probed`: the next run raises the same error without a trial load."""
    known = _failed()
    known.pop(_failed_key(key), None)
    kept = dict(list(known.items())[-(_PROBED_MAX - 1) :]) | {_failed_key(key): [message, hint]}
    _write_cache_file(_FAILED_FILE, kept)


def _remember_probed(key: str) -> None:
    """Best effort: a read-only or full cache only means probing again next time."""
    keys = [k for k in _probed() if k != key][-(_PROBED_MAX - 1) :] + [key]
    _write_cache_file(_PROBED_FILE, keys)


def _write_cache_file(name: str, doc: object) -> None:
    """Write `doc` as JSON to `name` in the cache directory, atomically; a read-only or full cache is ignored."""
    from specdec_cli import files
    from specdec_cli.config import cache_dir

    path = cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        files.write_atomic(path, json.dumps(doc, indent=0), private=False)
    except OSError:
        pass


def _probe_detail(stderr: str) -> str:
    """The line that says why: llama.cpp's GGML_ASSERT / error line (source path dropped), else the last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if "GGML_ASSERT" in ln or "error" in ln.lower() or "unsupported" in ln:
            ln = re.sub(r"^\S*\.(?:c|cpp|h):\d+:\s*", "", ln)
            return ln[:200]
    return lines[-1][:200] if lines else ""


def _verdict_key(system_info: str) -> str:
    """The key of a verdict: llama-cpp-python's version, llama.cpp's system info, the CPU and the build's library
    files (`build_id`)."""
    from specdec_cli.models.machine import cpu_model, package_version

    text = f"{package_version()}|{system_info}|{cpu_model()}|{build_id()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_id() -> str:
    """The loaded build's identity: "name:size:mtime_ns:sha256" of each llama.cpp/ggml library file in
    `build.library_dir()`, joined by spaces ("no library found" when there is none). Each file's sha256 is computed
    once (~0.2 s per 50 MB) and kept in host.json by real path, size and mtime, so a rebuilt file is hashed anew."""
    files = build.library_files()
    if not files:
        return "no library found"
    known = _hashes()
    parts, new = [], {}
    for path in files:
        try:
            st = path.stat()
            where = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
            digest = known.get(where) or _sha256(path)
        except OSError:
            continue
        if where not in known:
            new[where] = digest
        parts.append(f"{path.name}:{st.st_size}:{st.st_mtime_ns}:{digest}")
    if new:
        _remember_hashes(new)
    return " ".join(parts)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _host_file() -> Path:
    from specdec_cli.config import cache_dir

    return cache_dir() / _HOST_FILE


def _host_data() -> dict:
    try:
        data = json.loads(_host_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _strings(section: object) -> dict[str, str]:
    if not isinstance(section, dict):
        return {}
    return {k: v for k, v in section.items() if isinstance(k, str) and isinstance(v, str)}


def _verdicts() -> dict[str, str]:
    return _strings(_host_data().get("amx_verdicts"))


def _hashes() -> dict[str, str]:
    return _strings(_host_data().get("library_sha256"))


def _write_host(verdicts: dict[str, str], hashes: dict[str, str]) -> None:
    """Best effort: a read-only or full cache only means probing (or hashing) again next time."""
    from specdec_cli import files

    path = _host_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        files.write_atomic(
            path, json.dumps({"amx_verdicts": verdicts, "library_sha256": hashes}, indent=1), private=False
        )
    except OSError:
        pass


def _remember(key: str, verdict: str) -> None:
    _write_host(_verdicts() | {key: verdict}, _hashes())


def _remember_hashes(new: dict[str, str]) -> None:
    keep = max(0, _HASHES_MAX - len(new))
    old = [(k, v) for k, v in _hashes().items() if k not in new]
    _write_host(_verdicts(), dict((old[-keep:] if keep else []) + list(new.items())))


def set_flash_attn_fn():
    """llama.cpp's `llama_set_flash_attn(ctx, on) -> bool` (the flash-attention patch `specdec install-llama-cpp`
    applies: `models.build`), or None where this llama-cpp-python was built without it (a stock build)."""
    import ctypes

    import llama_cpp

    fn = getattr(getattr(getattr(llama_cpp, "llama_cpp", None), "_lib", None), "llama_set_flash_attn", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_bool]
        fn.restype = ctypes.c_bool
    return fn


def flash_attn_switch() -> bool:
    """Whether this build can turn flash attention on and off between passes (`llama.PHASED`)."""
    return set_flash_attn_fn() is not None


def describe_build(system_info: str) -> str:
    """Which llama.cpp a benchmark ran, for its header: stock or specdec's patched build, llama.cpp's system info,
    whether it has AMX kernels and the trial decode's remembered verdict for this build on this CPU (the patched
    build's passes), and whether it can switch flash attention between passes (`llama.flash_attn_switch`)."""
    verdict = known_verdict(system_info) or "not probed yet"
    return (
        f"llama.cpp: {build_info(system_info).name}; {system_info.strip()}\nAMX kernels in this build: "
        f"{amx_build(system_info)}; trial decode verdict on this CPU: {verdict}; flash attention switch "
        f"(phased): {flash_attn_switch()}"
    )


def build_info(system_info: str) -> build.BuildInfo:
    """Which llama.cpp this Python loads: stock or specdec's patched build (it has `llama_set_flash_attn`), with or
    without AMX kernels, from where, and how to get the patched one (`build.BuildInfo`)."""
    return build.describe(patched=flash_attn_switch(), amx_kernels=amx_build(system_info))


def known_verdict(system_info: str) -> str | None:
    """The remembered probe verdict for this build (llama.cpp's `system_info` and its library files) and CPU (None
    when never probed)."""
    return _verdicts().get(_verdict_key(system_info))


def _reset_for_tests() -> None:
    global _plan
    _plan = None
