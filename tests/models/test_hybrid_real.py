"""Hybrid and recurrent targets on llama.cpp: tiny random-weight lfm2 and qwen35 (hybrids that llama.cpp rolls back
by recurrent-state snapshots) and mamba2 (recurrent, no snapshots: checkpoint and replay). Random weights give noise,
but a deterministic one: speculative and plain greedy outputs must agree token for token."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdec_cli.__main__ import main

pytestmark = pytest.mark.real

PROMPT = "one two three four one two three four one two three four one two three"


@pytest.fixture(params=["lfm2_tiny", "qwen35_tiny", "mamba2_tiny"])
def tiny(request):
    return request.param, request.getfixturevalue(request.param)


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text(PROMPT, encoding="utf-8")
    return p


def cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def run_tokens(capsys, prompt_file, path, *args):
    code, out, err = cli(
        capsys, "run", str(prompt_file), "-t", str(path), "-n", "48", "--raw", "--json", "-", "--no-prompt-cache", *args
    )
    assert code == 0, err
    return json.loads(out)["tokens"]


def fresh_logits(path, chunks):
    """The last row's logits after feeding `chunks` (lists of tokens) one decode call each to a new context."""
    from specdec_cli.models.llama import LlamaBackend

    b = LlamaBackend(path, n_ctx=256, n_batch=64, n_threads=2, n_gpu_layers=0, extra_bufts=False)
    try:
        for c in chunks[:-1]:
            b.decode(c, n_logits=0)
        return b.decode(chunks[-1], n_logits=1)[0].copy()
    finally:
        b.close()


def test_the_kind_and_rollback_of_each_tiny_model(tiny):
    from specdec_cli.models.llama import describe_model

    name, path = tiny
    d = describe_model(path)
    want = {
        "lfm2_tiny": ("hybrid", "snapshots"),
        "qwen35_tiny": ("hybrid", "snapshots"),
        "mamba2_tiny": ("recurrent", "checkpoints"),
    }[name]
    assert (d["kind"], d["rollback"]) == want
    assert d["state_bytes"] > 0
    assert (d["n_rs_seq"] > 0) == (want[1] == "snapshots")


def test_a_rollback_inside_a_verify_pass_and_a_cleared_history_give_a_fresh_contexts_logits(tiny):
    from specdec_cli.models.backend import sync
    from specdec_cli.models.llama import LlamaBackend

    _, path = tiny
    b = LlamaBackend(path, n_ctx=256, n_batch=64, n_threads=2, n_gpu_layers=0, extra_bufts=False)
    try:
        prompt = [int(t) for t in b.tokenize(PROMPT)][:12]
        b.decode(prompt, n_logits=1)
        b.decode([5, 6, 7, 8, 9], n_logits=5)  # a verify pass: the pending token and four drafts
        b.truncate(len(prompt) + 2)  # two kept
        got = b.decode([10], n_logits=1)[0].copy()
        np.testing.assert_array_equal(got, fresh_logits(path, [prompt, [5, 6], [10]]))
        # a history that changed 4 tokens back (three calls ago): cleared and evaluated again, never trimmed
        changed = np.asarray(prompt[:-2] + [11, 12], np.int32)
        sync(b, changed)
        assert [int(t) for t in b.tokens] == changed.tolist()
        got = b.decode([13], n_logits=1)[0].copy()
        np.testing.assert_array_equal(got, fresh_logits(path, [changed.tolist(), [13]]))
    finally:
        b.close()


@pytest.mark.parametrize("method", [[], ["--method", "ngram", "--k", "4"], ["--method", "ngram", "--k", "16"]])
def test_speculative_greedy_output_equals_plain_decoding(tiny, method, prompt_file, capsys):
    _, path = tiny
    plain = run_tokens(capsys, prompt_file, path, "--method", "none")
    assert run_tokens(capsys, prompt_file, path, *method) == plain


TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def with_template(src, dst):
    """A copy of the GGUF `src` with a chat template (the random-weight models have none), by gguf-py's
    gguf_new_metadata."""
    import subprocess
    import sys

    subprocess.run(
        [
            sys.executable,
            "-m",
            "gguf.scripts.gguf_new_metadata",
            "--chat-template",
            TEMPLATE,
            str(src),
            str(dst),
            "--force",
        ],
        check=True,
        capture_output=True,
    )
    return dst


def test_check_exits_0(tiny, prompt_file, capsys):
    _, path = tiny
    code, _, err = cli(capsys, "check", str(prompt_file), "-t", str(path), "-n", "24", "--raw")
    assert code == 0, err


def test_a_three_turn_chat_gives_plain_decodings_replies(tiny, tmp_path, capsys, monkeypatch):
    import io

    name, path = tiny
    path = with_template(path, tmp_path / f"{name}.gguf")
    replies = []
    for method in (["--method", "none"], ["--method", "ngram", "--k", "4"]):
        monkeypatch.setattr("sys.stdin", io.StringIO("one two three\nfour five six\nseven eight\n"))
        code, out, err = cli(capsys, "chat", "-t", str(path), "-n", "12", "--no-prompt-cache", *method)
        assert code == 0 and "error" not in err, err
        assert err.count(" tokens · ") == 3  # three replies, each with its statistics line
        replies.append(out)
    assert replies[0] and replies[0] == replies[1]


def test_a_failed_pass_on_a_recurrent_state_is_undone_whole_never_trimmed(tiny):
    # an interrupted verify pass (llama_decode returns 2 after its first graph node): the state is restored from the
    # checkpoint or cleared, and evaluating the context again gives a fresh context's logits
    from specdec_cli.errors import DecodeError
    from specdec_cli.models.backend import sync
    from specdec_cli.models.llama import LlamaBackend

    _, path = tiny
    b = LlamaBackend(path, n_ctx=256, n_batch=64, n_threads=2, n_gpu_layers=0, extra_bufts=False)
    if not b.interruptible:
        b.close()
        pytest.skip("no abort callback in this build")
    try:
        prompt = [int(t) for t in b.tokenize(PROMPT)][:12]
        b.decode(prompt, n_logits=1)
        b.decode([5, 6], n_logits=2)
        b.truncate(len(prompt) + 1)  # a snapshot (or checkpoint) rollback of the last pass
        b.interrupt(True)
        with pytest.raises(DecodeError):
            b.decode([7, 8, 9], n_logits=3)
        b.interrupt(False)
        assert len(b.tokens) in (0, len(prompt) + 1)
        sync(b, np.asarray(prompt + [5], np.int32))
        got = b.decode([10], n_logits=1)[0].copy()
        np.testing.assert_array_equal(got, fresh_logits(path, [prompt, [5], [10]]))
    finally:
        b.close()


def test_doctor_says_the_kind_the_rollback_its_memory_and_the_mtp_block(tiny, tmp_path, capsys):
    name, path = tiny
    out = tmp_path / "doctor.json"
    code, _, err = cli(capsys, "doctor", "-t", str(path), "--json", str(out))
    assert code == 0, err
    m = json.loads(out.read_text(encoding="utf-8"))["model"]
    want = {
        "lfm2_tiny": ("hybrid", "snapshots", 0),
        "qwen35_tiny": ("hybrid", "snapshots", 1),
        "mamba2_tiny": ("recurrent", "checkpoints", 0),
    }[name]
    assert (m["kind"], m["rollback"], m["mtp_layers"]) == want
    assert m["snapshot_bytes"] == m["n_rs_seq"] * m["state_bytes"] and m["state_bytes"] > 0
