"""Flash attention on or off, measured at a long context (issue 34): the rule, the timing, keeping the choice, and
the setting a model loads with. Deterministic: the fake backend's passes advance a virtual clock by scripted costs."""

from __future__ import annotations

import pytest

from fakes import Clock, FakeBackend
from specdec_cli.core.verify_timing import measure_at_depth
from specdec_cli.errors import ConfigError
from specdec_cli.measure import flash_attn
from specdec_cli.session import FLASH_ATTN_ENV
from specdec_cli.session import flash_attn as flash_attn_for
from specdec_cli.stores import learnt

# Like this CPU at 2k tokens of context: flash attention halves the prefill chunk's cost per token but makes every
# verify pass over several rows dear (the kernel walks the KV cache once per row).
OFF = {"depth": 2048, "chunk": 256, "chunk_ms": 2560.0, "ms": {1: 100.0, 4: 150.0, 8: 200.0, 16: 300.0}}
ON_DEAR_VERIFY = {"depth": 2048, "chunk": 256, "chunk_ms": 1280.0, "ms": {1: 100.0, 4: 400.0, 8: 800.0, 16: 1600.0}}
ON_CHEAP = {"depth": 2048, "chunk": 256, "chunk_ms": 1280.0, "ms": {1: 90.0, 4: 140.0, 8: 190.0, 16: 290.0}}


def test_a_speculative_output_token_costs_the_cheapest_size_over_the_tokens_it_yields():
    # b = 8 at 0.8 acceptance yields 1 + 0.8 + ... + 0.8^7 = 4.16 tokens: 200 / 4.16 = 48.1 ms, below b = 4's 50.8
    assert flash_attn.decode_ms_per_token(OFF["ms"]) == pytest.approx(200 / sum(0.8**i for i in range(8)))
    assert flash_attn.decode_ms_per_token({1: 100.0}) == 100.0  # plain decoding: one token a pass


def test_off_wins_where_dear_verify_passes_outweigh_a_cheaper_prefill():
    choice = flash_attn.decide(OFF, ON_DEAR_VERIFY)
    assert not choice.on
    assert choice.turn_ms["off"] == pytest.approx(10.0 + 200 / sum(0.8**i for i in range(8)))
    assert choice.turn_ms["on"] == pytest.approx(5.0 + 100.0)  # its cheapest: plain decoding
    assert "off" in choice.reason and "2048" in choice.reason


def test_on_wins_where_it_is_cheaper_at_both_and_a_tie_keeps_it_on():
    assert flash_attn.decide(OFF, ON_CHEAP).on
    assert flash_attn.decide(OFF, dict(OFF)).on


def test_off_must_be_cheaper_by_the_margin_to_leave_llama_cpps_batch_invariant_default():
    # a turn off cheaper by less than the margin keeps on (the figures are a real sitting's at 2,048 tokens)
    def at(turn_ms: float) -> dict:
        return {"depth": 2048, "chunk": 256, "chunk_ms": 0.0, "ms": {1: turn_ms}}

    near = flash_attn.decide(at(72.7), at(75.5))
    assert near.on and "off is chosen only when 10% cheaper" in near.reason
    assert not flash_attn.decide(at(67.0), at(75.5)).on  # 11 % cheaper: off


def test_a_choice_round_trips_through_its_dict_and_a_bad_one_is_refused():
    choice = flash_attn.decide(OFF, ON_CHEAP)
    assert flash_attn.Choice.from_dict(choice.to_dict()) == choice
    with pytest.raises(TypeError):
        flash_attn.Choice.from_dict({**choice.to_dict(), "on": "yes"})


def test_measure_at_depth_times_a_chunk_and_each_size_after_the_context_and_empties_the_cache():
    clock = Clock()
    fake = FakeBackend(n_ctx=600, n_batch=64, clock=clock, cost=lambda b: 10.0 + 2.0 * b)
    m = measure_at_depth(fake, depth=4096, sizes=(1, 8), chunk=256, repeats=3, clock=clock)
    assert m["chunk"] == 64 and m["depth"] == 600 - 64  # the chunk fits one batch, the depth the context window
    assert m["chunk_ms"] == pytest.approx(10.0 + 2.0 * 64)
    assert m["ms"] == {1: pytest.approx(12.0), 8: pytest.approx(26.0)}
    assert len(fake.tokens) == 0


def test_measure_times_both_settings_each_in_its_own_backend_and_decides():
    clock = Clock()
    opened = []

    def backend(on: bool) -> FakeBackend:
        # on: prefill chunk cheap, every verify pass over several rows dear; off: the other way round
        cost = (lambda b: 5.0 * b if b > 16 else 100.0 * b) if on else (lambda b: 10.0 * b if b > 16 else 60.0 + 10 * b)
        fake = FakeBackend(n_ctx=2600, n_batch=512, clock=clock, cost=cost)
        opened.append((on, fake))
        return fake

    choice = flash_attn.measure("unused.gguf", backend=backend, depth=2048, clock=clock)
    assert [on for on, _ in opened] == [False, True]
    assert all(len(fake.tokens) == 0 for _, fake in opened)
    assert choice.ms["off"]["ms"] == pytest.approx({"1": 70.0, "4": 100.0, "8": 140.0, "16": 220.0})
    assert choice.ms["on"]["chunk_ms"] == pytest.approx(1280.0)
    # off: 10 ms a prompt token + 140 ms / 4.16 tokens at b = 8; on: 5 ms + 100 ms (plain decoding is its cheapest)
    assert choice.turn_ms == {
        "off": pytest.approx(10.0 + 140 / sum(0.8**i for i in range(8))),
        "on": pytest.approx(105.0),
    }
    assert not choice.on


def test_the_choice_is_kept_beside_the_curve_and_neither_overwrites_the_other(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_VERIFY_CURVE")  # curves (and choices) kept
    from specdec_cli.core.verify_curve import VerifyCurve

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    key = learnt.curve_key(model, 2)
    learnt.save_flash_attn(key, flash_attn.decide(OFF, ON_DEAR_VERIFY).to_dict())
    assert learnt.load_curve(key) is None  # a choice alone is no curve (and no warning)
    learnt.save_curve(key, VerifyCurve(ms=(20.0, 30.0)), model)
    assert learnt.load_flash_attn(key)["on"] is False
    learnt.save_flash_attn(key, flash_attn.decide(OFF, ON_CHEAP).to_dict())
    assert learnt.load_curve(key).ms == (20.0, 30.0)
    assert learnt.load_flash_attn(key)["on"] is True


def test_a_model_loads_with_the_variable_else_the_measured_choice_else_llama_cpp_auto(tmp_path, monkeypatch):
    from specdec_cli.models import llama

    monkeypatch.delenv("SPECDEC_VERIFY_CURVE")
    monkeypatch.setattr(llama, "flash_attn_switch", lambda: False)  # a build that cannot switch between passes
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    assert flash_attn_for(model, 2, {}) is None  # nothing measured: llama.cpp's auto
    learnt.save_flash_attn(learnt.curve_key(model, 2), flash_attn.decide(OFF, ON_DEAR_VERIFY).to_dict())
    assert flash_attn_for(model, 2, {}) is False
    kept_before_the_margin = {
        **flash_attn.decide(OFF, ON_DEAR_VERIFY).to_dict(),
        "on": False,
        "turn_ms": {"off": 72.7, "on": 75.5},
    }  # off by 4 %: decided again, on
    learnt.save_flash_attn(learnt.curve_key(model, 2), kept_before_the_margin)
    assert flash_attn_for(model, 2, {}) is True
    learnt.save_flash_attn(learnt.curve_key(model, 2), flash_attn.decide(OFF, ON_DEAR_VERIFY).to_dict())
    assert flash_attn_for(model, 4, {}) is None  # measured for 2 threads only
    learnt.save_flash_attn(learnt.curve_key(model, 2), flash_attn.decide(OFF, ON_CHEAP).to_dict())
    assert flash_attn_for(model, 2, {}) is True
    assert flash_attn_for(model, 2, {FLASH_ATTN_ENV: "off"}) is False
    assert flash_attn_for(model, 2, {FLASH_ATTN_ENV: "ON"}) is True
    assert flash_attn_for(model, 2, {FLASH_ATTN_ENV: "auto"}) is True
    with pytest.raises(ConfigError, match=FLASH_ATTN_ENV):
        flash_attn_for(model, 2, {FLASH_ATTN_ENV: "maybe"})
    with pytest.raises(ConfigError, match="specdec install-llama-cpp"):
        flash_attn_for(model, 2, {FLASH_ATTN_ENV: "phased"})


PHASED = {"depth": 2048, "chunk": 256, "chunk_ms": 1280.0, "ms": {1: 100.0, 4: 150.0, 8: 200.0, 16: 300.0}}


def test_where_the_build_can_switch_the_cpu_runs_phased_unless_on_was_measured_cheaper(tmp_path, monkeypatch):
    from specdec_cli.models import llama

    monkeypatch.delenv("SPECDEC_VERIFY_CURVE")
    monkeypatch.setattr(llama, "flash_attn_switch", lambda: True)
    monkeypatch.setattr(llama, "gpu_offload_supported", lambda: False)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    key = learnt.curve_key(model, 2)
    assert flash_attn_for(model, 2, {}) == llama.PHASED  # nothing measured
    learnt.save_flash_attn(key, flash_attn.decide(OFF, ON_CHEAP).to_dict())
    assert flash_attn_for(model, 2, {}) == llama.PHASED  # measured before phased existed: on's prefill, off's passes
    choice = flash_attn.decide(OFF, ON_DEAR_VERIFY, PHASED)
    assert choice.phased and "phased" in choice.reason
    assert choice.turn_ms["phased"] == pytest.approx(5.0 + 200 / sum(0.8**i for i in range(8)))
    learnt.save_flash_attn(key, choice.to_dict())
    assert flash_attn.Choice.from_dict(learnt.load_flash_attn(key)).phased
    assert flash_attn_for(model, 2, {}) == llama.PHASED
    learnt.save_flash_attn(key, flash_attn.decide(OFF, ON_CHEAP, {**PHASED, "chunk_ms": 2560.0}).to_dict())
    assert flash_attn_for(model, 2, {}) is True  # phased timed and dearer than on: on
    assert flash_attn_for(model, 2, {FLASH_ATTN_ENV: "off"}) is False
    assert flash_attn_for(model, 2, {FLASH_ATTN_ENV: "phased"}) == llama.PHASED
    monkeypatch.setattr(llama, "gpu_offload_supported", lambda: True)  # a GPU's kernels: as measured, else auto
    learnt.save_flash_attn(key, flash_attn.decide(OFF, ON_CHEAP).to_dict())
    assert flash_attn_for(model, 2, {}) is True


def test_doctor_shows_the_measured_choice_under_its_curve(tmp_path, monkeypatch):
    from rich.console import Console

    from specdec_cli.cli.commands import doctor
    from specdec_cli.core.verify_curve import VerifyCurve
    from specdec_cli.models import llama

    monkeypatch.delenv("SPECDEC_VERIFY_CURVE")
    monkeypatch.setattr(llama, "flash_attn_switch", lambda: False)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    key = learnt.curve_key(model, None)  # doctor shows the default thread count's curves
    learnt.save_curve(key, VerifyCurve(ms=(20.0, 30.0)), model)
    learnt.save_flash_attn(key, flash_attn.decide(OFF, ON_DEAR_VERIFY).to_dict())
    console = Console(width=400, record=True)
    for part in doctor.curve_renderables({"verify_curves": doctor.curves(), "threads_default": 2}):
        console.print(part)
    text = console.export_text()
    assert "flash attention off (measured at 2048 tokens of context" in text
    assert "v(8) 200 / 800" in text
    monkeypatch.setattr(llama, "flash_attn_switch", lambda: True)
    monkeypatch.setattr(llama, "gpu_offload_supported", lambda: False)
    learnt.save_flash_attn(key, flash_attn.decide(OFF, ON_DEAR_VERIFY, PHASED).to_dict())
    console = Console(width=400, record=True)
    for part in doctor.curve_renderables({"verify_curves": doctor.curves(), "threads_default": 2}):
        console.print(part)
    text = console.export_text()
    assert (
        "flash attention on for prefill chunks, off for verify passes past 2,048 tokens of context (measured at 2048"
        in text
    )
    assert "phased 53.1 ms" in text  # 5 ms of prefill + 200 ms over 4.16 tokens
    monkeypatch.setenv(FLASH_ATTN_ENV, "on")
    console = Console(width=400, record=True)
    for part in doctor.curve_renderables({"verify_curves": doctor.curves(), "threads_default": 2}):
        console.print(part)
    assert f"flash attention: on ({FLASH_ATTN_ENV})" in console.export_text()


def test_reports_say_which_kernels_the_target_runs_and_why(monkeypatch):
    from pathlib import Path

    from specdec_cli.session import Session, kernels_line

    fake = FakeBackend()
    session = Session(target=fake, target_path=Path("fake.gguf"))
    assert session.kernels()["flash_attn"].startswith("auto (llama.cpp's default")
    fake.flash_attn = False  # as LlamaBackend records what it was loaded with
    assert session.kernels()["flash_attn"] == "off (as the backend was opened)"
    monkeypatch.setenv(FLASH_ATTN_ENV, "off")
    assert session.kernels()["flash_attn"] == f"off ({FLASH_ATTN_ENV})"
    line = kernels_line(session.kernels())
    assert line.startswith("AMX kernels: ") and f"flash attention: off ({FLASH_ATTN_ENV})" in line
    assert kernels_line(None) == ""


def test_doctor_shows_the_choice_beside_a_curve_kept_per_device(tmp_path, monkeypatch):
    # On a build that offloads, the curve's key names the device and layers; the flash-attention choice is kept
    # under the key without them (it is read before the model loads). Doctor finds it for the curve all the same.
    from specdec_cli.cli.commands import doctor
    from specdec_cli.core.verify_curve import VerifyCurve

    monkeypatch.delenv("SPECDEC_VERIFY_CURVE")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    where = "Vulkan0 llvmpipe, 29 layers offloaded"
    learnt.save_curve(
        learnt.curve_key(model, None, where),
        VerifyCurve(ms=(20.0, 30.0), depth=640),
        model,
        learnt.timed_on(None, where),
    )
    learnt.save_flash_attn(learnt.curve_key(model, None), flash_attn.decide(OFF, ON_DEAR_VERIFY).to_dict())
    (entry,) = doctor.curves()
    assert entry["placement"] == where and entry["flash_attn"]["on"] is False


def test_a_device_whose_flash_attention_crashed_on_a_verify_pass_runs_it_off(tmp_path, monkeypatch):
    """Lavapipe's flash attention died on a multi-row verify pass (docs/gpu.md): where `host.device_flash_attn` saw
    that, an unmeasured run on the device loads with it off; on the CPU, or once measured, the probe is not asked."""
    from specdec_cli.models import llama

    monkeypatch.delenv("SPECDEC_VERIFY_CURVE")
    monkeypatch.setattr(llama, "flash_attn_switch", lambda: False)
    monkeypatch.setattr(llama, "gpu_offload_supported", lambda: True)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    asked = []

    def probe(verdict):
        return lambda: asked.append(verdict) or verdict

    assert flash_attn_for(model, 2, {}, gpu_layers=-1, device_probe=probe("crash: SIGSEGV")) is False
    assert flash_attn_for(model, 2, {}, gpu_layers=-1, device_probe=probe("ok")) is None  # llama.cpp's auto
    assert flash_attn_for(model, 2, {}, gpu_layers=-1, device_probe=probe("no verdict: timeout")) is None
    assert len(asked) == 3
    assert flash_attn_for(model, 2, {}, gpu_layers=0, device_probe=probe("crash: SIGSEGV")) is None  # on the CPU
    assert flash_attn_for(model, 2, {FLASH_ATTN_ENV: "on"}, gpu_layers=-1, device_probe=probe("crash: SIGSEGV"))
    learnt.save_flash_attn(learnt.curve_key(model, 2), flash_attn.decide(OFF, ON_CHEAP).to_dict())
    assert flash_attn_for(model, 2, {}, gpu_layers=-1, device_probe=probe("crash: SIGSEGV")) is True  # measured
    assert len(asked) == 3


def test_the_report_says_flash_attention_is_off_because_it_crashed_on_the_device(tmp_path, monkeypatch):
    from specdec_cli.models import host
    from specdec_cli.models.devices import Offload
    from specdec_cli.session import Session
    from specdec_cli.spec import ModelOptions

    monkeypatch.setattr(host, "_host_file", lambda: tmp_path / "host.json")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    host._remember(host._device_key(model, -1, ModelOptions().ctx), "crash: SIGSEGV")
    fake = FakeBackend()
    fake.flash_attn = False
    session = Session(target=fake, target_path=model, offload={"target": Offload(-1, "all")})
    assert (
        session.kernels()["flash_attn"]
        == "off (llama.cpp's flash attention crashed (SIGSEGV) on a verify pass on this device)"
    )
    session.offload = {"target": Offload(0, "--gpu-layers 0")}
    session._placement = None
    assert session.kernels()["flash_attn"] == "off (as the backend was opened)"
