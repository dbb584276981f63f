"""The devices llama.cpp computes on, and how many of a model's layers go to the GPU.

`devices()` lists ggml's backend devices (the CPU, and a CUDA/Metal/Vulkan GPU where the build has one) with their
free and total memory, through ggml's device API (`ggml_backend_dev_count`, `_get`, `_name`, `_description`,
`_type`, `_memory` in ggml-backend.h), which llama-cpp-python does not bind: the functions are looked up in the
library it loaded (`llama_cpp.llama_cpp._lib`, whose dependencies export them on Linux and macOS), else in ggml-base
and ggml next to it (Windows, where each DLL exports only its own functions). None where they cannot be found.

`offload(...)` decides `n_gpu_layers` for one model: what the user asked (`--gpu-layers`, SPECDEC_GPU_LAYERS), else
every layer (-1) on a build that offloads, unless the model's weights, its KV cache and a compute buffer do not fit
in the GPUs' free memory; then as many layers as fit. docs/gpu.md.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("CPU", "GPU", "IGPU", "ACCEL", "META")  # enum ggml_backend_dev_type, in its order (ggml-backend.h)
GPU_KINDS = ("GPU", "IGPU")
COMPUTE_MIB = 512  # room left on the GPU for llama.cpp's compute buffers and the CUDA context, MiB
ALL = -1  # n_gpu_layers: every layer


@dataclass(frozen=True, slots=True)
class Device:
    """One ggml backend device. kind: one of `KINDS` ("?" for a type this table does not know); memory in bytes."""

    name: str
    description: str
    kind: str
    free: int
    total: int

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "kind": self.kind,
            "free_mib": self.free >> 20,
            "total_mib": self.total >> 20,
        }


# ggml's device API lives in two libraries: ggml-backend-reg.cpp (`_count`, `_get`) is built into ggml,
# ggml-backend.cpp (`_name`, `_description`, `_type`, `_memory`) into ggml-base (ggml/src/CMakeLists.txt). Linux and
# macOS find them through llama's dependencies; Windows exports a function only from the DLL that defines it.
_GGML_LIBRARIES = ("ggml-base", "ggml")
_DEVICE_API = (
    "ggml_backend_dev_count",
    "ggml_backend_dev_get",
    "ggml_backend_dev_name",
    "ggml_backend_dev_description",
    "ggml_backend_dev_type",
    "ggml_backend_dev_memory",
)
_open_library = ctypes.CDLL


def devices() -> list[Device] | None:
    """ggml's backend devices in its order, or None where the device API cannot be reached (an older build, no
    llama-cpp-python). Initialises llama.cpp's backends first (`llama_backend_init`, idempotent)."""
    try:
        import llama_cpp

        llama_cpp.llama_backend_init()
        count, get, name, desc, kind, memory = _device_api(llama_cpp.llama_cpp)
    except (ImportError, AttributeError, OSError):
        return None
    count.restype, count.argtypes = ctypes.c_size_t, []
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    for fn in (name, desc):
        fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    kind.restype, kind.argtypes = ctypes.c_int, [ctypes.c_void_p]
    memory.restype = None
    memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    out = []
    for i in range(int(count())):
        dev = get(i)
        if not dev:
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        memory(dev, ctypes.byref(free), ctypes.byref(total))
        k = int(kind(dev))
        out.append(
            Device(
                name=(name(dev) or b"?").decode("utf-8", "replace"),
                description=(desc(dev) or b"").decode("utf-8", "replace"),
                kind=KINDS[k] if 0 <= k < len(KINDS) else "?",
                free=int(free.value),
                total=int(total.value),
            )
        )
    return out


def _device_api(bindings: Any) -> list:
    """The functions of `_DEVICE_API`, each from the first library that exports it: llama-cpp-python's `_lib` (the
    `bindings` module's), then ggml-base and ggml from the folder it loaded llama from (`_base_path`: its lib/ or
    LLAMA_CPP_LIB_PATH), as lib<name>.so, lib<name>.dylib, <name>.dll or lib<name>.dll. Raises AttributeError for a
    function none exports."""
    libraries = [bindings._lib]
    if not all(hasattr(bindings._lib, fn) for fn in _DEVICE_API):
        libraries += _ggml_libraries(Path(getattr(bindings, "_base_path", Path(bindings.__file__).parent / "lib")))
    out = []
    for fn in _DEVICE_API:
        lib = next((lib for lib in libraries if hasattr(lib, fn)), None)
        if lib is None:
            raise AttributeError(f"no library exports {fn}")
        out.append(getattr(lib, fn))
    return out


def _ggml_libraries(base: Path) -> list:
    """ggml-base and ggml from the folder `base`, those found and loadable (already loaded by llama: no new copy)."""
    out = []
    for name in _GGML_LIBRARIES:
        for file in (f"lib{name}.so", f"lib{name}.dylib", f"{name}.dll", f"lib{name}.dll"):
            if (base / file).is_file():
                try:
                    out.append(_open_library(str(base / file)))
                except OSError:
                    continue
                break
    return out


def gpu_free(devs: list[Device] | None) -> int | None:
    """Free bytes over the GPUs of `devs` (None: unknown, no device list or no GPU in it)."""
    gpus = [d for d in devs or () if d.kind in GPU_KINDS]
    return sum(d.free for d in gpus) if gpus else None


@dataclass(frozen=True, slots=True)
class Offload:
    """n_gpu_layers for one model and why. layers: -1 = all; need: bytes it takes on the GPU when all go (0: not
    estimated)."""

    layers: int
    why: str
    need: int = 0


def model_need(path: str | os.PathLike[str], n_ctx: int) -> tuple[int, int]:
    """(bytes a fully offloaded model takes on the GPU: its weights, an f16 KV cache of `n_ctx` tokens and
    `COMPUTE_MIB`; its layer count, 0 when the header does not say). Raises ModelError for a file that is not a
    GGUF (`gguf.check_gguf`)."""
    from specdec_cli.models.gguf import check_gguf

    info = check_gguf(path)
    meta, arch = info.metadata, info.architecture or ""

    def num(key: str) -> int:
        v = meta.get(f"{arch}.{key}")
        return int(v) if isinstance(v, (int, float)) else 0

    layers, embd = num("block_count"), num("embedding_length")
    heads, kv_heads = num("attention.head_count"), num("attention.head_count_kv") or num("attention.head_count")
    kv = 2 * n_ctx * layers * (embd * kv_heads // heads if heads else embd) * 2  # K and V, f16
    return info.file_size + kv + (COMPUTE_MIB << 20), layers


def offload(path: str | os.PathLike[str], requested: int, *, gpu: bool, free: int | None, n_ctx: int) -> Offload:
    """n_gpu_layers for the model at `path`: `requested` when it is not -1 (the user said); on a build without GPU
    offload (`gpu` False) -1, which the CPU ignores; else -1 when the model (`model_need`) fits in `free` bytes of GPU
    memory (None: unknown, then llama.cpp is left to try), else the share of its layers that fits (at least 0).
    Never raises: a file whose header cannot be read keeps `requested`."""
    if requested != ALL:
        return Offload(requested, f"{requested} layers (--gpu-layers / SPECDEC_GPU_LAYERS)")
    if not gpu:
        return Offload(ALL, "none: a CPU build of llama.cpp")
    if free is None:
        return Offload(ALL, "all layers (the GPU's free memory is not known)")
    try:
        need, layers = model_need(path, n_ctx)
    except Exception:  # noqa: BLE001 - a header llama.cpp may still read: let it try
        return Offload(ALL, "all layers (the model's size is not known)")
    mib = lambda n: f"{n / (1 << 30):.1f} GiB"  # noqa: E731
    if need <= free:
        return Offload(ALL, f"all layers: {Path(path).name} needs {mib(need)} of {mib(free)} free", need)
    fit = max(0, int(layers * (free - (COMPUTE_MIB << 20)) / max(need - (COMPUTE_MIB << 20), 1))) if layers else 0
    return Offload(
        fit,
        f"{fit} of {layers} layers: {Path(path).name} needs {mib(need)} and {mib(free)} is free "
        "(--gpu-layers N sets it)",
        need * fit // layers if layers else 0,
    )


def placement(path: str | os.PathLike[str], layers: int, *, gpu: bool, devs: list[Device] | None) -> str:
    """Where a model loaded with n_gpu_layers = `layers` (-1: all) runs its passes, one phrase for the keys of what
    was timed on it (`stores.tuned.machine`): "" on a build that cannot offload (every pass on the CPU, as keys
    written before this phrase existed assumed); else the device that holds the offloaded layers (the first GPU of
    `devs`: ggml's name and description, "CUDA0 NVIDIA ...", "Vulkan0 llvmpipe (...)"; "CPU" when none go) and
    the effective count of layers offloaded ("CPU, 0 layers offloaded", "Vulkan0 ..., 29 layers offloaded"): what
    llama.cpp offloads, the repeating layers and the output layer, at most (`model_need`'s count + 1; a header that
    cannot be read: the count asked, "all" for -1). Never raises."""
    if not gpu:
        return ""
    try:
        n = model_need(path, 0)[1]
    except Exception:  # noqa: BLE001 - the count asked is then the best there is
        n = 0
    count: int | str = (n + 1 if n else "all") if layers == ALL else (min(layers, n + 1) if n else layers)
    if count == 0:
        return "CPU, 0 layers offloaded"
    gpus = [d for d in devs or () if d.kind in GPU_KINDS]
    device = " ".join(x for x in (gpus[0].name, gpus[0].description) if x) if gpus else "a GPU"
    return f"{device}, {count} layers offloaded"
