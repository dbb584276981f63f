"""Write a GGUF model with random weights at a given shape, for timing passes and testing where no real model can be
downloaded: `benchmarks/gpu_check.py` times the verify curve and the host's work per pass of Qwen2.5-Coder-1.5B's shape
(a qwen2) on a machine without network; `benchmarks/bench_hybrid.py` times the hybrid and recurrent architectures
(lfm2: short convolutions and attention; qwen35: Gated DeltaNet and attention, with one multi-token-prediction block;
mamba2) at published shapes; the tests use tiny ones of each.

Written with the `gguf` package (llama.cpp's gguf-py: on PyPI, and inside llama-cpp-python's sdist under
vendor/llama.cpp/gguf-py). The tokenizer is a made-up SentencePiece-style ("llama") vocabulary: byte tokens and
unique pieces, enough for llama.cpp to tokenize any text. The output of such a model is noise; what it costs per pass
is a real model's of that shape and type.

The keys and tensors (names, shapes) follow llama.cpp b11312: `load_arch_hparams`/`load_arch_tensors` in
src/models/{lfm2,qwen35,mamba2}.cpp, and what its converter writes (conversion/lfm2.py `LFM2Model`, conversion/qwen.py
`Qwen3NextModel`/`_QwenMtpMixin`/`Qwen3_5TextModel`, conversion/mamba.py `Mamba2Model`). Keys are written by name
(`ARCH.key`), not through GGUFWriter helpers, so that older gguf-py releases without those helpers write them too.

Where each published shape's numbers come from: config.json of the Hugging Face repo, as the converter reads it,
copied by hand (nothing is fetched; llama.cpp's own size names, quoted, cross-check the layer counts and widths).
A real file's numbers override these:

  arch    shape               numbers and their source
  qwen2   qwen2.5-coder-1.5b  Qwen/Qwen2.5-Coder-1.5B-Instruct: hidden 1536, 28 layers, intermediate 8960, 12 heads,
                              2 KV heads, vocab 151936, tied embeddings
  lfm2    lfm2-1.2b           LiquidAI/LFM2-1.2B: hidden 2048, 16 layers, block_ff_dim 12288 with
                              block_auto_adjust_ff_dim, multiplier 1.0, multiple_of 256 -> n_ff 8192 (LFM2Model's
                              formula; llama.cpp names n_ff 8192 "1.2B"), 32 heads, 8 KV heads, vocab 65536,
                              conv_L_cache 3, attention at layers 2 5 8 10 12 14 (the rest "conv"), norm_eps 1e-5,
                              rope_theta 1e6, tied embeddings
  qwen35  qwen3.5-2b          Qwen/Qwen3.5-2B text_config: hidden 2048, 24 layers (llama.cpp names 24 layers with
                              n_embd != 1024 "2B"), intermediate 6144, 8 heads, 2 KV heads, head_dim 256,
                              linear_num_key_heads 16, linear_num_value_heads 16, linear_key/value_head_dim 128,
                              linear_conv_kernel_dim 4, full_attention_interval 4, mtp_num_hidden_layers 1,
                              vocab 248320, partial_rotary_factor 0.25, mrope_section [11, 11, 10] (the converter's
                              default), rope_theta 1e7, rms_norm_eps 1e-6, tied embeddings
  mamba2  mamba2-1.3b         state-spaces/mamba2-1.3b: d_model 2048, 48 layers (llama.cpp names 48 x 2048 "XL"),
                              vocab 50277 padded to 50288 (pad_vocab_size_multiple 16), d_state 128, headdim 64,
                              expand 2, ngroups 1, d_conv 4 (mamba_ssm's Mamba2 defaults)
  any     tiny                made up: a few layers of width 64, vocabulary 512, written and loaded in well under a
                              second; lfm2 2 conv + 2 attention layers, qwen35 3 DeltaNet + 1 attention layer and one
                              MTP block, mamba2 2 layers

    python benchmarks/random_gguf.py OUT.gguf [--arch qwen2|lfm2|qwen35|mamba2] [--shape NAME|tiny] [--type f16|q8_0]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, kw_only=True)
class _Model:
    """The hyper-parameters every model here has: layers, width, vocabulary, its RMS norms' epsilon."""

    n_layer: int
    n_embd: int
    n_vocab: int
    rms_eps: float = 1e-5


@dataclass(frozen=True, kw_only=True)
class _Transformer(_Model):
    """An attention model's: a `_Model`'s and its feed-forward width, query and KV heads."""

    n_ff: int
    n_head: int
    n_head_kv: int


@dataclass(frozen=True, kw_only=True)
class Shape(_Transformer):
    """A qwen2 model's hyper-parameters."""

    n_ctx_train: int = 32768
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6


@dataclass(frozen=True, kw_only=True)
class Lfm2Shape(_Transformer):
    """An lfm2 model's hyper-parameters: `attn_layers` are the attention layers, the others short convolutions of
    `l_cache` taps; `tied`: the output projection is the token embedding (no output.weight)."""

    attn_layers: tuple[int, ...]
    l_cache: int = 3
    tied: bool = True
    n_ctx_train: int = 128000
    rope_base: float = 1_000_000.0


@dataclass(frozen=True, kw_only=True)
class Qwen35Shape(_Transformer):
    """A qwen35 (Qwen3.5 dense) model's hyper-parameters: every `full_attn_interval`-th layer is attention (a query
    gate doubles its Q projection), the others Gated DeltaNet with `linear_k_heads` key and `linear_v_heads` value heads
    of `linear_head_dim`; then `n_nextn` MTP blocks (full-attention blocks with the nextn projection)."""

    head_dim: int
    linear_k_heads: int
    linear_v_heads: int
    linear_head_dim: int
    d_conv: int = 4
    full_attn_interval: int = 4
    n_nextn: int = 1
    partial_rotary: float = 0.25
    n_ctx_train: int = 262144
    rope_base: float = 10_000_000.0
    rms_eps: float = 1e-6

    @property
    def rope_sections(self) -> tuple[int, int, int, int]:
        """The rotary pairs (head_dim x partial_rotary / 2) split in three, the larger parts first: 32 pairs as
        Qwen3.5's mrope_section [11, 11, 10], 8 as 3/3/2; the fourth section is empty."""
        pairs = int(self.head_dim * self.partial_rotary) // 2
        a, b, c = (pairs + 2) // 3, (pairs + 1) // 3, pairs // 3
        return a, b, c, 0


@dataclass(frozen=True, kw_only=True)
class Mamba2Shape(_Model):
    """A mamba2 model's hyper-parameters (d_inner = expand * n_embd, heads of `head_dim`)."""

    d_state: int = 128
    head_dim: int = 64
    expand: int = 2
    n_group: int = 1
    d_conv: int = 4


TINY = dict(n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=512, n_ctx_train=4096)  # every tiny attention model's

SHAPES = {
    # Qwen2.5-Coder-1.5B-Instruct's config.json (tied embeddings: no output.weight)
    "qwen2.5-coder-1.5b": Shape(n_layer=28, n_embd=1536, n_ff=8960, n_head=12, n_head_kv=2, n_vocab=151936),
    "tiny": Shape(n_layer=2, **TINY),
}

ARCH_SHAPES: dict[str, dict[str, object]] = {
    "qwen2": SHAPES,
    "lfm2": {  # sources: the module docstring's table
        "lfm2-1.2b": Lfm2Shape(
            n_layer=16, n_embd=2048, n_ff=8192, n_head=32, n_head_kv=8, n_vocab=65536, attn_layers=(2, 5, 8, 10, 12, 14)
        ),
        # untied: with the embedding as its output, this tiny one repeats the prompt's last token forever
        "tiny": Lfm2Shape(n_layer=4, **TINY, attn_layers=(1, 3), tied=False),
    },
    "qwen35": {
        "qwen3.5-2b": Qwen35Shape(
            n_layer=24,
            n_embd=2048,
            n_ff=6144,
            n_head=8,
            n_head_kv=2,
            head_dim=256,
            n_vocab=248320,
            linear_k_heads=16,
            linear_v_heads=16,
            linear_head_dim=128,
        ),
        "tiny": Qwen35Shape(n_layer=4, **TINY, head_dim=64, linear_k_heads=2, linear_v_heads=2, linear_head_dim=32),
    },
    "mamba2": {
        "mamba2-1.3b": Mamba2Shape(n_layer=48, n_embd=2048, n_vocab=50288),
        "tiny": Mamba2Shape(n_layer=2, n_embd=64, n_vocab=512, d_state=16, head_dim=32),
    },
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


class _Writer:
    """A GGUFWriter with the project's header (name, tokenizer) and random tensors: matrices in `dtype` (f16 or q8_0,
    rows of a multiple of 32 inputs; f32 otherwise), vectors f32."""

    def __init__(self, path: str | Path, arch: str, n_vocab: int, dtype: str, seed: int, name: str) -> None:
        import gguf

        self.gguf, self.arch = gguf, arch
        self.rng = np.random.default_rng(seed)
        self.qtype = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[dtype]
        self.w = gguf.GGUFWriter(str(path), arch)
        self.w.add_name(name)
        self.w.add_file_type(1 if dtype == "f16" else 7)  # LLAMA_FTYPE_MOSTLY_F16 / Q8_0
        pieces, scores, types = vocabulary(n_vocab)
        self.w.add_tokenizer_model("llama")
        self.w.add_token_list(pieces)
        self.w.add_token_scores(scores)
        self.w.add_token_types(types)
        self.w.add_bos_token_id(1)
        self.w.add_eos_token_id(2)
        self.w.add_add_bos_token(True)

    def u32(self, key: str, value: int) -> None:
        self.w.add_uint32(f"{self.arch}.{key}", int(value))

    def f32(self, key: str, value: float) -> None:
        self.w.add_float32(f"{self.arch}.{key}", float(value))

    def array(self, key: str, values: list) -> None:
        self.w.add_array(f"{self.arch}.{key}", values)

    def weight(self, name: str, rows: int, cols: int, scale: float = 0.5) -> None:
        """A matrix of `rows` outputs x `cols` inputs (llama.cpp's {cols, rows})."""
        x = self.rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale / np.sqrt(cols))
        q = self.qtype if cols % 32 == 0 else self.gguf.GGMLQuantizationType.F16
        if q == self.gguf.GGMLQuantizationType.F16:
            self.w.add_tensor(name, x.astype(np.float16))
        else:
            self.w.add_tensor(name, self.gguf.quants.quantize(x, q), raw_dtype=q)

    def f32_tensor(self, name: str, x: np.ndarray) -> None:
        self.w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))

    def vector(self, name: str, n: int, value: float | None = None, scale: float = 0.02) -> None:
        self.f32_tensor(
            name,
            np.full(n, value, np.float32)
            if value is not None
            else self.rng.standard_normal(n, dtype=np.float32) * np.float32(scale),
        )

    def transformer(
        self, shape: Shape | Lfm2Shape | Qwen35Shape, head_count_kv: int | list[int], block_count: int | None = None
    ) -> None:
        """The keys every attention model here writes: context, width, blocks (`block_count`: MTP blocks included;
        None = `shape.n_layer`), feed-forward width, heads and KV heads (a list: per layer), RoPE base, norm epsilon."""
        self.u32("context_length", shape.n_ctx_train)
        self.u32("embedding_length", shape.n_embd)
        self.u32("block_count", shape.n_layer if block_count is None else block_count)
        self.u32("feed_forward_length", shape.n_ff)
        self.u32("attention.head_count", shape.n_head)
        if isinstance(head_count_kv, list):
            self.array("attention.head_count_kv", head_count_kv)
        else:
            self.u32("attention.head_count_kv", head_count_kv)
        self.f32("rope.freq_base", shape.rope_base)
        self.f32("attention.layer_norm_rms_epsilon", shape.rms_eps)

    def ffn(self, b: str, norm: str, shape: _Transformer) -> None:
        """Block `b`'s feed-forward part: its norm (named `norm`), then the gate, up and down matrices."""
        self.vector(b + norm, shape.n_embd, 1.0)
        self.weight(b + "ffn_gate.weight", shape.n_ff, shape.n_embd)
        self.weight(b + "ffn_up.weight", shape.n_ff, shape.n_embd)
        self.weight(b + "ffn_down.weight", shape.n_embd, shape.n_ff)

    def close(self, path: str | Path) -> Path:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        return Path(path)


def write(
    path: str | Path, shape: Shape | Lfm2Shape | Qwen35Shape | Mamba2Shape, *, dtype: str = "f16", seed: int = 0
) -> Path:
    """Write a random GGUF of `shape` (its type names the architecture) to `path` (weights `dtype`: "f16" or "q8_0";
    norms f32); return it. Raises KeyError for another dtype."""
    if isinstance(shape, Lfm2Shape):
        return _write_lfm2(path, shape, dtype, seed)
    if isinstance(shape, Qwen35Shape):
        return _write_qwen35(path, shape, dtype, seed)
    if isinstance(shape, Mamba2Shape):
        return _write_mamba2(path, shape, dtype, seed)
    return _write_qwen2(path, shape, dtype, seed)


def _write_qwen2(path: str | Path, shape: Shape, dtype: str, seed: int) -> Path:
    e, kv = shape.n_embd, shape.n_embd // shape.n_head * shape.n_head_kv
    g = _Writer(path, "qwen2", shape.n_vocab, dtype, seed, f"random {shape.n_layer}x{e}")
    g.transformer(shape, shape.n_head_kv)
    g.weight("token_embd.weight", shape.n_vocab, e)
    g.vector("output_norm.weight", e, 1.0)
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        g.vector(b + "attn_norm.weight", e, 1.0)
        g.weight(b + "attn_q.weight", e, e)
        g.vector(b + "attn_q.bias", e)
        g.weight(b + "attn_k.weight", kv, e)
        g.vector(b + "attn_k.bias", kv)
        g.weight(b + "attn_v.weight", kv, e)
        g.vector(b + "attn_v.bias", kv)
        g.weight(b + "attn_output.weight", e, e)
        g.ffn(b, "ffn_norm.weight", shape)
    return g.close(path)


def _write_lfm2(path: str | Path, shape: Lfm2Shape, dtype: str, seed: int) -> Path:
    """lfm2 as LFM2Model writes it: head_count_kv per layer (0 on a conv layer), shortconv.l_cache, the output norm
    named token_embd_norm, tied embeddings (or an output.weight); a conv layer has shortconv.{conv,in_proj,out_proj},
    an attention layer q/k/v/output with per-head Q/K norms (llama_model_lfm2::load_arch_tensors)."""
    e, hd = shape.n_embd, shape.n_embd // shape.n_head
    kv = hd * shape.n_head_kv
    g = _Writer(path, "lfm2", shape.n_vocab, dtype, seed, f"random lfm2 {shape.n_layer}x{e}")
    g.transformer(shape, [shape.n_head_kv if i in shape.attn_layers else 0 for i in range(shape.n_layer)])
    g.u32("vocab_size", shape.n_vocab)
    g.u32("shortconv.l_cache", shape.l_cache)
    g.weight("token_embd.weight", shape.n_vocab, e)
    g.vector("token_embd_norm.weight", e, 1.0)
    if not shape.tied:
        g.weight("output.weight", shape.n_vocab, e)
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        g.vector(b + "attn_norm.weight", e, 1.0)
        if i in shape.attn_layers:
            g.vector(b + "attn_q_norm.weight", hd, 1.0)
            g.vector(b + "attn_k_norm.weight", hd, 1.0)
            g.weight(b + "attn_q.weight", e, e)
            g.weight(b + "attn_k.weight", kv, e)
            g.weight(b + "attn_v.weight", kv, e)
            g.weight(b + "attn_output.weight", e, e)
        else:
            g.f32_tensor(
                b + "shortconv.conv.weight",  # {l_cache, n_embd}: one causal filter per channel
                g.rng.standard_normal((e, shape.l_cache), dtype=np.float32) * np.float32(0.5),
            )
            g.weight(b + "shortconv.in_proj.weight", 3 * e, e)
            g.weight(b + "shortconv.out_proj.weight", e, e)
        g.ffn(b, "ffn_norm.weight", shape)
    return g.close(path)


def _write_qwen35(path: str | Path, shape: Qwen35Shape, dtype: str, seed: int) -> Path:
    """qwen35 as Qwen3_5TextModel writes it: block_count = layers + MTP blocks, nextn_predict_layers, ssm.* keys of the
    Gated DeltaNet (conv_kernel, state_size = head dim, group_count = key heads, time_step_rank = value heads,
    inner_size = value dim), attention.recurrent_layers (false on attention and MTP layers), full_attention_interval,
    rope.dimension_count/sections; tensors of llama_model_qwen35::load_arch_tensors, the MTP block's
    blk.N.nextn.{eh_proj,enorm,hnorm,shared_head_norm} included (its embed_tokens and shared_head_head are absent,
    as in Qwen3.5's checkpoints: the trunk's are used)."""
    e, hd, n = shape.n_embd, shape.head_dim, shape.n_layer
    q, kv = hd * shape.n_head, hd * shape.n_head_kv
    key_dim, value_dim = shape.linear_head_dim * shape.linear_k_heads, shape.linear_head_dim * shape.linear_v_heads
    conv_dim = 2 * key_dim + value_dim
    n_all = n + shape.n_nextn
    recurrent = [i < n and (i + 1) % shape.full_attn_interval != 0 for i in range(n_all)]
    g = _Writer(path, "qwen35", shape.n_vocab, dtype, seed, f"random qwen35 {n}x{e} + {shape.n_nextn} MTP")
    g.transformer(shape, shape.n_head_kv, block_count=n_all)
    g.u32("attention.key_length", hd)
    g.u32("attention.value_length", hd)
    g.u32("ssm.conv_kernel", shape.d_conv)
    g.u32("ssm.state_size", shape.linear_head_dim)
    g.u32("ssm.group_count", shape.linear_k_heads)
    g.u32("ssm.time_step_rank", shape.linear_v_heads)
    g.u32("ssm.inner_size", value_dim)
    g.array("attention.recurrent_layers", recurrent)
    g.u32("full_attention_interval", shape.full_attn_interval)
    g.u32("rope.dimension_count", int(hd * shape.partial_rotary))
    g.array("rope.dimension_sections", list(shape.rope_sections))
    g.u32("nextn_predict_layers", shape.n_nextn)
    g.weight("token_embd.weight", shape.n_vocab, e)
    g.vector("output_norm.weight", e, 1.0)

    def attention(b: str) -> None:  # Q carries the output gate: 2 x n_head x head_dim rows
        g.weight(b + "attn_q.weight", 2 * q, e)
        g.weight(b + "attn_k.weight", kv, e)
        g.weight(b + "attn_v.weight", kv, e)
        g.weight(b + "attn_output.weight", e, q)
        g.vector(b + "attn_q_norm.weight", hd, 1.0)
        g.vector(b + "attn_k_norm.weight", hd, 1.0)

    for i in range(n_all):
        b = f"blk.{i}."
        g.vector(b + "attn_norm.weight", e, 1.0)
        if i >= n:  # the MTP block: a full-attention block behind the nextn projection of [embedding; hidden]
            attention(b)
            g.weight(b + "nextn.eh_proj.weight", e, 2 * e)
            g.vector(b + "nextn.enorm.weight", e, 1.0)
            g.vector(b + "nextn.hnorm.weight", e, 1.0)
            g.vector(b + "nextn.shared_head_norm.weight", e, 1.0)
        elif recurrent[i]:  # Gated DeltaNet
            g.weight(b + "attn_qkv.weight", conv_dim, e)
            g.weight(b + "attn_gate.weight", value_dim, e)
            g.f32_tensor(
                b + "ssm_conv1d.weight",  # {d_conv, conv_dim}
                g.rng.standard_normal((conv_dim, shape.d_conv), dtype=np.float32) * np.float32(0.5),
            )
            g.vector(b + "ssm_dt.bias", shape.linear_v_heads, scale=0.5)
            g.f32_tensor(
                b + "ssm_a",  # -exp(A_log), as the converter stores it: a decay in (0, 1) per step
                -np.exp(g.rng.uniform(-2.0, 0.5, shape.linear_v_heads).astype(np.float32)),
            )
            g.weight(b + "ssm_beta.weight", shape.linear_v_heads, e)
            g.weight(b + "ssm_alpha.weight", shape.linear_v_heads, e)
            g.vector(b + "ssm_norm.weight", shape.linear_head_dim, 1.0)
            g.weight(b + "ssm_out.weight", e, value_dim)
        else:
            attention(b)
        g.ffn(b, "post_attention_norm.weight", shape)
    return g.close(path)


def _write_mamba2(path: str | Path, shape: Mamba2Shape, dtype: str, seed: int) -> Path:
    """mamba2 as Mamba2Model writes it: ssm.{conv_kernel, inner_size, state_size, time_step_rank = d_inner / head_dim,
    group_count}, head_count and feed_forward_length 0; tensors of llama_model_mamba2::load_arch_tensors (ssm_in of
    d_inner + conv_dim + heads rows, ssm_conv1d with bias, ssm_dt.bias, ssm_a = -exp(A_log), ssm_d, a grouped
    ssm_norm, ssm_out)."""
    e, d_inner = shape.n_embd, shape.expand * shape.n_embd
    heads = d_inner // shape.head_dim
    conv_dim = d_inner + 2 * shape.n_group * shape.d_state
    g = _Writer(path, "mamba2", shape.n_vocab, dtype, seed, f"random mamba2 {shape.n_layer}x{e}")
    g.u32("context_length", 1 << 20)
    g.u32("embedding_length", e)
    g.u32("feed_forward_length", 0)
    g.u32("attention.head_count", 0)
    g.u32("block_count", shape.n_layer)
    g.u32("ssm.conv_kernel", shape.d_conv)
    g.u32("ssm.inner_size", d_inner)
    g.u32("ssm.state_size", shape.d_state)
    g.u32("ssm.time_step_rank", heads)
    g.u32("ssm.group_count", shape.n_group)
    g.f32("attention.layer_norm_rms_epsilon", shape.rms_eps)
    g.weight("token_embd.weight", shape.n_vocab, e)
    g.vector("output_norm.weight", e, 1.0)
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        g.vector(b + "attn_norm.weight", e, 1.0)
        g.weight(b + "ssm_in.weight", d_inner + conv_dim + heads, e)
        g.f32_tensor(
            b + "ssm_conv1d.weight",  # {d_conv, conv_dim}
            g.rng.standard_normal((conv_dim, shape.d_conv), dtype=np.float32) * np.float32(0.5),
        )
        g.vector(b + "ssm_conv1d.bias", conv_dim)
        g.vector(b + "ssm_dt.bias", heads, scale=0.5)
        g.f32_tensor(b + "ssm_a", -np.exp(g.rng.uniform(-2.0, 0.5, (heads, 1)).astype(np.float32)))  # {1, heads}
        g.f32_tensor(b + "ssm_d", np.ones((heads, 1), np.float32))
        g.f32_tensor(b + "ssm_norm.weight", np.ones((shape.n_group, d_inner // shape.n_group), np.float32))
        g.weight(b + "ssm_out.weight", e, d_inner)
    return g.close(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--arch", choices=sorted(ARCH_SHAPES), default="qwen2")
    ap.add_argument("--shape", default="tiny", help="a shape of the architecture (ARCH_SHAPES; the module docstring)")
    ap.add_argument("--type", dest="dtype", choices=("f16", "q8_0"), default="f16")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    shapes = ARCH_SHAPES[a.arch]
    if a.shape not in shapes:
        ap.error(f"--arch {a.arch} has no shape {a.shape!r}: use one of {', '.join(sorted(shapes))}")
    path = write(a.out, shapes[a.shape], dtype=a.dtype, seed=a.seed)
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
