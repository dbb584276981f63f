"""`specdec doctor`: what this machine and its llama.cpp look like, in one report to paste into a bug report.

It says which llama.cpp build this Python loads (PyPI's stock build, or specdec's patched one: `models.build`) and,
for a stock build, the command that builds the patched one.

The report goes to stdout (a table, or JSON with --json); nothing is loaded unless --probe asks for the AMX trial
decode (`specdec_cli.models.host`) or --measure for the verify curve (`specdec_cli.core.verify_curve`: the ms of one
target pass by batch size, which `--k auto` chooses K on). The verify curves measured on this machine are shown as
tables (cheap sizes marked) and, with --plot, drawn.
"""

from __future__ import annotations

import os
import platform
import re
from typing import Any

from rich.table import Table
from rich.text import Text

from specdec_cli import __version__
from specdec_cli.models import host
from specdec_cli.models.machine import cpu_model, package_version, physical_cores, usable_cpus
from specdec_cli.models.machine import default_threads as threads_choice


def curves(threads: int | None = None) -> list[dict[str, Any]]:
    """The verify curves learnt.json keeps for this machine (CPU, `threads`, llama.cpp build; every device and
    offload), one dict each: {"key", "target", "curve": VerifyCurve.to_dict(), "cheap": [b, ...], "flash_attn": the
    choice kept beside it or under the same key without its placement (`session.flash_attn` reads it there),
    "placement": where it was timed ("" on a build that cannot offload)}."""
    from specdec_cli.core.verify_curve import VerifyCurve
    from specdec_cli.stores import learnt
    from specdec_cli.stores.tuned import machine

    mine = machine(threads)["key"]
    out = []
    for key, entry in sorted(learnt.all_curves().items()):
        if f"|{mine}|" not in f"|{key}|":
            continue
        try:
            curve = VerifyCurve.from_dict(entry["curve"])
        except (ValueError, TypeError, KeyError):
            continue
        placement = (entry.get("timed") or {}).get("placement", "")
        plain = key.replace(f"|{placement}|llama-cpp-python", "|llama-cpp-python")  # where the choice is kept
        out.append(
            {
                "key": key,
                "target": entry.get("target", "?"),
                "curve": curve.to_dict(),
                "cheap": curve.cheap_sizes(),
                "flash_attn": learnt.load_flash_attn(key) or learnt.load_flash_attn(plain),
                "placement": placement,
            }
        )
    return out


def measure_curve(console, target: str | None = None, gpu_layers: int = -1) -> str | None:
    """Measure the verify curve of `target` (a catalog name or .gguf path; None: the catalog's default target, or
    the smallest downloaded model) now, with a progress bar on `console`, and keep it; returns the model's path
    (None: no model downloaded). The model loads as `session.gpu_layers` says (all layers on a GPU build where they
    fit). Raises ModelError for a target that cannot be resolved or loaded."""
    from specdec_cli.cli.console import RichReporter
    from specdec_cli.models.llama import LlamaBackend, default_threads
    from specdec_cli.session import Session
    from specdec_cli.session import gpu_layers as layers_for
    from specdec_cli.spec import ModelOptions
    from specdec_cli.stores import learnt

    model = _probe_model() if target is None else _resolve(target)
    if model is None:
        return None
    options = ModelOptions(ctx=1024, gpu_layers=gpu_layers)
    off = layers_for(model, options)
    session = Session(
        target=LlamaBackend(model, n_ctx=1024, n_threads=default_threads(), n_gpu_layers=off.layers),
        target_path=model,
        options=ModelOptions(),
        reporter=RichReporter(console),
        offload={"target": off},
    )
    learnt.forget_curve(session.curve_key(), "specdec doctor --measure asked for it")  # even when one is kept
    with session:
        session.verify_curve()
    measure_flash_attn(model, RichReporter(console))
    return str(model)


def measure_flash_attn(model, reporter) -> None:
    """Time flash attention on and off at a long context (`measure.flash_attn`) and keep the choice beside the curve."""
    from specdec_cli.measure import flash_attn
    from specdec_cli.stores import learnt

    settings = flash_attn.settings()
    total = len(settings) * (len(flash_attn.SIZES) + 1) * flash_attn.REPEATS
    what = "on, off and phased" if len(settings) == 3 else "on and off"
    with reporter.progress(
        f"timing flash attention {what} at {flash_attn.DEPTH} tokens of context", total, unit="steps"
    ) as task:
        choice = flash_attn.measure(model, progress=lambda done, total: task.advance())
    learnt.save_flash_attn(learnt.curve_key(model, None), choice.to_dict())
    reporter.say(choice.reason)


def gpu(target: str | None = None, gpu_layers: int = -1) -> dict[str, Any]:
    """What llama.cpp computes on: {"offload": bool, "backend": the GPU backends llama_print_system_info names, else the
    names of the non-CPU devices ("" on a CPU build), "devices": [models.devices.Device.to_dict()] (None: this build
    hides ggml's device API), "model": the file the layers are sized for (`target`, else the default/smallest downloaded
    model; None: none), "layers": n_gpu_layers it would load with, "why": one line}."""
    from specdec_cli.models import devices
    from specdec_cli.models.llama import gpu_offload_supported, system_info
    from specdec_cli.session import gpu_layers as layers_for
    from specdec_cli.spec import ModelOptions

    offload = gpu_offload_supported()
    info = system_info()
    backends = [
        name
        for name in (
            "CUDA",
            "METAL",
            "Metal",
            "VULKAN",
            "Vulkan",
            "HIP",
            "ROCm",
            "SYCL",
            "OPENCL",
            "MUSA",
            "CANN",
            "KOMPUTE",
            "BLAS",
        )
        if f"{name} :" in info or f"{name}:" in info
    ]
    devs = devices.devices()
    if not backends and devs:  # a build whose system info lists only the CPU (ggml's dynamic backends): the devices'
        backends = [re.sub(r"\d+$", "", d.name) for d in devs if d.kind != "CPU"]  # "Vulkan0" -> "Vulkan"
    try:
        model = _probe_model() if target is None else _resolve(target)
    except Exception:  # noqa: BLE001 - a report never fails on a model it cannot find
        model = None
    off = layers_for(model, ModelOptions(gpu_layers=gpu_layers)) if model is not None else None
    return {
        "offload": offload,
        "backend": ", ".join(dict.fromkeys(b.upper() for b in backends)),
        "devices": None if devs is None else [d.to_dict() for d in devs],
        "model": None if model is None else str(model),
        "layers": None if off is None else off.layers,
        "why": "" if off is None else off.why,
    }


def gpu_rows(g: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's GPU lines: backend, each device with its free/total memory, the layers a model offloads."""
    rows = [
        (
            "GPU backend",
            g["backend"]
            or (
                "none: a CPU build (docs/gpu.md builds one for CUDA or Metal)"
                if not g["offload"]
                else "a GPU build (llama_supports_gpu_offload)"
            ),
        )
    ]
    if g["devices"] is None:
        rows.append(("devices", "n/a (this llama.cpp does not expose ggml's device API)"))
    for d in g["devices"] or ():
        rows.append(
            (
                f"device {d['name']}",
                f"{d['kind']}: {d['description']}; memory {d['free_mib']:,} MiB free of {d['total_mib']:,} MiB",
            )
        )
    if g["model"] is None:
        rows.append(("layers offloaded", "n/a (no model downloaded to size)"))
    elif not g["offload"]:
        rows.append(("layers offloaded", "n/a: a CPU build runs every layer on the CPU"))
    else:
        rows.append(("layers offloaded", f"{'all' if g['layers'] == -1 else g['layers']} ({g['why']})"))
    return rows


def report(*, probe: bool = False, target: str | None = None, gpu_layers: int = -1) -> dict[str, Any]:
    """The machine facts as a JSON-serialisable dict.

    probe: when this llama.cpp has AMX kernels and no verdict is remembered for them on this CPU, run the trial
    decode now (`host.probe_child`, a few seconds) with the catalog's default target if it is downloaded, else the
    smallest downloaded catalog model.
    """
    from specdec_cli.config import cache_dir, config_dir, data_dir
    from specdec_cli.models.llama import default_threads, gpu_offload_supported, system_info

    info = system_info()
    setting = host.setting()
    verdict = host.known_verdict(info)
    probed_with = None
    if probe and host.amx_build(info) and setting == "auto" and verdict is None:
        model = _probe_model()
        if model is not None:
            probed_with = str(model)
            verdict = host.probe_child(model, default_threads())
    plan = host.decide(
        info,
        setting,
        lambda: verdict or "no verdict: not probed yet (at the first model load, or now with specdec doctor --probe)",
    )
    return {
        "specdec": __version__,
        "python": platform.python_version(),
        "os": platform.platform(),
        "llama_cpp_python": package_version(),
        "build": host.build_info(info).to_dict(),
        "system_info": info,
        "gpu_offload": gpu_offload_supported(),
        "gpu": gpu(target, gpu_layers),
        "cpu": cpu_model(),
        "cores": physical_cores(),
        "usable_cpus": usable_cpus(),
        "threads_default": default_threads(),
        "threads_why": threads_choice()[1],
        "amx": {
            "cpu_has_amx": host.cpu_has_amx(),
            "build_has_amx": host.amx_build(info),
            "setting": setting,
            "verdict": verdict,
            "probed_with": probed_with,
            "load_path": plan.path,
            "in_use": plan.amx_build and plan.extra_bufts,  # the AMX kernels multiply the weights
            "reason": plan.reason,
        },
        "paths": {"config": str(config_dir()), "data": str(data_dir()), "cache": str(cache_dir())},
        "verify_curves": curves(),
        "serve_kv": serve_kv(),
        "model": model_report(target) if target else None,
        "energy": energy_report(),
        "env": {
            k: os.environ[k]
            for k in (
                "SPECDEC_HOME",
                "SPECDEC_CACHE",
                host.ENV,
                "SPECDEC_DEBUG",
                "NO_COLOR",
                "SPECDEC_GPU_LAYERS",
                "CUDA_VISIBLE_DEVICES",
            )
            if k in os.environ
        },
    }


def model_report(target: str) -> dict[str, Any] | None:
    """What `-t MODEL` is to specdec: {"model" (its file), "architecture", "kind" (transformer, hybrid, recurrent),
    "rollback" (kv, snapshots, checkpoints, none), "n_rs_seq", "state_bytes", "snapshot_bytes" (per sequence),
    "mtp_layers" (the GGUF's `nextn_predict_layers`; 0: no MTP block)}, from a small CPU load of it
    (`llama.describe_model`); {"model", "error"} when it cannot be loaded; None when it cannot be found."""
    from specdec_cli.models.gguf import check_gguf, nextn_layers
    from specdec_cli.models.llama import describe_model

    try:
        path = _resolve(target)
        info = check_gguf(path)
    except Exception:  # noqa: BLE001 - a report never fails on a model it cannot find
        return None
    doc: dict[str, Any] = {"model": str(path), "architecture": info.architecture, "mtp_layers": nextn_layers(info)}
    try:
        return doc | describe_model(path)
    except Exception as e:  # noqa: BLE001 (doctor reports what it can)
        return doc | {"error": str(e)}


def model_row(m: dict[str, Any]) -> str:
    """The report's line about `-t MODEL`: its kind, how it rolls back and what that costs, its MTP block."""
    if "error" in m:
        return f"{m['model']}: {m['error']}"
    kind = {
        "transformer": "a transformer (KV cache: rolls back to any position)",
        "hybrid": "hybrid (attention and recurrent layers)",
        "recurrent": "recurrent",
    }[m["kind"]]
    state = _size(m["state_bytes"])
    how = {
        "kv": "",
        "snapshots": f"; rolls back by {m['n_rs_seq']} recurrent-state snapshots per sequence "
        f"({_size(m['snapshot_bytes'])} per sequence: {m['n_rs_seq']} x {state}), so a draft "
        f"is at most {m['n_rs_seq']} tokens",
        "checkpoints": f"; no snapshots in llama.cpp for {m['architecture']}: rolls back by a checkpoint of its "
        f"{state} state before each verify pass and a replay of the kept tokens",
        "none": "; cannot roll back: plain decoding",
    }[m["rollback"]]
    mtp = f"; MTP block: {m['mtp_layers']} layer(s)" if m["mtp_layers"] else "; no MTP block"
    return f"{m['architecture']}: {kind}{how}{mtp} ({m['model']})"


def _size(n: int) -> str:
    """Bytes as KB, MB or GB (binary units), one decimal from MB up."""
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.0f} KB"


def serve_kv() -> dict[str, Any] | None:
    """What `specdec serve`'s lanes take in KV cache with the catalog's default target (when downloaded): {"model",
    "lanes", "ctx", "bytes_per_token", "bytes"}; None without the model or its header's sizes."""
    from specdec_cli.cli.options import SERVE_CTX, SERVE_PARALLEL
    from specdec_cli.config import cache_dir, load_catalog
    from specdec_cli.models.gguf import check_gguf, kv_bytes_per_token

    catalog = load_catalog()
    spec = catalog.models.get(catalog.default_target)
    path = cache_dir() / spec.file if spec is not None else None
    if path is None or not path.is_file():
        return None
    try:
        per = kv_bytes_per_token(check_gguf(path))
    except Exception:  # noqa: BLE001 (doctor reports what it can)
        return None
    if per is None:
        return None
    return {
        "model": catalog.default_target,
        "lanes": SERVE_PARALLEL,
        "ctx": SERVE_CTX,
        "bytes_per_token": per,
        "bytes": per * SERVE_CTX * SERVE_PARALLEL,
    }


def energy_report() -> dict[str, Any]:
    """The energy counters this process can read (`models.energy.discover`), and each source that applies and cannot
    be read, with why and the fix."""
    from specdec_cli.models.energy import discover, powercap_root

    meter = discover()
    return {
        "powercap": str(powercap_root()),
        "counters": [{"name": c.name, "covers": c.covers, "wraps_at_joules": c.wrap_j} for c in meter.counters],
        "missing": [{"source": m.source, "reason": m.reason, "fix": m.fix} for m in meter.missing],
    }


def _resolve(target: str):
    """A catalog name or a .gguf path, as the model commands resolve it (a catalog model not downloaded is fetched).
    Raises ModelError, ConfigError."""
    from specdec_cli.config import load_catalog
    from specdec_cli.models.resolver import resolve

    return resolve(target, load_catalog())


def _probe_model():
    from specdec_cli.config import cache_dir, load_catalog

    catalog = load_catalog()
    present = [(p.stat().st_size, p) for p in (cache_dir() / s.file for s in catalog.models.values()) if p.is_file()]
    default = catalog.models.get(catalog.default_target)
    if default is not None and (cache_dir() / default.file).is_file():
        return cache_dir() / default.file
    return min(present)[1] if present else None


def table(doc: dict[str, Any]) -> Table:
    """The report as a two-column Rich table."""
    t = Table(title="specdec doctor", title_justify="left", show_header=False)
    t.add_column("what", style="spec.label", no_wrap=True)
    t.add_column("value", overflow="fold")
    amx, build = doc["amx"], doc["build"]
    yes_no = {True: "yes", False: "no", None: "unknown"}
    rows = [
        ("specdec", doc["specdec"]),
        ("python", f"{doc['python']} ({doc['os']})"),
        ("llama-cpp-python", doc["llama_cpp_python"] or "not installed"),
        ("llama.cpp build", build["name"] + (f"; {build['advice']}" if build["advice"] else "")),
        (
            "llama.cpp libraries",
            (build["library_dir"] or "not found")
            + (f" (installed from {build['installed_from']})" if build["installed_from"] else ""),
        ),
        (
            "GPU offload",
            yes_no[doc["gpu_offload"]]
            + (
                ""
                if doc["gpu_offload"]
                else " (a CPU build: specdec "
                "install-llama-cpp --backend cuda builds for CUDA; "
                "docs/install.md, docs/gpu.md)"
            ),
        ),
        ("CPU", f"{doc['cpu']}, {doc['cores'] or '?'} cores, {doc['usable_cpus']} usable CPUs"),
        ("threads", f"{doc['threads_default']} by default: {doc['threads_why']} (--threads)"),
        ("AMX in the CPU", yes_no[amx["cpu_has_amx"]]),
        ("AMX kernels in llama.cpp", yes_no[amx["build_has_amx"]]),
        (host.ENV, amx["setting"]),
        (
            "AMX trial decode",
            amx["verdict"] or "not needed"
            if not amx["build_has_amx"]
            else amx["verdict"] or "not run yet (specdec doctor --probe, or at the first model load)",
        ),
        ("AMX kernels in use", yes_no[amx["in_use"]]),
        ("models load", f"{amx['load_path']}: {amx['reason']}"),
        (
            "energy counters",
            " + ".join(f"{c['name']} ({c['covers']})" for c in doc["energy"]["counters"])
            or "none: energy is reported as n/a",
        ),
        *[
            ("energy: " + m["source"], m["reason"] + (f" (fix: {m['fix']})" if m["fix"] else ""))
            for m in doc["energy"]["missing"]
        ],
        ("system info", doc["system_info"]),
        ("config / data / cache", f"{doc['paths']['config']}  {doc['paths']['data']}  {doc['paths']['cache']}"),
    ]
    rows[4:4] = gpu_rows(doc["gpu"]) if "gpu" in doc else []
    if doc.get("model"):
        rows.append(("model (-t)", model_row(doc["model"])))
    kv = doc.get("serve_kv")
    if kv:
        rows.append(
            (
                "serve's KV cache",
                f"{kv['lanes']} lanes x {kv['ctx']} tokens x {kv['bytes_per_token'] / 1024:.0f} "
                f"KB = {kv['bytes'] / 2**30:.1f} GB for {kv['model']} (specdec serve --parallel, --ctx)",
            )
        )
    rows += [(k, v) for k, v in doc["env"].items() if k != host.ENV]
    for what, value in rows:
        t.add_row(what, Text(str(value)))
    return t


def curve_renderables(doc: dict[str, Any]) -> list[Any]:
    """Each verify curve of the report as a title, a table with the cheap sizes marked, and a caption; or the line
    that says how to measure one."""
    from specdec_cli.cli.curve_view import curve_caption, curve_table
    from specdec_cli.core.verify_curve import VerifyCurve

    if not doc["verify_curves"]:
        return [
            Text(
                "verify curve: not measured on this machine yet (the first `specdec run` measures it, or "
                "`specdec doctor --measure` now)",
                style="spec.label",
            )
        ]
    out: list[Any] = []
    for entry in doc["verify_curves"]:
        curve = VerifyCurve.from_dict(entry["curve"])
        where = f", {entry['placement']}" if entry.get("placement") else ""
        out += [
            Text(
                f"verify curve: {entry['target']}, {doc['threads_default']} threads{where}: ms of one target "
                "pass over b tokens",
                style="bold",
            ),
            curve_table(curve),
            curve_caption(curve),
            flash_attn_line(entry.get("flash_attn")),
        ]
    return out


def flash_attn_line(choice: dict[str, Any] | None) -> Text:
    """What the verify curve's entry says of flash attention: the measured choice at a long context and why."""
    from specdec_cli.session import FLASH_ATTN_ENV

    if os.environ.get(FLASH_ATTN_ENV, "auto").strip().lower() not in ("auto", ""):
        return Text(f"flash attention: {os.environ[FLASH_ATTN_ENV]} ({FLASH_ATTN_ENV})", style="spec.label")
    from specdec_cli.models.llama import PHASED, flash_attn_switch, gpu_offload_supported
    from specdec_cli.session import flash_attn_choice, flash_attn_state

    phased = PHASED if flash_attn_switch() and not gpu_offload_supported() else None
    if choice is None and phased:
        return Text(
            f"flash attention: {flash_attn_state(phased)} (this build switches it between passes; not "
            "measured here: specdec doctor --measure times it)",
            style="spec.label",
        )
    if choice is None:
        return Text(
            "flash attention: llama.cpp's auto (not measured here: specdec doctor --measure times it on and "
            "off at a long context)",
            style="spec.label",
        )
    from specdec_cli.measure.flash_attn import Choice

    try:
        Choice.from_dict(choice)  # only that it reads: `flash_attn_choice` below decides again under today's rule
    except (KeyError, TypeError, ValueError):
        return Text(
            "flash attention: llama.cpp's auto (the measured choice is unreadable: specdec doctor --measure)",
            style="spec.label",
        )
    on, off = (choice["ms"][k] for k in ("on", "off"))
    passes = ", ".join(f"v({b}) {off['ms'][b]:.0f} / {on['ms'][b]:.0f}" for b in off["ms"])
    state = flash_attn_state(flash_attn_choice(choice, phased))
    also = f"; phased {choice['turn_ms']['phased']:.1f} ms" if "phased" in choice["turn_ms"] else ""
    return Text(
        f"flash attention {state} (measured at {choice['depth']} tokens of context, "
        f"off / on ms: a {off['chunk']}-token prefill chunk {off['chunk_ms']:.0f} / {on['chunk_ms']:.0f}, "
        f"{passes}; a prompt token + an output token {choice['turn_ms']['off']:.1f} / "
        f"{choice['turn_ms']['on']:.1f} ms{also})",
        style="spec.label",
    )


def execute(
    *,
    json_path: str | None,
    probe: bool,
    measure: bool = False,
    plot: str | None = None,
    target: str | None = None,
    gpu_layers: int = -1,
) -> int:
    """Print the report (table to stdout, or JSON to `json_path`, '-' = stdout); `measure`: the verify curve first
    (a few seconds, progress on stderr); `plot`: draw the verify curves to that .png/.svg. Returns 0."""
    from specdec_cli.cli.console import err_console, make_console, write_json
    from specdec_cli.cli.inputs import check_output_path

    check_output_path(json_path)
    if plot:
        from specdec_cli.cli.curve_view import check_plot_path

        check_plot_path(plot)
    if measure and measure_curve(err_console(), target, gpu_layers) is None:
        err_console().print(
            Text(
                "No model downloaded to measure a verify curve with: specdec models pull qwen2.5-coder-1.5b",
                style="spec.warn",
            )
        )
    doc = report(probe=probe, target=target, gpu_layers=gpu_layers)
    if plot and doc["verify_curves"]:
        from specdec_cli.cli.curve_view import write_curve_plot
        from specdec_cli.core.verify_curve import VerifyCurve

        write_curve_plot(
            plot,
            [(e["target"], VerifyCurve.from_dict(e["curve"])) for e in doc["verify_curves"]],
            f"{doc['cpu']}, {doc['threads_default']} threads",
        )
    if json_path:
        write_json(json_path, doc)
        if json_path == "-":
            return 0
    console = make_console()
    console.print(table(doc))
    for part in curve_renderables(doc):
        console.print(part)
    return 0
