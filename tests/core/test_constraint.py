"""Constrained generation on the fake backend: grammars, grammar-aware speculation, logprobs (exact)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from llguidance import LLMatcher

from fakes import CHARS, EOS, FakeBackend, hashed_logits
from specdec_cli.core import constraint
from specdec_cli.core.constraint import Constraint, GrammarError
from specdec_cli.core.controller import FixedK
from specdec_cli.core.draft import Draft, DrafterBase
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import Finish, Step
from specdec_cli.core.sampling import SamplingParams
from specdec_cli.drafters.ngram import NgramDrafter

V = len(CHARS)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def logits_fn(prefix, seed=0):
    return hashed_logits(prefix, V, seed=seed, peak=2.0)


def backend(fn=logits_fn, **kw):
    return FakeBackend(fn, vocab=V, pieces=CHARS, n_ctx=kw.pop("n_ctx", 1024), **kw)


def text(tokens):
    return b"".join(CHARS[t] for t in tokens).decode()


def prompt_of(s: str, b: FakeBackend) -> list[int]:
    return b.tokenize(s)


def run(engine, prompt, grammar, **cfg):
    records = list(engine.generate(prompt, GenerationConfig(grammar=grammar, **cfg)))
    steps = [r for r in records if isinstance(r, Step)]
    assert isinstance(records[-1], Finish)
    return records, steps, [t for s in steps for t in s.emitted]


def constrained_reference(fn, prompt, grammar, b: FakeBackend, max_tokens: int) -> tuple[list[int], str]:
    """Greedy constrained decoding by definition, without the engine: at each position the argmax of fn(prefix)
    among the tokens llguidance allows (its byte-per-token logit bias, not the engine's bitmask), until the grammar
    is complete, the model ends, or max_tokens. Returns (tokens, finish reason)."""
    m = LLMatcher(b.lltokenizer(), LLMatcher.grammar_from_lark(grammar.lark), log_level=0)
    ctx, out = list(prompt), []
    while len(out) < max_tokens:
        if m.is_stopped():
            return out, "eog"
        allowed = np.frombuffer(m.compute_logit_bias(), dtype=np.uint8)[:V] > 0
        tok = int(np.argmax(np.where(allowed, fn(ctx), -np.inf)))
        if tok == EOS:
            return out, "eog"
        assert m.consume_token(tok)
        out.append(tok)
        ctx.append(tok)
    return out, ("eog" if m.is_stopped() else "length")


class Fixed(DrafterBase):
    """A lookup drafter that proposes the next tokens of `script` after the output written so far (or a fixed
    draft), as a prompt lookup would copy a document."""

    name = "prompt"

    def __init__(self, script=None, fixed=None, n_prompt=0):
        self.script, self.fixed, self.n_prompt = script, fixed, n_prompt

    def propose(self, context, k, sampling, rng):
        if self.fixed is not None:
            toks = self.fixed
        else:
            done = len(context) - self.n_prompt
            toks = self.script[done : done + k]
        return Draft(tokens=np.asarray(toks[:k], dtype=np.int32), source=self.name, match_len=4)


# --- grammars: construction and errors ----------------------------------------------------------------------------


def test_json_schema_layouts():
    inline = constraint.json_schema(SCHEMA, name="s")
    assert inline.name == "s" and inline.lark.startswith("start: %json {")
    assert '"x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}' in inline.lark
    free = constraint.json_schema(SCHEMA, name="s", layout="free")
    assert '"whitespace_flexible": true' in free.lark
    own = constraint.json_schema({**SCHEMA, "x-guidance": {"whitespace_flexible": False}}, name="s")
    assert json.loads(own.lark.removeprefix("start: %json "))["x-guidance"] == {"whitespace_flexible": False}
    assert (
        constraint.json_object().lark == 'start: %json {"type": "object", "x-guidance": '
        '{"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}}\n'
    )


@pytest.mark.parametrize(
    "schema, where",
    [
        ({"type": "object", "properties": {"age": {"type": "integr"}}}, "properties.age.type: Invalid type: integr"),
        ({"type": "object", "properties": {"a": {"type": "string", "minLength": "x"}}}, "properties.a.minLength: "),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}, "properties.a.$ref: "),
    ],
)
def test_a_bad_schema_names_the_spot(schema, where):
    with pytest.raises(GrammarError) as e:
        constraint.json_schema(schema, name="--json-schema s.json")
    assert str(e.value).startswith(f"--json-schema s.json: {where}")
    assert "\n" not in str(e.value) and e.value.exit_code == 2


def test_a_bad_grammar_names_line_and_column():
    with pytest.raises(GrammarError, match=r'^--grammar g\.lark: line 2, column 4: unknown name: "nope"'):
        constraint.from_lark('start: a\na: "x" nope\n', name="--grammar g.lark")
    with pytest.raises(GrammarError, match=r"^--grammar g\.gbnf: Rule 'b' not found"):
        constraint.from_gbnf('root ::= "a" b', name="--grammar g.gbnf")
    with pytest.raises(GrammarError, match="^x: a JSON schema is a JSON object, not str"):
        constraint.json_schema("{}", name="x")  # a string, not a dict


def test_gbnf_is_converted():
    g = constraint.from_gbnf('root ::= "yes" | "no"', name="g")
    b = backend()
    c = Constraint(g, b.lltokenizer(), V)
    assert c.cut(np.array(b.tokenize("yes"), np.int32)) == 3 and c.cut(np.array(b.tokenize("yo"), np.int32)) == 1


def test_load_reads_files(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "g.gbnf").write_text('root ::= "a"+\n')
    assert constraint.load(str(tmp_path / "s.json"), "json-schema").name == f"--json-schema {tmp_path / 's.json'}"
    assert constraint.load(str(tmp_path / "g.gbnf"), "grammar").lark.startswith("%llguidance")
    with pytest.raises(GrammarError, match=r"not JSON: .*line 1, column 2"):
        constraint.load(str(tmp_path / "bad.json"), "json-schema")
    with pytest.raises(constraint.UsageError, match="cannot read it"):
        constraint.load(str(tmp_path / "missing.lark"), "grammar")


# --- the engine under a grammar -----------------------------------------------------------------------------------


def test_a_grammar_that_forces_every_token_is_drafted_whole_and_accepted():
    # x k c d ; q v w: characters no merge in CHARS contains, so the forced text has one tokenization
    g = constraint.from_lark('start: "xkcd;qvw"', name="g")
    b = backend()
    prompt = prompt_of("say it", b)
    records, steps, tokens = run(SpeculativeEngine(b, Fixed(fixed=[]), FixedK(4)), prompt, g, max_tokens=64)
    assert text(tokens) == "xkcd;qvw"
    assert [s.source for s in steps] == ["grammar"] and steps[0].n_accepted == 8  # one pass, all 8 accepted
    assert records[-1].finish_reason == "eog"  # complete: nothing more allowed, no end token needed
    plain = run(SpeculativeEngine(backend(), None), prompt, g, max_tokens=64)
    assert plain[2] == tokens and len(plain[1]) == 8  # constrained plain decoding: one pass per token
    assert (tokens, "eog") == constrained_reference(logits_fn, prompt, g, b, 64)


@pytest.mark.parametrize("layout", ["inline", "free"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_speculative_equals_constrained_plain(layout, seed):
    g = constraint.json_schema(SCHEMA, name="s", layout=layout)
    fn = lambda p: logits_fn(p, seed)  # noqa: E731
    doc = 'Ann is 12. {"name": "Ann", "age": 12, "tags": ["on", "in"]} so'
    b = backend(fn)
    prompt = prompt_of(doc, b)
    records, steps, tokens = run(SpeculativeEngine(b, NgramDrafter(1, 3), FixedK(6)), prompt, g, max_tokens=80)
    expected, reason = constrained_reference(fn, prompt, g, b, 80)
    assert tokens == expected and records[-1].finish_reason == reason
    assert any(s.source == "grammar" and s.n_accepted > 0 for s in steps)
    if reason == "eog":
        json.loads(text(tokens))  # valid JSON
    plain = run(SpeculativeEngine(backend(fn), None), prompt, g, max_tokens=80)
    assert plain[2] == tokens


def test_a_draft_is_cut_at_the_first_forbidden_token_before_verification():
    g = constraint.from_lark('start: WORD ";"\nWORD: /[a-z]+/', name="g")
    b = backend()
    prompt = prompt_of("go", b)
    draft = b.tokenize("ab") + [ord("Z"), ord("c")]  # Z is forbidden: only "ab" may be verified
    engine = SpeculativeEngine(b, Fixed(fixed=draft), FixedK(4))
    gen = engine.generate(prompt, GenerationConfig(grammar=g, max_tokens=3))
    next(gen)  # prefill
    calls = b.n_decode_calls
    step = next(gen)
    assert step.drafted == tuple(b.tokenize("ab"))
    assert b.n_decode_calls == calls + 1 and b.max_logit_rows == 3  # one pass over [last, a, b]
    gen.close()


def test_rollback_after_rejections_keeps_the_matcher_in_sync():
    # every draft is valid where it is proposed but mostly wrong: each rejection must roll the matcher back,
    # or the masks of the next rows (string length, separators, closing brackets) would be those of text never
    # committed
    g = constraint.json_schema(SCHEMA, name="s")
    b = backend()
    prompt = prompt_of("describe", b)
    wrong = b.tokenize('{"name": "Bobin", "age": 1200, "tags": ["er"]}')
    records, steps, tokens = run(
        SpeculativeEngine(b, Fixed(script=wrong, n_prompt=len(prompt)), FixedK(4)), prompt, g, max_tokens=80
    )
    assert sum(s.rejected for s in steps) >= 3
    assert (tokens, records[-1].finish_reason) == constrained_reference(logits_fn, prompt, g, b, 80)


def test_a_grammar_that_cannot_finish_in_time_ends_with_length():
    g = constraint.json_schema(SCHEMA, name="s")
    b = backend()
    prompt = prompt_of("x", b)
    records, steps, tokens = run(SpeculativeEngine(b, NgramDrafter(1, 3), FixedK(4)), prompt, g, max_tokens=5)
    assert records[-1].finish_reason == "length" and len(tokens) == 5


def test_logprobs_are_the_masked_log_softmax_of_each_emitted_token():
    g = constraint.json_schema(SCHEMA, name="s")
    b = backend()
    doc = '{"name": "Ann", "age": 12, "tags": []}'
    prompt = prompt_of(doc, b)
    _, steps, tokens = run(SpeculativeEngine(b, NgramDrafter(1, 3), FixedK(4)), prompt, g, max_tokens=40, logprobs=3)
    m = LLMatcher(b.lltokenizer(), LLMatcher.grammar_from_lark(g.lark), log_level=0)
    got = [lp for s in steps for lp in s.logprobs]
    assert [lp.token for lp in got] == tokens and any(len(s.emitted) > 1 for s in steps)
    ctx = list(prompt)
    for lp in got:
        allowed = np.frombuffer(m.compute_logit_bias(), dtype=np.uint8)[:V] > 0
        x = np.where(allowed, logits_fn(ctx).astype(np.float64), -np.inf)
        logz = np.log(np.exp(x - x.max()).sum()) + x.max()
        assert lp.logprob == pytest.approx(x[lp.token] - logz, abs=1e-5)
        best = [t for t in np.argsort(-x, kind="stable")[:3] if allowed[t]]  # forbidden tokens have no probability
        assert [t for t, _ in lp.top] == best
        assert [v for _, v in lp.top] == pytest.approx([x[t] - logz for t in best], abs=1e-5)
        m.consume_token(lp.token)
        ctx.append(lp.token)
    off = run(SpeculativeEngine(backend(), NgramDrafter(1, 3), FixedK(4)), prompt, g, max_tokens=40)[1]
    assert all(s.logprobs == () for s in off)


def test_logprobs_without_a_grammar_and_at_zero():
    b = FakeBackend()
    _, steps, tokens = run(
        SpeculativeEngine(b, NgramDrafter(1, 3), FixedK(4)), [5, 9, 3, 5, 9], None, max_tokens=12, logprobs=0
    )
    got = [lp for s in steps for lp in s.logprobs]
    assert [lp.token for lp in got] == tokens and all(lp.top == () for lp in got)
    ctx = [5, 9, 3, 5, 9]
    for lp in got:
        x = hashed_logits(ctx).astype(np.float64)
        assert lp.logprob == pytest.approx(x[lp.token] - np.log(np.exp(x).sum()), abs=1e-5)
        ctx.append(lp.token)


def test_sampling_under_a_grammar_stays_inside_it():
    g = constraint.json_schema(SCHEMA, name="s")
    for seed in range(3):
        b = backend()
        records, _, tokens = run(
            SpeculativeEngine(b, NgramDrafter(1, 3), FixedK(4)),
            prompt_of("a b", b),
            g,
            max_tokens=120,
            sampling=SamplingParams(temperature=1.0, seed=seed),
        )
        if records[-1].finish_reason == "eog":
            doc = json.loads(text(tokens))
            assert set(doc) == {"name", "age", "tags"} and len(doc["name"]) <= 8


def test_a_complete_grammar_that_may_continue_is_not_cut_short():
    # after "xk" the grammar accepts, but "cd" may follow and the model wants it: the reply must not end there
    def wants_c(prefix):
        logits = np.zeros(V, np.float32)
        logits[ord("c")] = 5.0
        logits[ord("d")] = 4.0
        return logits

    g = constraint.from_lark('start: "xk" "cd"?', name="g")
    for drafter in (None, Fixed(fixed=[])):
        b = backend(wants_c)
        records, steps, tokens = run(SpeculativeEngine(b, drafter, FixedK(4)), prompt_of("go", b), g, max_tokens=10)
        assert text(tokens) == "xkcd" and records[-1].finish_reason == "eog"


# --- the CLI ----------------------------------------------------------------------------------------------------


@pytest.fixture
def char_sessions(monkeypatch, tmp_path):
    """run and check open fake sessions over the CHARS vocabulary."""
    from specdec_cli.session import Session

    def open_session(options, *, method=None, need_draft=False, reporter=None):
        return Session(target=backend(n_ctx=options.ctx), target_path=tmp_path / "target.gguf", options=options)

    monkeypatch.setattr("specdec_cli.cli.commands.run.open_session", open_session)
    monkeypatch.setattr("specdec_cli.cli.commands.check.open_session", open_session)
    monkeypatch.setattr("specdec_cli.models.llama.system_info", lambda: "fake")
    (tmp_path / "p.txt").write_text('Ann is 12, tags "on" and "in".', encoding="utf-8")
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA), encoding="utf-8")
    return tmp_path


def cli(capsys, *args):
    from specdec_cli.__main__ import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_run_json_schema_with_logprobs(char_sessions, capsys):
    d = char_sessions
    code, out, _ = cli(
        capsys,
        "run",
        d / "p.txt",
        "--json-schema",
        d / "s.json",
        "--json",
        "-",
        "--logprobs",
        2,
        "-n",
        120,
        "--method",
        "ngram",
    )
    doc = json.loads(out)
    assert code == 0 and doc["finish_reason"] == "eog"
    reply = json.loads(doc["text"])
    assert set(reply) == {"name", "age", "tags"}
    assert doc["config"]["grammar"] == f"--json-schema {d / 's.json'}" and doc["config"]["logprobs"] == 2
    assert [e["token"] for e in doc["logprobs"]] == doc["tokens"]
    assert all(e["logprob"] <= 0 and 1 <= len(e["top_logprobs"]) <= 2 for e in doc["logprobs"])
    assert "grammar" in doc["stats"]["by_source"]


def test_check_audits_a_constrained_run(char_sessions, capsys):
    d = char_sessions
    code, out, _ = cli(capsys, "check", d / "p.txt", "--json-schema", d / "s.json", "-n", 120, "--method", "ngram")
    assert code == 0 and "PASS" in out and "0 divergences" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--json-schema", "bad.json"], "--json-schema {d}/bad.json: properties.age.type: Invalid type: integr"),
        (["--grammar", "bad.lark"], "--grammar {d}/bad.lark: line 1, column 8: unknown name"),
        (["--json-object", "--grammar", "bad.lark"], "--json-object and --grammar both constrain the reply; give one."),
        (["--json-object", "--json-layout", "pretty"], "--json-layout 'pretty' is not a layout."),
        (["--json-object", "--logprobs", "3"], "add --json PATH"),
    ],
)
def test_bad_constraints_are_one_line_errors_with_exit_2(char_sessions, capsys, args, message):
    d = char_sessions
    (d / "bad.json").write_text('{"type": "object", "properties": {"age": {"type": "integr"}}}')
    (d / "bad.lark").write_text("start: nope\n")
    code, out, err = cli(capsys, "run", d / "p.txt", *[d / a if a.startswith("bad.") else a for a in args])
    assert code == 2 and out == ""
    assert message.format(d=d) in " ".join(err.split()) and "Traceback" not in err


def test_chat_replies_follow_the_schema_every_turn(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from specdec_cli.cli.app import app
    from specdec_cli.cli.commands import chat as chat_mod
    from specdec_cli.session import Session

    monkeypatch.setattr(
        chat_mod,
        "open_session",
        lambda options, **kw: Session(target=backend(n_ctx=options.ctx), target_path=tmp_path / "t.gguf"),
    )
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    result = CliRunner().invoke(
        app,
        ["chat", "--json-schema", str(tmp_path / "s.json"), "-n", "120", "--method", "ngram"],
        input="Ann is 12\nBob is 30\n",
    )
    assert result.exit_code == 0, result.output
    replies = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert len(replies) == 2 and all(set(r) == {"name", "age", "tags"} for r in replies)


def test_a_draft_that_ends_the_reply_is_accepted_whole():
    # the draft [x, k, <eos>] is valid and accepted whole; the bonus row after the end token is never consumed
    def wants(prefix):
        logits = np.zeros(V, np.float32)
        last = CHARS[prefix[-1]]
        logits[EOS if last == b"k" else ord("k") if last == b"x" else ord("x")] = 5.0
        return logits

    g = constraint.from_lark('start: "xk" "z"? | "yq"', name="g")  # nothing forced; "xk" may end or go on
    b = backend(wants)
    prompt = prompt_of("go", b)
    records, steps, tokens = run(
        SpeculativeEngine(b, Fixed(script=[ord("x"), ord("k"), EOS], n_prompt=len(prompt)), FixedK(4)),
        prompt,
        g,
        max_tokens=10,
    )
    assert text(tokens) == "xk" and records[-1].finish_reason == "eog"
    assert len(steps) == 1 and steps[0].n_accepted == 3 and steps[0].target_token is None


# --- issue 27 (B): a draft that completes the grammar and goes on with the end token ------------------------------
A_, B_, C_, X_ = (ord(c) for c in "abcx")


def _axc(prefix):
    """The model writes "a", then "x" (not the draft's "b"), then "c", then ends."""
    logits = np.zeros(len(CHARS), np.float32)
    logits[{A_: X_, X_: C_, C_: EOS}.get(int(prefix[-1]), A_)] = 5.0
    return logits


class _Replay(DrafterBase):
    """Drafts an earlier reply "abc" + its end token after the prompt, as the past-outputs store does."""

    name = "store"

    def __init__(self, n_prompt):
        self.n_prompt = n_prompt

    def propose(self, context, k, sampling, rng):
        done = len(context) - self.n_prompt
        return Draft(tokens=np.asarray([A_, B_, C_, EOS][done : done + k], np.int32), source=self.name, match_len=8)


def test_a_draft_ending_with_eos_after_the_grammar_completes_is_rolled_back_exactly():
    # llguidance's matcher is stopped after "c" and takes the end token without recording it: rolling back the
    # 3 rejected draft tokens ("b", "c", EOS) took one token too many, and the target's "x" was refused as
    # "doesn't satisfy the grammar" (the 400 openai-agents got mid-reply)
    b = FakeBackend(_axc, vocab=len(CHARS), pieces=CHARS, n_ctx=256)
    prompt = b.tokenize("Q:")
    engine = SpeculativeEngine(b, _Replay(len(prompt)), FixedK(4))
    g = constraint.from_lark('start: ("a" | "z") ("b" | "x") "c"\n', name="g")  # nothing forced
    records = list(engine.generate(prompt, GenerationConfig(grammar=g, max_tokens=16)))
    out = [t for r in records if isinstance(r, Step) for t in r.emitted]
    assert bytes(out).decode() == "axc"
    assert records[-1] == Finish("eog")


def test_a_constraint_out_of_step_recovers_from_the_committed_tokens(caplog):
    # an inconsistency inside the server is a bug, never the client's grammar: the matcher is rebuilt from the
    # committed output (logged), and the generation goes on
    b = FakeBackend(vocab=len(CHARS), pieces=CHARS)
    c = Constraint(constraint.from_lark('start: "a" ("b" | "x") "c"\n', name="g"), b.lltokenizer(), b.n_vocab)
    c.masks(np.asarray([A_], np.int32))
    c.commit(1, X_)
    c.matcher.rollback(1)  # out of step with the engine: the matcher forgot the "x" the engine committed
    c.masks(np.zeros(0, np.int32))
    with caplog.at_level("WARNING"):
        c.commit(0, C_)
    assert c.done and "out of step" in caplog.text
