"""What the engine asks of the KV states kept outside the KV cache, as protocols, so `core/` names no store above it:
the prompt cache on disk (`stores.prompt_cache.PromptCache` implements `StateCache`) and the server's states parked in
memory (`stores.kv_parking.KvParking` implements `StateParking`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from specdec_cli.models.backend import Backend


class StateCache(Protocol):
    """KV states saved across runs."""

    def restore(self, backend: Backend, tokens: Sequence[int] | np.ndarray) -> tuple[int, float]:
        """Replace the backend's KV cache by the saved state of the longest prefix of `tokens`, when that beats what
        it holds: (tokens restored, ms it took)."""
        ...

    def save(self, backend: Backend) -> int:
        """Save the backend's KV state; the bytes written (0: nothing written)."""
        ...


class StateParking(Protocol):
    """KV states kept in memory while a request with other tokens uses the KV cache."""

    def prepare(self, backend: Backend, context: np.ndarray) -> int:
        """Before `context` is evaluated: park what it would cut, or swap a parked state back in; the tokens
        restored."""
        ...
