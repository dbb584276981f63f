"""Pure-Python GGUF header validation: is this a GGUF file, and is it whole?

`check_gguf` reads only the header (magic, version, metadata key/values, tensor infos) through `mmap`, so only the
pages it touches are read: a few MB for a 150k-token vocabulary, never the tensor data. From the tensor infos it
computes the size the file must have (aligned data offset + the end of the last tensor), which catches interrupted
downloads and truncated copies before llama.cpp fails on them with a less helpful message.

Layout (GGUF v2/v3, little-endian unless the version word says otherwise):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv      x (string key | u32 value_type | value)
    n_tensors x (string name | u32 n_dims | u64 dims[n_dims] | u32 ggml_type | u64 offset)
    padding to general.alignment (default 32) | tensor data

Reference: the GGUF specification (ggml `docs/gguf.md`) and the block sizes in `ggml.c` (`type_traits`).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec_cli.errors import ModelError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# ggml type id -> (name, elements per block, bytes per block). From ggml.c `type_traits` (QK_K = 256).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}

# Metadata value types: id -> struct format of a scalar (STRING = 8 and ARRAY = 9 are handled apart).
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# Sanity bounds against corrupt counts (a corrupt u64 would otherwise make us loop for a very long time).
_MAX_TENSORS = 1 << 20
_MAX_KV = 1 << 20
_MAX_DIMS = 8

_REFETCH = "Delete it and fetch it again (`specdec models pull NAME` for catalog models)."


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # relative to the start of the data section

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type{self.ggml_type}", 0, 0))[0]

    @property
    def nbytes(self) -> int | None:
        """Bytes of tensor data, or None for a ggml type this module does not know."""
        return tensor_nbytes(self.dims, self.ggml_type)


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    """What the header of a GGUF file says.

    `metadata` holds the scalar and string key/values (arrays are skipped, `array_lengths` has their lengths).
    `implied_size` is a lower bound on the file size: aligned data offset + max(tensor offset + nbytes).
    """

    path: Path
    version: int
    n_tensors: int
    n_kv: int
    architecture: str | None
    name: str | None
    tokenizer_model: str | None
    alignment: int
    data_offset: int
    implied_size: int
    file_size: int
    tensors: tuple[TensorInfo, ...] = field(repr=False)
    metadata: dict[str, object] = field(repr=False, hash=False)
    array_lengths: dict[str, int] = field(repr=False, hash=False)
    unknown_types: tuple[int, ...] = ()


def tensor_nbytes(dims: tuple[int, ...], ggml_type: int) -> int | None:
    if ggml_type not in GGML_TYPES:
        return None
    _, block, type_size = GGML_TYPES[ggml_type]
    n = math.prod(dims)
    return n // block * type_size if block > 1 else n * type_size


class _Truncated(Exception):
    """The header runs past the end of the file."""


class _Corrupt(Exception):
    """The header contains an impossible value."""


class _Reader:
    """Cursor over the mapped file; every read is bounds-checked."""

    __slots__ = ("buf", "pos", "size", "e")

    def __init__(self, buf: mmap.mmap | bytes, size: int, endian: str) -> None:
        self.buf, self.pos, self.size, self.e = buf, 0, size, endian

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise _Truncated
        (v,) = struct.unpack_from(self.e + fmt, self.buf, self.pos)
        self.pos += n
        return v

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated
        self.pos += n

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > self.size:
            raise _Truncated
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        # The hot loop of the whole module (tokenizer.ggml.tokens / merges: ~150k strings for Qwen).
        buf, pos, size, unpack = self.buf, self.pos, self.size, struct.Struct(self.e + "Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                raise _Truncated
            pos += 8 + unpack(buf, pos)[0]
        if pos > size:
            raise _Truncated
        self.pos = pos


def _read_header(r: _Reader):
    n_tensors, n_kv = r.take("Q"), r.take("Q")
    if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
        raise _Corrupt(f"implausible counts: {n_tensors} tensors, {n_kv} metadata keys")
    metadata: dict[str, object] = {}
    arrays: dict[str, int] = {}
    for _ in range(n_kv):
        key = r.string()
        vtype = r.take("I")
        if vtype in _SCALAR:
            metadata[key] = r.take(_SCALAR[vtype])
        elif vtype == _STRING:
            metadata[key] = r.string()
        elif vtype == _ARRAY:
            etype, count = r.take("I"), r.take("Q")
            arrays[key] = count
            if etype in _SCALAR:
                r.skip(count * struct.calcsize(_SCALAR[etype]))
            elif etype == _STRING:
                r.skip_strings(count)
            else:  # nested arrays do not occur in practice; the spec allows them but nobody writes them
                raise _Corrupt(f"metadata key {key!r} has an array of unsupported type {etype}")
        else:
            raise _Corrupt(f"metadata key {key!r} has unknown value type {vtype}")
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.take("I")
        if n_dims > _MAX_DIMS:
            raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
        dims = tuple(r.take("Q") for _ in range(n_dims))
        tensors.append(TensorInfo(name, dims, r.take("I"), r.take("Q")))
    return n_tensors, n_kv, metadata, arrays, tensors


def check_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Validate the header of the GGUF file at `path` and return what it says.

    Raises ModelError when the file cannot be read, is not GGUF, has an unsupported version, has a corrupt header,
    or is shorter than its header implies ("truncated: X bytes, header implies Y").
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(24)
            if size == 0:
                raise ModelError(f"{path} is empty (0 bytes), not a GGUF file.", _REFETCH)
            if head[:4] != MAGIC:
                raise _not_gguf(path, head)
            if size < 24:
                raise ModelError(f"{path} is truncated: {size} bytes, a GGUF header needs at least 24.", _REFETCH)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _check(path, buf, size)
    except OSError as e:
        raise ModelError(f"Cannot read {path}: {e.strerror or e}.", "Check the path and its permissions.") from e


def _not_gguf(path: Path, head: bytes) -> ModelError:
    return ModelError(
        f"{path} is not a GGUF file (it starts with {bytes(head[:4])!r}, a GGUF file starts with b'GGUF').",
        "Pass a .gguf model file (llama.cpp format), or a catalog name from `specdec models list`.",
    )


def _check(path: Path, buf: mmap.mmap, size: int) -> GGUFInfo:
    if buf[:4] != MAGIC:
        raise _not_gguf(path, buf[:4])
    (version,) = struct.unpack_from("<I", buf, 4)
    endian = "<"
    if version not in SUPPORTED_VERSIONS:
        (be_version,) = struct.unpack_from(">I", buf, 4)
        if be_version in SUPPORTED_VERSIONS:
            version, endian = be_version, ">"
        else:
            raise ModelError(
                f"{path} is GGUF version {version}; specdec reads versions 2 and 3.",
                "Re-convert the model with a recent llama.cpp (convert_hf_to_gguf.py).",
            )
    r = _Reader(buf, size, endian)
    r.pos = 8
    try:
        n_tensors, n_kv, metadata, arrays, tensors = _read_header(r)
    except _Truncated:
        raise ModelError(
            f"{path} is truncated: {size} bytes, and its header alone runs past the end.", _REFETCH
        ) from None
    except _Corrupt as e:
        raise ModelError(f"{path} has a corrupt GGUF header: {e}.", _REFETCH) from None

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelError(f"{path} has a corrupt GGUF header: general.alignment = {alignment!r}.", _REFETCH)
    data_offset = -(-r.pos // alignment) * alignment
    end = 0
    unknown: set[int] = set()
    for t in tensors:
        nbytes = t.nbytes
        if nbytes is None:
            unknown.add(t.ggml_type)
            nbytes = 0
        end = max(end, t.offset + nbytes)
    implied = data_offset + end
    if size < implied:
        raise ModelError(f"{path} is truncated: {size} bytes, header implies {implied}.", _REFETCH)

    def text(key: str) -> str | None:
        v = metadata.get(key)
        return v if isinstance(v, str) else None

    return GGUFInfo(
        path=path,
        version=version,
        n_tensors=n_tensors,
        n_kv=n_kv,
        architecture=text("general.architecture"),
        name=text("general.name"),
        tokenizer_model=text("tokenizer.ggml.model"),
        alignment=alignment,
        data_offset=data_offset,
        implied_size=implied,
        file_size=size,
        tensors=tuple(tensors),
        metadata=metadata,
        array_lengths=arrays,
        unknown_types=tuple(sorted(unknown)),
    )


def kv_bytes_per_token(info: GGUFInfo, type_bytes: int = 2) -> int | None:
    """Bytes one token takes in llama.cpp's KV cache for this model: layers x (K head size + V head size) x KV heads x
    `type_bytes` (2: the default f16 cache), from the header's `{arch}.block_count`, `.attention.head_count(_kv)`,
    `.attention.key_length`/`.value_length` (else `.embedding_length` / heads). None when the header lacks them (a
    recurrent model's state is not per token). E.g. Qwen2.5-Coder-1.5B: 28 x (128 + 128) x 2 x 2 = 28,672."""
    meta: dict[str, Any] = info.metadata  # the header's values, of any type: int() below checks them
    arch = info.architecture
    try:
        layers = int(meta[f"{arch}.block_count"])
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head = int(meta[f"{arch}.embedding_length"]) // heads
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    k = int(meta.get(f"{arch}.attention.key_length", head))
    v = int(meta.get(f"{arch}.attention.value_length", head))
    return layers * (k + v) * kv_heads * type_bytes


def nextn_layers(info: GGUFInfo) -> int:
    """The model's multi-token-prediction (MTP) layers: the header's `{arch}.nextn_predict_layers` (Qwen3.5, GLM-4.5,
    DeepSeek-V3 ship them; llama.cpp drafts from them with `draft-mtp`); 0 when it has none."""
    v = info.metadata.get(f"{info.architecture}.nextn_predict_layers", 0)
    return int(v) if isinstance(v, int) and v > 0 else 0
