"""Flash attention on or off, measured on this host at a long context (issue 34: long contexts priced).

llama.cpp's flash attention is a context setting (`llama_context_params.flash_attn_type`; its default, auto, turns it
on wherever the backend supports it, the CPU's included) and changes the KV cache's layout; stock llama.cpp cannot
change it between passes, the build of `specdec install-llama-cpp` can (`llama_set_flash_attn`, a patch of ours).
On the CPU it pulls two ways at a long context: a prefill chunk gets cheaper, while a verify pass over
2-63 rows gets dearer, since the CPU's flash-attention kernel walks the whole KV cache once per query row (llama.cpp
`ggml-cpu/ops.cpp`, `ggml_compute_forward_flash_attn_ext_f16_one_chunk`). What wins depends on the machine, so
`measure` times both (`core.verify_timing.measure_at_depth`: a prefill chunk and verify passes after `DEPTH` tokens,
each setting in its own context) and `decide` prices a turn at that depth: one prompt token prefilled plus one output
token decoded by speculation (the cheapest verify size at an acceptance of `ACCEPTANCE`, the bonus token included).
On, llama.cpp's default, is kept unless off's turn is cheaper by `OFF_MARGIN`: with it on, each query row's attention
is computed alone, so a row of a verify pass rounds as it would in a one-token pass and greedy output parts from
plain decoding at fewer near-ties; and its prefill lead grows past `DEPTH`, where agents' prompts live, so a turn
only slightly cheaper at `DEPTH` pays for neither. The choice is kept in learnt.json beside the verify curve (same
key: model file, CPU, threads, build) and applied at every model load (`session.flash_attn`); SPECDEC_FLASH_ATTN=on|off
overrides it. `specdec doctor --measure` measures it.

Phased (`models.llama.PHASED`, where the build can switch): on for prefill chunks and below `PHASE_DEPTH` tokens of
context, off for verify passes past it, so a long context's turn pays on's prefill and off's decoding. It is timed as
a third setting and kept unless on's turn is cheaper; where the build can switch and nothing was measured, it is the
CPU's default (`session.flash_attn`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec_cli.core.verify_timing import OFF_MARGIN, prefers_on, prefers_phased

DEPTH = 2048  # tokens in the KV cache when both settings are timed
SIZES = (1, 4, 8, 16)  # verify pass sizes timed
CHUNK = 256  # prefill chunk timed
ACCEPTANCE = 0.8  # per-token acceptance assumed when pricing a verify size (copy-heavy traffic: 0.8-1.0)
REPEATS = 3


@dataclass(frozen=True)
class Choice:
    """The measured choice. `on`: flash attention on; `ms`: {"on"|"off": measure_at_depth's dict}; `turn_ms`: {"on"|
    "off": ms of one prompt token prefilled plus one output token decoded at `depth`}."""

    on: bool
    depth: int
    turn_ms: dict[str, float]
    ms: dict[str, dict[str, Any]]

    @property
    def phased(self) -> bool:
        """Phased was timed and its turn costs no more than on's."""
        return prefers_phased(self.turn_ms)

    @property
    def reason(self) -> str:
        on, off = self.turn_ms["on"], self.turn_ms["off"]
        if "phased" in self.turn_ms:
            state = "phased" if self.phased else "on" if self.on else "off"
            return (
                f"flash attention {state}"
                f": at {self.depth} tokens of context a prompt token plus an output token cost "
                f"{self.turn_ms['phased']:.1f} ms phased, {on:.1f} ms with it, {off:.1f} ms without"
            )
        why = "" if not (self.on and off < on) else f" (off is chosen only when {OFF_MARGIN:.0%} cheaper)"
        return (
            f"flash attention {'on' if self.on else 'off'}: at {self.depth} tokens of context a prompt token plus "
            f"an output token cost {on:.1f} ms with it, {off:.1f} ms without{why}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"on": self.on, "depth": self.depth, "turn_ms": self.turn_ms, "ms": self.ms}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Choice:
        """The choice kept in learnt.json, decided again from its turn costs under today's rule (`prefers_on`: one
        kept before `OFF_MARGIN` existed may have chosen off by less). Raises KeyError/TypeError/ValueError for a
        dict that is not one."""
        if not isinstance(d["on"], bool):
            raise TypeError("on must be a bool")
        names = ("on", "off", "phased") if "phased" in d["turn_ms"] else ("on", "off")
        turn_ms = {k: float(d["turn_ms"][k]) for k in names}
        return cls(
            on=prefers_on(turn_ms), depth=int(d["depth"]), turn_ms=turn_ms, ms={k: dict(d["ms"][k]) for k in names}
        )


def decode_ms_per_token(ms: dict[Any, float], acceptance: float = ACCEPTANCE) -> float:
    """ms per output token of the cheapest verify size in `ms` ({b: ms of one pass over b tokens}) when each draft
    token is accepted with probability `acceptance` until the first rejection: a pass over b tokens yields
    1 + a + ... + a^(b-1) tokens (the accepted drafts and the bonus token)."""
    return min(v / sum(acceptance**i for i in range(int(b))) for b, v in ms.items())


def decide(off: dict[str, Any], on: dict[str, Any], phased: dict[str, Any] | None = None) -> Choice:
    """Off when its turn cost (prefill ms per token + `decode_ms_per_token`) is below on's by at least `OFF_MARGIN`
    of on's, else on (llama.cpp's default; see the module's docstring); `Choice.phased` when phased was timed and
    costs no more than on. `off`/`on`/`phased`: `measure_at_depth`'s dicts."""
    timed = {"on": on, "off": off, **({"phased": phased} if phased is not None else {})}
    turn = {name: m["chunk_ms"] / m["chunk"] + decode_ms_per_token(m["ms"]) for name, m in timed.items()}
    return Choice(
        on=prefers_on(turn), depth=int(off["depth"]), turn_ms=turn, ms={name: _json(m) for name, m in timed.items()}
    )


def _json(m: dict[str, Any]) -> dict[str, Any]:
    return {**m, "ms": {str(b): v for b, v in m["ms"].items()}}


def settings() -> tuple[Any, ...]:
    """The settings `measure` times with its default backend: off, on, and phased where the build can switch
    (`models.llama.flash_attn_switch`)."""
    from specdec_cli.models.llama import PHASED, flash_attn_switch

    return (False, True, PHASED) if flash_attn_switch() else (False, True)


def measure(
    target_path: str | Path,
    *,
    threads: int | None = None,
    depth: int = DEPTH,
    backend: Callable[[bool], Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Choice:
    """Time the settings (off, on, then phased where the build can switch: `models.llama.flash_attn_switch`; each in a
    context of its own, loaded and closed in turn) and decide.
    `backend(flash_attn)`: opens a `Backend` (default: `LlamaBackend` of `target_path` with room for `depth`);
    `clock`: seconds (a virtual one in tests).
    Seconds: two prefills of `depth` tokens and a few passes (~1 min for a 1.5B model on 2 cores).
    Raises what the backends raise (ModelError, DecodeError)."""
    from specdec_cli.core.verify_timing import measure_at_depth

    timed: tuple[Any, ...] = (False, True)
    if backend is None:
        from specdec_cli.models.llama import LlamaBackend

        timed = settings()

        def backend(flash_attn: bool):
            return LlamaBackend(
                target_path, n_ctx=depth + 2 * CHUNK, n_batch=512, n_threads=threads, flash_attn=flash_attn
            )

    done = [0]
    total = len(timed) * (len(SIZES) + 1) * REPEATS

    def tick(_d: int, _t: int) -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total)

    results = {}
    for setting in timed:
        b = backend(setting)
        try:
            results[setting] = measure_at_depth(
                b, depth=depth, sizes=SIZES, chunk=CHUNK, repeats=REPEATS, progress=tick, clock=clock
            )
        finally:
            b.close()
    phased = next((r for s, r in results.items() if not isinstance(s, bool)), None)  # PHASED's, if timed
    return decide(results[False], results[True], phased)
