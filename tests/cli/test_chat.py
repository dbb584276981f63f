"""`specdec chat`: input handling, history fitting, slash commands, KV reuse across turns, Ctrl-C, and the CLI.

Logic runs on `tests/fakes.FakeBackend` (its `format_chat` joins the contents with spaces, and its logits depend on the
whole KV content, so a cache left inconsistent between turns changes the output); one CLI test uses SmolLM2-135M.
"""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fakes import FakeBackend, bigram_logits, hashed_logits, unstrike, wants_draft
from specdec_cli.cli.app import app
from specdec_cli.cli.commands import chat as chat_mod
from specdec_cli.cli.commands.chat import Chat, ChatView, Conversation, LineReader, Turn, dispatch
from specdec_cli.cli.console import make_console
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.drafters.model import ModelDrafter
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.errors import ContextOverflowError, ModelError, UsageError
from specdec_cli.session import Session
from specdec_cli.spec import SpecOptions

runner = CliRunner()


# -- helpers ----------------------------------------------------------------------------------------------------


def fake_session(fn=hashed_logits, *, n_ctx=512, draft=True) -> Session:
    return Session(
        target=FakeBackend(fn, n_ctx=n_ctx),
        target_path=Path("fake.gguf"),
        draft=FakeBackend(fn, n_ctx=n_ctx) if draft else None,
        draft_path=Path("fake-draft.gguf") if draft else None,
    )


def make_chat(session=None, *, method="draft", k="auto", max_tokens=8, system=None):
    session = session or fake_session()
    err = io.StringIO()
    view = ChatView(out=io.StringIO(), err=make_console(file=err), interactive=False, styled=False, show_rejected=False)
    chat = Chat(
        session,
        spec=SpecOptions(method=method, k=k),
        config=GenerationConfig(max_tokens=max_tokens),
        view=view,
        system=system,
    )
    return chat, view.out, err


def patch_session(monkeypatch, **kw) -> list[Session]:
    """`specdec chat` gets fake sessions; the list receives each one for inspection."""
    made: list[Session] = []

    def fake_open(options, *, method=None, need_draft=False, reporter=None):
        need_draft = wants_draft(options, method, need_draft)
        made.append(fake_session(n_ctx=options.ctx, draft=need_draft, **kw))
        return made[-1]

    monkeypatch.setattr(chat_mod, "open_session", fake_open)
    return made


def invoke(args, text):
    return runner.invoke(app, ["chat", *args], input=text)


def words(*ids) -> str:
    """A message the fake tokenizes as exactly these token ids."""
    return " ".join(f"w{i}" for i in ids)


# -- input ------------------------------------------------------------------------------------------------------


def read_all(text: str) -> list[str]:
    reader = LineReader(io.StringIO(text), interactive=False)
    out = []
    while (msg := reader.read()) is not None:
        out.append(msg)
    return out


def test_reader_one_message_per_line():
    assert read_all("Hi\n\nBye\r\n") == ["Hi", "", "Bye"]


def test_reader_trailing_backslash_continues_the_message():
    assert read_all("first \\\nsecond\\\nthird\nnext\n") == ["first \nsecond\nthird", "next"]


def test_reader_triple_quote_block():
    text = '"""\ndef f():\n    return 1\n"""\n"""one line"""\n"""start\nend"""\nafter\n'
    assert read_all(text) == ["def f():\n    return 1", "one line", "start\nend", "after"]


def test_reader_end_of_input_inside_a_block_sends_what_was_typed():
    assert read_all('"""\nabc\n') == ["abc"]


# -- history ----------------------------------------------------------------------------------------------------


def tokens_of(messages):
    return FakeBackend().tokenize(" ".join(m["content"] for m in messages))


def test_fit_keeps_everything_when_it_fits():
    conv = Conversation("w2 w3")
    conv.add(Turn(user=words(4, 5), assistant=words(6)))
    fit = conv.fit(tokens_of, words(7), n_ctx=64, max_tokens=8)
    assert fit.prompt.tolist() == [2, 3, 4, 5, 6, 7] and fit.start == 0 and fit.budget == 8


def test_fit_drops_oldest_turns_and_keeps_the_system_prompt():
    conv = Conversation("w2 w3")
    for i in range(4):
        conv.add(Turn(user=words(*[10 + i] * 5), assistant=words(*[20 + i] * 5)))  # 10 tokens per turn
    # system 2 + 4 turns x 10 + message 3 = 45 tokens; a 16-token reply leaves 32, and once turns must go they go
    # until the prompt takes at most 3/4 of that (24 tokens), so the next turns fit without dropping again
    fit = conv.fit(tokens_of, words(7, 7, 7), n_ctx=48, max_tokens=16)
    assert fit.start == 3  # three oldest turns dropped
    assert fit.prompt.tolist() == [2, 3] + [13] * 5 + [23] * 5 + [7, 7, 7]  # the system prompt stays
    assert fit.budget == 16
    # Without overflow nothing is dropped, even above the 3/4 mark.
    assert conv.fit(tokens_of, words(7), n_ctx=62, max_tokens=16).start == 0


def test_fit_shrinks_the_reply_budget_when_the_message_alone_leaves_less():
    conv = Conversation()
    conv.add(Turn(user=words(4), assistant=words(5)))
    fit = conv.fit(tokens_of, words(*[7] * 50), n_ctx=100, max_tokens=64)
    assert fit.start == 1 and len(fit.prompt) == 50 and fit.budget == 50


def test_fit_refuses_a_message_with_no_room_for_a_reply():
    conv = Conversation("w2")
    with pytest.raises(ContextOverflowError, match="system prompt and your message take 91 of the 100") as e:
        conv.fit(tokens_of, words(*[7] * 90), n_ctx=100, max_tokens=64)
    assert "--ctx" in e.value.fix


# -- generation and KV reuse ------------------------------------------------------------------------------------


class LoggingBackend(FakeBackend):
    """Records the size of every decode call."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[int] = []

    def decode(self, tokens, n_logits=0):
        self.calls.append(len(tokens))
        return super().decode(tokens, n_logits)


def test_second_turn_prefill_evaluates_only_the_new_tokens():
    # bigram logits never end the reply, so both turns stop at max tokens and retokenize exactly
    session = Session(
        target=FakeBackend(bigram_logits),
        target_path=Path("t.gguf"),
        draft=LoggingBackend(bigram_logits),
        draft_path=Path("d.gguf"),
    )
    chat, out, err = make_chat(session, k="3", max_tokens=8)
    first = chat.turn(words(5, 6, 7))
    assert first.stats.n_prompt == 3 and first.stats.n_prefill_evaluated == 2
    reply = session.target.tokenize(first.assistant)
    assert len(reply) == 8

    session.draft.calls.clear()
    second = chat.turn(words(9, 10, 11, 12))
    # prompt 2 = prompt 1 + reply 1 + 4 new tokens; the target cache held prompt 1 + reply 1 minus its last token
    assert second.stats.n_prompt == 3 + 8 + 4
    assert second.stats.n_prefill_evaluated == 4  # reply 1's last token + the 4 new tokens - the pending last one
    assert "prefill 5 new + 10 cached in " in err.getvalue()
    # The draft model: what the chat reports is what ModelDrafter.prefill evaluated (its first decode this turn).
    evaluated, cached = second.draft_cache
    assert session.draft.calls[0] == evaluated and evaluated + cached == second.stats.n_prompt - 1
    assert cached >= 3 + 8 - 4  # at most the tail it had not caught up with is evaluated again


def test_replies_are_the_same_as_a_fresh_chat_with_the_same_history():
    chat, _, _ = make_chat(max_tokens=12)
    chat.turn(words(3, 4))
    chat.turn(words(5, 6, 7))
    third = chat.turn(words(8))
    fresh, _, _ = make_chat(max_tokens=12)
    fresh.conversation.turns = list(chat.conversation.turns[:2])
    assert fresh.turn(words(8)).assistant == third.assistant


class Interrupting:
    """hashed_logits, but raises KeyboardInterrupt (as Ctrl-C would) at the n-th call once armed."""

    def __init__(self):
        self.countdown = None

    def __call__(self, prefix):
        if self.countdown is not None:
            self.countdown -= 1
            if self.countdown == 0:
                self.countdown = None
                raise KeyboardInterrupt
        return hashed_logits(prefix)


def test_ctrl_c_keeps_the_shown_text_and_leaves_the_caches_consistent():
    fn = Interrupting()
    session = Session(
        target=FakeBackend(fn), target_path=Path("t.gguf"), draft=FakeBackend(hashed_logits), draft_path=Path("d.gguf")
    )
    chat, out, err = make_chat(session, k="2", max_tokens=30)
    chat.turn(words(3, 4))
    fn.countdown = 12
    cut = chat.turn(words(5, 6))
    assert cut.interrupted and cut.stats.finish_reason == "interrupted"
    assert 0 < cut.stats.n_generated < 30
    assert chat.conversation.turns[-1] is cut and out.getvalue().endswith(cut.assistant + "\n")
    assert "interrupted" in err.getvalue()
    # The target's cache holds only committed tokens: a prefix of the prompt + the kept reply.
    prompt = chat.session.chat_tokens(chat.conversation.messages()[:-1])
    committed = prompt + chat.session.target.tokenize(cut.assistant)
    held = chat.session.target.tokens.tolist()
    assert held == committed[: len(held)] and len(held) >= len(prompt)
    # The next turn answers exactly as a fresh chat given the same history.
    after = chat.turn(words(8))
    fresh, _, _ = make_chat(max_tokens=30, k="2")
    fresh.conversation.turns = list(chat.conversation.turns[:2])
    assert fresh.turn(words(8)).assistant == after.assistant


def test_ctrl_c_before_any_text_drops_the_message():
    fn = Interrupting()
    session = Session(target=FakeBackend(fn), target_path=Path("t.gguf"))
    chat, out, err = make_chat(session, method="none")
    fn.countdown = 1
    assert chat.turn(words(5, 6)) is None
    assert chat.conversation.turns == [] and chat.totals.turns == 1
    assert "not added" in err.getvalue()
    assert chat.turn(words(5, 6)).assistant  # and the chat goes on


# -- slash commands ---------------------------------------------------------------------------------------------


def test_k_and_method_change_speculation_live():
    chat, _, err = make_chat()
    dispatch(chat, "/k 3")
    assert chat.spec.k == "3" and chat.engine.controller.next_k() == 3
    drafter = chat.drafter
    dispatch(chat, "/method ngram")
    assert isinstance(chat.drafter, NgramDrafter) and chat.spec.k == "3"
    dispatch(chat, "/method none")
    assert chat.drafter is None and chat.engine.drafter is None
    assert isinstance(drafter, ModelDrafter)
    with pytest.raises(UsageError, match="Use /k auto"):
        dispatch(chat, "/k banana")
    with pytest.raises(UsageError, match="Unknown method 'fast'"):
        dispatch(chat, "/method fast")
    assert chat.spec.method == "none" and chat.spec.k == "3"  # a bad command changes nothing


def test_method_needing_a_draft_model_loads_it_lazily(monkeypatch):
    chat, _, err = make_chat(fake_session(draft=False), method="ngram")

    def load_draft(self, name=None, *, reporter=None):
        self.draft, self.draft_path = FakeBackend(), Path("lazy.gguf")

    monkeypatch.setattr(Session, "load_draft", load_draft)
    dispatch(chat, "/method draft")
    assert isinstance(chat.drafter, ModelDrafter) and chat.drafter.backend is chat.session.draft
    assert "needs a draft model; loading it" in err.getvalue()
    assert chat.turn(words(3)).stats.n_drafted > 0


def test_method_needing_a_draft_model_that_cannot_load_says_so(monkeypatch):
    chat, _, err = make_chat(fake_session(draft=False), method="ngram")

    def load_draft(self, name=None, *, reporter=None):
        raise ModelError("Unknown model 'nope'.", "Run specdec models list.")

    monkeypatch.setattr(Session, "load_draft", load_draft)
    assert dispatch(chat, "/method draft") is False
    assert "Unknown model 'nope'" in err.getvalue() and "the method stays ngram" in err.getvalue()
    assert chat.spec.method == "ngram" and isinstance(chat.drafter, NgramDrafter)


def test_reset_forgets_the_conversation_but_not_the_system_prompt():
    chat, _, _ = make_chat(system="w2 w3")
    chat.turn(words(4))
    dispatch(chat, "/reset")
    assert chat.conversation.turns == [] and chat.conversation.system == "w2 w3"
    assert chat.session.chat_tokens(chat.conversation.messages(words(5))) == [2, 3, 5]


@pytest.mark.parametrize("name", ["chat.md", "chat.json"])
def test_save_writes_the_transcript_for_the_user_only(tmp_path, name):
    chat, _, err = make_chat(system="be brief")
    chat.turn(words(4))
    chat.turn(words(5))
    path = tmp_path / name
    path.write_text("old")
    path.chmod(0o644)
    dispatch(chat, f"/save {path}")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert "old" not in text and "Saved 2 turns" in err.getvalue()
    if name.endswith(".json"):
        doc = json.loads(text)
        assert [t["user"] for t in doc["turns"]] == [words(4), words(5)]
        assert doc["messages"][0] == {"role": "system", "content": "be brief"}
        assert doc["turns"][1]["stats"]["n_generated"] == 8
    else:
        assert text.count("## You") == 2 and "## System\n\nbe brief" in text
        assert f"## Assistant\n\n{chat.conversation.turns[0].assistant}\n" in text


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_save_and_a_pipe_get_the_clean_text_while_the_terminal_shows_rejected_drafts(tmp_path):
    tty = Tty()
    view = ChatView(out=tty, err=make_console(file=io.StringIO()), interactive=False, styled=True, show_rejected=True)
    chat = Chat(
        fake_session(), spec=SpecOptions(method="ngram", k="4"), config=GenerationConfig(max_tokens=60), view=view
    )
    chat.turn(words(5, 9, 3, 17, 4, 22, 8, 5, 9, 3, 17))
    reply = chat.conversation.turns[0].assistant
    kept, rejected = unstrike(tty.getvalue())
    assert rejected and kept == reply + "\n"  # shown in their own style, never in the reply's text
    dispatch(chat, f"/save {tmp_path / 'chat.json'}")
    assert json.loads((tmp_path / "chat.json").read_text())["turns"][0]["assistant"] == reply
    piped, _, _ = make_chat(method="ngram", k="4", max_tokens=60)  # styled=False: a pipe
    piped.turn(words(5, 9, 3, 17, 4, 22, 8, 5, 9, 3, 17))
    assert piped.view.out.getvalue() == reply + "\n" and piped.conversation.turns[0].assistant == reply


def test_rejected_command_shows_or_hides_rejected_drafts():
    chat, _, err = make_chat()
    chat.view.styled = True
    dispatch(chat, "/rejected off")
    assert chat.view.show_rejected is False and chat.view.stream().show_rejected is False
    dispatch(chat, "/rejected on")
    assert chat.view.show_rejected is True and chat.view.stream().show_rejected is True
    dispatch(chat, "/rejected")
    assert "Rejected drafts are shown. Change it with /rejected on or /rejected off." in err.getvalue()
    with pytest.raises(UsageError, match="/rejected takes on or off"):
        dispatch(chat, "/rejected maybe")
    dispatch(chat, "/help")
    assert "/rejected on|off" in err.getvalue()


def test_save_needs_a_known_extension(tmp_path):
    chat, _, _ = make_chat()
    with pytest.raises(UsageError, match="Use a path ending in .md"):
        dispatch(chat, f"/save {tmp_path / 'chat.txt'}")
    with pytest.raises(UsageError, match="Could not write"):
        dispatch(chat, f"/save {tmp_path / 'missing' / 'chat.md'}")


def test_unknown_command_is_an_error_that_says_the_fix():
    chat, _, _ = make_chat()
    with pytest.raises(UsageError, match="Unknown command /frobnicate") as e:
        dispatch(chat, "/frobnicate now")
    assert "/help" in e.value.fix


# -- the CLI ----------------------------------------------------------------------------------------------------


def test_cli_piped_turns_with_a_slash_command(monkeypatch):
    made = patch_session(monkeypatch)
    result = invoke(["-n", "6", "--k", "2", "--method", "draft"], "Hi\n/stats\nBye\n/quit\nnever read\n")
    assert result.exit_code == 0, result.output
    replies = result.stdout.splitlines()
    assert len(replies) == 2 and all(r.startswith("w") for r in replies)  # only the replies go to stdout
    err = result.stderr
    assert err.count("6 tokens · ") == 2  # one footer per turn
    assert "session totals" in err and "position 1" in err and "acceptance rate" in err
    assert "session: 2 replies, 12 tokens" in err
    assert ">>>" not in result.output  # no prompt decoration when stdin is not a terminal
    assert made[0].draft is not None


def test_cli_end_of_input_ends_the_chat_with_totals(monkeypatch):
    patch_session(monkeypatch)
    result = invoke(["-n", "4", "--method", "ngram"], "w3 w4 w3 w4 w3\n")
    assert result.exit_code == 0 and "session: 1 reply, 4 tokens" in result.stderr


def test_cli_context_overflow_drops_old_turns_and_refuses_oversized_messages(monkeypatch):
    made = patch_session(monkeypatch)
    msg = words(*range(2, 12))  # 10 tokens; each turn adds 10 + 8
    lines = [msg, msg, msg, msg, words(*[5] * 70), msg, "/quit"]
    result = invoke(["--ctx", "64", "-n", "8", "--system", "w2 w3", "--method", "none"], "\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    err = result.stderr
    assert "dropped the 2 oldest turns (the system prompt is kept)" in err
    assert "error: This message does not fit" in err and "--ctx" in err
    assert len(result.stdout.splitlines()) == 5  # every message but the oversized one got its reply
    # The system prompt is still the start of what the target holds.
    assert made[0].target.tokens.tolist()[:2] == [2, 3]


def test_cli_unknown_command_and_slash_escape(monkeypatch):
    patch_session(monkeypatch)
    result = invoke(["-n", "3", "--method", "none"], "/nope\n//w5 w6\n")
    assert result.exit_code == 0
    assert "error: Unknown command /nope" in result.stderr
    assert len(result.stdout.splitlines()) == 1  # "//..." was sent as a message


def test_cli_bad_k_fails_before_the_first_prompt(monkeypatch):
    patch_session(monkeypatch)
    result = invoke(["--k", "99"], "Hi\n")
    assert result.exit_code != 0 and isinstance(result.exception, UsageError)


def test_help_has_examples():
    result = runner.invoke(app, ["chat", "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0 and "Examples" in result.stdout and "/save chat.md" in result.stdout


# -- the real tiny model ----------------------------------------------------------------------------------------


@pytest.mark.real
def test_cli_real_smollm2_two_turns_reuse_the_cache(smollm2_path):
    result = invoke(
        [
            "-t",
            str(smollm2_path),
            "-d",
            str(smollm2_path),
            "--method",
            "draft",
            "-n",
            "12",
            "--k",
            "3",
            "--threads",
            "2",
        ],
        "Hi!\n/stats\nName a colour.\n",
    )
    assert result.exit_code == 0, result.output
    assert len([line for line in result.stdout.splitlines() if line.strip()]) >= 2
    footers = [line for line in result.stderr.splitlines() if " tok/s · " in line]
    assert len(footers) == 2
    # draft = target at temperature 0: every draft token is accepted
    assert all("acceptance 100%" in f for f in footers)
    assert " + 0 cached" in footers[0] and " + 0 cached" not in footers[1]


@pytest.mark.real
def test_real_second_turn_evaluates_only_the_new_tokens(smollm2_path):
    from specdec_cli.models.llama import LlamaBackend

    target = LlamaBackend(smollm2_path, n_ctx=1024, n_threads=2)
    draft = LlamaBackend(smollm2_path, n_ctx=1024, n_threads=2)
    session = Session(target=target, target_path=smollm2_path, draft=draft, draft_path=smollm2_path)
    with session:
        chat, _, _ = make_chat(session, k="3", max_tokens=10)
        first = chat.turn("Hi!")
        prompt1 = session.chat_tokens(chat.conversation.messages()[:-1])
        reply1 = session.target.tokenize(first.assistant, add_special=False)
        second = chat.turn("Name a colour.")
        prompt2 = session.chat_tokens(chat.conversation.messages()[:-1])
        # The template rendered turn 1 + the reply exactly as the cache holds them...
        assert prompt2[: len(prompt1) + len(reply1)] == prompt1 + reply1
        held = len(prompt1) + len(reply1) - (first.stats.finish_reason == "length")
        # ...so the prefill evaluated only the tokens after them (minus the last, evaluated by the first step).
        assert second.stats.n_prefill_evaluated == len(prompt2) - 1 - held
        assert second.stats.n_prefill_evaluated < 30 < len(prompt1)
        evaluated, cached = second.draft_cache
        assert cached >= len(prompt1)


def test_predict_drafts_the_next_reply_from_a_file_and_only_that_reply(tmp_path):
    chat, _, err = make_chat(fake_session(draft=False), method="predict", k="8", max_tokens=12)
    first = chat.turn(words(4, 5))
    assert "predict" not in first.stats.by_source  # no prediction: nothing drafted
    (tmp_path / "expected.txt").write_text(first.assistant, encoding="utf-8")
    dispatch(chat, "/reset")
    assert dispatch(chat, f"/predict {tmp_path / 'expected.txt'}") is False
    assert "The next reply drafts from" in err.getvalue()
    again = chat.turn(words(4, 5))  # the same message: the reply is the prediction (greedy, lossless)
    assert again.assistant == first.assistant
    assert again.stats.by_source["predict"]["accepted"] >= 8 and again.stats.accepted_prediction_tokens >= 8
    assert chat.prediction is None  # for the next reply only
    with pytest.raises(UsageError, match="Prediction file .* does not exist"):  # one line, the chat goes on
        dispatch(chat, f"/predict {tmp_path / 'missing.txt'}")
