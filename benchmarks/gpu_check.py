"""The device check: on a machine with an NVIDIA GPU and nvcc but no network, build llama-cpp-python for the card,
make a model, time the verify curve, a copy-heavy edit against plain decoding and the host's work per pass, and
print one table. It also runs on a CPU (`--no-build`: the llama-cpp-python already installed), so it is tested here
(tests/benchmarks/test_gpu_check.py). docs/gpu.md says how to run it and how to read the table.

    python benchmarks/gpu_check.py prepare          # here, with network: .cache/gpu_check/ (~6 MiB + wheels)
    python benchmarks/gpu_check.py                  # on the GPU machine (8 minutes): build, model, commands, table
    python benchmarks/gpu_check.py --no-build --shape tiny --tokens 48   # on a CPU, in a minute
    python benchmarks/gpu_check.py --tokens 16 --edit FILE vulkan --vk-python VENV/bin/python
        # a Vulkan build (specdec_cli/llama_build/install.py --backend vulkan in VENV) against this Python's:
        # the same greedy commands on both, outputs compared (docs/gpu.md, 'Vulkan')

`prepare` downloads the pinned sdist (llama-cpp-python==0.3.36) with pip and trims it to what the library build
needs (no models, docs, tests, examples, tools, other backends, git objects: 77 MB -> ~5 MB), and downloads the
wheels the build and specdec need where the GPU machine has no network (scikit-build-core, gguf, typer, rich, ...),
all under .cache/gpu_check/ (ignored by git, carried beside the repository; 64 MiB in all).

The check: (1) the card from nvidia-smi (name, compute capability, memory, driver); (2) unless --no-build, a venv
with the wheels, the trimmed sdist patched as specdec's installer patches it (specdec_cli/llama_build) and built with
CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=<the card's>" (-DLLAVA_BUILD=OFF: no multimodal library);
(3) a random-weight GGUF at Qwen2.5-Coder-1.5B's shape (`benchmarks/random_gguf.py`, f16), and the catalog's
smollm2-135m where the model cache has it; (4) `specdec doctor --measure --target M` (the verify curve, flash
attention, the GPU lines), `specdec run EDIT --raw --compare` on each model (speculative vs plain decoding in one
process) and, from that run's own clock, the host's work per target pass: the decode loop's wall time less the
target's passes and drafting, per pass, and decoding's joules per token where the run's counters read any (NVML on
an NVIDIA card); (5) `specdec serve --parallel 4` on the random model (issue 44's shared verify passes where a pass over
64 rows costs about what one row does): four greedy `/v1/completions` one after another and at once, with --method
auto and none, each cell on a fresh server, aggregate tok/s and whether each reply at once equals its reply alone.
Every step's seconds are in the table; a step that fails says why in its row and the check goes on. Exit 0 when every
step ran, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "gpu_check"
VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}"
TRIMMED = CACHE / f"{SDIST}-trimmed.tar.gz"
WHEELS = CACHE / "wheels"
EDIT = ROOT / "specdec_cli" / "prompts" / "edit" / "textwrap_rename.txt"
REAL = "smollm2-135m"  # the catalog's small real model, used where the model cache has it
# what the trimmed sdist leaves out (relative to its root): not needed to build the library
DROP = [
    ".git",
    ".github",
    "docs",
    "examples",
    "tests",
    "docker",
    *(
        f"vendor/llama.cpp/{d}"
        for d in (
            ".git",
            ".github",
            ".devops",
            "models",
            "docs",
            "media",
            "benches",
            "tests",
            "examples",
            "conversion",
            "scripts",
            "tools",
            "pocs",
            "app",
        )
    ),
    *(
        f"vendor/llama.cpp/ggml/src/ggml-{b}"
        for b in (
            "cann",
            "et",
            "hexagon",
            "hip",
            "musa",
            "opencl",
            "openvino",
            "sycl",
            "virtgpu",
            "vulkan",
            "webgpu",
            "zdnn",
            "zendnn",
        )
    ),
]
# wheels for a machine without network: the build backend, then specdec's and gguf's dependencies
BUILD_WHEELS = ["scikit-build-core", "pathspec", "packaging", "ninja"]
RUN_WHEELS = [
    "typer>=0.29,<0.30",
    "rich",
    "filelock",
    "huggingface-hub",
    "llguidance>=1.9,<1.10",
    "jinja2",
    "diskcache",
    "typing-extensions",
    "gguf",
    "pyyaml",
    "tqdm",
    "numpy",
    # specdec serve (the concurrency step): the ASGI stack and pydantic
    "fastapi",
    "uvicorn",
    "sse-starlette",
]
# the GPU machine's Python (its CUDA image: Python 3.12 on manylinux x86-64): compiled wheels must match it
DEVICE_PYTHON = "3.12"
DEVICE_PLATFORMS = [
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
# the concurrency step's four prompts: source files of this repository, cut to 0.6-2k tokens of the random model's
# tokenizer (about a token a character)
SERVE_FILES = [
    "specdec_cli/server/fim.py",
    "specdec_cli/core/detok.py",
    "specdec_cli/stores/kv_parking.py",
    "specdec_cli/server/reply.py",
]
SERVE_CHARS = [600, 1000, 1400, 2000]


# --------------------------------------------------------------------------------------------------------------
# prepare (with network)


def pip_download(python: str, *args: str) -> None:
    """`python -m pip download --quiet ARGS`; raises CalledProcessError when it fails."""
    subprocess.run([python, "-m", "pip", "download", "--quiet", *args], check=True)


def prepare(python: str = sys.executable) -> int:
    """Download and trim the sdist, and download the wheels, into `CACHE`. Returns 0."""
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = CACHE / "download"
    shutil.rmtree(tmp, ignore_errors=True)
    pip_download(python, "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", str(tmp))
    with tarfile.open(next(tmp.glob("*.tar.gz"))) as tar:
        tar.extractall(tmp, filter="data")
    src = tmp / SDIST
    for rel in DROP:
        shutil.rmtree(src / rel, ignore_errors=True)
        (src / rel).unlink(missing_ok=True) if (src / rel).is_file() else None
    with tarfile.open(TRIMMED, "w:gz") as tar:
        tar.add(src, arcname=SDIST)
    shutil.rmtree(tmp)
    shutil.rmtree(WHEELS, ignore_errors=True)
    platforms = [x for p in DEVICE_PLATFORMS for x in ("--platform", p)]
    binary = ["--only-binary", ":all:", "--python-version", DEVICE_PYTHON, "--implementation", "cp", *platforms]
    pip_download(python, *binary, "-d", str(WHEELS), *BUILD_WHEELS, *RUN_WHEELS)
    total = sum(f.stat().st_size for f in CACHE.rglob("*") if f.is_file())
    print(
        f"{TRIMMED.relative_to(ROOT)}: {TRIMMED.stat().st_size / 2**20:.1f} MiB; {WHEELS.relative_to(ROOT)}: "
        f"{len(list(WHEELS.iterdir()))} wheels; {total / 2**20:.1f} MiB in all under {CACHE.relative_to(ROOT)}",
        file=sys.stderr,
    )
    return 0


# --------------------------------------------------------------------------------------------------------------
# the check


class Row:
    """One line of the table: what, the result, seconds, ok."""

    def __init__(self, what: str, result: str, seconds: float | None = None, ok: bool = True) -> None:
        self.what, self.result, self.seconds, self.ok = what, result, seconds, ok


def card() -> dict:
    """nvidia-smi's first GPU: {"name", "compute_cap" ("8.9"), "memory", "driver"}; {} without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return {}
    name, cap, mem, driver = (x.strip() for x in (out.splitlines() or [",,,"])[0].split(",")[:4])
    return {"name": name, "compute_cap": cap, "memory": mem, "driver": driver}


def build(work: Path, arch: str, log: Path) -> tuple[str, str]:
    """A venv under `work` with the wheels, and llama-cpp-python built for CUDA `arch` ("89") from the trimmed
    sdist, patched by specdec's installer (specdec_cli/llama_build/install.py, its patcher and AMX choice). Returns
    (the venv's python, a one-line description). Raises RuntimeError with the step that failed (its output is in
    `log`)."""
    if not TRIMMED.is_file():
        raise RuntimeError(
            f"{TRIMMED.relative_to(ROOT)} is missing: run `python benchmarks/gpu_check.py prepare` "
            "where there is network, and carry .cache/gpu_check"
        )
    venv = work / "venv"
    py = str(venv / "bin" / "python")

    def step(what: str, cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> None:
        with open(log, "a") as f:
            f.write(f"\n$ {' '.join(cmd)}\n")
            f.flush()
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode:
                raise RuntimeError(f"{what} failed (see {log})")

    if not Path(py).exists():
        step("venv", [sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    wheels = ["--no-index", "--find-links", str(WHEELS)] if WHEELS.is_dir() else []
    for w in (*BUILD_WHEELS, *RUN_WHEELS):  # one at a time: what the machine has already may stand in for the rest
        try:
            step(f"wheel {w}", [py, "-m", "pip", "install", "--quiet", *wheels, w])
        except RuntimeError:
            pass  # the venv sees the system's packages; the build or the check says what is still missing
    src = work / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    with tarfile.open(TRIMMED) as tar:
        tar.extractall(src, filter="data")
    source = src / SDIST
    sys.path.insert(0, str(ROOT))
    from specdec_cli.llama_build import install as installer  # standard library only: no venv needed

    patches, amx_flags = installer.cpu_patches_and_flags(installer.cpu_description())
    for name in patches:
        try:
            installer.apply_patch(installer.PATCH_DIR / name, source)
        except installer.PatchError as e:
            raise RuntimeError(f"patch {name} failed: {e}") from e
    flags = f"{amx_flags} " if amx_flags else ""
    args = f"{flags}-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES={arch} -DLLAVA_BUILD=OFF"
    env = dict(os.environ, CMAKE_ARGS=args, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 4))
    step(
        "build",
        [
            py,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--verbose",
            str(source),
            "-w",
            str(work / "wheel"),
        ],
        env=env,
    )
    step(
        "install",
        [
            py,
            "-m",
            "pip",
            "install",
            "--force-reinstall",
            "--no-deps",
            str(next((work / "wheel").glob("llama_cpp_python-*.whl"))),
        ],
    )
    return py, f"llama-cpp-python {VERSION}, CMAKE_ARGS={args}"


def model_cache() -> Path:
    env = os.environ.get("SPECDEC_CACHE")
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec"


def real_model() -> Path | None:
    """The catalog's small real model where the model cache has it."""
    sys.path.insert(0, str(ROOT))
    try:
        from specdec_cli.config import load_catalog

        path = model_cache() / load_catalog().models[REAL].file
    except Exception:  # noqa: BLE001 - no catalog, no model: the check goes on with the random one
        return None
    return path if path.is_file() else None


def specdec(
    py: str, args: list[str], env: dict, log: Path, timeout: float, *, stdin: str | None = None, tag: str = ""
) -> tuple[int, float, str]:
    """Run `python -m specdec_cli ARGS` with `stdin` (None: this process's); (exit code, seconds, its stdout); stderr
    goes to `log`, after the command line (`tag` before it)."""
    t0 = time.monotonic()
    with open(log, "a") as f:
        f.write(f"\n$ {tag}specdec {' '.join(args)}\n")
        f.flush()
        try:
            p = subprocess.run(
                [py, "-m", "specdec_cli", *args],
                input=stdin,
                stdout=subprocess.PIPE,
                stderr=f,
                text=True,
                env=env,
                cwd=ROOT,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return 124, time.monotonic() - t0, ""
    return p.returncode, time.monotonic() - t0, p.stdout


def host_ms(stats: dict) -> float | None:
    """The host's work per target pass from a run's own clock: (decode wall - target passes - drafting) / passes."""
    n = stats.get("n_target_passes") or 0
    return (stats["decode_ms"] - stats["verify_ms"] - stats["draft_ms"]) / n if n else None


def check(a: argparse.Namespace) -> int:
    t_start = time.monotonic()
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = work / "gpu_check.log"
    log.write_text("")
    rows: list[Row] = []
    gpu = card()
    rows.append(
        Row(
            "card",
            f"{gpu['name']}, compute {gpu['compute_cap']}, {gpu['memory']}, driver {gpu['driver']}"
            if gpu
            else "no NVIDIA GPU (nvidia-smi not found or failed): a CPU run",
        )
    )
    py = sys.executable
    if a.no_build:
        try:
            import llama_cpp

            rows.append(
                Row(
                    "build",
                    f"--no-build: llama-cpp-python {llama_cpp.__version__} as installed ("
                    f"{'GPU offload' if llama_cpp.llama_supports_gpu_offload() else 'CPU'})",
                )
            )
        except ImportError:
            rows.append(Row("build", "--no-build, and no llama-cpp-python installed", ok=False))
    else:
        arch = a.arch or (gpu.get("compute_cap", "").replace(".", "") if gpu else "")
        t0 = time.monotonic()
        if not arch or shutil.which("nvcc") is None:
            rows.append(
                Row("build", "skipped: " + ("no nvcc on PATH" if arch else "no card to build for (--arch)"), ok=False)
            )
        else:
            try:
                py, what = build(work, arch, log)
                rows.append(Row("build", what, time.monotonic() - t0))
            except RuntimeError as e:
                rows.append(Row("build", str(e), time.monotonic() - t0, ok=False))
    env = dict(
        os.environ,
        SPECDEC_HOME=str(work / "home"),
        NO_COLOR="1",
        COLUMNS="200",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    env.pop("SPECDEC_VERIFY_CURVE", None)
    # the model: a random GGUF at the shape asked for (gguf from the environment, else the sdist's gguf-py)
    t0 = time.monotonic()
    model = work / f"random-{a.shape}.gguf"
    gguf_py = work / "src" / SDIST / "vendor" / "llama.cpp" / "gguf-py"
    mk_env = dict(env, PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], str(gguf_py)]))
    if not model.is_file():
        p = subprocess.run(
            [py, str(ROOT / "benchmarks" / "random_gguf.py"), str(model), "--shape", a.shape],
            env=mk_env,
            capture_output=True,
            text=True,
        )
        if p.returncode:
            rows.append(
                Row(
                    "model",
                    f"random_gguf.py failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}",
                    time.monotonic() - t0,
                    ok=False,
                )
            )
    models = [model] if model.is_file() else []
    if models:
        rows.append(
            Row(
                "model",
                f"{model.name}: random weights at {a.shape}'s shape, {model.stat().st_size / 2**20:,.1f} MiB",
                time.monotonic() - t0,
            )
        )
    real = None if a.no_real else real_model()
    if real is not None:
        models.append(real)
        rows.append(Row("model", f"{real.name}: the catalog's {REAL} (real weights)"))
    left = lambda: max(30.0, a.budget - (time.monotonic() - t_start))  # noqa: E731
    if models:
        code, s, out = specdec(py, ["doctor", "--measure", "--target", str(models[0]), "--json", "-"], env, log, left())
        rows += doctor_rows(code, s, out, models[0])
        if a.serve_repeats:
            rows += serve_rows(py, models[0], a, env, work, log, left)
    for m in models:
        doc = work / f"run-{m.stem}.json"
        code, s, _ = specdec(
            py,
            [
                "run",
                a.edit,
                "--target",
                str(m),
                "--raw",
                "-n",
                str(a.tokens),
                "--compare",
                "--json",
                str(doc),
                "--no-prompt-cache",
            ],
            env,
            log,
            left(),
        )
        rows += run_rows(code, s, doc, m)
    table = render(rows, time.monotonic() - t_start)
    print(table)
    out_dir = os.environ.get("OUT")
    for d in (work, Path(out_dir) if out_dir else None):
        if d is not None:
            (d / "gpu_check.txt").write_text(table + "\n")
            (d / "gpu_check.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1))
            if d != work:
                shutil.copy(log, d / "gpu_check.log")
    return 0 if all(r.ok for r in rows) else 1


# --------------------------------------------------------------------------------------------------------------
# the concurrency step: `specdec serve --parallel N` on the card


def post(url: str, body: dict, timeout: float) -> dict:
    """POST `body` as JSON; the reply's JSON. Raises OSError (urllib's errors) or ValueError."""
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def serve_cell(
    py: str,
    model: Path,
    method: str,
    at_once: bool,
    prompts: list[str],
    a: argparse.Namespace,
    env: dict,
    home: Path,
    log: Path,
    timeout: float,
) -> dict:
    """One cell on a fresh server (`home`: a SPECDEC_HOME holding only the verify curve): the prompts as greedy
    `/v1/completions` of `a.serve_tokens` tokens each, one after another or all at once. Returns {"wall_s", "tokens",
    "texts"}. Raises RuntimeError (the server did not start, a request failed)."""
    import threading
    import urllib.request

    from bench_serve import free_port  # benchmarks/ is on sys.path when a script in it runs

    port = free_port()
    cmd = [
        py,
        "-m",
        "specdec_cli",
        "serve",
        "--port",
        str(port),
        "--parallel",
        str(a.parallel),
        "-t",
        str(model),
        "--method",
        method,
        "--ctx",
        "8192",
        "--no-prompt-cache",
    ]
    url = f"http://127.0.0.1:{port}"
    t_end = time.monotonic() + timeout
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(env, SPECDEC_HOME=str(home)), cwd=ROOT
        )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}; see {log.name})")
            if time.monotonic() > t_end:
                raise RuntimeError(f"the server did not start in {timeout:.0f} s (see {log.name})")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        out: list[dict | None] = [None] * len(prompts)
        errors: list[str] = []

        def one(i: int) -> None:
            body = {"model": "any", "prompt": prompts[i], "max_tokens": a.serve_tokens, "temperature": 0}
            try:
                out[i] = post(f"{url}/v1/completions", body, max(5.0, t_end - time.monotonic()))
            except (OSError, ValueError) as e:
                errors.append(f"request {i}: {e}")

        t0 = time.monotonic()
        if at_once:
            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for i in range(len(prompts)):
                one(i)
        wall = time.monotonic() - t0
        if errors:
            raise RuntimeError("; ".join(errors))
        return {
            "wall_s": wall,
            "tokens": sum(r["usage"]["completion_tokens"] for r in out),
            "texts": [r["choices"][0]["text"] for r in out],
        }
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_rows(
    py: str, model: Path, a: argparse.Namespace, env: dict, work: Path, log: Path, left: Callable[[], float]
) -> list[Row]:
    """`specdec serve --parallel N` on `model`: for --method auto and none, four greedy completions one after another
    and then at once, each cell on a fresh server holding the verify curve that `doctor --measure` kept (nothing else
    learnt), the cells interleaved over `a.serve_repeats`. A row per method: aggregate tok/s (output tokens over the
    wall time from the first send to the last reply) one after another and at once, their ratio (medians), and
    whether each reply at once equals its reply one after another; and speculative against plain at once."""
    prompts = [(ROOT / f).read_text()[:n] for f, n in zip(SERVE_FILES, SERVE_CHARS, strict=False)]
    curve = Path(env["SPECDEC_HOME"]) / "data" / "learnt.json"
    results: dict[tuple[str, bool], list[dict]] = {}
    failed: list[Row] = []
    t_all = time.monotonic()
    for rep in range(a.serve_repeats):
        for method in ("auto", "none"):
            for at_once in (False, True) if rep % 2 == 0 else (True, False):
                home = work / f"serve-{method}-{'once' if at_once else 'serial'}-{rep}"
                shutil.rmtree(home, ignore_errors=True)
                (home / "data").mkdir(parents=True)
                if curve.is_file():
                    shutil.copy(curve, home / "data" / "learnt.json")
                try:
                    r = serve_cell(py, model, method, at_once, prompts, a, env, home, log, left())
                except RuntimeError as e:
                    failed.append(Row(f"serve --parallel {a.parallel} --method {method}", str(e), ok=False))
                    return failed
                results.setdefault((method, at_once), []).append(r)
    med = lambda rs: statistics.median(r["tokens"] / r["wall_s"] for r in rs)  # noqa: E731
    rows = []
    for method in ("auto", "none"):
        serial, once = results[(method, False)], results[(method, True)]
        same = sum(
            x == y for s, o in zip(serial, once, strict=False) for x, y in zip(s["texts"], o["texts"], strict=False)
        )
        rows.append(
            Row(
                f"serve --parallel {a.parallel} --method {method}",
                f"4 completions of {a.serve_tokens} tokens ({serial[0]['tokens']} made): one after another "
                f"{med(serial):.1f} tok/s, at once "
                f"{med(once):.1f} tok/s: {med(once) / med(serial):.2f}x; replies at once equal to one after "
                f"another: {same}/{len(prompts) * len(serial)}",
            )
        )
    rows.append(
        Row(
            "serve: speculative vs plain at once",
            f"{med(results[('auto', True)]) / med(results[('none', True)]):.2f}x "
            f"(medians of {a.serve_repeats} interleaved repeat(s))",
            time.monotonic() - t_all,
        )
    )
    return rows


def doctor_rows(code: int, seconds: float, out: str, model: Path) -> list[Row]:
    what = f"specdec doctor --measure -t {model.name}"
    try:
        doc = json.loads(out)
    except ValueError:
        return [Row(what, f"exit {code}: no report (see gpu_check.log)", seconds, ok=False)]
    curve = next((c["curve"] for c in doc.get("verify_curves", []) if c.get("target") == model.name), None)
    g = doc.get("gpu", {})
    devs = ", ".join(f"{d['name']} {d['free_mib']:,}/{d['total_mib']:,} MiB" for d in g.get("devices") or [])
    rows = [
        Row(
            "GPU lines",
            f"backend {g.get('backend') or 'none'}; devices {devs or 'n/a'}; layers "
            f"{g.get('layers')} ({g.get('why') or 'n/a'})",
        )
    ]
    if curve is None:
        return [Row(what, f"exit {code}: no curve kept (see gpu_check.log)", seconds, ok=False), *rows]
    ms = curve["ms"]
    v = {b: ms[b - 1] for b in (1, 2, 4, 8, 16, 32, 64) if b <= len(ms)}
    flat = len(ms) >= 64 and ms[63] <= 1.3 * ms[0]
    text = (
        "  ".join(f"v({b}) {x:.2f}" for b, x in v.items()) + f" ms; {'flat' if flat else 'not flat'} "
        f"(v(64)/v(1) = {ms[min(63, len(ms) - 1)] / ms[0]:.2f})"
        + (f"; disturbed: {curve['disturbed']}" if curve.get("disturbed") else "")
    )
    return [Row(what, text, seconds, ok=code == 0), *rows]


def run_rows(code: int, seconds: float, path: Path, model: Path) -> list[Row]:
    what = f"specdec run EDIT -t {model.name} --compare"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return [Row(what, f"exit {code}: no --json written (see gpu_check.log)", seconds, ok=False)]
    st, c = doc["stats"], doc.get("compare") or {}
    speed = (
        f"{c['speedup']:.2f}x plain ({c['speculative_tokens_per_s']:.1f} vs {c['plain_tokens_per_s']:.1f} "
        f"tok/s, {'identical' if c.get('identical') else 'outputs differ: ' + str(c.get('verdict'))})"
        if c
        else "no comparison"
    )
    rows = [
        Row(
            what,
            f"{speed}; {st['tokens_per_pass']:.2f} tokens/pass, {st['ms_per_pass']:.2f} ms/pass, "
            f"mean K {st['mean_k']:.1f}",
            seconds,
            ok=code == 0,
        )
    ]
    spec, plain = host_ms(st), host_ms(c.get("plain_stats") or {}) if c else None
    if spec is not None:
        rows.append(
            Row(
                "host work per pass",
                f"{spec:.2f} ms speculative ({st['n_target_passes']} passes)"
                + (f", {plain:.2f} ms plain" if plain is not None else "")
                + f"; a target pass {st['ms_per_pass']:.2f} ms",
            )
        )
    rows.append(energy_row(st.get("energy") or {}, ((c.get("plain_stats") or {}).get("energy") or {}) if c else {}))
    return rows


def energy_row(spec: dict, plain: dict) -> Row:
    """Decoding's joules per output token from the run's own counters (`models.energy`: NVML on an NVIDIA card), or
    why there is none."""
    if not spec.get("available"):
        return Row("energy per token", f"n/a: {spec.get('reason') or 'not in the report'}")
    text = f"{spec['j_per_token']:.4f} J/token speculative"
    if plain.get("available") and plain.get("j_per_token"):
        text += f", {plain['j_per_token']:.4f} plain ({plain['j_per_token'] / spec['j_per_token']:.2f}x less)"
    return Row(
        "energy per token",
        f"{text}; {spec['decode_watts']:.1f} W decoding; counted: {', '.join(spec.get('counted') or []) or '?'}",
    )


def render(rows: list[Row], total: float) -> str:
    """The one table, as plain text (it goes to logs and reports): what | result | seconds."""
    width = max(len(r.what) for r in rows)
    lines = [
        f"gpu_check ({platform.node() or '?'}, {total:.0f} s in all)",
        f"{'what':<{width}}  {'s':>6}  result",
        f"{'-' * width}  {'-' * 6}  {'-' * 40}",
    ]
    for r in rows:
        s = f"{r.seconds:6.1f}" if r.seconds is not None else " " * 6
        lines.append(f"{r.what:<{width}}  {s}  {'' if r.ok else 'FAILED: '}{r.result}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# the Vulkan mode: a real GPU backend on any machine (Mesa's lavapipe runs Vulkan on the CPU)


VK_COMMANDS = (
    "run --method none",
    "run (auto)",
    "check",
    "chat (3 turns)",
    "prompt cache (2nd run restores)",
    "serve --parallel 2 (2 at once)",
)
CHAT_TURNS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Now make it ignore case and spaces.",
    "Add a docstring to it.",
]


def _vk_run(
    py: str, args: list[str], env: dict, log: Path, timeout: float, stdin: str | None = None
) -> tuple[int, float, str]:
    """`specdec` in the Vulkan check's environment `py`, named in the log, with `stdin` (none: empty)."""
    return specdec(py, args, env, log, timeout, stdin=stdin or "", tag=f"[{Path(py).parent.parent.name}] ")


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def vk_outputs(py: str, model: Path, a: argparse.Namespace, env: dict, work: Path, log: Path) -> dict:
    """Every greedy command of the Vulkan check with one build (`py`), on `model`: {command: {"rc", "s", "text",
    "tok_s", ...}}. A fresh SPECDEC_HOME per build and model, so nothing learnt on one build reaches the other."""
    tag = Path(py).parent.parent.name
    home = work / f"home-{tag}-{model.stem}"
    shutil.rmtree(home, ignore_errors=True)
    env = dict(env, SPECDEC_HOME=str(home))
    t = a.budget
    common = ["-t", str(model), "--raw", "-n", str(a.tokens)]
    out: dict[str, dict] = {}
    for name, extra in (
        ("run --method none", ["--method", "none", "--no-prompt-cache", "--logprobs", "2"]),
        ("run (auto)", ["--no-prompt-cache"]),
    ):
        doc = work / f"{tag}-{model.stem}-{name.split()[-1].strip('()')}.json"
        rc, s, _ = _vk_run(py, ["run", a.edit, *common, *extra, "--json", str(doc)], env, log, t)
        d = _json(doc)
        st = d.get("stats") or {}
        out[name] = {
            "rc": rc,
            "s": s,
            "text": d.get("text"),
            "tok_s": st.get("tokens_per_s"),
            "passes": st.get("n_target_passes"),
            "tokens": d.get("tokens"),
            "logprobs": d.get("logprobs"),
        }
    doc = work / f"{tag}-{model.stem}-check.json"
    rc, s, _ = _vk_run(
        py, ["check", a.edit, "-t", str(model), "--raw", "-n", str(a.tokens), "--json", str(doc)], env, log, t
    )
    d = _json(doc)
    c = d.get("check") or {}
    out["check"] = {
        "rc": rc,
        "s": s,
        "text": d.get("text"),
        "verdict": f"{c.get('n_checked')} positions checked, {c.get('n_flagged')} flagged" if c else "",
    }
    saved = work / f"{tag}-{model.stem}-chat.json"
    script = "\n".join([*CHAT_TURNS, f"/save {saved}", "/quit"]) + "\n"
    rc, s, _ = _vk_run(py, ["chat", "-t", str(model), "-n", str(a.tokens)], env, log, t, stdin=script)
    d = _json(saved)
    turns = [m.get("content") for m in (d.get("messages") or []) if m.get("role") == "assistant"]
    out["chat (3 turns)"] = {"rc": rc, "s": s, "text": turns or None}
    texts, restored = [], []
    for i in range(2):  # the prompt cache: the first run saves the KV state from the device, the second restores it
        doc = work / f"{tag}-{model.stem}-cache{i}.json"
        rc, s, _ = _vk_run(py, ["run", a.edit, *common, "--method", "none", "--json", str(doc)], env, log, t)
        d = _json(doc)
        texts.append(d.get("text"))
        restored.append((d.get("stats") or {}).get("n_restored") or 0)
    out["prompt cache (2nd run restores)"] = {
        "rc": rc,
        "s": s,
        "text": texts[1],
        "same_as_first": texts[0] == texts[1],
        "restored": restored[1],
    }
    try:
        cell = serve_cell(
            py,
            model,
            "auto",
            True,
            [CHAT_TURNS[0], CHAT_TURNS[1]],
            argparse.Namespace(parallel=2, serve_tokens=a.tokens),
            env,
            home / "serve",
            log,
            t,
        )
        out[VK_COMMANDS[-1]] = {"rc": 0, "s": cell["wall_s"], "text": cell["texts"]}
    except RuntimeError as e:
        out[VK_COMMANDS[-1]] = {"rc": 1, "s": None, "text": None, "error": str(e)}
    return out


def cross_divergence(cpu: dict, vk: dict) -> str:
    """Where the device's plain greedy output first leaves the CPU build's, judged in the CPU build's numerics: its
    logprob of its own token minus its logprob of the device's token there (top-2 logprobs of its run), against the
    near-tie threshold `specdec check` uses (1.0)."""
    a, b = cpu.get("tokens") or [], vk.get("tokens") or []
    i = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if i is None:
        return "identical" if len(a) == len(b) else f"one is a prefix of the other ({len(a)} vs {len(b)} tokens)"
    lps = cpu.get("logprobs") or []
    if i >= len(lps):
        return f"first differs at token {i} (no logprobs there)"
    top = {t["token"]: t["logprob"] for t in lps[i]["top_logprobs"]}
    if b[i] not in top:
        return f"first differs at token {i}: the device's token is not in the CPU build's top 2 (a DIVERGENCE)"
    margin = lps[i]["logprob"] - top[b[i]]
    return (
        f"first differs at token {i} of {len(a)}: margin {margin:.3f} logits in the CPU build's numerics, "
        f"{'a numerical near-tie' if margin < 1.0 else 'a DIVERGENCE'}"
    )


def vulkan(a: argparse.Namespace) -> int:
    """The Vulkan check: `--vk-python` (a Python whose llama-cpp-python was built with -DGGML_VULKAN=on) against this
    Python's build (the CPU's), every layer on the Vulkan device, the same greedy commands on the same models; a row
    per command: exit codes, whether the device's output equals the CPU build's (and where it does not, whether
    `specdec check` on the device calls every divergence a near-tie), and the device's tok/s, which on Mesa's lavapipe
    is a CPU's speed, not a GPU's. Writes vulkan_check.txt/.json under --work (and $OUT). Exit 0 when every command
    exited 0 on both builds."""
    t_start = time.monotonic()
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = work / "vulkan_check.log"
    log.write_text("")
    env = dict(
        os.environ,
        NO_COLOR="1",
        COLUMNS="200",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    env["SPECDEC_VERIFY_CURVE"] = "off"  # outputs are compared here, not speed: no curve measured on either build
    cpu_env = dict(env, SPECDEC_GPU_LAYERS="0")
    # ggml-vulkan skips a device of type CPU (Mesa's lavapipe) unless it is named
    vk_env = dict(env, SPECDEC_GPU_LAYERS="-1", GGML_VK_VISIBLE_DEVICES=os.environ.get("GGML_VK_VISIBLE_DEVICES", "0"))
    rows: list[Row] = []
    rc, s, out = _vk_run(a.vk_python, ["doctor", "--json", "-"], vk_env, log, a.budget)
    try:
        g = json.loads(out).get("gpu", {})
        devs = ", ".join(f"{d['name']} {d['free_mib']:,}/{d['total_mib']:,} MiB" for d in g.get("devices") or [])
        rows.append(
            Row(
                "device",
                f"backend {g.get('backend') or 'none'}; devices {devs or 'n/a'}",
                s,
                ok=rc == 0 and bool(g.get("backend")),
            )
        )
    except ValueError:
        rows.append(Row("device", f"specdec doctor exited {rc} with no report (see vulkan_check.log)", s, ok=False))
    models = [Path(m) for m in a.models] if a.models else [m for m in (real_model(),) if m is not None]
    results: list[dict] = []
    for model in models:
        rc, s, out = _vk_run(a.vk_python, ["doctor", "-t", str(model), "--json", "-"], vk_env, log, a.budget)
        try:
            g = json.loads(out).get("gpu", {})
            rows.append(
                Row(
                    f"{model.name}: layers", f"{g.get('layers')} on the device ({g.get('why') or 'n/a'})", s, ok=rc == 0
                )
            )
        except ValueError:
            rows.append(Row(f"{model.name}: layers", f"doctor -t exited {rc} with no report", s, ok=False))
        cpu = vk_outputs(sys.executable, model, a, cpu_env, work, log)
        vk = vk_outputs(a.vk_python, model, a, vk_env, work, log)
        for name in VK_COMMANDS:
            c, v = cpu.get(name, {}), vk.get(name, {})
            ok = c.get("rc") == 0 and v.get("rc") == 0
            equal = c.get("text") is not None and c.get("text") == v.get("text")
            what = "yes" if equal else ("n/a" if not ok else "no")
            extra = ""
            if name.startswith("prompt cache"):
                extra = (
                    f"; restored {v.get('restored')} tokens on the device, same as its first run: "
                    f"{v.get('same_as_first')}"
                )
            if v.get("tok_s"):
                extra += f"; {v['tok_s']:.1f} tok/s on lavapipe (a CPU's speed), {c.get('tok_s') or 0:.1f} CPU build"
            if v.get("error"):
                extra += f"; {v['error']}"
            rows.append(
                Row(
                    f"{model.name}: {name}",
                    f"exit {c.get('rc')}/{v.get('rc')} (CPU/Vulkan); output equal to the CPU build's: {what}{extra}",
                    v.get("s"),
                    ok=ok,
                )
            )
            results.append(
                {
                    "model": model.name,
                    "command": name,
                    "equal": equal,
                    "cpu_rc": c.get("rc"),
                    "vk_rc": v.get("rc"),
                    "vk": {k: x for k, x in v.items() if k != "text"},
                }
            )
        cmp_cpu, cmp_vk = cpu.get("run --method none", {}), vk.get("run --method none", {})
        rows.append(Row(f"{model.name}: plain greedy, CPU build vs device", cross_divergence(cmp_cpu, cmp_vk)))
        chk = vk.get("check", {})
        rows.append(
            Row(
                f"{model.name}: check on the device",
                f"exit {chk.get('rc')} (0: every divergence from "
                f"one-token decoding a near-tie); {chk.get('verdict') or ''}",
                chk.get("s"),
                ok=chk.get("rc") == 0,
            )
        )
    table = render(rows, time.monotonic() - t_start).replace("gpu_check (", "vulkan check (", 1)
    print(table)
    out_dir = os.environ.get("OUT")
    for d in (work, Path(out_dir) if out_dir else None):
        if d is not None:
            (d / "vulkan_check.txt").write_text(table + "\n")
            (d / "vulkan_check.json").write_text(
                json.dumps({"rows": [r.__dict__ for r in rows], "commands": results}, indent=1)
            )
    return 0 if all(r.ok for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    sub.add_parser("prepare", help="download and trim the sdist and the wheels into .cache/gpu_check (network)")
    vk = sub.add_parser("vulkan", help="the same greedy commands on a Vulkan build and this Python's, compared")
    vk.add_argument("--vk-python", required=True, help="a Python whose llama-cpp-python is a Vulkan build")
    vk.add_argument(
        "--model",
        dest="models",
        action="append",
        help="a GGUF to run (repeatable; default: the catalog's smollm2-135m from the model cache)",
    )
    ap.add_argument("--no-build", action="store_true", help="use the llama-cpp-python installed (a CPU run)")
    ap.add_argument("--arch", help="CMAKE_CUDA_ARCHITECTURES (default: the card's compute capability)")
    ap.add_argument("--shape", default="qwen2.5-coder-1.5b", help="the random model's shape (random_gguf.SHAPES)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens the edit generates (default 128)")
    ap.add_argument("--edit", default=str(EDIT), help="the copy-heavy edit's prompt file (default: textwrap_rename)")
    ap.add_argument("--no-real", action="store_true", help="skip the real model even where the cache has it")
    ap.add_argument("--parallel", type=int, default=4, help="the concurrency step's specdec serve --parallel")
    ap.add_argument("--serve-tokens", type=int, default=128, help="tokens of each of its completions (default 128)")
    ap.add_argument("--serve-repeats", type=int, default=1, help="its interleaved repeats (0: skip the step)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole check (default 480)")
    ap.add_argument("--work", default=str(CACHE / "work"), help="where the venv, build, models and home go")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        return prepare()
    if a.cmd == "vulkan":
        return vulkan(a)
    return check(a)


if __name__ == "__main__":
    sys.exit(main())
