"""`specdec learn` with a real tokenizer and model (SmolLM2-135M): the CLI learns a folder incrementally with the
GGUF's own tokenizer, and `--method auto` drafts a reply from the corpus, which the target accepts."""

from __future__ import annotations

import pytest

from specdec_cli.__main__ import main
from specdec_cli.config import data_dir
from specdec_cli.core.records import Source

pytestmark = pytest.mark.real

QUESTION = "Write a Python function that parses a comma-separated list of integers."


def cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out + err


def test_vocab_only_tokenizer_is_the_models(smollm2_path):
    from specdec_cli.models.llama import LlamaBackend, VocabOnly

    text = "def parse(s: str) -> list[int]:\n    return [int(x) for x in s.split(',')]  # é\n"
    full, vocab = LlamaBackend(smollm2_path, n_ctx=256), VocabOnly(smollm2_path)
    try:
        assert vocab.tokenize(text, add_special=False) == full.tokenize(text, add_special=False)
        assert vocab.vocab_info().fingerprint == full.vocab_info().fingerprint
    finally:
        vocab.close()
        full.close()


def test_learn_then_auto_drafts_the_reply_from_the_corpus(smollm2_path, tmp_path, capsys):
    from specdec_cli.assemble import Assembler
    from specdec_cli.core.engine import GenerationConfig
    from specdec_cli.driver import generate
    from specdec_cli.session import open_session
    from specdec_cli.spec import Method, ModelOptions, SpecOptions

    with (
        open_session(
            ModelOptions(target=str(smollm2_path), ctx=1024, prompt_cache=False), method=Method.none
        ) as session,
        Assembler(session) as assembler,
    ):
        prompt = session.prompt_tokens(QUESTION)
        plain = generate(assembler.engine(SpecOptions(method="none")), prompt, GenerationConfig(max_tokens=96))
        # the project's code is what the reply reuses: here, the reply itself, in a file of the repository
        repo = tmp_path / "repo"
        repo.mkdir()
        (repo / "parsing.py").write_text(plain.text)
        (repo / "other.py").write_text("import os\n\nprint(os.getcwd())\n")
        (repo / "image.bin").write_bytes(b"\0\1\2\3" * 100)

        code, out = cli(capsys, "learn", str(repo), "-t", str(smollm2_path))
        assert code == 0, out
        assert "learnt repo: 2 files" in out and "skipped 1 binary" in out
        code, out = cli(capsys, "learn", str(repo), "-t", str(smollm2_path))
        assert code == 0 and "unchanged repo: 2 files" in out and "0 tokenized" in out
        (repo / "other.py").write_text("import sys\n")
        code, out = cli(capsys, "learn", str(repo), "-t", str(smollm2_path))
        assert "1 tokenized" in out and "1 unchanged" in out

        # K fixed: which source drafts is auto's choice, but how far --k auto goes rests on wall-clock timings
        # (no verify curve in tests), which made this test pass alone and fail after another model load
        off = generate(
            assembler.engine(SpecOptions(method="auto", corpus="off", k="8"), fresh=True),
            prompt,
            GenerationConfig(max_tokens=96),
        )
        on = generate(
            assembler.engine(SpecOptions(method="auto", k="8"), fresh=True), prompt, GenerationConfig(max_tokens=96)
        )
    assert Source.corpus not in off.stats.by_source
    corpus = on.stats.by_source[Source.corpus]
    assert corpus["accepted"] >= 30, on.stats.by_source
    assert on.stats.n_target_passes < off.stats.n_target_passes
    # greedy: the target's own output (batched verification can flip a rare near-tie late; none this early)
    assert on.tokens[:48] == plain.tokens[:48] == off.tokens[:48]
    assert len(list((data_dir() / "corpus").glob("*/repo/manifest.json"))) == 1
