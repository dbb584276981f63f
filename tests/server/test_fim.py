"""Fill-in-the-middle (issue 27 part 3): `/v1/completions` with `suffix`, raw prompts whose special tokens are parsed,
token-array prompts, and llama.cpp's `POST /infill` (llama.vim, llama.vscode), on the fake backend; a real
Qwen2.5-Coder-1.5B test returns the missing line through each."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fakes import FakeBackend, hashed_logits  # noqa: E402
from helpers import serving  # noqa: E402
from specdec_cli.models.backend import FimTokens  # noqa: E402
from specdec_cli.server.fim import SNIPPET, fim_prompt  # noqa: E402
from specdec_cli.server.request import Fim  # noqa: E402

# FakeBackend: "wN" is token N; the FIM tokens of a Qwen-like vocabulary, in a 64-token one
PRE, SUF, MID, PAD, REP, SEP = 60, 61, 62, 63, 58, 59
QWEN_LIKE = FimTokens(pre=PRE, suf=SUF, mid=MID, pad=PAD, rep=REP, sep=SEP)


class FimBackend(FakeBackend):
    """FakeBackend with FIM tokens, recording the prompts it evaluates; `<|fim_*|>` text is one token when special
    tokens are parsed (as llama.cpp's tokenizer does)."""

    SPECIAL = {"<|fim_prefix|>": PRE, "<|fim_suffix|>": SUF, "<|fim_middle|>": MID}

    def __init__(self, fim: FimTokens = QWEN_LIKE, **kw) -> None:
        super().__init__(lambda p: hashed_logits(p, 64), vocab=64, **kw)
        self.fim = fim
        self.parsed: list[bool] = []

    def fim_tokens(self) -> FimTokens:
        return self.fim

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self.parsed.append(parse_special)
        if not parse_special:
            return super().tokenize(text, add_special=add_special)
        out = []
        for part in text.replace("<|", " <|").replace("|>", "|> ").split():
            out.extend([self.SPECIAL[part]] if part in self.SPECIAL else super().tokenize(part))
        return out


def completion(s, body: dict, path: str = "/v1/completions"):
    return s.raw("POST", path, json.dumps({"model": "fake", "max_tokens": 4, **body}).encode())


def test_the_fim_prompt_is_llama_servers_layout():
    backend = FimBackend()
    plain = fim_prompt(backend, Fim(prefix="w5 w6", suffix="w7"), n_ctx=512, n_predict=8)
    assert plain == [PRE, 5, 6, SUF, 7, MID]
    repo = fim_prompt(
        backend,
        Fim(prefix="w5", suffix="w7", extra=(("w9", "w10 w11"),), prompt="w12", repo=True),
        n_ctx=512,
        n_predict=8,
    )
    # [REP] myproject\n [SEP] filename\n chunk ... [SEP] filename\n [PRE] prefix prompt [SUF] suffix [MID]
    myproject, filename = backend.tokenize("myproject\n", add_special=False), backend.tokenize("filename\n")
    assert repo == [REP, *myproject, SEP, 9, *backend.tokenize("\n"), 10, 11, SEP, *filename, PRE, 5, 12, SUF, 7, MID]
    no_repo = FimBackend(FimTokens(pre=PRE, suf=SUF, mid=MID))
    joined = fim_prompt(
        no_repo, Fim(prefix="w5", suffix="w7", extra=(("a.py", "w10"),), repo=True), n_ctx=512, n_predict=8
    )
    # no FIM_REP/FIM_SEP: the chunk after llama-server's "--- snippet ---" separator, then the FIM prompt
    assert joined == [*no_repo.tokenize(SNIPPET, add_special=False), 10, PRE, 5, SUF, 7, MID]


def test_a_long_prefix_and_suffix_are_cut_to_fit_3_to_1():
    backend = FimBackend()
    tokens = fim_prompt(
        backend, Fim(prefix=" ".join(["w5"] * 400), suffix=" ".join(["w7"] * 400)), n_ctx=512, n_predict=8
    )
    assert tokens.count(5) == 192 and tokens.count(7) == 64 - 2  # window 256: 3/4 prefix, 1/4 - 2 suffix
    assert tokens[0] == PRE and tokens[-1] == MID


def test_completions_with_suffix_fill_the_middle():
    backend = FimBackend()
    with serving(backend) as s:
        status, reply = completion(s, {"prompt": "w5 w6", "suffix": "w7"})
        status_raw, raw = completion(s, {"prompt": "<|fim_prefix|>w5 w6<|fim_suffix|>w7<|fim_middle|>"})
        status_ids, ids = completion(s, {"prompt": [PRE, 5, 6, SUF, 7, MID]})
        status_nested, nested = completion(s, {"prompt": [[PRE, 5, 6, SUF, 7, MID]]})
        status_bad, bad = completion(s, {"prompt": [5, 999]})
    assert status == status_raw == status_ids == status_nested == 200, (reply, raw, ids, nested)
    text = reply["choices"][0]["text"]
    # the same prompt tokens, whichever way they were sent: the same greedy middle
    assert raw["choices"][0]["text"] == ids["choices"][0]["text"] == nested["choices"][0]["text"] == text
    assert reply["usage"]["prompt_tokens"] == raw["usage"]["prompt_tokens"] == 6
    assert status_bad == 400 and bad["error"]["param"] == "prompt"


def test_a_model_without_fim_tokens_gets_a_400_naming_it():
    with serving(FimBackend(FimTokens())) as s:
        status, reply = completion(s, {"prompt": "w5", "suffix": "w7"})
        status_infill, infill = completion(s, {"input_prefix": "w5", "input_suffix": "w7"}, "/infill")
    assert status == 400 and reply["error"]["param"] == "suffix" and "fake.gguf" in reply["error"]["message"]
    assert status_infill == 400 and "fake.gguf" in infill["error"]["message"]


def test_infill_in_llama_cpps_shape_streamed_and_not():
    backend = FimBackend()
    with serving(backend) as s:
        body = {
            "input_prefix": "w5 w6",
            "input_suffix": "w7",
            "input_extra": [{"filename": "w9", "text": "w10"}],
            "prompt": "w12",
            "n_predict": 4,
            "temperature": 0,
            "n_indent": 4,
            "t_max_predict_ms": 500,
            "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True,
        }
        status, reply = completion(s, body, "/infill")
        status_f, fields = completion(s, {**body, "response_fields": ["content", "timings/prompt_n"]}, "/infill")
        import http.client
        from urllib.parse import urlparse

        u = urlparse(s.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        conn.request(
            "POST", "/infill", body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"}
        )
        stream = conn.getresponse().read().decode()
        conn.close()
    assert status == 200, reply
    assert reply["stop"] is True and reply["tokens_predicted"] == 4 and reply["stop_type"] == "limit"
    assert reply["tokens_evaluated"] > 0 and set(reply["timings"]) >= {
        "prompt_n",
        "prompt_ms",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
    }
    assert isinstance(reply["content"], str) and "specdec" in reply
    assert status_f == 200 and set(fields) == {"content", "timings/prompt_n"}
    assert fields["content"] == reply["content"]
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: ")]
    assert "".join(c["content"] for c in chunks) == reply["content"]
    assert [c["stop"] for c in chunks][-1] is True and not any(c["stop"] for c in chunks[:-1])


# -- the real model ---------------------------------------------------------------------------------------------------
PREFIX = "def fib(n):\n    if n < 2:\n        return n\n"
SUFFIX = "\n\nprint(fib(10))\n"
MISSING = r"return fib\(n ?- ?1\) ?\+ ?fib\(n ?- ?2\)"


@pytest.mark.real
@pytest.mark.qwen
def test_qwen_coder_fills_the_missing_line_through_completions_and_infill(qwen_pair):
    """Qwen2.5-Coder-1.5B (its GGUF has no fim_* keys: llama.cpp finds <|fim_prefix|> ... by name) completes the
    missing line of fib through `suffix`, a raw FIM-token prompt, and `/infill` with another file as extra context."""
    import http.client
    import re
    from urllib.parse import urlparse

    from helpers import qwen_server

    with qwen_server(qwen_pair[0]) as (url, service):
        assert service.fim.usable and service.fim.rep is not None and service.fim.sep is not None
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        by_suffix = client.completions.create(model="q", prompt=PREFIX, suffix=SUFFIX, max_tokens=24, temperature=0)
        raw = client.completions.create(
            model="q",
            prompt=f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>",
            max_tokens=24,
            temperature=0,
        )
        u = urlparse(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        conn.request(
            "POST",
            "/infill",
            body=json.dumps(
                {
                    "input_prefix": PREFIX,
                    "input_suffix": SUFFIX,
                    "n_predict": 24,
                    "temperature": 0,
                    "input_extra": [{"filename": "main.py", "text": "from fib import fib\n"}],
                }
            ),
            headers={"Content-Type": "application/json"},
        )
        infill = json.loads(conn.getresponse().read())
        conn.close()
    for text in (by_suffix.choices[0].text, raw.choices[0].text, infill["content"]):
        assert re.search(MISSING, text), text
    assert raw.usage.prompt_tokens < 40  # the FIM markers are single tokens (parsed), not text
    assert by_suffix.choices[0].text == raw.choices[0].text  # the same prompt, sent either way


def test_infill_applies_t_max_predict_ms_as_llama_server_does_and_orders_by_the_whole_budget():
    """`t_max_predict_ms` changes what comes back (the reply ends at the first newline after that much generation:
    `GenerationConfig.line_time_ms`, tested in test_engine), so it is applied, not only accepted; with
    `t_max_prompt_ms` it is the scheduler's deadline. Left out or 0: no time limit, no deadline."""
    from types import SimpleNamespace

    from specdec_cli.server.llama_infill import InfillRequest, to_request
    from specdec_cli.server.request import Defaults

    ctx = SimpleNamespace(service=SimpleNamespace(require_fim=lambda param: None), defaults=Defaults(), n_ctx=512)
    body = {"input_prefix": "w5", "input_suffix": "w7", "n_predict": 128}
    timed = to_request(InfillRequest(**body, t_max_prompt_ms=500, t_max_predict_ms=1000), ctx)
    assert timed.config.line_time_ms == 1000.0 and timed.deadline_ms == 1500.0
    for untimed in (to_request(InfillRequest(**body), ctx), to_request(InfillRequest(**body, t_max_predict_ms=0), ctx)):
        assert untimed.config.line_time_ms is None and untimed.deadline_ms is None
