"""The openai and anthropic SDKs against a `specdec serve` that has an API key: what the server's defences (issue 35:
Host and Origin checks, keys, timeouts, connection limits) let through, and what they refuse.

Starts one `specdec serve` (the default model unless `-t`, `--max-tokens` short replies, a fresh SPECDEC_HOME,
loopback) with its key in SPECDEC_SERVE_KEY (or `--api-key-file FILE`, the way a user keeps it off the command line),
then, with the key, through both of the names a user types (`127.0.0.1` and `localhost`):

- openai: `chat.completions.create` (plain and streamed), `responses.create` (plain and streamed), `models.list`;
- anthropic: `messages.create` (plain and streamed), `messages.count_tokens`;
- the same client again after an idle pause longer than the server's keep-alive (its pooled connection was closed);

and what must be refused: no key and a wrong key (401, the SDKs' AuthenticationError), a forged `Host` (403,
PermissionDeniedError), a browser `Origin` (403). Prints one PASS/FAIL line per check and exits 1 if any failed.

    python clients/clients_access.py                          # the default model, --max-tokens 16
    python clients/clients_access.py -t qwen2.5-coder-0.5b    # quicker
    python clients/clients_access.py --url http://127.0.0.1:8000 --key KEY   # a server already running

Needs `pip install 'specdec-cli[serve]' openai anthropic`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bench_serve: the server helpers
from bench_serve import launch, stop_server  # noqa: E402

ASK = "Say hello in three words."
IDLE_S = 6.5  # past the server's keep-alive (5 s): the client's pooled connection was closed by the server


def checks(base: str, key: str, max_tokens: int) -> list[tuple[str, object]]:
    """(name, function) of every check against the server at `base` (http://HOST:PORT, no /v1)."""
    import anthropic
    import openai

    port = base.rsplit(":", 1)[1]
    urls = {"127.0.0.1": f"http://127.0.0.1:{port}", "localhost": f"http://localhost:{port}"}
    out: list[tuple[str, object]] = []

    def oai(url: str, api_key: str = key, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=900, **kw)

    def ant(url: str, api_key: str = key, **kw) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=900, **kw)

    msgs = [{"role": "user", "content": ASK}]
    for name, url in urls.items():

        def chat(url=url):
            r = oai(url).chat.completions.create(model="specdec", messages=msgs, max_tokens=max_tokens)
            assert r.choices[0].message.content, r
            return r.choices[0].message.content

        def chat_stream(url=url):
            text = "".join(
                c.choices[0].delta.content or ""
                for c in oai(url).chat.completions.create(
                    model="specdec", messages=msgs, max_tokens=max_tokens, stream=True
                )
                if c.choices
            )
            assert text, text
            return text

        def responses(url=url):
            r = oai(url).responses.create(model="specdec", input=ASK, max_output_tokens=max_tokens)
            assert r.output_text, r
            return r.output_text

        def responses_stream(url=url):
            kinds, text = [], ""
            for ev in oai(url).responses.create(model="specdec", input=ASK, max_output_tokens=max_tokens, stream=True):
                kinds.append(ev.type)
                text += getattr(ev, "delta", "") if ev.type == "response.output_text.delta" else ""
            assert text and kinds[-1] in ("response.completed", "response.incomplete"), kinds
            return f"{text!r} ({len(kinds)} events)"

        def models(url=url):
            return ", ".join(m.id for m in oai(url).models.list())

        def messages(url=url):
            r = ant(url).messages.create(model="specdec", messages=msgs, max_tokens=max_tokens)
            assert r.content and r.content[0].text, r
            return r.content[0].text

        def messages_stream(url=url):
            with ant(url).messages.stream(model="specdec", messages=msgs, max_tokens=max_tokens) as s:
                text = "".join(s.text_stream)
                final = s.get_final_message()
            assert text and final.stop_reason in ("end_turn", "max_tokens"), final
            return text

        def count(url=url):
            n = ant(url).messages.count_tokens(model="specdec", messages=msgs).input_tokens
            assert n > 0, n
            return f"{n} tokens"

        out += [
            (f"openai chat.completions ({name})", chat),
            (f"openai chat.completions stream ({name})", chat_stream),
            (f"openai responses ({name})", responses),
            (f"openai responses stream ({name})", responses_stream),
            (f"openai models.list ({name})", models),
            (f"anthropic messages ({name})", messages),
            (f"anthropic messages stream ({name})", messages_stream),
            (f"anthropic count_tokens ({name})", count),
        ]

    def after_idle():
        client, aclient = oai(urls["127.0.0.1"]), ant(urls["127.0.0.1"])
        got = []
        for _ in range(2):
            got.append(
                client.chat.completions.create(model="specdec", messages=msgs, max_tokens=4).choices[0].message.content
            )
            got.append(aclient.messages.create(model="specdec", messages=msgs, max_tokens=4).content[0].text)
            time.sleep(IDLE_S)
        return " / ".join(map(repr, got))

    def refused(call, error, status):
        try:
            call()
        except error as e:
            assert e.status_code == status, e
            return f"{status} {type(e).__name__}: {str(e)[:100]}"
        raise AssertionError(f"not refused (expected {status})")

    url = urls["127.0.0.1"]
    out += [
        ("openai and anthropic again after an idle pause past keep-alive", after_idle),
        ("refused: a request without a key", lambda: without_key(url, msgs)),
        (
            "refused: openai with a wrong key",
            lambda: refused(
                lambda: oai(url, api_key="wrong").responses.create(model="s", input=ASK, max_output_tokens=2),
                openai.AuthenticationError,
                401,
            ),
        ),
        (
            "refused: anthropic with a wrong key",
            lambda: refused(
                lambda: ant(url, api_key="wrong").messages.create(model="s", messages=msgs, max_tokens=2),
                anthropic.AuthenticationError,
                401,
            ),
        ),
        (
            "refused: openai with a forged Host",
            lambda: refused(
                lambda: oai(url, default_headers={"Host": "evil.example"}).chat.completions.create(
                    model="s", messages=msgs, max_tokens=2
                ),
                openai.PermissionDeniedError,
                403,
            ),
        ),
        (
            "refused: anthropic with a forged Host",
            lambda: refused(
                lambda: ant(url, default_headers={"Host": f"evil.example:{port}"}).messages.create(
                    model="s", messages=msgs, max_tokens=2
                ),
                anthropic.PermissionDeniedError,
                403,
            ),
        ),
        (
            "refused: a browser Origin",
            lambda: refused(
                lambda: oai(url, default_headers={"Origin": "https://evil.example"}).models.list(),
                openai.PermissionDeniedError,
                403,
            ),
        ),
        (
            "health without a key",
            lambda: json.loads(urllib.request.urlopen(f"{url}/health", timeout=10).read())["status"],
        ),
    ]
    return out


def without_key(url: str, msgs: list[dict]) -> str:
    """POST /v1/chat/completions with no key at all (the SDKs will not send one without): must be a 401."""
    body = json.dumps({"model": "s", "messages": msgs, "max_tokens": 2}).encode()
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", method="POST", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        assert e.code == 401, e
        return f"401 {json.loads(e.read())['error']['message'][:80]}"
    raise AssertionError("not refused (expected 401)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--target", default=None, help="the served model (default: the catalog's default)")
    ap.add_argument("--max-tokens", type=int, default=16, help="serve's --max-tokens (every reply is short)")
    ap.add_argument(
        "--api-key-file", action="store_true", help="give serve its key with --api-key-file, not SPECDEC_SERVE_KEY"
    )
    ap.add_argument("--url", default=None, help="a running server (http://HOST:PORT); then --key is its key")
    ap.add_argument("--key", default=None)
    args = ap.parse_args()

    proc = None
    if args.url:
        base, key = args.url.rstrip("/").removesuffix("/v1"), args.key or ""
    else:
        home = tempfile.mkdtemp(prefix="clients-access-")
        key = f"sk-{secrets.token_hex(16)}"
        cmd = [sys.executable, "-m", "specdec_cli", "serve", "--port", "0", "--max-tokens", str(args.max_tokens)]
        cmd += ["-t", args.target] if args.target else []
        if args.api_key_file:
            Path(home, "key").write_text(key + "\n")
            cmd += ["--api-key-file", str(Path(home, "key"))]
        else:
            os.environ["SPECDEC_SERVE_KEY"] = key  # the server's variable (launch passes os.environ on)
        proc, url = launch(cmd, home)
        os.environ.pop("SPECDEC_SERVE_KEY", None)
        base = url.removesuffix("/v1")
    failed = 0
    try:
        for name, fn in checks(base, key, args.max_tokens):
            t0 = time.monotonic()
            try:
                detail, ok = str(fn()), True
            except Exception as e:  # a check's failure is a FAIL line, never the end of the run
                detail, ok = f"{type(e).__name__}: {e}"[:300], False
                if os.environ.get("SPECDEC_DEBUG"):
                    traceback.print_exc()
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'}  {name:62} {time.monotonic() - t0:6.1f} s  {detail[:120]}", flush=True)
    finally:
        if proc is not None:
            log = stop_server(proc)
            Path(tempfile.gettempdir(), "clients-access-serve.log").write_text(log)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
