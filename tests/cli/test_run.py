"""`specdec run` through the real CLI entry point, on a fake session (no model files)."""

from __future__ import annotations

import io
import json
import sys

import pytest

from fakes import FakeBackend, greedy_reference, hashed_logits, wants_draft, word
from specdec_cli.__main__ import main
from specdec_cli.session import Session


@pytest.fixture
def fake_session(monkeypatch, tmp_path):
    """Every `open_session` returns fresh fake target/draft backends; the calls are recorded."""
    calls = []

    def open_session(options, *, method=None, need_draft=False, reporter=None):
        need_draft = wants_draft(options, method, need_draft)
        calls.append((options, need_draft))
        s = Session(
            target=FakeBackend(hashed_logits, n_ctx=options.ctx), target_path=tmp_path / "target.gguf", options=options
        )
        if need_draft:
            s.draft = FakeBackend(hashed_logits, n_ctx=options.ctx)
            s.draft_path = tmp_path / "draft.gguf"
        return s

    monkeypatch.setattr("specdec_cli.cli.commands.run.open_session", open_session)
    return calls


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text("w5 w9 w3 w17 w4 w22 w8", encoding="utf-8")
    return p


def cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def expected_text(n):
    tokens = greedy_reference(hashed_logits, [5, 9, 3, 17, 4, 22, 8], n)
    return b"".join(word(t) for t in tokens).decode("utf-8", "replace")


def test_piped_stdout_receives_exactly_the_generated_text(fake_session, prompt_file, capsys):
    code, out, err = cli(capsys, "run", str(prompt_file), "--method", "draft", "--k", "3", "--max-tokens", "20")
    assert code == 0
    assert out == expected_text(20)
    assert "acceptance rate" in err and "tok/s" in err


def test_json_to_stdout_has_the_text_and_every_statistic(fake_session, prompt_file, capsys):
    code, out, _ = cli(
        capsys,
        "run",
        str(prompt_file),
        "--method",
        "draft",
        "--k",
        "4",
        "--max-tokens",
        "15",
        "--compare",
        "--json",
        "-",
    )
    assert code == 0
    doc = json.loads(out)  # stdout is JSON only: the text is not also streamed there
    assert doc["text"] == expected_text(15)
    for key in (
        "n_prompt",
        "prefill_ms",
        "n_generated",
        "decode_ms",
        "tokens_per_s",
        "n_target_passes",
        "n_drafted",
        "n_accepted",
        "acceptance_rate",
        "mean_accepted_length",
        "tokens_per_pass",
        "acceptance_by_position",
        "k_histogram",
        "finish_reason",
    ):
        assert key in doc["stats"], key
    assert doc["config"]["method"] == "draft" and doc["config"]["k"] == "4"
    assert doc["compare"]["identical"] is True
    assert doc["compare"]["shared_prefix_tokens"] == 15
    assert len(doc["steps"]) == doc["stats"]["n_target_passes"]


def test_json_to_a_file_and_text_to_stdout(fake_session, prompt_file, tmp_path, capsys):
    path = tmp_path / "out.json"
    code, out, _ = cli(capsys, "run", str(prompt_file), "--method", "ngram", "--max-tokens", "10", "--json", str(path))
    assert code == 0
    assert out == expected_text(10)
    assert json.loads(path.read_text())["text"] == out


def test_method_none_loads_no_draft_model(fake_session, prompt_file, capsys):
    code, out, _ = cli(capsys, "run", str(prompt_file), "--method", "none", "--max-tokens", "5")
    assert code == 0 and out == expected_text(5)
    assert fake_session[-1][1] is False


def test_stdin_prompt(fake_session, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"w5 w9 w3 w17 w4 w22 w8")))
    code, out, _ = cli(capsys, "run", "-", "--method", "none", "--max-tokens", "5")
    assert code == 0 and out == expected_text(5)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "is empty"),
        (b"   \n", "is empty"),
        (b"\xff\xfe\x00a", "looks binary"),
        (b"caf\xe9", "not UTF-8"),
    ],
)
def test_bad_prompt_files_are_one_line_errors_with_exit_2(content, message, tmp_path, capsys):
    p = tmp_path / "bad.txt"
    p.write_bytes(content)
    code, out, err = cli(capsys, "run", str(p))
    assert code == 2
    assert message in err and "Traceback" not in err
    assert out == ""


def test_missing_prompt_file_and_directory(tmp_path, capsys):
    code, _, err = cli(capsys, "run", str(tmp_path / "nope.txt"))
    assert code == 2 and "does not exist" in err
    code, _, err = cli(capsys, "run", str(tmp_path))
    assert code == 2 and "is a directory" in err


def test_prompt_longer_than_the_context_says_how_many_tokens(fake_session, tmp_path, capsys):
    p = tmp_path / "long.txt"
    p.write_text(" ".join(f"w{i % 30 + 2}" for i in range(100)))
    code, _, err = cli(capsys, "run", str(p), "--ctx", "64", "--method", "none")
    assert code == 5
    assert "100 tokens" in err and "--ctx" in err


def test_out_of_range_options_are_usage_errors(capsys, prompt_file):
    code, _, err = cli(capsys, "run", str(prompt_file), "--temperature", "-1")
    assert code == 2
    code, _, err = cli(capsys, "run", str(prompt_file), "--k", "banana", "--method", "none")
    assert code != 0


def test_version(capsys):
    code, out, _ = cli(capsys, "--version")
    assert code == 0 and out.startswith("specdec ")


@pytest.mark.parametrize(
    "alias, canonical",
    [
        ("prompt-lookup", "ngram"),
        ("past_outputs", "suffix"),
        ("draft-model", "draft"),
        ("plain", "none"),
        ("ngram", "ngram"),
    ],
)
def test_method_takes_the_fields_names_and_the_old_spellings(fake_session, prompt_file, capsys, alias, canonical):
    code, out, _ = cli(capsys, "run", str(prompt_file), "--method", alias, "--max-tokens", "5", "--json", "-")
    assert code == 0
    assert json.loads(out)["config"]["method"] == canonical
    from specdec_cli.measure.bench import parse_methods
    from specdec_cli.spec import Method

    assert Method(alias) is Method(canonical)
    assert canonical in parse_methods(alias)
    assert Method("Predicted outputs") is Method("prediction") is Method.predict


def test_an_unknown_method_is_one_usage_line_listing_the_names(prompt_file, capsys):
    code, _, err = cli(capsys, "run", str(prompt_file), "--method", "bogus")
    assert code == 2
    assert "'bogus' is not a method" in err and "prompt-lookup" in err


class Cp1252Terminal(io.TextIOWrapper):
    """A terminal that displays cp1252 (a legacy Windows code page)."""

    def isatty(self) -> bool:
        return True


def test_a_cp1252_pipe_gets_utf8_and_nothing_is_reported_as_a_bug(monkeypatch, tmp_path):
    """Windows gives a pipe cp1252: the CLI chooses UTF-8 for stdout and stderr before it writes anything."""
    text = "→ é 中文 ✓\n"
    pieces = [piece.encode() for piece in ("→ ", "é ", "中文 ", "✓\n")] * 8
    pieces[1] = b""  # EOS
    monkeypatch.setattr(
        "specdec_cli.cli.commands.run.open_session",
        lambda options, **kw: Session(
            target=FakeBackend(hashed_logits, pieces=pieces, n_ctx=options.ctx),
            target_path=tmp_path / "target.gguf",
            options=options,
        ),
    )
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text * 3, encoding="utf-8")
    out, err = io.BytesIO(), io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, encoding="cp1252", write_through=True))
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(err, encoding="cp1252", write_through=True))
    code = main(["run", str(prompt), "--method", "ngram", "-n", "24"])
    shown = out.getvalue().decode("utf-8")  # UTF-8, not cp1252
    assert code == 0, err.getvalue().decode("utf-8", "replace")
    assert len(shown) >= 24 and set(shown) <= set(text) and ("中文" in shown or "✓" in shown)
    assert "acceptance rate" in err.getvalue().decode("utf-8")
    code = main(["run", str(tmp_path / "nowhere → 中文.txt")])  # an error's message on stderr
    assert code == 2 and "nowhere → 中文.txt" in err.getvalue().decode("utf-8")


def test_a_cp1252_terminal_keeps_its_encoding_and_replaces_what_it_cannot_show():
    from specdec_cli.cli.console import choose_encoding

    raw = io.BytesIO()
    tty = Cp1252Terminal(raw, encoding="cp1252", write_through=True)
    choose_encoding(tty)
    tty.write("é 中文 ✓")
    assert raw.getvalue() == "é ?? ?".encode("cp1252")
