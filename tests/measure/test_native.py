"""The native llama.cpp peer: parsers on recorded output, finding a build, the command lines, the subprocess wrapper.

The fixtures in tests/data/native/ were recorded once with the llama.cpp vendored in llama-cpp-python 0.3.36 (see
tests/data/native/README.md for the commands). No llama.cpp binary is built or run here: `run_plain` and
`run_speculative` are driven through a stand-in script that replays a recorded output.
"""

from __future__ import annotations

import ast
import json
import stat
import sys
from pathlib import Path

import pytest

from specdec_cli.errors import NativeToolError, UsageError
from specdec_cli.measure import native as N

DATA = Path(__file__).parents[1] / "data" / "native"


def read(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


# -- parsers on recorded output ------------------------------------------------------------------------------
def test_parse_completion_smollm2():
    s = N.parse_completion(read("smollm2.completion.stderr.txt"))
    # "prompt eval time =   26215.62 ms /   625 tokens", "       eval time =   88055.57 ms /   127 runs"
    # (recorded on a loaded host: the rates are not representative, the format is)
    assert s == N.NativeStats(n_prompt=625, prefill_ms=26215.62, n_decoded=127, decode_s=88.05557)


def test_parse_speculative_smollm2_ngram_simple():
    s = N.parse_speculative(read("smollm2.ngram-simple.stderr.txt"))
    # "encoded  625 tokens in   19.199 seconds", "decoded  176 tokens in   65.337 seconds" (176 > -n 127: a whole
    # draft verified at the budget's end), n_drafted = 194, n_accept = 101; the target's own common_perf_print
    # "prompt eval" (826 tokens: verify batches count as prompt eval) and "eval" lines must not be used.
    assert s == N.NativeStats(
        n_prompt=625, prefill_ms=19199.0, n_decoded=176, decode_s=65.337, n_drafted=194, n_accepted=101
    )


def test_parse_completion_qwen():
    s = N.parse_completion(read("qwen2.5-coder-1.5b.completion.stderr.txt"))
    assert s == N.NativeStats(n_prompt=584, prefill_ms=105911.05, n_decoded=127, decode_s=249.62615)


def test_parse_speculative_qwen_ngram_simple():
    s = N.parse_speculative(read("qwen2.5-coder-1.5b.ngram-simple.stderr.txt"))
    assert s == N.NativeStats(
        n_prompt=584, prefill_ms=24511.0, n_decoded=143, decode_s=39.464, n_drafted=188, n_accepted=108
    )


def test_parse_speculative_nothing_drafted():
    """A free-text prompt: no n-gram match, so nothing drafted ("accept = -nan%"): acceptance None, not a crash."""
    s = N.parse_speculative(read("smollm2.ngram-simple.story.stderr.txt"))
    assert (s.n_drafted, s.n_accepted) == (0, 0)
    r = N._result("native ngram-simple", s, None, ["x"])
    assert r.acceptance is None and r.decode_tok_s == pytest.approx(s.n_decoded / s.decode_s)


def test_result_rates():
    s = N.NativeStats(n_prompt=10, prefill_ms=5.0, n_decoded=128, decode_s=4.0, n_drafted=100, n_accepted=75)
    r = N._result("native ngram-simple", s, "out", ["tool", "-n", "127"])
    assert r.decode_tok_s == 32.0 and r.acceptance == 0.75 and r.prefill_ms == 5.0
    assert r.command == ("tool", "-n", "127")


def test_eval_line_is_not_the_prompt_eval_line():
    """Only a prompt eval line: the decode rate must not be read from it."""
    only_prompt = "common_perf_print: prompt eval time =     99.02 ms /   625 tokens (    0.16 ms per token)\n"
    with pytest.raises(NativeToolError, match="llama-completion printed no"):
        N.parse_completion(only_prompt)


@pytest.mark.parametrize("parse", [N.parse_completion, N.parse_speculative])
def test_parsers_refuse_other_output(parse):
    err = "main: error: unable to load model\n"
    with pytest.raises(NativeToolError, match="unable to load model"):
        parse(err)


def test_speculative_parser_needs_the_accept_lines():
    text = read("smollm2.ngram-simple.stderr.txt")
    cut = "\n".join(ln for ln in text.splitlines() if "n_accept" not in ln)
    with pytest.raises(NativeToolError, match="n_accept"):
        N.parse_speculative(cut)


def test_output_text_from_recorded_stdout():
    prompt = read("smollm2.prompt.txt")
    comp = N._completion_text(read("smollm2.completion.stdout.txt"))
    spec = N._speculative_text(read("smollm2.ngram-simple.stdout.txt"), prompt)
    assert comp.startswith("```python\ndef dedent(text):\n") and not comp.endswith("\n\n")
    assert spec is not None and spec.startswith("```python\ndef dedent(text):\n")
    assert read("smollm2.ngram-simple.stdout.txt") == "\n\n" + prompt + spec + "\n\n"
    # Native plain and native ngram-simple agree for 172 characters, then part at a near-tie ("left\n    edge" /
    # "left edge"): llama.cpp's batched verify is not bit-identical to its one-token steps on this Q4_1 model.
    assert comp[:172] == spec[:172] and comp != spec


def test_output_text_qwen_speculative_extends_plain():
    """Qwen2.5-Coder-1.5B: native ngram-simple's 143 tokens begin with native plain's 128 (587 characters)."""
    comp = N._completion_text(read("qwen2.5-coder-1.5b.completion.stdout.txt"))
    spec = N._speculative_text(
        read("qwen2.5-coder-1.5b.ngram-simple.stdout.txt"), read("qwen2.5-coder-1.5b.prompt.txt")
    )
    assert len(comp) == 587 and spec.startswith(comp) and len(spec) > len(comp)


# -- finding a build -----------------------------------------------------------------------------------------
def _exe(path: Path, body: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_tools_in_build_bin(tmp_path):
    _exe(tmp_path / "build" / "bin" / "llama-completion")
    _exe(tmp_path / "build" / "bin" / "llama-speculative-simple")
    tools = N.find_tools(tmp_path)
    assert tools.completion == (tmp_path / "build" / "bin" / "llama-completion").resolve()
    assert tools.speculative.name == "llama-speculative-simple"


def test_find_tools_missing_dir(tmp_path):
    with pytest.raises(UsageError, match="no such directory") as e:
        N.find_tools(tmp_path / "nope")
    assert "cmake --build build" in str(e.value)


def test_find_tools_names_the_missing_binary(tmp_path):
    _exe(tmp_path / "llama-completion")
    with pytest.raises(UsageError, match="no executable llama-speculative-simple in it") as e:
        N.find_tools(tmp_path)
    assert "llama-completion or" not in e.value.message


def test_find_tools_refuses_non_executables(tmp_path):
    (tmp_path / "llama-completion").write_text("")
    (tmp_path / "llama-speculative-simple").write_text("")
    with pytest.raises(UsageError, match="llama-completion or llama-speculative-simple"):
        N.find_tools(tmp_path)


# -- command lines -------------------------------------------------------------------------------------------
TOOLS = N.NativeTools(Path("/b/llama-completion"), Path("/b/llama-speculative-simple"))
JOB = N.NativeJob(TOOLS, Path("/m.gguf"), 64, 2, 4096)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_completion_command_is_greedy_plain_untemplated():
    cmd = N.completion_command(N.NativeJob(TOOLS, Path("/m.gguf"), 128, 2, 4096), "/tmp/p.txt")
    assert cmd[0] == "/b/llama-completion"
    assert (_flag(cmd, "-m"), _flag(cmd, "-bf"), _flag(cmd, "-n")) == ("/m.gguf", "/tmp/p.txt", "128")
    assert (_flag(cmd, "-t"), _flag(cmd, "-tb"), _flag(cmd, "-c")) == ("2", "2", "4096")
    assert (_flag(cmd, "--temp"), _flag(cmd, "--top-k")) == ("0", "1")
    assert {"--no-escape", "-no-cnv", "--no-display-prompt"} <= set(cmd)
    assert "-f" not in cmd and "--spec-type" not in cmd


def test_speculative_command_budget_and_type():
    cmd = N.speculative_command(N.NativeJob(TOOLS, Path("/m.gguf"), 128, 2, 4096), "/tmp/p.txt")
    assert cmd[0] == "/b/llama-speculative-simple"
    assert _flag(cmd, "-n") == "127"  # it decodes one token past -n
    assert (_flag(cmd, "--spec-type"), _flag(cmd, "--temp"), _flag(cmd, "--top-k")) == ("ngram-simple", "0", "1")
    assert (_flag(cmd, "-t"), _flag(cmd, "-tb"), _flag(cmd, "-c")) == ("2", "2", "4096")
    assert "--no-escape" in cmd and "-md" not in cmd and "-no-cnv" not in cmd


@pytest.mark.parametrize("spec_type,flag", sorted(N.N_MAX_FLAG.items()))
def test_speculative_n_max_flag(spec_type, flag):
    draft = Path("/d.gguf") if spec_type == "draft-simple" else None
    cmd = N.speculative_command(JOB, "/p", spec_type=spec_type, draft_model=draft, n_max=5)
    assert _flag(cmd, flag) == "5"


def test_speculative_command_draft_model():
    job = N.NativeJob(TOOLS, Path("/m.gguf"), 64, 3, 4096)
    cmd = N.speculative_command(job, "/p", spec_type="draft-simple", draft_model=Path("/d.gguf"))
    assert (_flag(cmd, "-md"), _flag(cmd, "-td"), _flag(cmd, "-tbd")) == ("/d.gguf", "3", "3")
    with pytest.raises(UsageError, match="draft-simple needs a draft model"):
        N.speculative_command(JOB, "/p", spec_type="draft-simple")
    with pytest.raises(UsageError, match="draft-simple needs a draft model"):
        N.speculative_command(JOB, "/p", draft_model=Path("/d.gguf"))
    with pytest.raises(UsageError, match="Unknown llama.cpp --spec-type 'lookahead'"):
        N.speculative_command(JOB, "/p", spec_type="lookahead")


# -- running, through a stand-in for the binaries ------------------------------------------------------------
REPLAY = """#!{python}
import json, os, sys
argv = sys.argv[1:]
prompt = open(argv[argv.index("-bf") + 1], "rb").read()
stdin_data = sys.stdin.read()
json.dump({{"argv": argv, "prompt": prompt.decode("utf-8"), "stdin": stdin_data,
           "llama_env": sorted(k for k in os.environ if k.startswith("LLAMA_ARG_"))}}, open({log!r}, "w"))
sys.stdout.write(open({stdout!r}).read())
sys.stderr.write(open({stderr!r}).read())
sys.exit({code})
"""


def _replay_tools(tmp_path: Path, stem: str, code: int = 0) -> tuple[N.NativeTools, Path]:
    log = tmp_path / "call.json"
    for name, kind in (("llama-completion", "completion"), ("llama-speculative-simple", "ngram-simple")):
        _exe(
            tmp_path / "bin" / name,
            REPLAY.format(
                python=sys.executable,
                log=str(log),
                code=code,
                stdout=str(DATA / f"{stem}.{kind}.stdout.txt"),
                stderr=str(DATA / f"{stem}.{kind}.stderr.txt"),
            ),
        )
    return N.find_tools(tmp_path), log


def test_run_plain_passes_the_prompt_verbatim(tmp_path, monkeypatch):
    tools, log = _replay_tools(tmp_path, "smollm2")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("LLAMA_ARG_N_PREDICT", "7")
    prompt = "<|im_start|>user\nsay \\n hi<|im_end|>\n<|im_start|>assistant\n"
    r = N.run_plain(N.NativeJob(tools, model, 128, 2, 4096), prompt)
    call = json.loads(log.read_text())
    assert call["prompt"] == prompt  # trailing newline and the backslash kept
    assert call["stdin"] == "" and call["llama_env"] == []
    assert r.name == "native plain" and (r.n_decoded, r.n_prompt) == (127, 625)
    assert r.decode_tok_s == pytest.approx(127 / 88.05557)
    assert r.n_drafted is None and r.acceptance is None
    assert list(r.command) == [str(tools.completion), *call["argv"]]
    assert not Path(_flag(list(r.command), "-bf")).exists()  # the prompt file is removed


def test_run_speculative_reports_acceptance(tmp_path):
    tools, log = _replay_tools(tmp_path, "smollm2")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    r = N.run_speculative(N.NativeJob(tools, model, 128, 2, 4096), read("smollm2.prompt.txt"))
    assert r.name == "native ngram-simple"
    assert (r.n_drafted, r.n_accepted, r.n_decoded) == (194, 101, 176)
    assert r.acceptance == pytest.approx(101 / 194)
    assert r.text == N._speculative_text(read("smollm2.ngram-simple.stdout.txt"), read("smollm2.prompt.txt"))


def test_run_failure_is_one_line(tmp_path):
    tools, _ = _replay_tools(tmp_path, "smollm2", code=1)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(NativeToolError, match="llama-completion exited with code 1: "):
        N.run_plain(N.NativeJob(tools, model, 8, 2, 512), "hi")


def test_run_timeout(tmp_path):
    tools = N.NativeTools(
        _exe(tmp_path / "llama-completion", f"#!{sys.executable}\nimport time; time.sleep(30)\n"), tmp_path / "unused"
    )
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(NativeToolError, match="did not finish within 1 s"):
        N.run_plain(N.NativeJob(tools, model, 8, 2, 512), "hi", timeout_s=1.0)


def test_run_checks_model_and_budget(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        N.run_plain(N.NativeJob(TOOLS, tmp_path / "none.gguf", 8, 2, 512), "hi")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(UsageError, match="at least 1 token"):
        N.run_speculative(N.NativeJob(TOOLS, tmp_path / "m.gguf", 0, 2, 512), "hi")


def test_module_imports_nothing_from_llama_cpp():
    tree = ast.parse(Path(N.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in names if m.split(".")[0] in ("llama_cpp", "ctypes")}
