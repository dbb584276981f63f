"""Structured outputs: grammar-aware speculation against constrained plain decoding and native llama.cpp.

Tasks (the documents are held out: written for this benchmark, in tests/data/structured/):
  (a) extract: JSON extraction from an invoice (17 fields and 4 line items, most values copied from the text),
      constrained by invoice.schema.json;
  (b) tool call: a tool-call turn in Qwen2.5's `<tool_call>` format, constrained by a grammar of the tool's schema
      (an e-mail asking for a meeting -> create_event(...), arguments copied from the mail), then
  (c) answer: the final answer after the tool's result (free text).
Configurations: specdec default (`auto`) and `--method none` (constrained plain decoding through the same engine),
each in both JSON layouts (inline: the default, every key forced; free: any whitespace), and native llama.cpp
`llama-completion -jf schema.json` (its own JSON-schema grammar) on the same chat-templated text, threads and
budget (extraction only: `-jf` cannot express the `<tool_call>` wrapper). Greedy. Repeats are interleaved
(configuration order within a repeat), the table gives medians with their spread (min-max); decode tok/s excludes
the prefill everywhere. "valid" = the reply parses and is accepted by the schema's grammar (any whitespace) or, for
tool calls, names the tool with arguments valid against its parameters. "grammar ms/step" is the grammar's own
work per target pass in the constrained runs (llguidance's masks, forced tokens, draft cuts, rollback, and applying
masks to logits rows), measured by timing those calls, beside "plain step ms", the mean cost of one unconstrained
plain decoding pass.

    python benchmarks/bench_structured.py [--llama-cpp DIR] [--repeats N] [-t MODEL] [--tasks extract,tool,answer]
    python benchmarks/bench_structured.py -t smollm2-135m --repeats 1 --tasks extract -n 64   # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from specdec_cli.assemble import Assembler
from specdec_cli.cli.console import RichReporter
from specdec_cli.core import constraint, sampling
from specdec_cli.core.constraint import Constraint
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.driver import generate
from specdec_cli.measure.sweep import NoLearning
from specdec_cli.session import open_session
from specdec_cli.spec import ModelOptions, SpecOptions

HERE = Path(__file__).resolve().parents[1] / "tests" / "data" / "structured"
DEFAULT_TARGET = "qwen2.5-coder-1.5b"

EXTRACT_PROMPT = (
    "Extract the invoice below into one JSON object with these fields: invoice_number, issue_date, due_date, "
    "purchase_order, seller_name, seller_vat_number, customer_name, customer_contact, line_items (each with "
    "description, quantity, unit_price, amount), subtotal, vat_rate_percent, vat_amount, total_due, currency, "
    "bank_sort_code, bank_account, contact_email. Copy the values exactly as they are written.\n\n"
)

TOOL = {
    "type": "function",
    "function": {
        "name": "create_event",
        "description": "Create a calendar event and invite people to it.",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "date": {"type": "string", "description": "YYYY-MM-DD"},
                "start_time": {"type": "string", "description": "HH:MM, 24-hour"},
                "duration_minutes": {"type": "integer"},
                "location": {"type": "string"},
                "attendees": {"type": "array", "items": {"type": "string", "description": "e-mail address"}},
                "notes": {"type": "string"},
            },
            "required": ["title", "date", "start_time", "duration_minutes", "location", "attendees", "notes"],
            "additionalProperties": False,
        },
    },
}
TOOL_USER = "Please put this meeting in my calendar and invite everyone on it.\n\n" + "{mail}"
TOOL_RESULT = {
    "event_id": "evt_7Q2K9",
    "status": "confirmed",
    "invitations_sent": 3,
    "calendar_link": "https://cal.example.org/e/evt_7Q2K9",
}

QWEN_TOOLS_SYSTEM = (  # Qwen2.5's chat template with tools, for a build whose format_chat takes no tools
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\nYou may call one or more "
    "functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> "
    "XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


class GrammarClock:
    """Times the grammar's own work in the engine (llguidance calls and applying masks to logits rows) by wrapping
    the functions that do it; `ms` accumulates wall time, reset per run."""

    def __init__(self) -> None:
        self.ms = 0.0
        for owner, name in (
            (Constraint, "masks"),
            (Constraint, "commit"),
            (Constraint, "forced"),
            (Constraint, "cut"),
            (Constraint, "done"),
            (sampling, "apply_mask"),
        ):
            self._wrap(owner, name)

    def _wrap(self, owner, name: str) -> None:
        real = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        clock = self

        if isinstance(real, property):

            def timed_get(obj, _f=real.fget):
                t = time.perf_counter()
                try:
                    return _f(obj)
                finally:
                    clock.ms += (time.perf_counter() - t) * 1e3

            setattr(owner, name, property(timed_get))
            return

        def timed(*a, _f=real, **kw):
            t = time.perf_counter()
            try:
                return _f(*a, **kw)
            finally:
                clock.ms += (time.perf_counter() - t) * 1e3

        setattr(owner, name, timed)


def tool_grammar(session, layout: str) -> constraint.Grammar:
    """`<tool_call>\\n{"name": "create_event", "arguments": {...}}\\n</tool_call>`: the wrapper as special tokens
    when the vocabulary has them as single tokens (Qwen2.5), as text otherwise."""
    call = {
        "type": "object",
        "properties": {"name": {"const": TOOL["function"]["name"]}, "arguments": TOOL["function"]["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    body = constraint.json_schema(call, name="tool", layout=layout).lark.removeprefix("start: ").strip()
    single = len(session.target.tokenize("<tool_call>", add_special=False, parse_special=True)) == 1
    open_, close = ("<tool_call>", "</tool_call>") if single else ('"<tool_call>"', '"</tool_call>"')
    return constraint.from_lark(f'start: {open_} "\\n" call "\\n" {close}\ncall: {body}\n', name="tools")


def render(session, messages: list[dict], tools: list[dict] | None) -> str:
    try:
        return session.target.format_chat(messages, tools=tools)
    except TypeError:  # a format_chat without tools: Qwen2.5's tool block by hand, tool turns as its template does
        out = [{"role": "system", "content": QWEN_TOOLS_SYSTEM.format(tools=json.dumps(tools[0]))}] if tools else []
        for m in messages:
            if m["role"] == "tool":
                out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
            elif m.get("tool_calls"):
                calls = "\n".join(f"<tool_call>\n{json.dumps(c['function'])}\n</tool_call>" for c in m["tool_calls"])
                out.append({"role": "assistant", "content": calls})
            else:
                out.append(m)
        return session.target.format_chat(out)


def valid_json(text: str, schema: dict, tokenizer) -> bool:
    """The reply is JSON accepted by the schema's grammar (any whitespace around it)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    g = constraint.json_schema(schema, name="check", layout="free")
    from llguidance import LLMatcher

    m = LLMatcher(tokenizer, LLMatcher.grammar_from_lark(g.lark), log_level=0)
    toks = tokenizer.tokenize_str(text.strip())
    return m.validate_tokens(toks) == len(toks) and m.consume_tokens(toks) and m.is_accepting()


def valid_call(text: str, tokenizer) -> bool:
    match = re.search(r"<tool_call>\s*(\{.*\})\s*</tool_call>", text, re.S)
    if not match:
        return False
    try:
        call = json.loads(match.group(1))
    except ValueError:
        return False
    return call.get("name") == TOOL["function"]["name"] and valid_json(
        json.dumps(call.get("arguments")), TOOL["function"]["parameters"], tokenizer
    )


def run_ours(session, method: str, prompt: np.ndarray, budget: int, grammar, clock: GrammarClock) -> dict:
    engine = Assembler(session).engine(SpecOptions(method=method), fresh=True)  # fresh: the assembler owns nothing
    drafter = engine.drafter
    if drafter is not None:
        engine.drafter = NoLearning(drafter)  # the store learns nothing from the benchmark's own outputs
    clock.ms = 0.0
    try:
        gen = generate(engine, prompt, GenerationConfig(max_tokens=budget, grammar=grammar))
    finally:
        if drafter is not None:
            drafter.close()
    s = gen.stats
    return {
        "tok_s": s.tokens_per_s,
        "n": s.n_generated,
        "passes": s.n_target_passes,
        "text": gen.text,
        "grammar_ms": clock.ms,
        "decode_ms": s.decode_ms,
        "finish": s.finish_reason,
        "sources": {k: v["accepted"] for k, v in s.by_source.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--target", default=DEFAULT_TARGET)
    ap.add_argument("--llama-cpp", help="a llama.cpp build dir with llama-completion")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", "--max-tokens", type=int, default=512)
    ap.add_argument("--tasks", default="extract,tool,answer")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--json", help="write every run's measurements to PATH")
    args = ap.parse_args()
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    tools_bin = None
    if args.llama_cpp:
        from specdec_cli.measure.native import NativeJob, find_tools, run_plain

        tools_bin = find_tools(args.llama_cpp)
    clock = GrammarClock()
    schema = json.loads((HERE / "invoice.schema.json").read_text())
    invoice = (HERE / "invoice.txt").read_text()
    mail = (HERE / "meeting_mail.txt").read_text()
    runs: dict[str, dict[str, list[dict]]] = {}
    t_start = time.perf_counter()
    with open_session(
        ModelOptions(target=args.target, ctx=args.ctx, threads=args.threads, prompt_cache=False),
        method="auto",
        reporter=RichReporter(console),
    ) as session:
        threads = session.target.n_threads
        tok = session.target.lltokenizer()
        call_messages = [{"role": "user", "content": TOOL_USER.format(mail=mail)}]
        tasks: dict[str, tuple[str, dict[str, object]]] = {}  # task: (rendered text, {config: grammar or None})
        for name in args.tasks.split(","):
            if name == "extract":
                text = render(session, [{"role": "user", "content": EXTRACT_PROMPT + invoice}], None)
                configs = {
                    f"{m} {lay}": constraint.json_schema(schema, name="bench", layout=lay)
                    for lay in constraint.LAYOUTS
                    for m in ("auto", "none")
                }
                configs["none unconstrained"] = None
            elif name == "tool":
                text = render(session, call_messages, [TOOL])
                configs = {
                    f"{m} {lay}": tool_grammar(session, lay) for lay in constraint.LAYOUTS for m in ("auto", "none")
                }
                configs["none unconstrained"] = None
            elif name == "answer":
                args_json = json.dumps({"title": "Pump maintenance review", "date": "2026-12-03"})
                history = call_messages + [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "create_event", "arguments": args_json},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": json.dumps(TOOL_RESULT)},
                ]
                text = render(session, history, [TOOL])
                configs = {"auto": None, "none": None}
            else:
                console.print(f"unknown task {name!r}: use extract, tool, answer")
                return 2
            tasks[name] = (text, configs)
            runs[name] = {c: [] for c in configs} | ({"native -jf": []} if tools_bin and name == "extract" else {})
        for rep in range(args.repeats):
            for name, (text, configs) in tasks.items():
                prompt = np.asarray(session.target.tokenize(text, add_special=False, parse_special=True), np.int32)
                run_ours(session, "none", prompt, 4, None, clock)  # the prompt into the KV cache (never timed)
                for label, grammar in configs.items():
                    r = run_ours(session, label.split()[0], prompt, args.max_tokens, grammar, clock)
                    r["valid"] = (
                        valid_json(r["text"], schema, tok)
                        if name == "extract"
                        else valid_call(r["text"], tok)
                        if name == "tool"
                        else None
                    )
                    runs[name][label].append(r)
                    console.print(
                        f"[{rep + 1}/{args.repeats}] {name:7s} {label:20s} {r['tok_s']:6.1f} tok/s "
                        f"{r['n']:4d} tokens {r['passes']:4d} passes  valid {r['valid']}  "
                        f"grammar {r['grammar_ms']:.0f} ms  {r['sources']}"
                    )
                if tools_bin and name == "extract":
                    job = NativeJob(tools_bin, session.target_path, args.max_tokens, threads, args.ctx)
                    nr = run_plain(job, text, json_schema=schema)
                    body = (nr.text or "").replace("<|im_end|>", "").strip()
                    r = {
                        "tok_s": nr.decode_tok_s,
                        "n": nr.n_decoded,
                        "passes": nr.n_decoded,
                        "text": body,
                        "valid": valid_json(body, schema, tok),
                        "grammar_ms": None,
                    }
                    runs[name]["native -jf"].append(r)
                    console.print(
                        f"[{rep + 1}/{args.repeats}] {name:7s} native -jf            "
                        f"{r['tok_s']:6.1f} tok/s {r['n']:4d} tokens  valid {r['valid']}"
                    )
    print(report(runs, session.target_path.name, threads, args, time.perf_counter() - t_start))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


def report(runs: dict, model: str, threads: int, args, seconds: float) -> str:
    """The Markdown table: per task and configuration, medians (spread) over the repeats."""
    lines = [
        f"Structured outputs, {model}, {threads} threads, greedy, budget {args.max_tokens}, {args.repeats} "
        f"interleaved repeat(s), {seconds:.0f} s in all. Decode tok/s: median (min-max); speedups are ratios "
        "of medians.",
        "",
        "| task | configuration | decode tok/s | vs none (same layout) | vs native -jf | tokens | passes "
        "| valid | grammar ms/step | plain step ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task, configs in runs.items():
        med = {c: statistics.median(r["tok_s"] for r in rs) for c, rs in configs.items() if rs}
        plain = configs.get("none unconstrained") or []
        plain_ms = statistics.median(r["decode_ms"] / max(r["passes"], 1) for r in plain) if plain else None
        for c, rs in configs.items():
            if not rs:
                continue
            tok_s = [r["tok_s"] for r in rs]
            layout = c.split()[-1] if c.split()[0] in ("auto", "none") else None
            base = med.get(f"none {layout}") if layout in constraint.LAYOUTS else med.get("none")
            vs_none = f"{med[c] / base:.2f}x" if base and not c.startswith("none") else ""
            vs_native = f"{med[c] / med['native -jf']:.2f}x" if med.get("native -jf") and c != "native -jf" else ""
            valid = [r["valid"] for r in rs if r["valid"] is not None]
            g = [r["grammar_ms"] / max(r["passes"], 1) for r in rs if r.get("grammar_ms") is not None]
            lines.append(
                f"| {task} | {c} | {med[c]:.1f} ({min(tok_s):.1f}-{max(tok_s):.1f}) | {vs_none} | {vs_native} "
                f"| {statistics.median(r['n'] for r in rs):.0f} | {statistics.median(r['passes'] for r in rs):.0f} "
                f"| {f'{100 * sum(valid) / len(valid):.0f} %' if valid else '-'} "
                f"| {f'{statistics.median(g):.2f}' if g and any(g) else '-'} "
                f"| {f'{plain_ms:.1f}' if plain_ms else '-'} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
