"""Which request field only informs and which changes what must come back, and what `specdec serve` does with each:
the one table (STYLE habit 12) that the translators' checks and docs/server.md's table are made from.

A field that *changes what must come back* (tools, a response format, `n`, log-probabilities, penalties, ...) is
implemented or refused with a 400 naming it (`param`): a client that asked for it must get it or an error, never a
reply that silently lacks it. A field that only *informs* (a participant's `name`, a schema's `description`,
`strict`, `cache_control`, `metadata`, `store`, reasoning settings, vendor extras) is used where the model has room
for it (the chat template, a system-message line) and otherwise accepted: llama-server, vLLM, Ollama and LM Studio
accept them, and LangChain, pydantic-ai, Codex and Claude Code send them on every request. A field nobody here knows
is accepted and ignored (logged once per name), as those peers do, rather than refused as OpenAI refuses it.

`python -m specdec_cli.server.fields` prints docs/server.md's table (`markdown_table`); a test checks they agree.
Sources: OpenAI's API reference (Chat Completions, Completions); llama-server (`tools/server/server-common.cpp`
`oaicompat_chat_params_parse`: `chat_template_kwargs`, `reasoning_format`, a message's `name`), vLLM
(`protocol.py`: `extra="allow"`, unknown fields logged), Ollama's and LM Studio's OpenAI compatibility pages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from specdec_cli.server.errors import ApiError

Kind = Literal["informs", "changes"]
INFORMS: Kind = "informs"
CHANGES: Kind = "changes"


@dataclass(frozen=True)
class Field:
    """One request field's policy.

    Attributes:
        name: as the wire names it (`messages[].name` for a field of each message; several names joined by ", ").
        kind: INFORMS (accepted; used where the model has room) or CHANGES (implemented, or refused with a 400).
        does: what specdec serve does with it (one line of docs/server.md's table).
        refused: why a CHANGES field is refused (None: implemented or accepted); it is refused only when set to
            something other than left out, null, or one of `neutral`.
        neutral: the values of a refused field that ask for nothing (e.g. `frequency_penalty: 0`).
    """

    name: str
    kind: Kind
    does: str
    refused: str | None = None
    neutral: tuple[Any, ...] = ()


_NO_PENALTIES = (
    "specdec serve does not implement repetition penalties (they would change the target distribution "
    "speculation preserves)"
)

_INFORMING: tuple[tuple[str, str], ...] = (
    # (field, what specdec serve does): accepted, used where the model has room
    ("messages[].name", "given to the chat template as the message's `name` (templates that read it show it)"),
    ("response_format.json_schema.description", "shown to the model in a system-message line, as OpenAI does"),
    ("response_format.json_schema.strict", "accepted; the schema is always enforced"),
    ("tools[].function.strict", "accepted; the parameters are always enforced"),
    (
        "chat_template_kwargs",
        "given to the chat template as variables (e.g. `enable_thinking`), as llama-server and vLLM do",
    ),
    (
        "reasoning_effort, reasoning.effort",
        "given to the chat template as `reasoning_effort` (reasoning models' templates read it)",
    ),
    (
        "messages[].reasoning_content",
        "an assistant's reasoning sent back: given to the chat template as `reasoning_content`",
    ),
    (
        "cache_control",
        "accepted and dropped (on messages and parts): the KV cache keeps the longest common prefix anyway",
    ),
    ("metadata, store", "accepted; nothing is stored"),
    ("service_tier", "accepted; one tier"),
    (
        "prompt_cache_key, prompt_cache_retention, prompt_cache_options",
        "accepted: the KV cache keeps the longest common prefix, and the prompt cache a finished prompt, on their own",
    ),
    ("user, safety_identifier, model", "accepted: labels (the server serves one model)"),
    ("verbosity", "accepted; not applied (a hint to OpenAI's models)"),
    ("any other field", "accepted and ignored, logged once per name (as llama-server, vLLM, Ollama and LM Studio do)"),
)

_IMPLEMENTED: tuple[tuple[str, str], ...] = (
    # (field, what specdec serve does): changes what must come back, and is implemented
    ("max_tokens, max_completion_tokens, stop, seed", "implemented"),
    (
        "temperature, top_p, top_k, min_p",
        "implemented (lossless: rejection sampling keeps the "
        "target's distribution; with a `seed`, the reply is plain decoding's with that seed)",
    ),
    ("stream, stream_options.include_usage", "implemented"),
    ("tools, tool_choice, parallel_tool_calls", "implemented: calls constrained by a grammar"),
    ("response_format", "implemented: `json_object`, `json_schema` (a grammar), `text`"),
    ("logprobs, top_logprobs", "implemented (0-20 alternatives)"),
    ("prediction", "implemented: drafted from, never evaluated"),
    (
        "suffix",
        "implemented on /v1/completions: fill in the middle with the model's FIM tokens (400 "
        "naming the model when it has none)",
    ),
)

FIELDS: tuple[Field, ...] = (
    *(Field(name, INFORMS, does) for name, does in _INFORMING),
    *(Field(name, CHANGES, does) for name, does in _IMPLEMENTED),
    # -- changes what must come back: refused with a 400 naming the field unless left out or neutral -----------
    Field(
        "n", CHANGES, "refused unless 1", "specdec serve generates one choice per request: send several requests", (1,)
    ),
    Field("best_of", CHANGES, "refused unless 1", "specdec serve generates one completion per request", (1,)),
    Field("frequency_penalty", CHANGES, "refused unless 0", _NO_PENALTIES, (0,)),
    Field("presence_penalty", CHANGES, "refused unless 0", _NO_PENALTIES, (0,)),
    Field("logit_bias", CHANGES, "refused unless empty", "specdec serve does not implement logit_bias", ({},)),
    Field("audio", CHANGES, "refused", "specdec serve generates text only"),
    Field("modalities", CHANGES, 'refused unless ["text"]', "specdec serve generates text only", (["text"],)),
    Field("functions", CHANGES, "refused: send `tools`", "functions is OpenAI's deprecated form of tools: send tools"),
    Field(
        "function_call",
        CHANGES,
        "refused: send `tool_choice`",
        "function_call is OpenAI's deprecated form of tool_choice: send tool_choice",
    ),
    Field("web_search_options", CHANGES, "refused", "specdec serve does not search the web"),
    Field("moderation", CHANGES, "refused", "specdec serve does not moderate"),
    Field("echo", CHANGES, "refused unless false", "specdec serve does not echo the prompt", (False,)),
    Field(
        "stream_options.include_obfuscation",
        CHANGES,
        "refused unless false",
        "specdec serve does not pad its stream chunks",
        (False,),
    ),
    Field(
        "tools, tool_choice, parallel_tool_calls, response_format on /v1/completions",
        CHANGES,
        "refused: send them to /v1/chat/completions",
    ),
    Field("content parts other than text (images, audio, files)", CHANGES, "refused: the model reads text only"),
)

CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "response_format")
"""Chat fields that change the reply, refused by a raw-prompt endpoint (`/v1/completions`) that cannot honour them."""

REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    f.name: (f.neutral, f.refused) for f in FIELDS if f.refused is not None and "." not in f.name
}
"""Top-level field → (its neutral values, why it is refused otherwise): what `openai_base.refuse_unsupported`
checks."""


def markdown_table() -> str:
    """docs/server.md's table of fields: | field | informs or changes the reply | what specdec serve does |."""
    rows = ["| field | kind | what specdec serve does |", "|---|---|---|"]
    for f in FIELDS:
        names = ", ".join(n if " " in n else f"`{n}`" for n in f.name.split(", "))
        kind = "informs" if f.kind == INFORMS else "changes the reply"
        rows.append(f"| {names} | {kind} | {f.does} |")
    return "\n".join(rows)


TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
        "functions",
        "function_call",
        "tool_choice",
    }
)
"""The chat template's variables specdec sets itself (Hugging Face's and llama-cpp-python's): not overridable."""


def check_template_kwargs(kwargs: Mapping[str, Any] | None, param: str) -> dict[str, Any]:
    """A request's extra chat-template variables (`chat_template_kwargs`), checked: a dict of JSON values whose
    names the template's caller does not set itself. Raises ApiError (400, `param` + "." + the variable)."""
    if not kwargs:
        return {}
    for name in kwargs:
        if name in TEMPLATE_VARIABLES:
            raise ApiError(
                400,
                f"{param}.{name}: the chat template's {name!r} is the server's to set. Leave it out.",
                param=f"{param}.{name}",
            )
    return dict(kwargs)


class Ignored:
    """The unknown fields seen so far, so each is logged once per server (`note`)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def note(self, names) -> list[str]:
        """The names among `names` not seen before (sorted), now remembered."""
        new = sorted(set(names) - self._seen)
        self._seen.update(new)
        return new


if __name__ == "__main__":
    print(markdown_table())
