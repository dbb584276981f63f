"""The suite never touches the user's own directory: every test, and every fixture wider than a test (a module's real
server is made before the first test's own home), sees a SPECDEC_HOME under pytest's temporary directory and no verify
curve measured."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def module_env() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in ("SPECDEC_HOME", "SPECDEC_PROMPT_CACHE", "SPECDEC_VERIFY_CURVE")}


def test_a_module_fixture_sees_an_isolated_home(module_env, tmp_path_factory) -> None:
    base = tmp_path_factory.getbasetemp().resolve()
    for name in ("SPECDEC_HOME", "SPECDEC_PROMPT_CACHE"):
        assert module_env[name] is not None and base in Path(module_env[name]).resolve().parents, name
    assert module_env["SPECDEC_VERIFY_CURVE"] == "off"


def test_a_test_sees_a_home_of_its_own(module_env, tmp_path) -> None:
    assert Path(os.environ["SPECDEC_HOME"]).parent == tmp_path
    assert os.environ["SPECDEC_HOME"] != module_env["SPECDEC_HOME"]
