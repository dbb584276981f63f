"""llama.cpp backend through llama-cpp-python's low-level API. The one module of the engine's that imports `llama_cpp`
(besides it only `specdec_cli.measure.peer` does: it drives llama-cpp-python's own `Llama` as bench's peer).

What it does differently from `llama_cpp.Llama`:
- logits are requested only for the positions being verified (`llama_batch.logits[i] = 1` on the last rows), never
  `logits_all`, and read as a zero-copy numpy view of llama.cpp's output buffer;
- the batch is allocated once and filled through numpy views of its arrays;
- rollback is `llama_memory_seq_rm` on sequence 0 with its bool result checked; a recurrent or hybrid model (Mamba,
  LFM2, Qwen3.5, ...) rolls back by llama.cpp's recurrent-state snapshots (`n_rs_seq`) inside the last pass's own
  tokens, else by a checkpoint of its recurrent state taken before a verify pass and a replay of the kept tokens, else
  it clears the sequence (the guard in `truncate`: a partial `llama_memory_seq_rm` outside those limits returns true
  and leaves a wrong state);
- a second draft branch can share a verify pass (`decode_branches`): the context has two sequences over one unified
  KV cache (`n_seq_max = 2`, `kv_unified`: the committed prefix's cells belong to both, `llama_memory_seq_cp` is
  metadata only, and the batch is evaluated as one ubatch, as llama.cpp's examples/speculative does with `-kvu`);
  plain one-sequence decoding is bit-identical to a one-sequence context and costs the same;
- `llama_decode` return codes map to named errors (1 = no KV slot, 2 = aborted: `PassInterrupted`, < 0 = fatal);
- a pass can be interrupted from another thread (`interrupt`): llama.cpp's abort callback, checked by ggml's CPU
  backend after every graph node, is libc's `strlen` over a one-byte flag, so the check runs no Python and takes no
  GIL (a Python callback would take the GIL at every graph node). llama.cpp hands the callback only to a backend whose
  registry exports `ggml_backend_set_abort_callback` (`llama_context::set_abort_callback`): the CPU's alone. CUDA
  and Vulkan never check it, nor does Metal (its own setter, `ggml_backend_metal_set_abort_callback`, is not called by
  llama.cpp, and its check runs only while a GPU trace is captured), so a pass with every layer on such a device
  runs to its end; layers left on the CPU still stop at the next node;
- the KV state of sequence 0 is saved and restored with llama.cpp's streaming `llama_state_seq_save_file` /
  `llama_state_seq_load_file` (one tensor row range at a time, never the whole state in memory), for the prompt cache.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import llama_cpp
import numpy as np
from llama_cpp import _logger as _llama_logger
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from specdec_cli.errors import (
    CacheTrimError,
    ContextOverflowError,
    DecodeError,
    ModelError,
    StateError,
    ToolsUnsupportedError,
    UsageError,
)
from specdec_cli.models.backend import FimTokens, VocabInfo, common_prefix
from specdec_cli.models.host import flash_attn_switch  # noqa: F401  (re-exported: what `PHASED` needs)
from specdec_cli.models.host import set_flash_attn_fn as _set_flash_attn_fn
from specdec_cli.models.rollback import (
    CHECKPOINT,
    HYBRID,
    KV,
    RECURRENT,
    SNAPSHOTS,
    TRANSFORMER,
    RecurrentGuard,
)
from specdec_cli.models.rollback import (
    draft_limit as _draft_limit,
)

_backend_ready = False


def _init_once(verbose: bool) -> None:
    global _backend_ready
    # llama-cpp-python routes llama.cpp's log through its logger; keep it quiet unless asked.
    _llama_logger.logger.setLevel(10 if verbose else 50)
    if not _backend_ready:
        llama_cpp.llama_backend_init()
        _backend_ready = True


def default_threads() -> int:
    """Threads for generation: `machine.default_threads` (the CPUs this process may use; on Apple Silicon its
    performance cores)."""
    from specdec_cli.models import machine

    return machine.default_threads()[0]


def gpu_offload_supported() -> bool:
    """True when llama.cpp was built with Metal, CUDA, Vulkan, ... (then --gpu-layers defaults to all layers)."""
    return bool(llama_cpp.llama_supports_gpu_offload())


PHASED = "phased"  # flash_attn: on for prefill chunks and short contexts, off for long verify passes (`LlamaBackend`)
PHASE_ROWS = 64  # phased: a llama_decode call over more rows than this is a prefill chunk, run with flash attention
# phased: below this many tokens of context every pass runs with flash attention too. There it costs about what off
# does and keeps each row's attention computed alone, so a verify pass rounds as a one-token pass does; past it,
# off's verify passes are cheaper, so long contexts verify with it off.
PHASE_DEPTH = 2048
COPY_MIN = 32  # rows a peer must hold beyond a lane's own for `copy_prefix`: the whole stream's copy then pays
RS_SNAPSHOTS = 16  # recurrent-state snapshots per sequence asked of llama.cpp (`n_rs_seq`): the controller's K_max
_PARTIAL = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: a hybrid's recurrent part alone (a recurrent model's whole state)


def _install_abort(ctx: Any) -> tuple[ctypes.Array | None, Any]:
    """Install llama.cpp's abort callback on `ctx`: libc's `strlen` over a 2-byte buffer, so `buffer[0] = 1` stops
    the pass under way (`LlamaBackend.interrupt`). ggml's CPU backend calls it on its first thread after every graph
    node with the buffer as its argument and reads the result as a bool; strlen returns 0 or 1 here, which every ABI
    reads as that bool, and runs no Python (no GIL while the pass computes). Returns (buffer, the callback; both
    must outlive the context), or (None, None) where libc or the symbol is missing: passes are then not
    interruptible, nothing else changes."""
    try:
        libc = ctypes.cdll.msvcrt if os.name == "nt" else ctypes.CDLL(None)  # the process's C library
        fn = llama_cpp.ggml_abort_callback(cast(int, ctypes.cast(libc.strlen, ctypes.c_void_p).value))
        flag = ctypes.create_string_buffer(2)
        llama_cpp.llama_set_abort_callback(ctx, fn, ctypes.cast(flag, ctypes.c_void_p))
        return flag, fn
    except (AttributeError, OSError, TypeError, ValueError):  # no libc / strlen / llama_set_abort_callback
        return None, None


def system_info() -> str:
    """llama.cpp's build and CPU feature line (for --json and bench reports)."""
    return llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool = True,
    model_name: str = "the model",
    tools: list[dict] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Render a GGUF chat template with llama-cpp-python's `Jinja2ChatFormatter` (Jinja's ImmutableSandboxedEnvironment:
    no attribute starting with `_`, no mutating methods, no imports, so a template cannot reach Python objects).

    The template comes from the model file, so it is untrusted: every failure becomes one line, nothing of it runs
    outside the sandbox. `tools` (OpenAI's tool dicts) are passed as the template's `tools` variable, as Hugging
    Face's `apply_chat_template` does; a template that never reads `tools` would drop them silently, so it is refused,
    and so is one that never mentions tool turns when the messages carry some (`tool_calls`, role "tool").
    `template_kwargs` are more variables (`chat_template_kwargs`, as llama-server and vLLM pass them).

    Raises:
        ToolsUnsupportedError: tools (or tool turns) for a template that cannot express them.
        UsageError: the template itself refused the conversation (its `raise_exception(...)`, e.g. roles that must
            alternate); the message is the template's.
        ModelError: the template is unsafe (jinja2 SecurityError), has a syntax error, or fails while rendering.
    """
    import jinja2

    tool_turns = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    if (tools and "tools" not in template) or (tool_turns and "tool" not in template):
        what = "tools" if tools and "tools" not in template else "tool calls and tool results"
        raise ToolsUnsupportedError(
            f"The chat template of {model_name} cannot express {what}: it never reads them, "
            "so the model would not see them.",
            "Use a model whose template takes tools (e.g. Qwen2.5), or leave tools out.",
        )
    try:
        formatter = Jinja2ChatFormatter(
            template, eos_token=eos_token, bos_token=bos_token, add_generation_prompt=add_generation_prompt
        )
        # (the request's dicts, of OpenAI's shape: the formatter's TypedDicts say the same)
        return formatter(messages=cast(Any, messages), tools=cast(Any, tools), **dict(template_kwargs or {})).prompt
    except jinja2.exceptions.SecurityError as e:
        raise ModelError(
            f"The chat template of {model_name} tried an unsafe operation ({_one_line(e)}); it was "
            "stopped by the sandbox and nothing ran.",
            "Use --raw, or a model file you trust.",
        ) from None
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ModelError(
            f"The chat template of {model_name} is broken: {_one_line(e)} (template line {e.lineno}).",
            "Use --raw to send the prompt without it.",
        ) from None
    except ValueError as e:  # the template's own raise_exception(message)
        raise UsageError(
            f"The chat template of {model_name} refused the conversation: {_one_line(e)}",
            "Change the messages (e.g. drop --system), or use --raw.",
        ) from None
    except Exception as e:  # UndefinedError, TypeError, RecursionError, ... while rendering
        raise ModelError(
            f"The chat template of {model_name} failed: {type(e).__name__}: {_one_line(e)}.",
            "Use --raw to send the prompt without it.",
        ) from None


def _free(owner: object, *handles: tuple[str, Callable[[Any], None]]) -> None:
    """Free, in order, each llama.cpp handle `owner` still holds (its attribute's name, llama.cpp's free function for
    it) and set the attribute to None, so that a second `close` (or `__del__` after one) frees nothing twice."""
    for name, free in handles:
        handle = getattr(owner, name)
        if handle is not None:
            free(handle)
            setattr(owner, name, None)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."


class LlamaBackend(RecurrentGuard):
    """One GGUF model with one context and one sequence (seq_id 0). Implements `specdec_cli.models.backend.Backend`.

    Args:
        path: the .gguf file (already validated by `specdec_cli.models.gguf.check_gguf`).
        n_ctx: context window in tokens.
        n_batch: maximum tokens per `llama_decode` call; prompts are evaluated in chunks of this size and a verify
            batch (K + 1 tokens) must fit in one chunk.
        n_threads: CPU threads (None = all CPUs this process may use).
        n_gpu_layers: layers to offload (-1 = all; ignored by CPU builds).
        verbose: let llama.cpp log to stderr.
        extra_bufts: load with llama.cpp's extra buffer types (AMX kernels, repacked weights). None = as
            `specdec_cli.models.host.plan` decides for this host (off only where this build's AMX kernels crash).
        branches: a second sequence over a unified KV cache for `decode_branches` (default). Plain decoding is
            bit-identical either way (measured: Qwen2.5-Coder-1.5B, SmolLM2-135M); False = one sequence.
        flash_attn: llama.cpp's flash attention on (True) or off (False); None = llama.cpp's auto (on wherever the
            backend supports it, the CPU's included). On the CPU it makes a prefill chunk at long context cheaper
            and a short verify pass dearer (`specdec_cli.measure.flash_attn` measures both on the host). `PHASED`
            ("phased"): both, by pass: the context is made with it off and each llama_decode call over more than
            `PHASE_ROWS` rows (a prefill chunk), or starting before `phase_depth` tokens of context, runs with it on;
            needs `flash_attn_switch()` (else ValueError).
        phase_depth: phased: a pass that starts before this many tokens of context runs with flash attention
            (`PHASE_DEPTH`).
        n_lanes: sequences this context serves side by side (`lane(i)`, `decode_many`: the server's `--parallel`),
            each with its own `n_ctx` tokens of KV cache in a KV stream of its own (its rows attend to its cells only;
            no second branch). 1 = one sequence, as before.
        rs_snapshots: recurrent-state snapshots per sequence to ask llama.cpp for (`llama_context_params.n_rs_seq`)
            on a recurrent or hybrid model; llama.cpp grants them only to the architectures in its
            `llm_arch_supports_rs_rollback` (0 otherwise: then rollback is by checkpoint and replay). Each snapshot
            is one more copy of a sequence's recurrent state (`snapshot_bytes`). Ignored for transformers.

    Attributes:
        kind: "transformer", "hybrid" (attention and recurrent layers) or "recurrent" (llama.cpp's
            `llama_model_is_hybrid` / `llama_model_is_recurrent`).
        rollback: how `truncate` drops a verify pass's rejected tokens: "kv" (any suffix of a KV cache), "snapshots"
            (the last pass's own tokens, at most `n_rs_seq`, once per pass), "checkpoints" (restore the recurrent
            state saved before the pass, then evaluate the kept tokens again) or "none" (no draft is verified).
        n_rs_seq: the snapshots llama.cpp granted (`llama_n_rs_seq`), 0 for a transformer.

    Raises:
        ModelError: llama.cpp could not load the model or create the context.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_threads: int | None = None,
        n_gpu_layers: int = -1,
        verbose: bool = False,
        extra_bufts: bool | None = None,
        branches: bool = True,
        flash_attn: bool | str | None = None,
        phase_depth: int = PHASE_DEPTH,
        n_lanes: int = 1,
        rs_snapshots: int = RS_SNAPSHOTS,
    ) -> None:
        _init_once(verbose)
        self.path = str(path)
        self._model = None
        self._ctx = None
        self._batch: Any = None  # llama_cpp.llama_batch once the context exists
        threads = n_threads or default_threads()
        if extra_bufts is None:
            from specdec_cli.models import host

            extra_bufts = host.plan(self.path, n_threads=threads, system_info=system_info()).extra_bufts
        self.extra_bufts = extra_bufts
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers if n_gpu_layers >= 0 else 0x7FFFFFFF
        mparams.use_extra_bufts = extra_bufts
        if hasattr(mparams, "load_mtp"):  # an MTP block's weights, where the model has one (`LlamaMtp`)
            mparams.load_mtp = True
        model = llama_cpp.llama_model_load_from_file(self.path.encode(), mparams)
        if not model:
            raise ModelError(
                f"llama.cpp could not load {self.path}.",
                "Check that it is a GGUF model supported by llama-cpp-python "
                f"{llama_cpp.__version__}; SPECDEC_DEBUG=1 shows llama.cpp's log.",
            )
        self._model = model
        self.kind = (
            HYBRID
            if llama_cpp.llama_model_is_hybrid(model)
            else RECURRENT
            if llama_cpp.llama_model_is_recurrent(model)
            else TRANSFORMER
        )
        cparams = llama_cpp.llama_context_default_params()
        if self.kind != TRANSFORMER:
            branches = False  # a recurrent state cannot branch: no second sequence (its snapshots would double too)
            cparams.n_rs_seq = max(0, int(rs_snapshots))
        if n_lanes < 1:
            raise ValueError(f"n_lanes={n_lanes}: at least 1")
        cparams.n_ctx = n_ctx * n_lanes  # n_ctx per lane's stream
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        # lane i: sequence i in a KV stream of its own; one lane: sequence 0, and 1 for the second branch
        if n_lanes > 1:
            branches = False  # a branch's cells would be copied across streams
        cparams.n_seq_max = 2 if branches else n_lanes
        cparams.kv_unified = branches  # branches share the committed prefix's cells (one pool)
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        self._set_fa: Any = None
        if flash_attn == PHASED:
            self._set_fa = _set_flash_attn_fn()
            if self._set_fa is None:
                self.close()
                raise ValueError("flash_attn='phased' needs llama_set_flash_attn (specdec install-llama-cpp)")
        elif flash_attn not in (None, True, False):
            raise ValueError(f"flash_attn={flash_attn!r}: one of None, True, False, {PHASED!r}")
        cparams.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
            if flash_attn is None
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            if flash_attn in (False, PHASED)
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        )
        self.flash_attn = flash_attn
        self._fa_on = False  # phased: flash attention's setting for the next llama_decode call
        self.phase_depth = phase_depth
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            raise ModelError(
                f"llama.cpp could not create a context of {n_ctx} tokens for {self.path}.", "Try a smaller --ctx."
            )
        self._ctx = ctx
        self._cparams = cparams
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self._mem = llama_cpp.llama_get_memory(ctx)
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._n_ctx = int(llama_cpp.llama_n_ctx(ctx)) // n_lanes
        self.n_lanes = n_lanes
        self._n_batch = int(llama_cpp.llama_n_batch(ctx))
        self.n_threads = threads

        # One batch for the whole life of the context, filled through numpy views of its C arrays.
        self._batch = llama_cpp.llama_batch_init(self._n_batch, 0, 2 if branches else 1)
        b = self._batch
        self._b_token = np.ctypeslib.as_array(b.token, shape=(self._n_batch,))
        self._b_pos = np.ctypeslib.as_array(b.pos, shape=(self._n_batch,))
        self._b_nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(self._n_batch,))
        self._b_logits = np.ctypeslib.as_array(
            ctypes.cast(b.logits, ctypes.POINTER(ctypes.c_int8)), shape=(self._n_batch,)
        )
        self._b_nseq[:] = 1
        for i in range(self._n_batch):
            b.seq_id[i][0] = 0
            if branches:
                b.seq_id[i][1] = 1  # read only where n_seq_id is 2 (a branch pass's shared tokens)
        self._seq1 = [0] * self._n_batch  # seq_id[i][0] as set: a lane's sequence, or its second branch's
        self._seq2 = [1] * self._n_batch  # seq_id[i][1] as set (read only where n_seq_id is 2)
        self._branches = branches
        self.n_rs_seq = int(llama_cpp.llama_n_rs_seq(ctx)) if self.kind != TRANSFORMER else 0
        self._pieces: dict[int, bytes] = {}
        self._lltokenizer: Any = None  # built on first use (grammars)
        self._piece_buf = ctypes.create_string_buffer(256)
        self._abort_flag, self._abort_fn = _install_abort(ctx)
        self._init_sequence(self, 0, 1, KV if self.kind == TRANSFORMER else SNAPSHOTS if self.n_rs_seq else CHECKPOINT)

    # What every lane of one context shares (`lane`): the model, the context, its one batch and the batch's views, the
    # vocabulary's caches, sizes and settings. The rest is each sequence's own (`_init_sequence`).
    _SHARED = (
        "path", "extra_bufts", "kind", "flash_attn", "phase_depth", "n_lanes", "n_threads", "n_rs_seq",
        "_model", "_ctx", "_cparams", "_vocab", "_mem", "_n_vocab", "_n_ctx", "_n_batch", "_branches",
        "_batch", "_b_token", "_b_pos", "_b_nseq", "_b_logits", "_seq1", "_seq2",
        "_pieces", "_piece_buf", "_abort_flag", "_abort_fn",
    )  # fmt: skip

    def _init_sequence(self, root: LlamaBackend, s0: int, s1: int, rollback: str) -> None:
        """One sequence's own state: the lane that owns the context (`root`), its sequence ids (its own, its second
        branch's), the tokens its KV cells hold, a pending branch, how it rolls back (`rollback`, which its guard may
        lower), its recurrent state's guard and checkpoint buffer, and its counters."""
        self._root = root
        self._s0, self._s1 = s0, s1
        self._tokens = np.zeros(root._n_ctx, dtype=np.int32)  # the tokens held in the KV cache, positions 0.._n-1
        self._n = 0
        self._branch: tuple[int, np.ndarray] | None = None  # (start, the pending second branch's tokens)
        self.rollback = rollback
        self._guard_reset()
        self._ckpt_buf: ctypes.Array | None = None  # reused by every checkpoint of the same size
        self._state_bytes: int | None = None  # one sequence's recurrent state (`recurrent_state_bytes`)
        self.n_decode_calls = 0  # llama_decode calls (for stats and tests)
        self.n_evaluated = 0  # tokens evaluated in total

    # -- sizes ---------------------------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_batch(self) -> int:
        return self._n_batch

    shared_rows = 0  # a lane's passes are shared through `server.lanes.Slot`, never here
    # called after each llama_decode of `decode` and `decode_many` (a call of the lane's own) with (its first position,
    # its tokens): `LlamaMtp`'s catch-up
    on_hidden: Callable[[int, np.ndarray], None] | None = None

    @property
    def n_nextn(self) -> int:
        """The model's MTP (nextn) layers: 0 for most models, 1 for Qwen3.5's single trained head (`LlamaMtp`)."""
        return int(llama_cpp.llama_model_n_layer_nextn(self._model))

    @property
    def draft_limit(self) -> int:
        """n_batch - 1; with rollback by snapshots at most `n_rs_seq`; 0 where nothing rolls back
        (`rollback.draft_limit`)."""
        return _draft_limit(self.rollback, self._n_batch, self.n_rs_seq)

    @property
    def tokens(self) -> np.ndarray:
        view = self._tokens[: self._n]
        view.flags.writeable = False
        return view

    # -- the KV cache ------------------------------------------------------------------------------------------
    @property
    def branches(self) -> bool:
        """True: `decode_branches` works (False for recurrent and hybrid models, whose state cannot branch)."""
        return self._branches

    def _seq_ids(self, n: int, first: list[int], second: int | None = None) -> None:
        """Set batch rows 0..n-1 to sequence `first[i]` each, only where it changed; `second`: the sequence the
        rows marked n_seq_id = 2 also belong to (a lane's second branch)."""
        b, cur = self._batch, self._seq1
        for i in range(n):
            if cur[i] != first[i]:
                b.seq_id[i][0] = cur[i] = first[i]
        if second is not None:
            cur2 = self._seq2
            for i in range(n):
                if cur2[i] != second:
                    b.seq_id[i][1] = cur2[i] = second

    def decode(self, tokens: Sequence[int] | np.ndarray, n_logits: int = 0) -> np.ndarray:
        """Evaluate `tokens` after the cache; return float32 [n_logits, n_vocab] logits of the last rows (a view).

        Raises ContextOverflowError (nothing evaluated) or DecodeError (cache rolled back to its state before the call).
        """
        self._drop_branch()
        toks = np.asarray(tokens, dtype=np.int32)
        m = len(toks)
        if n_logits > min(m, self._n_batch):
            raise ValueError(f"n_logits={n_logits} exceeds the batch ({m} tokens, n_batch {self._n_batch})")
        start = self._n
        if start + m > self._n_ctx:
            raise ContextOverflowError(
                f"The context window is full: {start} + {m} tokens > --ctx {self._n_ctx}.",
                "Use a larger --ctx or a shorter prompt / --max-tokens.",
            )
        if self.kind != TRANSFORMER:
            self._before_pass(start, m, n_logits)
        try:
            for c0 in range(0, m, self._n_batch):
                c1 = min(m, c0 + self._n_batch)
                n = c1 - c0
                # batch.token / pos: [n]; logits flags: 1 only on the last n_logits rows of the whole call
                self._b_token[:n] = toks[c0:c1]
                self._b_pos[:n] = np.arange(start + c0, start + c1, dtype=np.int32)
                self._b_logits[:n] = 0
                self._b_nseq[:n] = 1
                if self._seq1[:n] != [self._s0] * n:
                    self._seq_ids(n, [self._s0] * n)
                first_out = max(c0, m - n_logits)
                if first_out < c1:
                    self._b_logits[first_out - c0 : n] = 1
                self._batch.n_tokens = n
                root = self._root
                if root._set_fa is not None and (n > PHASE_ROWS or start + c0 < self.phase_depth) != root._fa_on:
                    root._phase(not root._fa_on)
                rc = llama_cpp.llama_decode(self._ctx, self._batch)
                self.n_decode_calls += 1
                if rc != 0:
                    raise DecodeError.of(rc, n)
                self._tokens[start + c0 : start + c1] = toks[c0:c1]
                self._n = start + c1
                self._after_call(start + c0)  # the last llama_decode call's tokens: what a snapshot can drop
                self.n_evaluated += n
                if self.on_hidden is not None:  # an MTP drafter catches up on this call's hidden states
                    self.on_hidden(start + c0, toks[c0:c1])
        except BaseException:
            # A failed or interrupted call leaves the cache as it was before the call (or, for a recurrent state
            # without a checkpoint of it, empty).
            if self.kind == TRANSFORMER:
                llama_cpp.llama_memory_seq_rm(self._mem, self._s0, start, -1)
                self._n = start
            else:
                self._undo_pass(start)
            raise
        if n_logits == 0:
            return np.zeros((0, self._n_vocab), dtype=np.float32)
        ptr = llama_cpp.llama_get_logits(self._ctx)
        # Outputs are stored contiguously in batch order: [n_logits, n_vocab], zero-copy.
        view = np.ctypeslib.as_array(ptr, shape=(n_logits, self._n_vocab))
        view.flags.writeable = False
        return view

    def decode_branches(self, tokens: Sequence[int] | np.ndarray, branch: Sequence[int] | np.ndarray) -> np.ndarray:
        """One pass over two branches after the cache (`Backend.decode_branches`): t_0 and the branches' common
        prefix in sequences 0 and 1, the rest of `tokens` in sequence 0, the rest of `branch` in sequence 1 at the
        same positions; sequence 1 first becomes a copy of sequence 0 (the committed prefix's cells, metadata only in
        a unified cache). Logits for every row, float32 [R, n_vocab] in `backend.branch_rows` order (a view).

        Raises ValueError (more than one batch), ContextOverflowError, DecodeError (the cache is left as before).
        """
        if not self._branches:
            raise NotImplementedError(f"{Path(self.path).name} cannot branch its KV cache")
        self._drop_branch()
        toks, alt = np.asarray(tokens, dtype=np.int32), np.asarray(branch, dtype=np.int32)
        m, c = len(toks), common_prefix(toks[1:], alt)
        rows = m + len(alt) - c
        if rows > self._n_batch:
            raise ValueError(f"a tree of {rows} tokens exceeds one batch (n_batch {self._n_batch})")
        start = self._n
        if start + max(m, 1 + len(alt)) > self._n_ctx:
            raise ContextOverflowError(
                f"The context window is full: {start} + {max(m, 1 + len(alt))} tokens > --ctx {self._n_ctx}.",
                "Use a larger --ctx or a shorter prompt / --max-tokens.",
            )
        mem = llama_cpp.llama_memory_seq_rm  # sequence 1 := sequence 0 (both stop at start - 1)
        mem(self._mem, self._s1, -1, -1)
        llama_cpp.llama_memory_seq_cp(self._mem, self._s0, self._s1, -1, -1)
        # rows: [t_0, a_1..a_c (shared), a_(c+1)..a_(m-1) (seq 0), b_(c+1)..b_n (seq 1)]
        self._b_token[:m] = toks
        self._b_token[m:rows] = alt[c:]
        self._b_pos[:m] = np.arange(start, start + m, dtype=np.int32)
        self._b_pos[m:rows] = np.arange(start + 1 + c, start + 1 + len(alt), dtype=np.int32)
        self._b_nseq[:rows] = 1
        self._b_nseq[: c + 1] = 2
        self._seq_ids(rows, [self._s0] * m + [self._s1] * (rows - m), self._s1)
        self._b_logits[:rows] = 1
        self._batch.n_tokens = rows
        root = self._root
        if root._set_fa is not None and (rows > PHASE_ROWS or start < self.phase_depth) != root._fa_on:
            root._phase(not root._fa_on)
        try:
            rc = llama_cpp.llama_decode(self._ctx, self._batch)
            self.n_decode_calls += 1
            if rc != 0:
                raise DecodeError.of(rc, rows)
        except BaseException:
            llama_cpp.llama_memory_seq_rm(self._mem, self._s0, start, -1)
            llama_cpp.llama_memory_seq_rm(self._mem, self._s1, -1, -1)
            raise
        self._tokens[start : start + m] = toks
        self._n = start + m
        self.n_evaluated += rows
        self._branch = (start, alt)
        ptr = llama_cpp.llama_get_logits(self._ctx)
        view = np.ctypeslib.as_array(ptr, shape=(rows, self._n_vocab))
        view.flags.writeable = False
        return view

    def _phase(self, on: bool) -> None:
        """Phased flash attention: on for the next calls (prefill chunks) or off (verify passes). A build whose
        context refuses to turn it on keeps it off from then on."""
        if not self._set_fa(self._ctx, on):
            self._set_fa = None  # cannot turn on (the backend lacks it): off, as the context was made
            self._fa_on = False
            return
        self._fa_on = on

    def _drop_branch(self) -> None:
        """Drop a pending second branch (sequence 1) from the cache: a whole sequence, which never fails."""
        if self._branch is not None:
            llama_cpp.llama_memory_seq_rm(self._mem, self._s1, -1, -1)
            self._branch = None

    def truncate(self, n: int, *, branch: bool = False) -> None:
        """Keep positions [0, n) of sequence 0, or (`branch`, after `decode_branches`) of the second branch, which
        then becomes sequence 0. A recurrent or hybrid state rolls back only as `_truncate_recurrent` allows and is
        otherwise cleared: `tokens` may then hold fewer than n tokens (none), and the caller evaluates again what it
        needs (`backend.sync`). Raises CacheTrimError when llama.cpp refuses to trim a KV cache."""
        if n < 0:
            raise ValueError(f"truncate({n}): a negative length")
        if branch:
            if self._branch is None:
                raise ValueError("truncate(branch=True) without a pending branch")
            start, alt = self._branch
            keep = n - start - 1  # tokens of the branch after t_0
            # sequence 0 drops its own path after t_0, takes the branch's cells [start + 1, n), then sequence 1 goes
            if not llama_cpp.llama_memory_seq_rm(self._mem, self._s0, start + 1, -1):
                raise CacheTrimError(
                    f"llama.cpp refused to drop a branch of {Path(self.path).name}.", "Use --method none."
                )
            llama_cpp.llama_memory_seq_cp(self._mem, self._s1, self._s0, start + 1, n)
            self._drop_branch()
            self._tokens[start + 1 : n] = alt[:keep]
            self._n = n
            return
        self._drop_branch()
        if n >= self._n:
            return
        if self.kind != TRANSFORMER:
            self._truncate_recurrent(n)
            return
        if not llama_cpp.llama_memory_seq_rm(self._mem, self._s0, n, -1):
            raise CacheTrimError(
                f"llama.cpp refused to roll back the KV cache of {Path(self.path).name} to {n} tokens "
                "(recurrent and hybrid models cannot drop a partial sequence).",
                "Use a transformer model, or --method none.",
            )
        self._n = n

    # -- the raw operations under `rollback.RecurrentGuard` (a recurrent or hybrid model's sequence) ------------------
    def _seq_rm(self, n: int) -> bool:
        """llama.cpp's partial trim of sequence 0 to n tokens (by a snapshot on a recurrent state: the guard's)."""
        if not llama_cpp.llama_memory_seq_rm(self._mem, self._s0, n, -1):
            return False
        self._n = n
        return True

    def _seq_clear(self) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, self._s0, -1, -1)
        self._n = 0

    def _state_save(self) -> ctypes.Array | None:
        """The recurrent part of sequence 0's state (`llama_state_seq_get_data_ext`, PARTIAL_ONLY: a hybrid's
        attention cells stay in the cache and are trimmed by position). None when llama.cpp copies nothing."""
        size = int(llama_cpp.llama_state_seq_get_size_ext(self._ctx, self._s0, _PARTIAL))
        buf = self._ckpt_buf if self._ckpt_buf is not None and len(self._ckpt_buf) == size else None
        if buf is None:
            buf = self._ckpt_buf = (ctypes.c_uint8 * size)()
        if not size or int(llama_cpp.llama_state_seq_get_data_ext(self._ctx, buf, size, self._s0, _PARTIAL)) == 0:
            return None
        return buf

    def _state_load(self, data: ctypes.Array, at: int) -> bool:
        """Sequence 0's recurrent state := `data` (from `_state_save` at `at` tokens); a hybrid's attention cells from
        `at` on dropped (past the restored state's position, which asks no rollback of it)."""
        if int(llama_cpp.llama_state_seq_set_data_ext(self._ctx, data, len(data), self._s0, _PARTIAL)) == 0:
            self._seq_clear()
            return False
        llama_cpp.llama_memory_seq_rm(self._mem, self._s0, at, -1)
        self._n = at
        return True

    def recurrent_state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state (a hybrid's recurrent layers; `llama_state_seq_get_size_ext` with
        PARTIAL_ONLY): what one snapshot or one checkpoint copies. 0 for a transformer. Measured once, on a sequence
        that holds a state (on an empty cache: a one-token pass, then the sequence cleared)."""
        if self.kind == TRANSFORMER:
            return 0
        if self._state_bytes is None:
            if self._n == 0:
                bos = int(llama_cpp.llama_vocab_bos(self._vocab))
                self.decode([bos if bos >= 0 else 0], n_logits=0)
                size = int(llama_cpp.llama_state_seq_get_size_ext(self._ctx, self._s0, _PARTIAL))
                self._clear()
                self.n_cleared -= 1
            else:
                size = int(llama_cpp.llama_state_seq_get_size_ext(self._ctx, self._s0, _PARTIAL))
            self._state_bytes = size
        return self._state_bytes

    def describe(self) -> dict[str, Any]:
        """What kind of model this is and how it rolls back: {"kind", "rollback", "n_rs_seq", "state_bytes" (one
        sequence's recurrent state, 0 for a transformer), "snapshot_bytes" (its snapshots, per sequence)}."""
        return {
            "kind": self.kind,
            "rollback": self.rollback,
            "n_rs_seq": self.n_rs_seq,
            "state_bytes": self.recurrent_state_bytes(),
            "snapshot_bytes": self.snapshot_bytes,
        }

    @property
    def snapshot_bytes(self) -> int:
        """Memory the recurrent-state snapshots take per sequence, in bytes: n_rs_seq x `recurrent_state_bytes`."""
        return self.n_rs_seq * self.recurrent_state_bytes() if self.n_rs_seq else 0

    def kv_bytes_per_token(self) -> int:
        """Bytes one token takes in the KV cache: layers x 2 (K and V) x KV heads x head size x the cache type's
        bytes (2 for the default f16), e.g. 28 x 2 x 2 x 128 x 2 = 28,672 for Qwen2.5-Coder-1.5B."""
        m = self._model
        n_head = max(1, int(llama_cpp.llama_model_n_head(m)))
        head = int(llama_cpp.llama_model_n_embd(m)) // n_head
        size = 1 if int(self._cparams.type_k) == llama_cpp.GGML_TYPE_Q8_0 else 2
        return int(llama_cpp.llama_model_n_layer(m)) * 2 * int(llama_cpp.llama_model_n_head_kv(m)) * head * size

    # -- lanes: several sequences side by side in one context ------------------------------------------------
    def lane(self, i: int) -> LlamaBackend:
        """Lane `i` (0 <= i < n_lanes) of this context: a `Backend` of its own sequence (seq_id i, in a KV stream of its
        own; no second branch) and its own `tokens`, sharing `_SHARED` (the model, the context, the batch) with every
        other lane; lane 0 is this object. Not thread-safe: llama.cpp's context is shared, so one thread at a time
        calls any lane (`server.lanes.Scheduler`'s loop does). Raises ValueError for a lane the context was not made
        with."""
        if not 0 <= i < self.n_lanes:
            raise ValueError(f"lane {i}: this context has {self.n_lanes} (n_lanes)")
        root = self._root
        if i == 0:
            return root
        lane = LlamaBackend.__new__(LlamaBackend)  # (not __init__: the model and context are root's)
        for name in self._SHARED:
            setattr(lane, name, getattr(root, name))
        lane._init_sequence(root, i, i, root.rollback)  # (a rollback the root's guard lowered holds for the model)
        llama_cpp.llama_memory_seq_rm(root._mem, lane._s0, -1, -1)
        return lane

    def copy_prefix(self, rows: np.ndarray, peers: Sequence[LlamaBackend]) -> int:
        """Copy into this lane, instead of evaluating them, the cells of the first of `rows` (int32 [m], the tokens
        that follow this lane's) that one of `peers` (other lanes of this context) holds after the same tokens: a
        prompt prefix a sibling lane already read (a shared system prompt), as llama-server's slots reuse each
        other's cached prompts. llama.cpp copies only whole KV streams (`llama_memory_seq_cp` across streams, run at
        the next `llama_decode`), so the peer's stream is copied and this lane's cells past the prefix removed; a
        state read of this lane (`snapshot`, `save_state`) holds the copy only after that next pass.

        Returns the rows copied (this lane's tokens grew by as many; the cells are the peer's, bit for bit): 0 when
        no peer holds COPY_MIN more, for a recurrent, hybrid or sliding-window target (whose cells a truncated copy
        would not hold) and for a lane an MTP head follows. Raises StateError if llama.cpp did not copy (the lane is
        then empty)."""
        if self.kind != TRANSFORMER or self.on_hidden is not None or llama_cpp.llama_model_n_swa(self._model) > 0:
            return 0
        want = np.concatenate([self.tokens, np.asarray(rows, dtype=np.int32)])
        best, src = self._n + COPY_MIN - 1, None
        for lane in peers:
            if lane is not self and lane._n > best and lane.on_hidden is None:
                c = common_prefix(lane.tokens, want)
                best, src = (c, lane) if c > best else (best, src)
        if src is None:
            return 0
        self._drop_branch()
        llama_cpp.llama_memory_seq_rm(self._mem, self._s0, -1, -1)  # (a unified cache would keep both otherwise)
        llama_cpp.llama_memory_seq_cp(self._mem, src._s0, self._s0, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._mem, self._s0, best, -1)
        if int(llama_cpp.llama_memory_seq_pos_max(self._mem, self._s0)) != best - 1:
            llama_cpp.llama_memory_seq_rm(self._mem, self._s0, -1, -1)
            self._n = 0
            raise StateError(f"llama.cpp did not copy {best} cells between two lanes of {Path(self.path).name}.",
                             "Run the server with --parallel 1; SPECDEC_DEBUG=1 shows llama.cpp's log.")  # fmt: skip
        got = best - self._n
        self._tokens[self._n : best] = want[self._n : best]
        self._n = best
        return got

    def _decode_apart(
        self, parts: Sequence[tuple[LlamaBackend, np.ndarray, int]], calls: Sequence[int] | None
    ) -> list[np.ndarray]:
        """`decode_many` of unequal parts over KV streams: one `llama_decode` per row count (and call, `calls`), the
        parts of equal rows together (one ubatch: the weights read once for all of them), each call with its own
        flash-attention phase.
        llama.cpp would split a mixed call into ubatches of equal rows per stream anyway (consecutive sequence ids
        together), which cost more than a call each, and one call runs every ubatch with the phase of its largest
        part: a verify step beside a prefill chunk would run with flash attention on, the slow setting for it. A lane
        an MTP head follows has a call of its own. Logits come back in the parts' order, every call's but the last
        copied (the next call overwrites them). A call that fails rolls the earlier ones back too."""
        groups: dict[object, list[int]] = {}
        for k, (lane, toks, _) in enumerate(parts):
            key = (len(toks), calls[k] if calls is not None else 0) if lane.on_hidden is None else ("apart", k)
            groups.setdefault(key, []).append(k)
        views: list[np.ndarray | None] = [None] * len(parts)
        done: list[tuple[LlamaBackend, int]] = []
        try:
            for g, ks in enumerate(groups.values()):
                before = [(parts[k][0], parts[k][0]._n) for k in ks]
                got = self.decode_many([parts[k] for k in ks])
                done += before
                last = g == len(groups) - 1
                for k, view in zip(ks, got, strict=True):
                    views[k] = view if last or not len(view) else view.copy()
        except BaseException:
            for lane, before_n in done:
                lane.truncate(before_n)
            raise
        return [v for v in views if v is not None]

    def decode_many(
        self, parts: Sequence[tuple[LlamaBackend, np.ndarray, int]], calls: Sequence[int] | None = None
    ) -> list[np.ndarray]:
        """One `llama_decode` over several lanes' tokens (with KV streams and parts of unequal rows, one per row count,
        or per row count and `calls`, a key per part: `_decode_apart`; a shallow stream in a call with a deep one
        pays for its cells): each part (lane, int32 tokens [m], n_logits) is appended to its lane's sequence as `decode`
        would, and gets float32 [n_logits, n_vocab] logits of its last rows (a view, valid until the next call on
        this context). Rows of one lane attend to that lane's cells only, so
        each part's logits are what its own pass gives, up to the rounding of a larger batch (llama.cpp's kernels
        are not batch-invariant). The parts' lanes are distinct; their rows together fit one batch (n_batch). A lane
        an MTP head follows (`on_hidden` set) gets a call of its own, after which its hook runs, as after `decode`.

        Raises ValueError (rows over n_batch, a lane twice), ContextOverflowError (nothing evaluated) or
        DecodeError (every part's lane rolled back to its state before the call). After llama.cpp's
        `server_context::update_slots`, which puts every slot's tokens into one batch.
        """
        rows = sum(len(t) for _, t, _ in parts)
        if rows > self._n_batch:
            raise ValueError(f"{rows} rows exceed one batch (n_batch {self._n_batch})")
        if len({id(lane) for lane, _, _ in parts}) != len(parts):
            raise ValueError("a lane appears twice in one pass")
        for lane, toks, n_logits in parts:
            if lane._n + len(toks) > lane._n_ctx:
                raise ContextOverflowError(
                    f"The context window is full: {lane._n} + {len(toks)} tokens > --ctx {lane._n_ctx}.",
                    "Use a larger --ctx or a shorter prompt / --max-tokens.",
                )
            if n_logits > len(toks):
                raise ValueError(f"n_logits={n_logits} exceeds the part ({len(toks)} tokens)")
        if (
            self.n_lanes > 1
            and len(parts) > 1
            and (
                len({len(t) for _, t, _ in parts}) > 1
                or any(lane.on_hidden is not None for lane, _, _ in parts)
                or len(set(calls or ())) > 1
            )
        ):
            return self._decode_apart(parts, calls)  # (an MTP head reads its lane's hidden states from its own call)
        first: list[int] = []
        off, depth = 0, self._n_ctx
        for lane, toks, n_logits in parts:
            lane._drop_branch()
            m, start = len(toks), lane._n
            if lane.kind != TRANSFORMER:
                lane._before_pass(start, m, n_logits)
            self._b_token[off : off + m] = toks
            self._b_pos[off : off + m] = np.arange(start, start + m, dtype=np.int32)
            self._b_logits[off : off + m] = 0
            if n_logits:
                self._b_logits[off + m - n_logits : off + m] = 1
            first += [lane._s0] * m
            depth = min(depth, start)
            off += m
        self._b_nseq[:rows] = 1
        self._seq_ids(rows, first)
        self._batch.n_tokens = rows
        root = self._root
        if root._set_fa is not None and (rows > PHASE_ROWS or depth < self.phase_depth) != root._fa_on:
            root._phase(not root._fa_on)
        rc = llama_cpp.llama_decode(self._ctx, self._batch)
        if rc != 0:
            for lane, _, _ in parts:
                if lane.kind == TRANSFORMER:
                    llama_cpp.llama_memory_seq_rm(self._mem, lane._s0, lane._n, -1)
                else:
                    lane._undo_pass(lane._n)
            raise DecodeError.of(rc, rows)
        n_out = sum(n for _, _, n in parts)
        out = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self._ctx), shape=(max(n_out, 1), self._n_vocab))
        out.flags.writeable = False
        views, row = [], 0
        for lane, toks, n_logits in parts:
            m = len(toks)
            lane._tokens[lane._n : lane._n + m] = toks
            lane._after_call(lane._n)
            lane._n += m
            lane.n_evaluated += m
            lane.n_decode_calls += 1
            if lane.on_hidden is not None:  # the lane's MTP drafter catches up, as after `decode`
                lane.on_hidden(lane._n - m, toks)
            views.append(out[row : row + n_logits] if n_logits else np.zeros((0, self._n_vocab), np.float32))
            row += n_logits
        return views

    # -- saving and restoring the KV cache (the prompt cache) --------------------------------------------------
    def state_key(self) -> dict[str, str | int]:
        """What a saved KV state of this context depends on, besides the model file and the tokens: the llama.cpp
        build (llama-cpp-python version, its state-file version, llama.cpp's system info line) and every context
        parameter that changes the KV cache's layout or values (n_ctx, n_batch/n_ubatch, K/V types, flash
        attention, RoPE scaling, SWA/unified KV). Threads and GPU offload are left out. JSON-serialisable.
        """
        p = self._cparams
        key: dict[str, str | int] = {
            "llama_cpp_python": str(llama_cpp.__version__),
            "state_seq_version": int(getattr(llama_cpp, "LLAMA_STATE_SEQ_VERSION", 0)),
            "system_info": system_info(),
            "model_desc": self._model_desc(),
            "model_n_params": int(llama_cpp.llama_model_n_params(self._model)),
            "n_ctx": self._n_ctx,
            "n_batch": self._n_batch,
            "n_ubatch": int(p.n_ubatch),
            "n_seq_max": int(p.n_seq_max),
            "type_k": int(p.type_k),
            "type_v": int(p.type_v),
            "flash_attn_type": int(p.flash_attn_type),
            "rope": f"{p.rope_scaling_type}/{p.rope_freq_base!r}/{p.rope_freq_scale!r}/{p.yarn_orig_ctx}",
            "swa_full": int(p.swa_full),
            "kv_unified": int(p.kv_unified),
        }
        if self.flash_attn == PHASED:  # prefill chunks computed with flash attention on (a key of its own)
            key["flash_attn_phased"] = 1
        if self.kind != TRANSFORMER:
            key["n_rs_seq"] = self.n_rs_seq
        return key

    def _model_desc(self) -> str:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_desc(self._model, buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n > 0 else ""

    def state_size(self) -> int:
        """Bytes the KV state of sequence 0 takes when saved (without the file's header and token list)."""
        return int(llama_cpp.llama_state_seq_get_size(self._ctx, self._s0))

    def save_state(self, path: str | Path) -> int:
        """Write the KV state of sequence 0 and its token list to `path` (llama.cpp's sequence-state file: magic,
        version, n_tokens, int32 tokens [n], then the cells), streamed one tensor range at a time (llama.cpp's
        `llama_io_write_file`), so memory grows by one layer's K or V rows at most. Overwrites `path` in place (the
        caller makes it atomic: write a temp file created 0o600, then `os.replace`).

        Returns the bytes written (> 0). Raises StateError when llama.cpp fails (disk full, unwritable path).
        """
        toks = self._tokens[: self._n]
        ptr = toks.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        written = llama_cpp.llama_state_seq_save_file(self._ctx, os.fsencode(path), self._s0, ptr, self._n)
        if written == 0:
            raise StateError(f"llama.cpp could not save the KV state of {Path(self.path).name} to {path}.",
                             "Check the free disk space and the directory's permissions.")  # fmt: skip
        return int(written)

    def load_state(self, path: str | Path) -> int:
        """Replace the KV cache of sequence 0 with the state saved in `path` by `save_state` (streamed, like the save:
        memory grows by one tensor range, not by the state's size). Afterwards `tokens` is the saved token list.

        Only llama.cpp's own checks apply here (magic, version, token capacity = n_ctx, layer count, K/V types and
        row sizes): it cannot tell a state of another model with the same shapes, so callers check identity first
        (`specdec_cli.stores.prompt_cache` does). To restore a prefix, `load_state` then `truncate(n)`.

        Returns the number of tokens restored. Raises StateError when llama.cpp refuses or fails; the cache is then
        empty (`tokens` has length 0), never half-restored.
        """
        self._n = 0  # llama.cpp drops sequence 0 before it reads the cells
        n_out = ctypes.c_size_t(0)
        ptr = self._tokens.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        read = llama_cpp.llama_state_seq_load_file(self._ctx, os.fsencode(path), self._s0, ptr, self._n_ctx,
                                                    ctypes.byref(n_out))  # fmt: skip
        n = int(n_out.value)
        pos_max = int(llama_cpp.llama_memory_seq_pos_max(self._mem, self._s0))
        if read == 0 or n == 0 or n > self._n_ctx or pos_max != n - 1:
            llama_cpp.llama_memory_seq_rm(self._mem, self._s0, -1, -1)
            why = "refused the file" if read == 0 else f"restored {pos_max + 1} positions for {n} tokens"
            raise StateError(f"llama.cpp {why} when loading the KV state {path} into {Path(self.path).name}.",
                             "The file is not a state of this model and context; it is not used.")  # fmt: skip
        self._n = n
        self._guard_reset()  # no pass to roll back: a recurrent state loaded is used whole or not at all
        return n

    def snapshot(self) -> ctypes.Array:
        """A copy in memory of the KV state of sequence 0 (its cells; `llama_state_seq_get_data`), for
        `restore_snapshot` (`specdec_cli.stores.kv_parking`). Its len() is its size in bytes (~28 KB per token for
        Qwen2.5-Coder-1.5B). Raises StateError when llama.cpp copies nothing."""
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, self._s0))
        buf = (ctypes.c_uint8 * size)()
        written = int(llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, self._s0))
        if written == 0 and self._n:
            raise StateError(f"llama.cpp could not copy the KV state of {Path(self.path).name}.",
                             "Run with less context (--ctx) or more free memory.")  # fmt: skip
        return buf

    def restore_snapshot(self, data: ctypes.Array, tokens: np.ndarray) -> None:
        """Replace the KV cache of sequence 0 by `data` (from `snapshot`), which holds `tokens` (int32 [n]).
        Raises StateError when llama.cpp refuses it; the cache is then empty."""
        llama_cpp.llama_memory_seq_rm(self._mem, self._s0, -1, -1)
        self._n = 0
        read = int(llama_cpp.llama_state_seq_set_data(self._ctx, data, len(data), self._s0))
        n = len(tokens)
        if read == 0 or int(llama_cpp.llama_memory_seq_pos_max(self._mem, self._s0)) != n - 1:
            llama_cpp.llama_memory_seq_rm(self._mem, self._s0, -1, -1)
            raise StateError(f"llama.cpp refused a parked KV state of {n} tokens for {Path(self.path).name}.",
                             "It is evaluated again instead.")  # fmt: skip
        self._tokens[:n] = tokens
        self._n = n
        self._guard_reset()

    # -- tokens and text -------------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        cached = self._pieces.get(token)
        if cached is None:
            n = llama_cpp.llama_token_to_piece(self._vocab, token, self._piece_buf, 256, 0, False)
            cached = self._piece_buf.raw[: max(n, 0)]
            self._pieces[token] = cached
        return cached

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def token_text(self, token: int) -> str:
        raw = llama_cpp.llama_vocab_get_text(self._vocab, token)
        return raw.decode("utf-8", "replace") if raw else ""

    def fim_tokens(self) -> FimTokens:
        """llama.cpp's FIM token ids for this vocabulary (-1 = none → None)."""
        ids = [
            f(self._vocab)
            for f in (
                llama_cpp.llama_vocab_fim_pre,
                llama_cpp.llama_vocab_fim_suf,
                llama_cpp.llama_vocab_fim_mid,
                llama_cpp.llama_vocab_fim_pad,
                llama_cpp.llama_vocab_fim_rep,
                llama_cpp.llama_vocab_fim_sep,
            )
        ]
        return FimTokens(*(int(t) if t >= 0 else None for t in ids))

    def vocab_info(self) -> VocabInfo:
        h = hashlib.sha256()
        for i in range(self._n_vocab):
            h.update(llama_cpp.llama_vocab_get_text(self._vocab, i) or b"")
            h.update(b"\0")
        return VocabInfo(
            vocab_type=int(llama_cpp.llama_vocab_type(self._vocab)),
            n_vocab=self._n_vocab,
            bos=int(llama_cpp.llama_vocab_bos(self._vocab)),
            eos=int(llama_cpp.llama_vocab_eos(self._vocab)),
            fingerprint=h.hexdigest(),
        )

    def lltokenizer(self):
        """The vocabulary as an llguidance `LLTokenizer` (`llguidance.llamacpp.lltokenizer_from_vocab`: every token's
        piece, control tokens marked special, llama.cpp's own tokenizer for forced text), with the model's
        end-of-generation tokens as its end-of-sequence tokens. Built once (it walks the whole vocabulary), cached."""
        if self._root is not self:
            return self._root.lltokenizer()
        if self._lltokenizer is None:
            from llguidance.llamacpp import lltokenizer_from_vocab

            eog = [t for t in range(self._n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)]
            eos = int(llama_cpp.llama_vocab_eos(self._vocab))
            eog.sort(key=lambda t: t != eos)  # the EOS first: llguidance's own end token
            with warnings.catch_warnings():  # it calls llama_token_get_attr, deprecated in 0.3.36, once per token
                warnings.simplefilter("ignore", DeprecationWarning)
                self._lltokenizer = lltokenizer_from_vocab(self._vocab, n_vocab=self._n_vocab, eos_token=eog or None)
        return self._lltokenizer

    def chat_template(self) -> str | None:
        """The GGUF's `tokenizer.chat_template` (None when it has none)."""
        template = llama_cpp.llama_model_chat_template(self._model, None)
        return template.decode("utf-8", "replace") if template else None

    def format_chat(self, messages: list[dict], **options: Any) -> str:
        """`Backend.format_chat`: render messages with the GGUF's `tokenizer.chat_template` in llama-cpp-python's
        sandboxed Jinja env (`chat_formatter`)."""
        return self.chat_formatter()(messages, **options)

    def chat_formatter(self) -> Callable[..., str]:
        """`format_chat` with the chat template and its BOS/EOS text read now: the function it returns touches no
        llama.cpp state, so another thread may call it while this one decodes (`session.PromptText`). Without a
        template, that function raises UsageError."""
        template, name = self.chat_template(), Path(self.path).name
        if not template:

            def no_template(messages: list[dict], **options: Any) -> str:
                raise UsageError(f"{name} has no chat template.", "Use --raw to send the prompt as is.")

            return no_template
        bos = llama_cpp.llama_vocab_bos(self._vocab)
        eos = llama_cpp.llama_vocab_eos(self._vocab)
        return functools.partial(
            render_chat_template,
            template,
            bos_token=self.token_text(bos) if bos >= 0 else "",
            eos_token=self.token_text(eos) if eos >= 0 else "",
            model_name=name,
        )

    # -- interrupting a pass from another thread -----------------------------------------------------------------
    @property
    def interruptible(self) -> bool:
        """`interrupt` can stop a pass (the abort callback is installed; only the CPU backend checks it, so the layers
        on a GPU finish their part of the pass)."""
        return self._abort_flag is not None

    def interrupt(self, on: bool = True) -> None:
        """From any thread: make the `llama_decode` under way (or the next one) stop after its current graph node
        and raise `PassInterrupted`, the cache as it was before the call (milliseconds: one graph node); `on=False`
        clears the request (the caller's duty once that pass has returned, or every later pass stops at once)."""
        if self._abort_flag is not None:
            self._abort_flag[0] = b"\x01" if on else b"\x00"

    def close(self) -> None:
        if self._root is not self:  # a lane: the root lane frees the context and the model
            return
        _free(
            self,
            ("_batch", llama_cpp.llama_batch_free),
            ("_ctx", llama_cpp.llama_free),
            ("_model", llama_cpp.llama_model_free),
        )

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    def synchronize(self) -> None:
        """Wait until the device finished this context's last pass (`llama_synchronize`; the CPU has finished when
        `decode` returns, a GPU may not have where no logits were read)."""
        llama_cpp.llama_synchronize(self._root._ctx)


def describe_model(path: str | Path, *, rs_snapshots: int = RS_SNAPSHOTS) -> dict[str, Any]:
    """`LlamaBackend.describe` of the model at `path`, loaded on the CPU with a small context (its weights are
    mmapped; the recurrent state's size is read after a one-token pass). Raises ModelError when llama.cpp cannot load
    it."""
    backend = LlamaBackend(
        path, n_ctx=256, n_batch=64, n_gpu_layers=0, extra_bufts=False, branches=False, rs_snapshots=rs_snapshots
    )
    try:
        return backend.describe()
    finally:
        backend.close()


class VocabOnly:
    """A GGUF's tokenizer alone (llama.cpp's vocab_only load: no weights, no context, so cheap): `specdec learn` and
    `specdec serve --learn` tokenize files with it, apart from the model that generates. `tokenize` and
    `vocab_info` are `LlamaBackend`'s. Raises ModelError when llama.cpp cannot read the file."""

    def __init__(self, path: str | Path) -> None:
        _init_once(False)
        self.path = str(path)
        mparams = llama_cpp.llama_model_default_params()
        mparams.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(self.path.encode(), mparams)
        if not model:
            raise ModelError(
                f"llama.cpp could not read the tokenizer of {self.path}.",
                "Check that it is a GGUF model; SPECDEC_DEBUG=1 shows llama.cpp's log.",
            )
        self._model = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))

    # LlamaBackend's own methods, which read only the fields set above (typed Any: their `self` is a LlamaBackend)
    tokenize: Any = LlamaBackend.tokenize
    vocab_info: Any = LlamaBackend.vocab_info

    def close(self) -> None:
        _free(self, ("_model", llama_cpp.llama_model_free))


def probe_main(argv: list[str]) -> int:
    """Child side of a trial load: load argv[0] on the CPU, decode a few tokens, roll back, exit 0.

    argv = [path] for `host.probe_load` (is this file safe to load?): extra buffer types off, so a host whose
    llama.cpp AMX kernels crash does not make a sound file look corrupt. argv = [path, threads] for
    `host.probe_child` (do this build's AMX kernels work on this CPU?): loaded as built, with the threads of the real
    load (AMX worker threads are where issue 20824 faults). argv = [path, "device", layers, n_ctx] for
    `host.device_flash_attn` (does the device's flash attention survive verify passes?): `layers` offloaded, llama.cpp's
    flash attention, a prefill and verify passes of several sizes with logits for every row, each rolled back.

    Run in a separate process, so a GGML_ASSERT or a segfault in llama.cpp ends only this process; the parent turns
    the signal into an error or a verdict. Exit code `host.PROBE_REFUSED`, with the message on stderr, when the load
    fails cleanly.
    """
    if len(argv) in (3, 4) and argv[1] == "device":
        return _probe_device(argv[0], int(argv[2]), int(argv[3]) if len(argv) > 3 else 1024)
    kernels = len(argv) > 1
    threads = int(argv[1]) if kernels else 2

    def passes(backend: LlamaBackend) -> None:
        toks = backend.tokenize("Hello, world", add_special=True)[:8] or [0]
        backend.decode(toks, n_logits=1)  # a prefill ...
        backend.decode([toks[-1], toks[0], toks[0]], n_logits=3)  # ... a verify batch, logits for every row ...
        backend.truncate(len(toks) + 1)  # ... and a rollback inside it, as the engine's
        backend.piece(toks[0])

    return _probe(
        lambda: LlamaBackend(argv[0], n_ctx=64, n_batch=64, n_threads=threads, n_gpu_layers=0, extra_bufts=kernels),
        passes,
    )


def _probe_device(path: str, layers: int, n_ctx: int) -> int:
    """`probe_main`'s device mode: verify passes the engine's sizes make, on the device, in a context of the run's
    `n_ctx` (a kernel's plan can depend on the cache's size), with flash attention as llama.cpp chooses it; exit 0
    when they return, `host.PROBE_REFUSED` when the load fails cleanly."""

    def passes(backend: LlamaBackend) -> None:
        # a context past 512 tokens, as an edit's prompt makes (a kernel may split the KV cache there)
        text = "def f(x):\n    return x + 1\n" * 64
        toks = [int(t) for t in backend.tokenize(text, add_special=True)][:640]
        backend.decode(toks, n_logits=1)
        for rows in (2, 9, 17):  # a short, a middling and a long draft with its bonus row
            backend.decode(toks[-rows:], n_logits=rows)
            backend.truncate(len(toks))

    return _probe(
        lambda: LlamaBackend(
            path, n_ctx=max(n_ctx, 1024), n_batch=512, n_threads=2, n_gpu_layers=layers, flash_attn=None
        ),
        passes,
    )


def _probe(load: Callable[[], LlamaBackend], passes: Callable[[LlamaBackend], None]) -> int:
    """A probe child's run: `load()`, `passes` on it, close; 0 when they return, `host.PROBE_REFUSED` (the message on
    stderr) when llama.cpp refuses cleanly. A crash ends the process: the parent reads the signal."""
    import sys

    from specdec_cli.errors import SpecdecError
    from specdec_cli.models.host import PROBE_REFUSED

    try:
        backend = load()
        try:
            passes(backend)
        finally:
            backend.close()
    except SpecdecError as e:
        print(str(e), file=sys.stderr)
        return PROBE_REFUSED
    return 0


class LlamaMtp:
    """The target's own multi-token-prediction (MTP, "nextn") block as a drafter: a second llama.cpp context of type
    `LLAMA_CONTEXT_TYPE_MTP` on the target's model, linked to the target's context (`ctx_other`), after llama.cpp's
    `common_speculative_impl_draft_mtp` (common/speculative.cpp, a single trained head as in Qwen3.5).

    The MTP block predicts the token after position p from the token at p and the target's hidden state at p - 1
    (`llama_get_embeddings_nextn`). So after every target `decode` call (`LlamaBackend.on_hidden`), the block's own
    KV cache catches up on the pairs (token at p, target state at p - 1) of that call's tokens, and `draft` then
    chains the block from the newest committed token: each step feeds back the block's own state. Rows the target
    rejected are dropped from the block's cache at the next catch-up or draft (its cache is attention only, and
    dropping a suffix of it is always allowed). A draft only proposes: the target verifies every token, so a stale
    state costs acceptance, never correctness.

    Args:
        target: the target (a `LlamaBackend` of one sequence whose model has nextn layers).

    Raises:
        ModelError: the model has no MTP block, or llama.cpp could not create the MTP context.
    """

    def __init__(self, target: LlamaBackend) -> None:
        from llama_cpp import llama_cpp_ext as ext

        model = target._model
        self.n_heads = int(llama_cpp.llama_model_n_layer_nextn(model))
        if self.n_heads < 1:
            raise ModelError(f"{Path(target.path).name} has no MTP block (no nextn layers).",
                             "Use another --method, or a model with an MTP head (e.g. Qwen3.5).")  # fmt: skip
        self._ext = ext
        self.target = target
        self.n_embd = int(llama_cpp.llama_model_n_embd_out(model))
        tp = target._cparams
        cp = llama_cpp.llama_context_default_params()
        cp.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        cp.ctx_other = target._ctx
        cp.n_ctx = target.n_ctx
        cp.n_batch = cp.n_ubatch = target.n_batch
        cp.n_seq_max = 1
        cp.n_rs_seq = 0
        cp.n_threads = cp.n_threads_batch = target.n_threads
        cp.flash_attn_type = tp.flash_attn_type
        cp.no_perf = True
        ctx = llama_cpp.llama_init_from_model(model, cp)
        if not ctx:
            raise ModelError(f"llama.cpp could not create the MTP context of {Path(target.path).name}.",
                             "Use another --method; SPECDEC_DEBUG=1 shows llama.cpp's log.")  # fmt: skip
        self._ctx = ctx
        self._mem = llama_cpp.llama_get_memory(ctx)
        self._batch = llama_cpp.llama_batch_ext_init(ctx)
        self._n_vocab = target.n_vocab
        ext.llama_set_embeddings_nextn(target._ctx, True, False)  # every row of a target call: its hidden state
        ext.llama_set_embeddings_nextn(ctx, True, True)  # the block's own state, for the rows it outputs
        self._pos = (llama_cpp.llama_pos * 1)()
        # the target's hidden states of its last call: float32 [m, n_embd] for positions h_start .. h_start + m - 1
        self._h = np.zeros((0, self.n_embd), dtype=np.float32)
        self._h_start = 0
        self._zero = np.zeros(self.n_embd, dtype=np.float32)
        self.n_process_calls = 0  # llama_process calls on the MTP context (catch-up and draft steps)
        target._branches = False  # a second branch's rows would break the pairing of tokens and states
        target.on_hidden = self._catch_up

    def _state(self, pos: int) -> np.ndarray:
        """The target's hidden state at `pos` (float32 [n_embd]) where the last call has it, else zeros."""
        i = pos - self._h_start
        return self._h[i] if 0 <= i < len(self._h) else self._zero

    def _add(self, token: int, pos: int, state: np.ndarray, output: bool) -> int:
        b = self._batch
        idx = llama_cpp.llama_batch_ext_add_token(b, 0, int(token))
        if idx < 0:  # -1: the batch is full, -2/-3: an invalid token or sequence
            raise DecodeError(-1, llama_cpp.llama_n_batch(self._ctx))
        self._pos[0] = pos
        llama_cpp.llama_batch_ext_set_pos(b, idx, self._pos)
        embd = llama_cpp.llama_embd(state.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_embd)
        llama_cpp.llama_batch_ext_set_embd_token(b, idx, embd)
        if output:
            llama_cpp.llama_batch_ext_set_output_logits(b, idx, True)
        return idx

    def _process(self, n: int = 1) -> None:
        rc = llama_cpp.llama_process(self._ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        self.n_process_calls += 1
        if rc != 0:
            raise DecodeError.of(rc, n)

    def _catch_up(self, start: int, tokens: np.ndarray) -> None:
        """After a target call over `tokens` (int32 [m]) at positions start..: the block's cache gets the pairs
        (token at p, target state at p - 1), and the call's states are kept for the next catch-up and draft."""
        h = np.ctypeslib.as_array(
            self._ext.llama_get_embeddings_nextn(self.target._ctx), shape=(len(tokens), self.n_embd)
        ).copy()
        prev = self._state(start - 1).copy()
        llama_cpp.llama_memory_seq_rm(self._mem, 0, start, -1)
        llama_cpp.llama_batch_ext_clear(self._batch)
        for i, tok in enumerate(tokens):
            self._add(int(tok), start + i, prev if i == 0 else h[i - 1], False)
        self._process(len(tokens))
        self._h, self._h_start = h, start

    def draft(self, last: int, pos: int, k: int, choose: Callable[[np.ndarray, int], int]) -> list[int]:
        """Up to `k` tokens after `last`, the newest committed token, at position `pos` (the target's cache holds
        positions < pos). `choose(logits, i)` picks draft token i from the block's float32 [n_vocab] logits (argmax,
        or a draw from q that the caller keeps) and may return -1 to stop. Returns the tokens."""
        llama_cpp.llama_memory_seq_rm(self._mem, 0, pos, -1)  # earlier drafts, rejected rows
        state = self._state(pos - 1).copy()
        out: list[int] = []
        tok = int(last)
        for i in range(k):
            llama_cpp.llama_batch_ext_clear(self._batch)
            idx = self._add(tok, pos + i, state, True)
            self._process()
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, idx), shape=(self._n_vocab,))
            tok = choose(logits, i)
            if tok < 0:
                break
            out.append(tok)
            if i + 1 < k:
                state = np.ctypeslib.as_array(
                    self._ext.llama_get_embeddings_nextn_ith(self._ctx, idx), shape=(self.n_embd,)
                ).copy()
        return out

    def close(self) -> None:
        if self.target.on_hidden == self._catch_up:
            self.target.on_hidden = None
        _free(self, ("_batch", llama_cpp.llama_batch_ext_free), ("_ctx", llama_cpp.llama_free))
