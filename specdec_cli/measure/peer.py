"""The peer `specdec bench` measures against: llama-cpp-python's own prompt lookup decoding.

llama-cpp-python ships speculative decoding in its high-level API (its README, "Speculative Decoding"):

    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    llm = Llama(model_path, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))
    # "num_pred_tokens is the number of tokens to predict 10 is the default and generally good for gpu,
    #  2 performs better for cpu-only machines."

In 0.3.36 that call fails with `ValueError: could not broadcast input array from shape (…) into shape (0,)` as soon
as the context passes n_batch (512) tokens: `draft_model` forces `Llama._logits_all` on, but its `scores` buffer is
sized from the `logits_all` *argument* (n_batch rows, not n_ctx). A user gets it to work by also passing
`logits_all=True`, which allocates an n_ctx × n_vocab float32 buffer (4096 × 151,936 × 4 B = 2.3 GiB for
Qwen2.5 at --ctx 4096; pages become resident as positions are evaluated) and makes llama.cpp compute the output
layer for every evaluated position, the prompt included. We run it that way (`PeerModel`).

Exception to the project rule that only `specdec_cli.models.llama` imports `llama_cpp`: this module measures
llama-cpp-python's own high-level `Llama` API, which is the thing under test, so it imports `llama_cpp` lazily,
inside functions (never at module level); nothing else in specdec uses it.

How it is driven: `Llama.generate(tokens, temp=0.0, repeat_penalty=1.0)`, the token generator that
`create_completion` wraps (same prefix reuse, drafting and sampling; we skip only detokenisation and stop strings,
so the output is token ids we can compare with our engine's). Prompt tokens are the same chat-templated ids our
engine gets. The end-of-generation check is `create_completion`'s (`llama_vocab_is_eog`).

Acceptance is derived, not reported by the library: the draft model is wrapped by `RecordingDraft`, which records
each call's context length L and proposal d (it changes nothing). `Llama.generate` calls the draft model with the
whole committed context, so the tokens accepted from d are its common prefix with the final output at position L
(the token after the accepted prefix is the target's own and differs from d there). See `lookup_acceptance`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from specdec_cli.core.records import FinishReason
from specdec_cli.errors import ModelError

PEER_SETTINGS = (10, 2)  # num_pred_tokens: the documented default (GPU) and the documented CPU advice
MAX_NGRAM_SIZE = 2  # LlamaPromptLookupDecoding's default


def peer_call(num_pred_tokens: int, n_ctx: int) -> str:
    """The Python call the peer configuration runs, as shown in the report."""
    return (
        f"Llama(model_path, n_ctx={n_ctx}, logits_all=True, "
        f"draft_model=LlamaPromptLookupDecoding(num_pred_tokens={num_pred_tokens}))"
    )


class RecordingDraft:
    """Wraps a llama-cpp-python draft model and records (context length, proposal) for every call.

    `calls`: list of (L, int32 [k'] proposal). Duck-types `LlamaDraftModel` (`Llama` only calls it).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[int, np.ndarray]] = []

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        out = self.inner(input_ids, **kwargs)
        self.calls.append((len(input_ids), np.array(out, dtype=np.int32)))
        return out


@dataclass(frozen=True)
class LookupStats:
    """Acceptance of a prompt-lookup generation.

    n_drafted: proposed tokens that fall within the output (a proposal running past the last output token is cut
        there, as our engine caps K to the remaining budget). n_accepted: of those, accepted.
    n_spec_steps: target passes with a non-empty proposal. n_steps: target passes after the prompt's.
    k_histogram: proposal length → passes.
    """

    n_drafted: int
    n_accepted: int
    n_spec_steps: int
    n_steps: int
    k_histogram: dict[int, int]


def lookup_acceptance(calls: list[tuple[int, np.ndarray]], context: np.ndarray) -> LookupStats:
    """Acceptance from `RecordingDraft.calls` and the final context (int32 [n]: prompt + output tokens).

    For a call with context length L and proposal d: drafted = d cut to the n - L positions that exist;
    accepted = its common prefix with context[L:].
    """
    context = np.asarray(context, dtype=np.int32)
    drafted = accepted = spec_steps = 0
    hist: dict[int, int] = {}
    for L, d in calls:
        d = d[: max(0, len(context) - L)]
        hist[len(d)] = hist.get(len(d), 0) + 1
        if not len(d):
            continue
        spec_steps += 1
        drafted += len(d)
        neq = np.flatnonzero(d != context[L : L + len(d)])
        accepted += int(neq[0]) if len(neq) else len(d)
    return LookupStats(drafted, accepted, spec_steps, len(calls), hist)


@dataclass
class PeerRun:
    """One peer generation. Times in seconds from the `generate` call (perf_counter).

    tokens: output token ids (EOG excluded). token_times_s: when each was yielded. decode tok/s is
    (n - 1) / (t_n - t_1): the first token comes out of the prompt's pass, so it is time to first token, not decode.
    """

    tokens: list[int]
    token_times_s: list[float]
    finish_reason: FinishReason
    acceptance: LookupStats
    proposals: list[tuple[int, int]] = field(default_factory=list)  # (L, proposal length) per target pass

    @property
    def ttft_ms(self) -> float | None:
        return self.token_times_s[0] * 1e3 if self.token_times_s else None

    @property
    def decode_ms(self) -> float:
        t = self.token_times_s
        return (t[-1] - t[0]) * 1e3 if len(t) > 1 else 0.0

    @property
    def tokens_per_s(self) -> float:
        n = len(self.tokens)
        return (n - 1) / (self.decode_ms / 1e3) if n > 1 and self.decode_ms > 0 else 0.0


class PeerModel:
    """One `llama_cpp.Llama` with prompt lookup decoding, run as a user gets it to work (`logits_all=True`).

    Args:
        path: the GGUF file. n_ctx, n_threads, n_gpu_layers: as for our backend (threads are passed explicitly:
            Llama's own default is cpu_count // 2). verbose: llama.cpp's log.
        logits_all: True is what makes it work in 0.3.36; False reproduces the broadcast error (tests).

    One object serves every `num_pred_tokens` setting (its `draft_model` is swapped per run), so the settings share
    its KV cache the way our methods share our target's. Raises ModelError when llama.cpp cannot load the model.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_gpu_layers: int = -1,
        verbose: bool = False,
        logits_all: bool = True,
    ) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from specdec_cli.models.llama import default_threads

        self._lookup = LlamaPromptLookupDecoding
        threads = n_threads or default_threads()
        try:
            self.llm = Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_threads=threads,
                n_threads_batch=threads,
                n_gpu_layers=n_gpu_layers,
                logits_all=logits_all,
                verbose=verbose,
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=PEER_SETTINGS[0]),
            )
        except ValueError as e:
            raise ModelError(
                f"llama-cpp-python could not load {path}: {e}.", "Run with --verbose to see llama.cpp's log."
            ) from None
        self.n_threads = threads

    @property
    def scores_nbytes(self) -> int:
        """Bytes of Llama.scores, the float32 [n_ctx or n_batch, n_vocab] logits buffer (allocated, not all
        resident)."""
        return int(self.llm.scores.nbytes)

    @property
    def n_vocab(self) -> int:
        return int(self.llm.n_vocab())

    def is_eog(self, token: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, token))  # create_completion's own check

    def generate(
        self, prompt: list[int] | np.ndarray, *, num_pred_tokens: int, max_tokens: int, cold: bool = False
    ) -> PeerRun:
        """Greedy generation of up to `max_tokens` tokens after `prompt` (int [n] ids).

        cold: start from an empty KV cache (`Llama.reset`); otherwise `Llama.generate` reuses the longest cached
        prefix, as it does for a user's consecutive calls. Raises ValueError (the broadcast error) without
        logits_all once the context passes n_batch tokens.
        """
        llm = self.llm
        draft = RecordingDraft(self._lookup(max_ngram_size=MAX_NGRAM_SIZE, num_pred_tokens=num_pred_tokens))
        llm.draft_model = cast(Any, draft)  # (duck-typed: it wraps a LlamaPromptLookupDecoding)
        if cold:
            llm.reset()
        prompt = [int(t) for t in prompt]
        tokens: list[int] = []
        times: list[float] = []
        finish = FinishReason.length
        t0 = time.perf_counter()
        gen = llm.generate(prompt, temp=0.0, repeat_penalty=1.0)
        try:
            for tok in gen:
                t = time.perf_counter() - t0
                if self.is_eog(tok):
                    finish = FinishReason.eog
                    break
                tokens.append(int(tok))
                times.append(t)
                if len(tokens) >= max_tokens:
                    break
        finally:
            gen.close()
        # The draft model's first call sees the prompt + the first output token; earlier calls (none) would be the
        # prompt's own pass. Every call maps to one target pass over [last token, proposal].
        context = np.asarray(prompt + tokens, dtype=np.int32)
        calls = [(L, d) for L, d in draft.calls if L > len(prompt)]
        return PeerRun(
            tokens=tokens,
            token_times_s=times,
            finish_reason=finish,
            acceptance=lookup_acceptance(calls, context),
            proposals=[(L, len(d)) for L, d in calls],
        )

    def close(self) -> None:
        self.llm.close()
