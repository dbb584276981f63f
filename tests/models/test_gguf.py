"""gguf.check_gguf: header parsing, the implied size, and every way a file can be wrong.

Synthetic files are header-only GGUFs built here (a few KB); the real catalog models are checked when the shared cache
has them (pytest -m real pulls smollm2-135m).
"""

from __future__ import annotations

import mmap
import struct
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec_cli import config
from specdec_cli.errors import ModelError
from specdec_cli.models import gguf
from specdec_cli.models.gguf import GGML_TYPES, check_gguf, tensor_nbytes

F32, Q8_0, Q4_K = 0, 8, 12


def _str(s: str, e: str = "<") -> bytes:
    b = s.encode()
    return struct.pack(e + "Q", len(b)) + b


def build_gguf(
    kvs: list[tuple[str, int, object]] | None = None,
    tensors: list[tuple[str, tuple[int, ...], int]] | None = None,
    *,
    alignment: int | None = None,
    version: int = 3,
    endian: str = "<",
) -> bytes:
    """A whole GGUF file: metadata (key, value type, value), tensors (name, dims, ggml type) laid out in order."""
    kvs = list(kvs if kvs is not None else [(k, 8, v) for k, v in _DEFAULT_META.items()])
    tensors = tensors if tensors is not None else [("tok_embd.weight", (64, 4), F32), ("out.weight", (256, 2), Q4_K)]
    if alignment is not None:
        kvs.append(("general.alignment", 4, alignment))
    align = alignment or 32
    out = bytearray(b"GGUF" + struct.pack(endian + "IQQ", version, len(tensors), len(kvs)))
    for key, vtype, value in kvs:
        out += _str(key, endian) + struct.pack(endian + "I", vtype)
        if vtype == 8:
            out += _str(value, endian)
        elif vtype == 9:
            etype, items = value
            out += struct.pack(endian + "IQ", etype, len(items))
            for item in items:
                out += _str(item, endian) if etype == 8 else struct.pack(endian + "i", item)
        else:
            out += struct.pack(endian + {4: "I", 5: "i", 6: "f", 7: "?", 10: "Q"}[vtype], value)
    offset = 0
    sizes = []
    for name, dims, gtype in tensors:
        out += _str(name, endian) + struct.pack(endian + "I", len(dims))
        out += struct.pack(endian + f"{len(dims)}Q", *dims) + struct.pack(endian + "IQ", gtype, offset)
        n = tensor_nbytes(dims, gtype)
        sizes.append(n)
        offset += -(-n // align) * align
    out += b"\0" * (-len(out) % align)
    for n in sizes:
        out += b"\x11" * n + b"\0" * (-n % align)
    return bytes(out[: len(out) - (-sizes[-1] % align)] if sizes else out)


_DEFAULT_META = {"general.architecture": "llama", "general.name": "Tiny Test", "tokenizer.ggml.model": "gpt2"}


def write(tmp_path: Path, data: bytes, name: str = "m.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_reads_header_fields_and_implied_size(tmp_path):
    kvs = [(k, 8, v) for k, v in _DEFAULT_META.items()]
    kvs += [("tokenizer.ggml.tokens", 9, (8, ["a", "bb", "<|im_end|>"]))]
    kvs += [("tokenizer.ggml.token_type", 9, (5, [1, 1, 3]))]
    kvs += [("llama.context_length", 4, 2048), ("general.quantized", 7, True)]
    data = build_gguf(kvs)
    info = check_gguf(write(tmp_path, data))
    assert (info.version, info.architecture, info.name, info.tokenizer_model) == (3, "llama", "Tiny Test", "gpt2")
    assert info.metadata["llama.context_length"] == 2048
    assert info.array_lengths == {"tokenizer.ggml.tokens": 3, "tokenizer.ggml.token_type": 3}
    assert [(t.name, t.dims, t.type_name) for t in info.tensors] == [
        ("tok_embd.weight", (64, 4), "F32"),
        ("out.weight", (256, 2), "Q4_K"),
    ]
    assert info.tensors[1].offset == 1024 and info.tensors[1].nbytes == 2 * 144
    assert info.data_offset % 32 == 0
    assert info.implied_size == info.data_offset + 1024 + 288 == len(data) == info.file_size


def test_custom_alignment_moves_the_data_offset(tmp_path):
    info = check_gguf(write(tmp_path, build_gguf(alignment=256)))
    assert info.alignment == 256 and info.data_offset % 256 == 0


def test_big_endian_file(tmp_path):
    info = check_gguf(write(tmp_path, build_gguf(endian=">")))
    assert info.architecture == "llama" and info.implied_size == info.file_size


@pytest.mark.parametrize(
    ("dims", "gtype", "nbytes"),
    [
        ((10,), 0, 40),
        ((7, 3), 1, 42),
        ((64,), 8, 68),
        ((256, 2), 12, 288),
        ((512,), 14, 420),
        ((32,), 2, 18),
        ((8,), 30, 16),
    ],
)
def test_tensor_nbytes(dims, gtype, nbytes):
    assert tensor_nbytes(dims, gtype) == nbytes


def test_type_table_covers_the_common_quantisations():
    names = {name for name, _, _ in GGML_TYPES.values()}
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"} <= names
    assert {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"} <= names
    assert {"Q8_K", "IQ2_XXS", "IQ4_XS", "IQ1_M"} <= names


def test_truncated_data_names_both_sizes(tmp_path):
    data = build_gguf()
    with pytest.raises(ModelError, match=rf"truncated: {len(data) - 100} bytes, header implies {len(data)}\.") as e:
        check_gguf(write(tmp_path, data[:-100]))
    assert "fetch it again" in e.value.fix
    assert e.value.exit_code == 3


def test_truncated_inside_the_header(tmp_path):
    data = build_gguf([("tokenizer.ggml.tokens", 9, (8, ["tok"] * 200))])
    with pytest.raises(ModelError, match="truncated: 500 bytes, and its header alone runs past the end"):
        check_gguf(write(tmp_path, data[:500]))


def test_not_gguf(tmp_path):
    with pytest.raises(ModelError, match=r"not a GGUF file \(it starts with b'PK\\x03\\x04'") as e:
        check_gguf(write(tmp_path, b"PK\x03\x04" + b"\0" * 100, "m.zip"))
    assert "specdec models list" in e.value.fix


def test_empty_and_tiny_files(tmp_path):
    with pytest.raises(ModelError, match="is empty"):
        check_gguf(write(tmp_path, b""))
    with pytest.raises(ModelError, match="truncated: 10 bytes"):
        check_gguf(write(tmp_path, build_gguf()[:10]))


def test_unsupported_version(tmp_path):
    with pytest.raises(ModelError, match="GGUF version 1; specdec reads versions 2 and 3"):
        check_gguf(write(tmp_path, build_gguf(version=1)))


def test_corrupt_value_type(tmp_path):
    data = bytearray(build_gguf())
    key_end = 24 + 8 + len("general.architecture")
    data[key_end : key_end + 4] = struct.pack("<I", 77)
    with pytest.raises(ModelError, match="corrupt GGUF header: metadata key 'general.architecture' has unknown value"):
        check_gguf(write(tmp_path, bytes(data)))


def test_unreadable_path(tmp_path):
    with pytest.raises(ModelError, match="Cannot read"):
        check_gguf(tmp_path / "missing.gguf")


_VALID = build_gguf(
    [("tokenizer.ggml.tokens", 9, (8, ["x", "yy", "zzz"] * 20)), *[(k, 8, v) for k, v in _DEFAULT_META.items()]]
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=len(_VALID) - 1))
def test_every_prefix_is_rejected_with_a_model_error(tmp_path, cut):
    with pytest.raises(ModelError):
        check_gguf(write(tmp_path, _VALID[:cut]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pos=st.integers(min_value=0, max_value=len(_VALID) - 1), byte=st.integers(0, 255))
def test_a_corrupt_byte_never_crashes(tmp_path, pos, byte):
    data = bytearray(_VALID)
    data[pos] = byte
    try:
        check_gguf(write(tmp_path, bytes(data)))
    except ModelError:
        pass


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_real_models_header_implies_their_size(name):
    from specdec_cli.models import resolver

    catalog = config.load_catalog()
    spec = catalog.models[name]
    path = resolver.resolve(name, catalog)  # fetched when missing, as every real-model fixture does: nothing skips
    head = 32 * 2**20  # more than any of these headers (a 152k vocabulary's strings included), less than each file

    def header_only(fileno, length, **kw):  # maps the first `head` bytes: a read past them fails
        return mmap.mmap(fileno, head, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "mmap", types.SimpleNamespace(mmap=header_only, ACCESS_READ=mmap.ACCESS_READ))
        info = check_gguf(path)
    assert info.implied_size == info.file_size == spec.size > head  # read from the header alone, not the tensors
    assert info.architecture in {"llama", "gemma3", "qwen2"} and not info.unknown_types


def test_kv_bytes_per_token_from_the_header():
    """Layers x (K + V head sizes) x KV heads x 2 bytes (f16): what `specdec serve --parallel` and doctor state."""
    from specdec_cli.models.gguf import GGUFInfo, kv_bytes_per_token

    def info(meta):
        return GGUFInfo(
            path=None,
            version=3,
            n_tensors=0,
            n_kv=0,
            architecture="qwen2",
            name=None,
            tokenizer_model=None,
            alignment=32,
            data_offset=0,
            implied_size=0,
            file_size=0,
            tensors=(),
            metadata=meta,
            array_lengths={},
        )

    qwen = {
        "qwen2.block_count": 28,
        "qwen2.attention.head_count": 12,
        "qwen2.attention.head_count_kv": 2,
        "qwen2.embedding_length": 1536,
    }
    assert kv_bytes_per_token(info(qwen)) == 28 * 2 * 128 * 2 * 2 == 28672
    assert kv_bytes_per_token(info({**qwen, "qwen2.attention.key_length": 64})) == 28 * (64 + 128) * 2 * 2
    assert kv_bytes_per_token(info({"qwen2.block_count": 28})) is None
