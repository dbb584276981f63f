"""Energy from this host's own counters, in joules, or why there is none: nothing is ever estimated.

The sources, summed only where they do not nest:

* RAPL (Linux, Intel and AMD CPUs): the package domains of the powercap tree, `intel-rapl:N/energy_uj` named
  `package-N` (µJ, a counter that wraps at `max_energy_range_uj`). Domains nest: psys (the platform) holds the
  packages, a package holds its core/uncore (`intel-rapl:N:M`) subdomains, so only the packages are read and summed
  (one per socket). `SPECDEC_POWERCAP` points the reader at another tree (a container's, a test's). Root-only since
  the CVE-2020-8694 fix unless the admin opens it (docs/energy.md).
* NVML (NVIDIA GPUs, Volta and newer): `nvmlDeviceGetTotalEnergyConsumption` (mJ since the driver loaded) of every
  board NVML sees, through the official `nvidia-ml-py` (the `energy-nvidia` extra: `NVML_FIX`); read only when
  llama.cpp is a CUDA build, the one case where a generation runs on the board. It updates every 20-100 ms: a whole
  reply is measured, never a step.
* Apple Silicon: `zeus-apple-silicon`'s `AppleEnergyMonitor.get_cumulative_energy` (mJ, what `powermetrics` reads,
  without sudo; the `energy-apple` extra: `APPLE_FIX`): the SoC's CPU, GPU, ANE and DRAM channels (the per-core and
  per-cluster channels nest in the CPU's and are not added).

    meter = default_meter()          # discovered once per process (and per SPECDEC_POWERCAP)
    meter.counters                   # the Counters it reads; () where none can be read
    meter.missing                    # Missing(source, reason, fix) for each source that applies and cannot be read
    gauge = Gauge(meter)             # one generation (driver.py): start → prefill_done → tick per record → end
    gauge.energy                     # Energy(prefill_j, prefill_s, decode_j, decode_s, counted, left_out) or None
    gauge.note                       # why there is no Energy ("no energy counter: RAPL: … absent …")
"""

from __future__ import annotations

import importlib
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

POWERCAP_ENV = "SPECDEC_POWERCAP"
DEFAULT_POWERCAP = "/sys/class/powercap"
MAX_WATTS = 1000.0  # no one counter draws more: a counter is read at least once per wrap_j / MAX_WATTS seconds
PACKAGE_ZONE = re.compile(r"intel-rapl:\d+")  # a top-level RAPL zone (subdomains are intel-rapl:N:M)
AUTO: Any = object()  # `discover`'s default for a module: import it where it applies
IDLE_SECONDS = 1.0  # the idle baseline's length
# what to run when a meter's library is missing: the distribution is specdec-cli, not on PyPI, so the extra is named
# from a checkout (docs/install.md) and the package itself is the short way
NVML_FIX = (
    "install nvidia-ml-py into specdec's environment: uv tool install './specdec[energy-nvidia]', or "
    "pip install nvidia-ml-py"
)
APPLE_FIX = (
    "install zeus-apple-silicon into specdec's environment: uv tool install './specdec[energy-apple]', or "
    "pip install zeus-apple-silicon"
)


@dataclass(frozen=True)
class Counter:
    """One energy counter this process can read.

    Attributes:
        name: what it is, for people ("RAPL package-0", "NVML GPU 0 (NVIDIA RTX 4090)").
        covers: what its joules count ("CPU socket", "GPU board", "Apple SoC").
        read: () -> joules (float), cumulative from some fixed point; raises on a read error.
        wrap_j: the counter goes back to 0 after this many joules (RAPL's max_energy_range_uj); None: it never wraps
            within a run (NVML's 64-bit mJ).
    """

    name: str
    covers: str
    read: Callable[[], float]
    wrap_j: float | None = None


@dataclass(frozen=True)
class Missing:
    """A source that applies on this host and cannot be read. source: "RAPL", "NVML" or "Apple Silicon"; reason: why
    (absent, permission denied, not installed, unsupported); fix: the command or step that opens it, or None."""

    source: str
    reason: str
    fix: str | None = None

    def line(self) -> str:
        return f"{self.source}: {self.reason}" + (f" (fix: {self.fix})" if self.fix else "")


def counted(before: float, after: float, wrap_j: float | None) -> float:
    """Joules between two readings of one counter: `after - before`, or across one wrap (`after` below `before`:
    the counter passed `wrap_j` and restarted at 0). A counter that must not wrap and went back (a driver reload)
    raises ValueError: its figure would be invented."""
    if after >= before:
        return after - before
    if wrap_j is None:
        raise ValueError(f"the counter went back from {before:.3f} J to {after:.3f} J")
    return wrap_j - before + after


class Meter:
    """The counters of this host (`discover`) and the sources that apply but cannot be read."""

    def __init__(self, counters: tuple[Counter, ...] = (), missing: tuple[Missing, ...] = ()) -> None:
        self.counters = tuple(counters)
        self.missing = tuple(missing)
        wraps = [c.wrap_j for c in self.counters if c.wrap_j]
        # read at least this often (s) so that no counter can wrap twice between two readings
        self.interval_s = min(wraps) / MAX_WATTS if wraps else math.inf

    @property
    def available(self) -> bool:
        return bool(self.counters)

    def why_none(self) -> str:
        """One line: why this meter has no counter (each source that applies, why it cannot be read, its fix)."""
        if not self.missing:
            return "no energy counter on this host"
        return "no energy counter: " + "; ".join(m.line() for m in self.missing)

    def read(self) -> list[float]:
        """Every counter's reading (J), in `counters` order."""
        return [c.read() for c in self.counters]


class Span:
    """Joules counted by every counter of a meter since `Span(meter)`, kept by `mark` (wraps handled; `due`: the
    time by which `mark` must be called again so that no counter can wrap twice between two readings)."""

    def __init__(self, meter: Meter, clock: Callable[[], float] | None = None) -> None:
        clock = clock if clock is not None else time.perf_counter
        self._meter, self._clock = meter, clock
        self.error: str | None = None
        self.joules = 0.0
        self._last = self._read()
        self.t0 = self.t = clock()
        self.due = self.t0 + meter.interval_s

    def _read(self) -> list[float] | None:
        try:
            return self._meter.read()
        except Exception as e:  # a host quirk (EIO, an NVML error) ends the measurement, not the generation
            self.error = f"a counter could not be read: {type(e).__name__}: {e}"
            return None

    def mark(self) -> tuple[float, float]:
        """Read every counter now: (joules since the start, seconds since the start). After a read error the span
        stops counting (`error` says why)."""
        if self.error is None:
            now = self._read()
            if now is not None and self._last is not None:
                try:
                    self.joules += sum(
                        counted(a, b, c.wrap_j) for c, a, b in zip(self._meter.counters, self._last, now, strict=False)
                    )
                    self._last = now
                except ValueError as e:
                    self.error = str(e)
            self.t = self._clock()
            self.due = self.t + self._meter.interval_s
        return self.joules, self.t - self.t0


@dataclass(frozen=True)
class Energy:
    """One generation's energy, read from the counters, prefill and decoding apart.

    Attributes:
        prefill_j / prefill_s: joules and seconds from the start to the prefill's record.
        decode_j / decode_s: joules and seconds from the prefill's record to the end (the Finish record, or the stop).
        counted: the counters summed ("RAPL package-0", ...). left_out: sources that apply and could not be read
            (`Missing.line`), so the figure leaves them out.
        idle_w: the idle baseline (W) measured before the generation, or None (`Energy.net_of`).
    """

    prefill_j: float
    prefill_s: float
    decode_j: float
    decode_s: float
    counted: tuple[str, ...]
    left_out: tuple[str, ...] = ()
    idle_w: float | None = None

    @property
    def joules(self) -> float:
        return self.prefill_j + self.decode_j

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def watts(self) -> float:
        """Mean power over the whole generation (W)."""
        return self.joules / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_watts(self) -> float:
        return self.decode_j / self.decode_s if self.decode_s > 0 else 0.0

    def per_token(self, n_tokens: int) -> float | None:
        """Decoding's joules per output token (prefill apart); None without tokens."""
        return self.decode_j / n_tokens if n_tokens > 0 else None

    def net_of(self, idle_w: float) -> Energy:
        """The same readings with an idle baseline (W) attached: `to_dict` then adds the figures net of idle."""
        return Energy(self.prefill_j, self.prefill_s, self.decode_j, self.decode_s, self.counted, self.left_out, idle_w)

    def to_dict(self, n_tokens: int) -> dict[str, Any]:
        """For --json: joules (J), seconds, watts (W) and J per output token, rounded to what counters resolve."""
        r = lambda x, n=4: round(x, n) if x is not None else None  # noqa: E731
        d = {
            "available": True,
            "joules": r(self.joules),
            "prefill_joules": r(self.prefill_j),
            "decode_joules": r(self.decode_j),
            "seconds": r(self.seconds),
            "prefill_seconds": r(self.prefill_s),
            "decode_seconds": r(self.decode_s),
            "watts": r(self.watts, 3),
            "decode_watts": r(self.decode_watts, 3),
            "j_per_token": r(self.per_token(n_tokens), 6),
            "counted": list(self.counted),
            "left_out": list(self.left_out),
        }
        if self.idle_w is not None:
            net = self.decode_j - self.idle_w * self.decode_s
            d.update(
                idle_watts=r(self.idle_w, 3),
                decode_joules_net_of_idle=r(net),
                j_per_token_net_of_idle=r(net / n_tokens if n_tokens > 0 else None, 6),
            )
        return d


def unavailable_dict(note: str | None) -> dict[str, Any]:
    """For --json where there is no figure: why, and no number."""
    return {"available": False, "reason": note or "not measured"}


class Gauge:
    """One generation's energy, as the driver measures it: `Gauge(meter)` at the start, `prefill_done` at the prefill's
    record, `tick(t)` with each record's time (a reading only when one is due: no work per target pass otherwise),
    `end` at the Finish record or the stop. Three readings in all for a generation shorter than `Meter.interval_s`."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.span = Span(meter) if meter.available else None
        self._prefill: tuple[float, float] | None = None
        self._end: tuple[float, float] | None = None

    def prefill_done(self) -> None:
        if self.span is not None and self._prefill is None:
            self._prefill = self.span.mark()

    def tick(self, t: float) -> None:
        if self.span is not None and t >= self.span.due:
            self.span.mark()

    def end(self) -> None:
        if self.span is not None and self._end is None:
            self.prefill_done()  # stopped before the prefill's record: all of it is prefill
            self._end = self.span.mark()

    @property
    def energy(self) -> Energy | None:
        """The figures once `end` was called and every reading succeeded; else None (`note` says why)."""
        if self.span is None or self._end is None or self.span.error is not None:
            return None
        assert self._prefill is not None  # (`end` marks the prefill first)
        (pj, ps), (j, s) = self._prefill, self._end
        return Energy(
            prefill_j=pj,
            prefill_s=ps,
            decode_j=j - pj,
            decode_s=s - ps,
            counted=tuple(c.name for c in self.meter.counters),
            left_out=tuple(m.line() for m in self.meter.missing),
        )

    @property
    def note(self) -> str | None:
        """Why `energy` is None (None when it is not)."""
        if self.span is None:
            return self.meter.why_none()
        if self.span.error is not None:
            return f"energy not measured: {self.span.error}"
        return None if self._end is not None else "energy not measured: the generation has not ended"


def idle_watts(
    meter: Meter,
    seconds: float = IDLE_SECONDS,
    sleep: Callable[[float], None] | None = None,
    clock: Callable[[], float] | None = None,
) -> float | None:
    """The idle baseline: mean power (W) over `seconds` of sleeping, from the same counters; None without any (or on a
    read error)."""
    if not meter.available:
        return None
    sleep = sleep if sleep is not None else time.sleep
    clock = clock if clock is not None else time.perf_counter
    span = Span(meter, clock)
    end = span.t0 + seconds
    while (left := end - clock()) > 0:
        sleep(min(left, meter.interval_s))
        span.mark()
    j, s = span.mark()
    return j / s if span.error is None and s > 0 else None


# ---------------------------------------------------------------------------------------------------------------
# Discovery


def powercap_root(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(env.get(POWERCAP_ENV) or DEFAULT_POWERCAP)


def _uj_reader(path: Path) -> Callable[[], float]:
    def read() -> float:
        with open(path, "rb") as f:
            return int(f.read()) / 1e6

    return read


def rapl(root: Path) -> tuple[list[Counter], list[Missing]]:
    """The package domains of the powercap tree at `root` (never psys, never a subdomain)."""
    if not root.is_dir():
        return [], [
            Missing(
                "RAPL",
                f"{root} does not exist: this kernel exposes no RAPL counters (a virtual machine, "
                "a container without /sys/class/powercap, or not Linux)",
            )
        ]
    try:
        zones = sorted(
            (z for z in root.iterdir() if PACKAGE_ZONE.fullmatch(z.name)), key=lambda z: int(z.name.split(":")[1])
        )
    except OSError as e:
        return [], [Missing("RAPL", f"{root} cannot be listed: {e.strerror or e}")]
    counters, missing = [], []
    for zone in zones:
        try:
            name = (zone / "name").read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if not name.startswith("package"):
            continue  # psys holds the packages; dram and the rest sit beside them on some hosts: not summed
        energy = zone / "energy_uj"
        try:
            read = _uj_reader(energy)
            read()
            wrap_j = int((zone / "max_energy_range_uj").read_text(encoding="utf-8")) / 1e6
        except PermissionError:
            missing.append(
                Missing(
                    "RAPL",
                    f"permission denied reading {energy} (root-only since the CVE-2020-8694 fix)",
                    f"sudo chmod o+r {root}/intel-rapl:*/energy_uj until the next boot, or the udev rule in "
                    "docs/energy.md",
                )
            )
            return [], missing  # a partial package sum would be a figure for part of the machine
        except (OSError, ValueError) as e:
            missing.append(Missing("RAPL", f"{energy} cannot be read: {getattr(e, 'strerror', None) or e}"))
            return [], missing
        counters.append(Counter(f"RAPL {name}", "CPU socket", read, wrap_j if wrap_j > 0 else None))
    if not counters and not missing:
        missing.append(Missing("RAPL", f"{root} has no RAPL package domain (intel-rapl:N named package-N)"))
    return counters, missing


def _text(x: Any) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


def _nvml_joules(module: Any, handle: Any) -> float:
    """A GPU board's energy counter, in J (NVML counts mJ)."""
    return module.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3


def nvml(module: Any) -> tuple[list[Counter], list[Missing]]:
    """Every board NVML sees, through `module` (pynvml from nvidia-ml-py). A board without an energy counter (older
    than Volta) makes the GPU side unavailable: a sum over some of the boards llama.cpp may use would be a guess."""
    try:
        module.nvmlInit()
        n = module.nvmlDeviceGetCount()
    except Exception as e:
        return [], [Missing("NVML", f"NVML did not start: {e}", "check the NVIDIA driver with nvidia-smi")]
    counters = []
    for i in range(n):
        try:
            handle = module.nvmlDeviceGetHandleByIndex(i)
            name = _text(module.nvmlDeviceGetName(handle))
            module.nvmlDeviceGetTotalEnergyConsumption(handle)
        except Exception as e:
            return [], [Missing("NVML", f"GPU {i} has no energy counter ({e}; Volta and newer have one)")]
        counters.append(Counter(f"NVML GPU {i} ({name})", "GPU board", partial(_nvml_joules, module, handle)))
    if not counters:
        return [], [Missing("NVML", "NVML sees no GPU")]
    return counters, []


APPLE_CHANNELS = ("cpu_total_mj", "gpu_mj", "ane_mj", "dram_mj")  # the SoC's channels that do not nest


def apple(module: Any) -> tuple[list[Counter], list[Missing]]:
    """The SoC's energy through `module` (zeus_apple_silicon): CPU, GPU, ANE and DRAM channels summed."""
    try:
        monitor = module.AppleEnergyMonitor()
        first = monitor.get_cumulative_energy()
    except Exception as e:
        return [], [Missing("Apple Silicon", f"zeus-apple-silicon could not read IOReport: {e}")]
    channels = [c for c in APPLE_CHANNELS if getattr(first, c, None) is not None]
    if not channels:
        return [], [Missing("Apple Silicon", "IOReport reports no CPU, GPU, ANE or DRAM energy")]

    def read() -> float:
        m = monitor.get_cumulative_energy()
        return sum(getattr(m, c) or 0 for c in channels) / 1e3

    covers = ", ".join(c.split("_")[0].upper() for c in channels)
    return [Counter(f"Apple SoC ({covers})", "Apple SoC", read)], []


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception:  # not installed, or a broken install: the same for the meter
        return None


def _cuda_build() -> bool:
    """llama.cpp here is a CUDA build (checked only where llama_cpp is already imported: no model, no offload)."""
    if "llama_cpp" not in sys.modules:
        return False
    try:
        from specdec_cli.models.llama import system_info

        return "CUDA" in system_info()
    except Exception:
        return False


def _apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def discover(powercap: str | Path | None = None, *, nvml_module: Any = AUTO, apple_module: Any = AUTO) -> Meter:
    """Every counter this process can read, and why each source that applies cannot be.

    Args:
        powercap: the powercap tree (default: `SPECDEC_POWERCAP`, else /sys/class/powercap).
        nvml_module: pynvml (or a fake), None to leave NVML out; AUTO: imported where llama.cpp is a CUDA build.
        apple_module: zeus_apple_silicon (or a fake), None to leave it out; AUTO: imported on Apple Silicon.
    """
    counters: list[Counter] = []
    missing: list[Missing] = []
    root = Path(powercap) if powercap is not None else powercap_root()
    if sys.platform.startswith("linux") or powercap is not None or POWERCAP_ENV in os.environ:
        c, m = rapl(root)
        counters += c
        missing += m
    # the optional sources: the module given (AUTO: imported where the source applies), its reader, and what is
    # missing where it applies and its package is not installed
    optional = (
        (
            nvml_module,
            _cuda_build,
            "pynvml",
            nvml,
            Missing("NVML", "llama.cpp runs on an NVIDIA GPU and nvidia-ml-py is not installed", NVML_FIX),
        ),
        (
            apple_module,
            _apple_silicon,
            "zeus_apple_silicon",
            apple,
            Missing("Apple Silicon", "zeus-apple-silicon is not installed", APPLE_FIX),
        ),
    )
    for module, applies, name, read, not_installed in optional:
        if module is AUTO:
            module = None
            if applies():
                module = _import(name)
                if module is None:
                    missing.append(not_installed)
        if module is not None:
            c, m = read(module)
            counters += c
            missing += m
    return Meter(tuple(counters), tuple(missing))


_meters: dict[tuple[str, bool], Meter] = {}


def default_meter() -> Meter:
    """This process's meter, discovered once per powercap tree (`SPECDEC_POWERCAP`) and per whether llama.cpp is
    loaded yet; `SPECDEC_ENERGY=off` gives a meter with no counter."""
    if os.environ.get("SPECDEC_ENERGY", "").strip().lower() == "off":
        return Meter((), (Missing("energy", "turned off (SPECDEC_ENERGY=off)"),))
    key = (str(powercap_root()), "llama_cpp" in sys.modules)
    meter = _meters.get(key)
    if meter is None:
        meter = _meters[key] = discover()
    return meter
