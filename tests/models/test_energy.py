"""Energy per token from real counters or an honest "n/a" (issue 45, docs/energy.md), with fake counters only.

A fake powercap tree (SPECDEC_POWERCAP) laid out as the kernel lays out /sys/class/powercap: package domains with
core/uncore subdomains nested inside them and listed beside them, psys over everything, a wrapping counter; a fake
pynvml and a fake zeus_apple_silicon. The end-to-end test raises a fake package counter at a known wattage from a
background thread (wrapping once) while `specdec run --compare --json` runs on the fake backend.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fakes import FakeBackend, hashed_logits, wants_draft
from specdec_cli.__main__ import main
from specdec_cli.core.stats import RunStats
from specdec_cli.driver import Result
from specdec_cli.measure import bench as B
from specdec_cli.measure import tune as T
from specdec_cli.measure.comparison import energy_pairs
from specdec_cli.measure.paired import Pair, Paired
from specdec_cli.models import energy as E
from specdec_cli.session import Session

# ---- a fake powercap tree


def write_uj(path: Path, uj: int) -> None:
    """Replace a counter file at once (a reader sees the old value or the new one, never half a write)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{uj}\n", encoding="utf-8")
    os.replace(tmp, path)


def zone(path: Path, name: str, uj: int = 0, max_uj: int = 262_143_328_850) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "name").write_text(name + "\n", encoding="utf-8")
    write_uj(path / "energy_uj", uj)
    (path / "max_energy_range_uj").write_text(f"{max_uj}\n", encoding="utf-8")
    return path


def powercap_tree(root: Path, *, sockets: int = 1, max_uj: int = 262_143_328_850) -> dict[str, Path]:
    """The kernel's layout: intel-rapl:N (package-N) holding intel-rapl:N:0 (core) and intel-rapl:N:1 (uncore), the
    subdomains listed beside it too; intel-rapl:S (psys, over everything); intel-rapl-mmio:0 (the package again,
    through MMIO). Returns each zone's directory by name."""
    zones = {}
    for n in range(sockets):
        pkg = zones[f"package-{n}"] = zone(root / f"intel-rapl:{n}", f"package-{n}", max_uj=max_uj)
        for m, sub in enumerate(("core", "uncore")):
            zones[f"{sub}-{n}"] = zone(pkg / f"intel-rapl:{n}:{m}", sub, max_uj=max_uj)
            zone(root / f"intel-rapl:{n}:{m}", sub, max_uj=max_uj)  # as /sys/class/powercap lists them (links)
    zones["psys"] = zone(root / f"intel-rapl:{sockets}", "psys", max_uj=max_uj)
    zones["mmio"] = zone(root / "intel-rapl-mmio:0", "package-0", max_uj=max_uj)
    return zones


def advance(zones: dict[str, Path], joules: dict[str, float]) -> None:
    for name, j in joules.items():
        f = zones[name] / "energy_uj"
        top = int((zones[name] / "max_energy_range_uj").read_text())
        write_uj(f, (int(f.read_text()) + round(j * 1e6)) % top)


def test_only_the_package_domains_are_summed(tmp_path):
    """Two sockets: their packages add up; the core/uncore subdomains (inside them), psys (over them) and the MMIO
    copy of package-0 are never added."""
    zones = powercap_tree(tmp_path, sockets=2)
    meter = E.discover(tmp_path, nvml_module=None, apple_module=None)
    assert [c.name for c in meter.counters] == ["RAPL package-0", "RAPL package-1"]
    span = E.Span(meter)
    advance(
        zones,
        {
            "package-0": 30.0,
            "package-1": 20.0,
            "core-0": 18.0,
            "uncore-0": 5.0,
            "core-1": 12.0,
            "psys": 65.0,
            "mmio": 30.0,
        },
    )
    joules, _ = span.mark()
    assert joules == pytest.approx(50.0)


def test_a_wrapping_counter_is_counted_across_its_wrap(tmp_path):
    """package-0 wraps at 100 J: from 95 J, 12 J later it reads 7 J; the span counts 12 J, then 3 J more."""
    zones = powercap_tree(tmp_path, max_uj=100_000_000)
    write_uj(zones["package-0"] / "energy_uj", 95_000_000)
    meter = E.discover(tmp_path, nvml_module=None, apple_module=None)
    assert meter.counters[0].wrap_j == 100.0 and meter.interval_s == pytest.approx(100.0 / E.MAX_WATTS)
    span = E.Span(meter)
    advance(zones, {"package-0": 12.0})
    assert int((zones["package-0"] / "energy_uj").read_text()) == 7_000_000
    assert span.mark()[0] == pytest.approx(12.0)
    advance(zones, {"package-0": 3.0})
    assert span.mark()[0] == pytest.approx(15.0)


def test_no_powercap_tree_is_absent_with_no_number(tmp_path):
    meter = E.discover(tmp_path / "none", nvml_module=None, apple_module=None)
    assert meter.counters == () and not meter.available
    assert [m.source for m in meter.missing] == ["RAPL"] and "does not exist" in meter.missing[0].reason
    gauge = E.Gauge(meter)
    gauge.prefill_done()
    gauge.tick(time.perf_counter())
    gauge.end()
    assert gauge.energy is None and "RAPL" in gauge.note and "does not exist" in gauge.note


def test_a_root_only_counter_says_permission_denied_and_the_fix(tmp_path, monkeypatch):
    """Root-only energy_uj (the CVE-2020-8694 fix): no counter, the reason and the chmod that opens it. Tests run as
    root here, so the denial is the reader's `open` raising what the kernel raises for a user."""
    powercap_tree(tmp_path)
    real_open = open

    def denied(path, *args, **kwargs):
        if str(path).endswith("energy_uj"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(E, "open", denied, raising=False)
    meter = E.discover(tmp_path, nvml_module=None, apple_module=None)
    assert meter.counters == ()
    (m,) = meter.missing
    assert "permission denied" in m.reason and "CVE-2020-8694" in m.reason
    assert m.fix.startswith(f"sudo chmod o+r {tmp_path}/intel-rapl:*/energy_uj")
    assert "permission denied" in meter.why_none()


def test_a_tree_without_packages_has_no_counter(tmp_path):
    zone(tmp_path / "intel-rapl:0", "psys")
    meter = E.discover(tmp_path, nvml_module=None, apple_module=None)
    assert meter.counters == () and "no RAPL package domain" in meter.missing[0].reason


# ---- the gauge: three readings per generation, prefill apart


class CountingCounter:
    """A counter at `watts` on a scripted clock; counts its reads."""

    def __init__(self, clock, watts: float, wrap_j: float | None = None) -> None:
        self.clock, self.watts, self.wrap_j, self.reads = clock, watts, wrap_j, 0

    def read(self) -> float:
        self.reads += 1
        j = self.clock() * self.watts
        return j % self.wrap_j if self.wrap_j else j


def test_the_gauge_reads_at_start_prefill_and_end_only(monkeypatch):
    """200 records of a generation shorter than the counters' interval: 3 readings, no work per target pass; 10 W
    for 0.5 s of prefill and 2 s of decoding."""
    now = [100.0]
    monkeypatch.setattr(E.time, "perf_counter", lambda: now[0])
    c = CountingCounter(lambda: now[0], 10.0)
    meter = E.Meter((E.Counter("fake", "CPU socket", c.read),))
    gauge = E.Gauge(meter)
    now[0] += 0.5
    gauge.prefill_done()
    for _ in range(200):
        now[0] += 0.01
        gauge.tick(now[0])
    gauge.end()
    assert c.reads == 3
    e = gauge.energy
    assert (e.prefill_j, e.prefill_s, e.decode_j, e.decode_s) == pytest.approx((5.0, 0.5, 20.0, 2.0))
    assert e.watts == pytest.approx(10.0) and e.per_token(40) == pytest.approx(0.5)


def test_the_gauge_reads_again_before_a_counter_can_wrap_twice(monkeypatch):
    """A counter wrapping every 2 J at 500 W (every 4 ms): read at least every 2 J / MAX_WATTS, so 5 s of decoding
    counts 2,500 J, not what is left after many wraps."""
    now = [0.0]
    monkeypatch.setattr(E.time, "perf_counter", lambda: now[0])
    c = CountingCounter(lambda: now[0], 500.0, wrap_j=2.0)
    gauge = E.Gauge(E.Meter((E.Counter("fake", "CPU socket", c.read, 2.0),)))
    gauge.prefill_done()
    while now[0] < 5.0:
        now[0] += 0.001
        gauge.tick(now[0])
    gauge.end()
    assert gauge.energy.decode_j == pytest.approx(2500.0, rel=1e-3)


def test_a_counter_that_goes_back_gives_no_figure():
    """A counter that does not wrap (NVML) going back (a driver reload) invents nothing: no energy, and why."""
    values = iter([10.0, 12.0, 3.0])
    gauge = E.Gauge(E.Meter((E.Counter("NVML GPU 0", "GPU board", lambda: next(values)),)))
    gauge.prefill_done()
    gauge.end()
    assert gauge.energy is None and "went back" in gauge.note


def test_a_read_error_mid_run_gives_no_figure():
    def broken():
        raise OSError(5, "Input/output error")

    values = [lambda: 1.0, broken]
    gauge = E.Gauge(E.Meter((E.Counter("RAPL package-0", "CPU socket", lambda: values[0]()),)))
    values.pop(0)
    gauge.end()
    assert gauge.energy is None and "Input/output error" in gauge.note


# ---- NVML and Apple Silicon, faked


class FakeNVMLError(Exception):
    pass


def fake_pynvml(boards_mj: list[list[float] | None]) -> SimpleNamespace:
    """pynvml with one board per entry: its successive total-energy readings (mJ), or None for a board without an
    energy counter (older than Volta: NVML_ERROR_NOT_SUPPORTED)."""
    its = [iter(b) if b is not None else None for b in boards_mj]

    def energy(h):
        if its[h] is None:
            raise FakeNVMLError("Not Supported")
        return next(its[h])

    return SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: len(its),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: f"NVIDIA Fake {h}".encode(),
        nvmlDeviceGetTotalEnergyConsumption=energy,
    )


def test_nvml_boards_add_to_the_package(tmp_path):
    """CPU package + two GPU boards (they do not nest): 40 J + 15 J + 25 J, NVML's mJ read as J."""
    zones = powercap_tree(tmp_path)
    nvml = fake_pynvml([[1_000.0, 1_000.0, 16_000.0], [500.0, 500.0, 25_500.0]])  # a test read at discovery
    meter = E.discover(tmp_path, nvml_module=nvml, apple_module=None)
    assert [c.name for c in meter.counters] == [
        "RAPL package-0",
        "NVML GPU 0 (NVIDIA Fake 0)",
        "NVML GPU 1 (NVIDIA Fake 1)",
    ]
    assert [c.covers for c in meter.counters] == ["CPU socket", "GPU board", "GPU board"]
    span = E.Span(meter)
    advance(zones, {"package-0": 40.0, "core-0": 30.0, "psys": 90.0})
    assert span.mark()[0] == pytest.approx(80.0)


def test_a_board_without_an_energy_counter_leaves_the_gpu_out_and_says_so(tmp_path):
    powercap_tree(tmp_path)
    meter = E.discover(tmp_path, nvml_module=fake_pynvml([[1.0, 2.0], None]), apple_module=None)
    assert [c.name for c in meter.counters] == ["RAPL package-0"]
    assert meter.missing[0].source == "NVML" and "no energy counter" in meter.missing[0].reason
    gauge = E.Gauge(meter)
    gauge.end()
    assert gauge.energy.left_out and "NVML" in gauge.energy.left_out[0]


def test_nvml_is_asked_only_for_a_cuda_build(monkeypatch, tmp_path):
    monkeypatch.setattr(E, "_cuda_build", lambda: False)
    monkeypatch.setattr(E, "_import", lambda name: pytest.fail(f"imported {name}"))
    monkeypatch.setattr(E, "_apple_silicon", lambda: False)
    assert E.discover(tmp_path / "none").missing[0].source == "RAPL"
    monkeypatch.setattr(E, "_cuda_build", lambda: True)
    monkeypatch.setattr(E, "_import", lambda name: None)  # nvidia-ml-py not installed
    missing = E.discover(tmp_path / "none").missing
    assert [m.source for m in missing] == ["RAPL", "NVML"]
    assert missing[1].fix == E.NVML_FIX and "pip install nvidia-ml-py" in E.NVML_FIX  # a name PyPI has


class FakeAppleMonitor:
    """zeus_apple_silicon.AppleEnergyMonitor: cumulative mJ per channel, each reading `step` mJ more per channel; the
    per-core and per-cluster channels sum to the CPU's (they nest in it); DRAM unavailable (None) as on some M1s."""

    def __init__(self) -> None:
        self.n = 0

    def get_cumulative_energy(self):
        self.n += 1
        cpu = 1_000 * self.n
        return SimpleNamespace(
            cpu_total_mj=cpu,
            efficiency_cores_mj=[cpu // 4, cpu // 4],
            performance_cores_mj=[cpu // 4, cpu // 4],
            efficiency_core_manager_mj=cpu // 10,
            performance_core_manager_mj=cpu // 10,
            gpu_mj=3_000 * self.n,
            gpu_sram_mj=100 * self.n,
            ane_mj=500 * self.n,
            dram_mj=None,
        )


def test_apple_silicon_sums_cpu_gpu_and_ane_but_not_the_cores_inside_the_cpu():
    meter = E.discover(
        nvml_module=None, apple_module=SimpleNamespace(AppleEnergyMonitor=FakeAppleMonitor), powercap="/nonexistent"
    )
    meter = E.Meter(meter.counters)  # RAPL's "absent" aside
    (c,) = meter.counters
    assert c.name == "Apple SoC (CPU, GPU, ANE)" and c.wrap_j is None
    span = E.Span(meter)
    assert span.mark()[0] == pytest.approx(4.5)  # (1,000 + 3,000 + 500) mJ per reading


def test_apple_silicon_without_zeus_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(E, "_apple_silicon", lambda: True)
    monkeypatch.setattr(E, "_import", lambda name: None)
    monkeypatch.setattr(E.sys, "platform", "darwin")
    (m,) = [m for m in E.discover(nvml_module=None).missing if m.source != "RAPL"]
    assert m.source == "Apple Silicon" and m.fix == E.APPLE_FIX and "pip install zeus-apple-silicon" in E.APPLE_FIX


# ---- what the commands report


def test_stats_without_a_counter_carry_the_reason_and_no_number():
    d = RunStats(n_generated=10, energy_note="no energy counter: RAPL: absent").to_dict()
    assert d["energy"] == {"available": False, "reason": "no energy counter: RAPL: absent"}
    assert "energy_note" not in d


def result(decode_j: float | None, n: int) -> Result:
    e = E.Energy(0.1, 0.01, decode_j, 1.0, ("fake",)) if decode_j is not None else None
    return Result("", [0] * n, RunStats(n_generated=n, energy=e, energy_note=None if e else "no counter"), [])


def test_compare_pairs_energy_per_token_as_it_pairs_the_rates():
    """Speculative 6 J for 20 tokens against plain 10 J for 20: 0.6× per pair; one pair without a figure: none."""
    paired = Paired(
        (Pair(30.0, 10.0, True), Pair(28.0, 10.0, False)),
        (result(6.0, 20), result(9.0, 20)),
        (result(10.0, 20), result(10.0, 20)),
    )
    e = energy_pairs(paired)
    assert e.ratios == pytest.approx([0.6, 0.9]) and [p.a_first for p in e.pairs] == [True, False]
    assert e.a_median == pytest.approx(0.375) and e.b_median == pytest.approx(0.5)
    assert energy_pairs(Paired(paired.pairs, paired.a_results, (result(10.0, 20), result(None, 20)))) is None
    assert energy_pairs(Paired(paired.pairs, paired.a_results, (result(10.0, 20), result(0.0, 20)))) is None


def test_tune_and_bench_pool_joules_over_tokens_or_say_why_not():
    runs = [
        T.Measurement("4", "p", r, 10.0, n, 0, 0, 0, 0.0, {}, 1.0, 1.0, 0, "length", decode_j=j)
        for r, (n, j) in enumerate([(20, 4.0), (30, 11.0)])
    ]
    (s,) = T.summarize(runs, [T.TuneConfig("4")], ["p"])
    assert s.j_per_token == pytest.approx(15.0 / 50) and s.to_dict()["j_per_token"] == pytest.approx(0.3)
    runs[1].decode_j, runs[1].energy_note = None, "no energy counter: RAPL: absent"
    (s,) = T.summarize(runs, [T.TuneConfig("4")], ["p"])
    assert s.j_per_token is None and s.energy_note == "no energy counter: RAPL: absent"
    base = {"config": "none", "prompt": "p", "cold": False, "tokens_per_s": 10.0, "tokens": [1]}
    docs = [dict(base, repeat=0, n_tokens=20, decode_joules=4.0), dict(base, repeat=1, n_tokens=30, decode_joules=11.0)]
    (b,) = B.summarize(docs, [B.BenchConfig("none", "ours", method="none")], [("p", "code")])
    assert b.j_per_token == pytest.approx(0.3) and b.to_dict()["j_per_token"] == pytest.approx(0.3)
    docs[1] = dict(docs[1], decode_joules=None, energy_note="no energy counter: RAPL: absent")
    (b,) = B.summarize(docs, [B.BenchConfig("none", "ours", method="none")], [("p", "code")])
    assert b.j_per_token is None and b.energy_note == "no energy counter: RAPL: absent"


def test_the_table_cells_show_a_figure_or_n_a():
    from specdec_cli.cli.tables import energy_cell

    assert energy_cell(0.25312).plain == "0.253" and energy_cell(None).plain == "n/a"


# ---- specdec run --compare --json end to end, on the fake backend


class PacedBackend(FakeBackend):
    """The fake target, each pass taking `PASS_S` of wall time (the counter's thread runs meanwhile); `hooks` are
    called (once) at its first pass: the shown run's prefill."""

    PASS_S = 0.005

    def __init__(self, *args, hooks: list | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hooks = hooks if hooks is not None else []

    def _pass(self, b: int) -> None:
        while self.hooks:
            self.hooks.pop()()
        time.sleep(self.PASS_S)
        super()._pass(b)


class PowerThread(threading.Thread):
    """Raises package-0 at `watts` from `go` on (and core-0 inside it at 60 % of that, psys at 1.5×: neither to be
    added), every 0.5 ms; the counter starts 30 ms short of its range, so it wraps once, 30 ms into the shown run."""

    def __init__(self, zones: dict[str, Path], watts: float, max_uj: int) -> None:
        super().__init__(daemon=True)
        self.zones, self.watts, self.max_uj = zones, watts, max_uj
        self.start_uj = max_uj - round(watts * 0.030 * 1e6)
        write_uj(zones["package-0"] / "energy_uj", self.start_uj)
        self.go, self.stop, self.wrapped = threading.Event(), threading.Event(), False
        self.t0 = 0.0

    def begin(self) -> None:
        """Start the counter rising now (the thread catches up from this moment, however late it wakes)."""
        self.t0 = time.perf_counter()
        self.go.set()

    def run(self) -> None:
        self.go.wait()
        while not self.stop.is_set():
            uj = self.watts * (time.perf_counter() - self.t0) * 1e6
            total = self.start_uj + round(uj)
            self.wrapped |= total >= self.max_uj
            write_uj(self.zones["package-0"] / "energy_uj", total % self.max_uj)
            write_uj(self.zones["core-0"] / "energy_uj", round(0.6 * uj) % self.max_uj)
            write_uj(self.zones["psys"] / "energy_uj", round(1.5 * uj) % self.max_uj)
            time.sleep(0.0005)


@pytest.fixture
def slow_session(monkeypatch, tmp_path):
    started = []

    def open_session(options, *, method=None, need_draft=False, reporter=None):
        s = Session(
            target=PacedBackend(hashed_logits, n_ctx=options.ctx, hooks=started),
            target_path=tmp_path / "target.gguf",
            options=options,
        )
        if wants_draft(options, method, need_draft):
            s.draft = FakeBackend(hashed_logits, n_ctx=options.ctx)
            s.draft_path = tmp_path / "draft.gguf"
        return s

    monkeypatch.setattr("specdec_cli.cli.commands.run.open_session", open_session)
    monkeypatch.setattr("specdec_cli.models.llama.system_info", lambda: "fake")
    return started


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text("w5 w9 w3 w17 w4 w22 w8", encoding="utf-8")
    return p


WATTS = 25.0


def test_run_compare_reports_the_counters_wattage_and_joules_for_both_arms(
    slow_session, prompt_file, tmp_path, monkeypatch, capsys
):
    root = tmp_path / "powercap"
    max_uj = round(WATTS * 20 * 1e6)  # one wrap every 20 s: once in this test
    zones = powercap_tree(root, max_uj=max_uj)
    monkeypatch.setenv(E.POWERCAP_ENV, str(root))
    power = PowerThread(zones, WATTS, max_uj)
    power.start()
    slow_session.append(power.begin)  # the counter starts rising at the shown run's prefill
    try:
        code = main(
            ["run", str(prompt_file), "--method", "ngram", "--k", "3", "-n", "60", "--compare", "2", "--json", "-"]
        )
    finally:
        power.stop.set()
        power.join()
    out, err = capsys.readouterr()
    assert code == 0, err
    assert power.wrapped
    doc = json.loads(out)
    assert doc["stats"]["decode_ms"] > 2 * 30  # the wrap came inside the shown run
    e = doc["stats"]["energy"]
    assert e["available"] and e["counted"] == ["RAPL package-0"]
    assert e["watts"] == pytest.approx(WATTS, rel=0.2)
    assert e["decode_watts"] == pytest.approx(WATTS, rel=0.2)
    assert e["joules"] == pytest.approx(e["prefill_joules"] + e["decode_joules"], abs=1e-3)
    n = doc["stats"]["n_generated"]
    assert n == 60 and e["j_per_token"] == pytest.approx(e["decode_joules"] / n, rel=1e-3)
    c = doc["compare"]["energy"]
    assert c["available"] and len(c["speculative_decode_joules"]) == len(c["plain_decode_joules"]) == 2
    assert all(j > 0 for j in c["speculative_decode_joules"] + c["plain_decode_joules"])
    for pair, js, jp in zip(c["each_pair"], c["speculative_decode_joules"], c["plain_decode_joules"], strict=True):
        assert pair["speculative_j_per_token"] == pytest.approx(js / doc["compare"]["n_speculative"], rel=1e-3)
        assert pair["plain_j_per_token"] == pytest.approx(jp / doc["compare"]["n_plain"], rel=1e-3)
        assert pair["ratio"] == pytest.approx(pair["speculative_j_per_token"] / pair["plain_j_per_token"])
    assert c["ratio_min"] <= c["ratio"] <= c["ratio_max"]
    assert "J per output token" in err and "W mean" in err and "the energy per token" in err


def test_run_without_any_counter_exits_0_and_says_why_with_no_number(
    slow_session, prompt_file, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(E.POWERCAP_ENV, str(tmp_path / "no-powercap"))
    code = main(["run", str(prompt_file), "--method", "ngram", "-n", "8", "--compare", "1", "--json", "-"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    reason = f"no energy counter: RAPL: {tmp_path / 'no-powercap'} does not exist"
    for e in (doc["stats"]["energy"], doc["compare"]["energy"], doc["compare"]["plain_stats"]["energy"]):
        assert e["available"] is False and e["reason"].startswith(reason) and set(e) == {"available", "reason"}
    screen = " ".join(err.split())
    assert screen.count("energy n/a: no energy counter: RAPL:") == 2 and screen.count("does not exist") == 2
    assert "J per output token" not in err and " W mean" not in err and "J/token" not in err


def test_idle_baseline_gives_the_figure_net_of_idle(monkeypatch):
    """5 W idle for 1 s measured first; decoding at 25 W for 2 s, 40 tokens: 1.25 J/token, 1.0 net of idle."""
    now = [0.0]
    monkeypatch.setattr(E.time, "perf_counter", lambda: now[0])
    watts = [5.0]
    joules = [0.0]

    def sleep(s):
        joules[0] += watts[0] * s
        now[0] += s

    meter = E.Meter((E.Counter("fake", "CPU socket", lambda: joules[0]),))
    idle = E.idle_watts(meter, 1.0, sleep=sleep, clock=lambda: now[0])
    assert idle == pytest.approx(5.0)
    e = E.Energy(0.0, 0.0, 50.0, 2.0, ("fake",)).net_of(idle).to_dict(40)
    assert e["j_per_token"] == pytest.approx(1.25) and e["j_per_token_net_of_idle"] == pytest.approx(1.0)
    assert E.idle_watts(E.Meter()) is None


def test_doctor_lists_the_counters_it_can_read(tmp_path, monkeypatch):
    from specdec_cli.cli.commands.doctor import energy_report

    powercap_tree(tmp_path / "pc", sockets=2)
    monkeypatch.setenv(E.POWERCAP_ENV, str(tmp_path / "pc"))
    monkeypatch.setattr(E, "_cuda_build", lambda: False)
    monkeypatch.setattr(E, "_apple_silicon", lambda: False)
    r = energy_report()
    assert [c["name"] for c in r["counters"]] == ["RAPL package-0", "RAPL package-1"] and r["missing"] == []
    monkeypatch.setenv(E.POWERCAP_ENV, str(tmp_path / "none"))
    r = energy_report()
    assert r["counters"] == [] and r["missing"][0]["source"] == "RAPL"


def test_run_idle_baseline_measures_idle_first_and_nets_it_out(
    slow_session, prompt_file, tmp_path, monkeypatch, capsys
):
    """The counter rises at 25 W throughout: the idle second reads 25 W, and decoding net of it is about nothing."""
    root = tmp_path / "powercap"
    max_uj = round(WATTS * 20 * 1e6)
    zones = powercap_tree(root, max_uj=max_uj)
    monkeypatch.setenv(E.POWERCAP_ENV, str(root))
    power = PowerThread(zones, WATTS, max_uj)
    power.start()
    power.begin()
    try:
        code = main(["run", str(prompt_file), "--method", "ngram", "-n", "20", "--idle-baseline", "--json", "-"])
    finally:
        power.stop.set()
        power.join()
    out, err = capsys.readouterr()
    assert code == 0, err
    e = json.loads(out)["stats"]["energy"]
    assert e["idle_watts"] == pytest.approx(WATTS, rel=0.2)
    assert e["decode_joules_net_of_idle"] == pytest.approx(
        e["decode_joules"] - e["idle_watts"] * e["decode_seconds"], abs=2e-3
    )
    assert e["j_per_token_net_of_idle"] == pytest.approx(e["decode_joules_net_of_idle"] / 20, abs=1e-4)
    assert "net of idle" in err


def test_the_server_and_chat_carry_j_per_token_only_where_counted():
    from specdec_cli.cli.commands.chat_history import Turn
    from specdec_cli.cli.commands.chat_view import footer_text
    from specdec_cli.server.reply import RequestStats

    counted = RunStats(n_generated=20, energy=E.Energy(1.0, 0.1, 5.0, 1.0, ("RAPL package-0",)))
    none = RunStats(n_generated=20, energy_note="no energy counter: RAPL: absent")
    assert RequestStats(counted).specdec("ngram")["j_per_token"] == pytest.approx(0.25)
    assert RequestStats(none).specdec("ngram")["j_per_token"] is None
    assert "0.25 J/token" in footer_text(Turn("hi", "hello", stats=counted, method="none"))
    assert "J/token" not in footer_text(Turn("hi", "hello", stats=none, method="none"))
