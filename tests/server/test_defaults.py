"""What a request that leaves sampling or its token limit out gets: each API's documented defaults, unless
`specdec serve` was started with its own (`--temperature`, `--top-p`, `--max-tokens` given on the command line win),
and a default cap on the reply's tokens that is said at start-up."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from typer.testing import CliRunner  # noqa: E402

from specdec_cli.server.openai_base import generation_config  # noqa: E402
from specdec_cli.server.openai_chat import ChatRequest  # noqa: E402
from specdec_cli.server.request import ANTHROPIC, DEFAULT_MAX_TOKENS, LLAMA_CPP, OPENAI, Defaults, SamplingValues  # noqa: E402

USER = [{"role": "user", "content": "hi"}]


def config(defaults: Defaults, n_ctx: int = 32768, **body):
    return generation_config(ChatRequest(messages=USER, **body), defaults, n_ctx)


def test_a_request_without_sampling_gets_openais_defaults():
    c = config(Defaults())
    s = c.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (1.0, 1.0, 0, 0.0)  # OpenAI: temperature 1, top_p 1
    assert c.max_tokens == DEFAULT_MAX_TOKENS == 4096


def test_the_servers_own_values_win_over_the_apis_and_the_requests_over_both():
    own = Defaults(temperature=0.2, top_p=0.9, max_tokens=100)
    c = config(own)
    assert (c.sampling.temperature, c.sampling.top_p, c.max_tokens) == (0.2, 0.9, 100)
    c = config(own, temperature=0.7, top_p=0.5, max_tokens=7)
    assert (c.sampling.temperature, c.sampling.top_p, c.max_tokens) == (0.7, 0.5, 7)
    assert generation_config(ChatRequest(messages=USER), own, 32768, max_tokens=9).max_tokens == 9  # chat's own


def test_the_default_cap_never_exceeds_the_context():
    assert config(Defaults(), n_ctx=2048).max_tokens == 2048
    assert config(Defaults(max_tokens=10_000), n_ctx=2048).max_tokens == 2048


def test_each_api_has_its_documented_defaults():
    assert (OPENAI.temperature, OPENAI.top_p) == (1.0, 1.0)
    assert ANTHROPIC.temperature == 1.0
    assert (LLAMA_CPP.temperature, LLAMA_CPP.top_k, LLAMA_CPP.top_p, LLAMA_CPP.min_p) == (0.8, 40, 0.95, 0.05)
    s = Defaults(top_k=5).sampling(ANTHROPIC)
    assert (s.temperature, s.top_k) == (1.0, 5)
    s = Defaults().sampling(LLAMA_CPP, SamplingValues(temperature=0.0))
    assert (s.temperature, s.top_k, s.min_p) == (0.0, 40, 0.05)


def test_serve_passes_only_the_sampling_options_given_on_the_command_line(monkeypatch):
    from specdec_cli.cli.app import app
    from specdec_cli.cli.commands import serve

    seen = {}
    monkeypatch.setattr(serve, "execute", lambda **kw: seen.update(kw) or 0)
    assert CliRunner().invoke(app, ["serve"]).exit_code == 0
    assert seen["defaults"] == Defaults()  # nothing given: each API's defaults
    assert CliRunner().invoke(app, ["serve", "--temperature", "0", "--max-tokens", "64"]).exit_code == 0
    d = seen["defaults"]
    assert (d.temperature, d.max_tokens, d.top_p, d.top_k) == (0.0, 64, None, None)


def test_the_start_up_line_says_the_defaults_and_the_cap():
    from specdec_cli.cli.commands.serve import startup_line

    line = startup_line("qwen", "auto", "http://127.0.0.1:8000/v1", Defaults(), n_ctx=32768, api_key=False)
    assert "at most 4096 tokens per reply" in line and "--max-tokens" in line
    assert "temperature and top_p as each API documents" in line
    line = startup_line(
        "qwen", "auto", "http://x/v1", Defaults(temperature=0.0, max_tokens=64), n_ctx=2048, api_key=True
    )
    assert "at most 64 tokens per reply" in line and "temperature 0" in line and "API key required" in line
