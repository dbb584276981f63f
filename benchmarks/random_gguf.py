"""Write a GGUF model with random weights at a given shape (a qwen2 architecture), for timing passes where no real
model can be downloaded: `benchmarks/gpu_check.py` times the verify curve and the host's work per pass of
Qwen2.5-Coder-1.5B's shape on a machine without network; the tests use a tiny one.

Written with the `gguf` package (llama.cpp's gguf-py: on PyPI, and inside llama-cpp-python's sdist under
vendor/llama.cpp/gguf-py). The tokenizer is a made-up SentencePiece-style ("llama") vocabulary: byte tokens and
unique pieces, enough for llama.cpp to tokenize any text. The output of such a model is noise; what it costs per pass
is a real model's of that shape and type.

    python benchmarks/random_gguf.py OUT.gguf [--shape qwen2.5-coder-1.5b|tiny] [--type f16|q8_0]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    """A qwen2 model's hyper-parameters."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    n_ctx_train: int = 32768
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6


SHAPES = {
    # Qwen2.5-Coder-1.5B-Instruct's config.json (tied embeddings: no output.weight)
    "qwen2.5-coder-1.5b": Shape(n_layer=28, n_embd=1536, n_ff=8960, n_head=12, n_head_kv=2, n_vocab=151936),
    "tiny": Shape(n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=512, n_ctx_train=4096),
}


def vocabulary(n: int) -> tuple[list[bytes], list[float], list[int]]:
    """(pieces, scores, token types) of a made-up SPM vocabulary of n >= 300 tokens: <unk>, <s>, </s>, the 256 byte
    tokens, then "▁" + letters and numbered pieces (unique)."""
    import gguf

    T = gguf.TokenType
    pieces = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
    words = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    extra = ["\u2581" + w for w in words] + words + ["\u2581"] + [str(d) for d in range(10)]
    i = 0
    while len(pieces) < n:
        p = extra[i] if i < len(extra) else f"\u2581t{i}"
        pieces.append(p.encode())
        types.append(T.NORMAL)
        i += 1
    scores = [0.0] * 3 + [-1e4] * 256 + [-float(j) for j in range(n - 259)]
    return pieces[:n], scores[:n], [int(t) for t in types[:n]]


def write(path: str | Path, shape: Shape, *, dtype: str = "f16", seed: int = 0) -> Path:
    """Write a random qwen2 GGUF of `shape` to `path` (weights `dtype`: "f16" or "q8_0"; norms f32); return it."""
    import gguf

    rng = np.random.default_rng(seed)
    qtype = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[dtype]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name(f"random {shape.n_layer}x{shape.n_embd}")
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_file_type(1 if dtype == "f16" else 7)  # LLAMA_FTYPE_MOSTLY_F16 / Q8_0
    pieces, scores, types = vocabulary(shape.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)

    def weight(name: str, rows: int, cols: int) -> None:  # a matrix of `rows` outputs x `cols` inputs
        x = (rng.standard_normal((rows, cols), dtype=np.float32) * (0.5 / np.sqrt(cols)))
        if qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    def vector(name: str, n: int, value: float | None = None) -> None:
        w.add_tensor(name, np.full(n, value, np.float32) if value is not None
                     else (rng.standard_normal(n, dtype=np.float32) * 0.02))

    e, kv = shape.n_embd, shape.n_embd // shape.n_head * shape.n_head_kv
    weight("token_embd.weight", shape.n_vocab, e)
    vector("output_norm.weight", e, 1.0)
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", e, 1.0)
        weight(b + "attn_q.weight", e, e)
        vector(b + "attn_q.bias", e)
        weight(b + "attn_k.weight", kv, e)
        vector(b + "attn_k.bias", kv)
        weight(b + "attn_v.weight", kv, e)
        vector(b + "attn_v.bias", kv)
        weight(b + "attn_output.weight", e, e)
        vector(b + "ffn_norm.weight", e, 1.0)
        weight(b + "ffn_gate.weight", shape.n_ff, e)
        weight(b + "ffn_up.weight", shape.n_ff, e)
        weight(b + "ffn_down.weight", e, shape.n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--type", dest="dtype", choices=("f16", "q8_0"), default="f16")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    path = write(a.out, SHAPES[a.shape], dtype=a.dtype, seed=a.seed)
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
