"""The AMX guard (`specdec_cli.models.host`) and `specdec doctor`, with made-up llama.cpp system-info strings.

llama.cpp builds with AMX kernels crash on the first decode on Intel CPUs with AMX (llama.cpp issue 20824). These
tests drive the decision without such a CPU: the system info, the probe's verdict and the environment are fakes.
"""

from __future__ import annotations

import json
import re
import subprocess
import warnings

import pytest
from typer.testing import CliRunner

from specdec_cli.errors import ModelError, UsageError
from specdec_cli.models import host

NO_AMX = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | REPACK = 1 |"
)
AMX = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | "
    "AMX_INT8 = 1 | LLAMAFILE = 1 | REPACK = 1 |"
)


def never() -> str:
    raise AssertionError("the probe must not run here")


@pytest.fixture
def fresh_plan(monkeypatch, tmp_path):
    """No plan decided yet in this process, the verdict file in a tmp dir, SPECDEC_AMX unset."""
    monkeypatch.setattr(host, "_host_file", lambda: tmp_path / "host.json")
    monkeypatch.delenv(host.ENV, raising=False)
    host._reset_for_tests()
    yield
    host._reset_for_tests()


def test_amx_build_is_read_from_system_info():
    assert host.amx_build(AMX)
    assert not host.amx_build(NO_AMX)
    assert not host.amx_build(AMX.replace("AMX_INT8 = 1", "AMX_INT8 = 0"))


def test_cpu_has_amx_reads_cpuinfo_flags():
    assert host.cpu_has_amx("flags\t\t: fpu sse avx2 amx_bf16 amx_tile amx_int8\n")
    assert not host.cpu_has_amx("flags\t\t: fpu sse avx2 avx512f\n")


def test_no_amx_build_loads_as_built_without_probing():
    plan = host.decide(NO_AMX, "auto", never)
    assert plan.extra_bufts and not plan.amx_build and plan.verdict is None
    assert host.warning_for(plan) is None


@pytest.mark.parametrize("verdict", ["crash: SIGSEGV", "no verdict: the trial decode took over 180 s"])
def test_amx_build_whose_probe_fails_loads_without_extra_buffer_types(verdict):
    plan = host.decide(AMX, "auto", lambda: verdict)
    assert not plan.extra_bufts and plan.amx_build and plan.verdict == verdict
    assert plan.path == "extra buffer types off"
    message = host.warning_for(plan)
    assert "20824" in message and "1.7x slower" in message and "specdec install-llama-cpp" in message
    assert "-mno-amx-tile" in message and "\n" not in message  # one line, with the rebuild command


def test_amx_build_whose_probe_passes_loads_as_built():
    plan = host.decide(AMX, "auto", lambda: "ok")
    assert plan.extra_bufts and plan.verdict == "ok" and host.warning_for(plan) is None


def test_settings_force_either_choice_without_probing():
    assert host.decide(AMX, "keep", never).extra_bufts
    off = host.decide(AMX, "off", never)
    assert not off.extra_bufts and "SPECDEC_AMX=off" in host.warning_for(off)


def test_setting_reads_the_environment():
    assert host.setting({}) == "auto"
    assert host.setting({host.ENV: " OFF "}) == "off"
    with pytest.raises(UsageError, match="SPECDEC_AMX=auto, keep or off"):
        host.setting({host.ENV: "maybe"})


def test_plan_probes_once_per_build_and_cpu_and_warns_once(monkeypatch, fresh_plan):
    import specdec_cli.models.llama as llama

    calls = []
    monkeypatch.setattr(llama, "system_info", lambda: AMX)
    monkeypatch.setattr(
        host, "probe_child", lambda path, threads: calls.append((str(path), threads)) or "crash: SIGSEGV"
    )
    with pytest.warns(host.HostWarning, match="issue 20824"):
        plan = host.plan("m.gguf", n_threads=2, system_info=AMX)
    assert not plan.extra_bufts and calls == [("m.gguf", 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the decided plan is reused: no second warning, no second probe
        assert host.plan("other.gguf", n_threads=2, system_info=AMX) is plan
    assert host.current_plan() is plan
    host._reset_for_tests()  # a new process: the verdict is remembered on disk
    with pytest.warns(host.HostWarning):
        assert not host.plan("m.gguf", n_threads=2, system_info=AMX).extra_bufts
    assert len(calls) == 1


def test_plan_does_not_remember_a_probe_without_verdict(monkeypatch, fresh_plan):
    import specdec_cli.models.llama as llama

    calls = []
    monkeypatch.setattr(llama, "system_info", lambda: AMX)
    monkeypatch.setattr(host, "probe_child", lambda path, threads: calls.append(1) or "no verdict: timeout")
    with pytest.warns(host.HostWarning):
        host.plan("m.gguf", n_threads=2, system_info=AMX)
    host._reset_for_tests()
    with pytest.warns(host.HostWarning):
        host.plan("m.gguf", n_threads=2, system_info=AMX)
    assert len(calls) == 2


@pytest.mark.parametrize(
    "returncode, verdict",
    [(0, "ok"), (-11, "crash: SIGSEGV"), (-6, "crash: SIGABRT"), (3, "no verdict: the trial decode exited with 3")],
)
def test_probe_child_maps_the_child_exit(monkeypatch, tmp_path, returncode, verdict):
    seen = {}

    def fake_run(command, **kw):
        seen["command"] = command
        return subprocess.CompletedProcess(command, returncode, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert host.probe_child(tmp_path / "m.gguf", 4) == verdict
    assert seen["command"][-2:] == [str(tmp_path / "m.gguf"), "4"]  # loaded as built, with the real thread count


@pytest.mark.parametrize(
    "returncode, verdict",
    [
        (0xC0000005, "crash: STATUS_ACCESS_VIOLATION (0xC0000005)"),  # as subprocess gives it on Windows: unsigned
        (0xC0000005 - 2**32, "crash: STATUS_ACCESS_VIOLATION (0xC0000005)"),  # the same read as a signed int32
        (0xC000001D, "crash: STATUS_ILLEGAL_INSTRUCTION (0xC000001D)"),  # an AMX kernel on a CPU without it
        (0xC0000409, "crash: STATUS_STACK_BUFFER_OVERRUN (0xC0000409)"),  # abort() in a release build (fail fast)
        (0xC0000135 - 2**32, "crash: NTSTATUS (0xC0000135)"),  # any other error-severity code
        (0x40010004, "no verdict: the trial decode exited with 1073807364"),
    ],
)  # not an error: no crash
def test_a_windows_exception_exit_is_a_crash_like_a_signal(monkeypatch, tmp_path, returncode, verdict):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))  # probed.json stays here
    monkeypatch.setattr(
        subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(command, returncode, "", "fault\n")
    )
    assert host.probe_child(tmp_path / "m.gguf", 4) == verdict
    model = tmp_path / "user.gguf"
    model.write_bytes(b"GGUF")
    if verdict.startswith("crash"):  # a trial load that died the same way refuses the file, as a signal does
        with pytest.raises(ModelError, match=rf"llama.cpp crashed \({re.escape(verdict[7:])}\) on a trial load"):
            host.probe_load(model)
    else:
        host.probe_load(model)  # no verdict on the file: the real load goes ahead


def test_probe_child_timeout_is_no_verdict(monkeypatch, tmp_path):
    def slow(command, **kw):
        raise subprocess.TimeoutExpired(command, 1)

    monkeypatch.setattr(subprocess, "run", slow)
    assert host.probe_child(tmp_path / "m.gguf", 2).startswith("no verdict")


def test_doctor_json_shows_the_guard_decision(monkeypatch, fresh_plan):
    import specdec_cli.models.llama as llama
    from specdec_cli.cli.app import app

    monkeypatch.setattr(llama, "system_info", lambda: AMX)
    monkeypatch.setenv(host.ENV, "off")
    result = CliRunner().invoke(app, ["doctor", "--json", "-"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["amx"]["build_has_amx"] is True and doc["amx"]["setting"] == "off"
    assert doc["amx"]["load_path"] == "extra buffer types off"
    assert doc["system_info"] == AMX and doc["llama_cpp_python"]


def test_doctor_table_names_every_fact(monkeypatch, fresh_plan):
    import specdec_cli.models.llama as llama
    from specdec_cli.cli.app import app

    monkeypatch.setattr(llama, "system_info", lambda: NO_AMX)
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    for label in (
        "llama-cpp-python",
        "GPU offload",
        "threads",
        "AMX in the CPU",
        "AMX kernels in llama.cpp",
        "models load",
        "as built",
    ):
        assert label in result.stdout


def test_bad_setting_is_one_line_exit_2(monkeypatch, fresh_plan):
    from specdec_cli.__main__ import main

    monkeypatch.setenv(host.ENV, "sometimes")
    assert main(["doctor"]) == 2


@pytest.mark.real
def test_backend_loads_with_extra_buffer_types_off(smollm2_path):
    from specdec_cli.models.llama import LlamaBackend

    for extra in (False, True):
        backend = LlamaBackend(smollm2_path, n_ctx=128, n_batch=64, n_threads=2, extra_bufts=extra)
        try:
            assert backend.extra_bufts is extra
            toks = backend.tokenize("def f(x):", add_special=True)
            logits = backend.decode(toks, n_logits=1)
            assert logits.shape == (1, backend.n_vocab)
        finally:
            backend.close()


@pytest.mark.real
def test_backend_follows_the_host_plan(monkeypatch, fresh_plan, smollm2_path):
    from specdec_cli.models.llama import LlamaBackend

    monkeypatch.setenv(host.ENV, "off")
    import specdec_cli.models.llama as llama

    monkeypatch.setattr(llama, "system_info", lambda: AMX)
    with pytest.warns(host.HostWarning):
        backend = LlamaBackend(smollm2_path, n_ctx=128, n_batch=64, n_threads=2)
    try:
        assert backend.extra_bufts is False
    finally:
        backend.close()


def test_tune_records_the_load_path_and_keys_the_slow_path_apart(monkeypatch, fresh_plan):
    import specdec_cli.models.llama as llama
    from specdec_cli.stores import tuned

    monkeypatch.setattr(llama, "system_info", lambda: AMX)
    monkeypatch.setenv(host.ENV, "off")
    as_built = tuned.machine(2)
    assert as_built["load_plan"] is None  # nothing loaded yet in this process
    with pytest.warns(host.HostWarning):
        host.plan("m.gguf", n_threads=2, system_info=AMX)
    slow = tuned.machine(2)
    assert slow["load_plan"]["path"] == "extra buffer types off"
    assert slow["key"] == as_built["key"] + "|extra-bufts-off"


# --------------------------------------------------------------------------------------------------------------------
# One verdict per build: a stock and a patched llama-cpp-python on one machine share the cache, never a verdict


def fake_build(root, name: str, payload: bytes):
    """A llama-cpp-python build's library folder: the files llama-cpp-python loads (`LLAMA_CPP_LIB_PATH`)."""
    lib = root / name / "lib"
    lib.mkdir(parents=True)
    (lib / "libllama.so").write_bytes(b"\x7fELF llama " + payload)
    (lib / "libggml-cpu.so").write_bytes(b"\x7fELF ggml-cpu " + payload)
    return lib


@pytest.mark.parametrize("first, second", [("patched", "stock"), ("stock", "patched")])
def test_two_builds_sharing_one_cache_each_get_their_own_verdict(monkeypatch, fresh_plan, tmp_path, first, second):
    """Same llama-cpp-python version, system info and CPU; only the library files differ (stock AMX kernels crash,
    the patched ones run). Each build is probed once and loads at its own speed, in either order."""
    builds = {
        "patched": fake_build(tmp_path, "patched", b"with the tile barrier"),
        "stock": fake_build(tmp_path, "stock", b"without it"),
    }
    verdicts = {"patched": "ok", "stock": "crash: SIGILL"}
    probed = []

    def use(build):
        monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(builds[build]))
        monkeypatch.setattr(host, "probe_child", lambda path, threads: probed.append(build) or verdicts[build])
        host._reset_for_tests()  # a new process
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", host.HostWarning)
            return host.plan("m.gguf", n_threads=2, system_info=AMX)

    for build in (first, second, first, second):
        plan = use(build)
        # the patched build keeps its AMX kernels, the stock one never crashes
        assert plan.extra_bufts is (build == "patched"), (build, plan)
        assert host.known_verdict(AMX) == verdicts[build]
    assert probed == [first, second]  # once per build, remembered across processes


def test_a_rebuilt_library_in_the_same_place_is_probed_again(monkeypatch, fresh_plan, tmp_path):
    lib = fake_build(tmp_path, "venv", b"build one")
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(lib))
    monkeypatch.setattr(host, "probe_child", lambda path, threads: "ok")
    host.plan("m.gguf", n_threads=2, system_info=AMX)
    assert host.known_verdict(AMX) == "ok"
    (lib / "libggml-cpu.so").write_bytes(b"\x7fELF ggml-cpu build two")  # `pip install --force-reinstall` of another
    assert host.known_verdict(AMX) is None


def test_library_hashes_are_kept_bounded_and_not_recomputed(monkeypatch, fresh_plan, tmp_path):
    monkeypatch.setattr(host, "_HASHES_MAX", 2)
    for i in range(4):
        monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(fake_build(tmp_path, f"build{i}", str(i).encode())))
        first = host.build_id()
    assert len(host._hashes()) == 2  # the last build's two files
    monkeypatch.setattr(host, "_sha256", lambda path: pytest.fail(f"{path} hashed again"))
    assert host.build_id() == first


def test_a_trial_load_that_llama_cpp_refused_is_remembered_and_not_tried_again(tmp_path, monkeypatch):
    from specdec_cli.errors import ModelError

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "hybrid.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    runs = []

    def refusing(args, timeout):
        runs.append(args)
        return subprocess.CompletedProcess(args, host.PROBE_REFUSED, "", "llama.cpp could not load it.\n")

    monkeypatch.setattr(host, "_probe_process", refusing)
    for _ in range(2):
        with pytest.raises(ModelError, match="could not load it"):
            host.probe_load(model)
    assert len(runs) == 1  # the second run raised the remembered failure without a trial load
    model.touch()  # a changed file is tried again
    with pytest.raises(ModelError):
        host.probe_load(model)
    assert len(runs) == 2


@pytest.mark.parametrize(
    "returncode, verdict, kept",
    [
        (0, "ok", True),
        (-11, "crash: SIGSEGV", True),
        (0xC0000005, "crash: STATUS_ACCESS_VIOLATION (0xC0000005)", True),
        (1, "no verdict: the trial passes exited with 1", False),
    ],
)
def test_the_device_flash_attention_probe_runs_once_and_keeps_a_verdict(
    monkeypatch, tmp_path, returncode, verdict, kept
):
    monkeypatch.setattr(host, "_host_file", lambda: tmp_path / "host.json")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    calls = []

    def fake_run(command, **kw):
        calls.append(command)
        return subprocess.CompletedProcess(command, returncode, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert host.known_device_flash_attn(model, -1, 4096) is None
    assert host.device_flash_attn(model, -1, 4096) == verdict
    assert calls[0][-4:] == [str(model), "device", "-1", "4096"]  # the device mode, with this run's layers and context
    assert host.device_flash_attn(model, -1, 4096) == verdict
    assert len(calls) == (1 if kept else 2)  # a verdict is remembered; no verdict is asked again next time
    assert host.known_device_flash_attn(model, -1, 4096) == (verdict if kept else None)
    assert host.known_device_flash_attn(model, 12, 4096) is None  # another placement: its own verdict
    assert host.known_device_flash_attn(model, -1, 8192) is None  # another context size: its own verdict


def test_the_device_probes_child_runs_verify_passes_on_a_real_model(smollm2_path):
    """`probe_main`'s device mode on this machine's build (a CPU build offloads nothing): exit 0."""
    from specdec_cli.models.llama import probe_main

    assert probe_main([str(smollm2_path), "device", "-1", "1024"]) == 0
