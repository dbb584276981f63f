"""The one request every API dialect is translated into: what to generate, in no dialect's words.

A translator (`openai_chat`, `openai_completions`, ...) parses its API's wire body and builds a `Request`; the service
(`service.GenerationService`) turns it into prompt tokens and the engine's `GenerationConfig`; the worker serves it
without learning which API it came in through. So a feature added below the translators (a tool-call format, a loop
guard, FIM, predicted outputs, the prompt cache) reaches every client.

Shaped after llama-server, which turns a Responses or Anthropic body into one chat body that a single
`oaicompat_chat_params_parse` reads (tools/server/server-common.cpp), and vLLM's one engine request behind its
`serving_*.py` modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from specdec_cli.core.engine import GenerationConfig
from specdec_cli.core.sampling import SamplingParams

if TYPE_CHECKING:
    from specdec_cli.core.constraint import Grammar

Role = Literal["system", "user", "assistant", "tool"]
ToolMode = Literal["auto", "none", "required"]
ToolKind = Literal["function", "custom"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call the assistant made (in a past turn, or parsed from this reply).

    Attributes:
        id: the call's id (the tool result that answers it names it).
        name: the tool's name.
        arguments: a function tool's arguments as JSON text (an object); a custom tool's raw input text.
        kind: "function" (JSON arguments) or "custom" (free-form input: `custom_tools`).
    """

    id: str
    name: str
    arguments: str
    kind: ToolKind = "function"


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of a conversation, its content already flattened to text.

    Attributes:
        role: "system" (also OpenAI's "developer" and Anthropic's `system`), "user", "assistant" or "tool" (a tool's
            result).
        content: the text.
        name: a participant's name (informs; the chat template gets it as `name`).
        tool_calls: an assistant turn's calls.
        tool_call_id: a tool turn: the id of the call it answers.
        reasoning: an assistant turn's reasoning sent back by the client (informs; the template gets it as
            `reasoning_content`, which reasoning models' templates read).
    """

    role: Role
    content: str = ""
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning: str | None = None


NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a tool without parameters


@dataclass(frozen=True, slots=True)
class InputGrammar:
    """What a custom tool's free-form input must match (OpenAI's custom tool `format`), in no dialect's words.

    Attributes:
        syntax: "lark" (llguidance's Lark dialect) or "regex" (Rust regex syntax), as the client gave it.
        definition: the grammar or regex, as given.
        pattern: the same language as one anchored regex, which llguidance holds the input's JSON string to
            (`core.lark_regex.input_pattern`).
    """

    syntax: Literal["lark", "regex"]
    definition: str
    pattern: str


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool the model may call.

    Attributes:
        name: its name (letters, digits, _ and -, at most 64).
        description: what it does (for the model; the template shows it).
        parameters: the JSON schema of a function tool's arguments object; a custom tool's is
            {"input": string} with the string held to its grammar (`custom_tools.custom_tool`).
        kind: "function", or "custom": free-form input (the model writes it as the string `input`).
        grammar: a custom tool's input grammar (None: any text).
    """

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(NO_PARAMETERS))
    kind: ToolKind = "function"
    grammar: InputGrammar | None = None

    def template_json(self) -> dict:
        """The tool as chat templates take it (OpenAI's shape, Hugging Face's convention):
        {"type": "function", "function": {"name", "description", "parameters"}}. A custom tool shows its input as
        one string parameter described by its grammar (the regex it is held to is too long to help the model)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = dict(self.parameters) if self.kind == "function" else _input_parameters(self.grammar)
        return {"type": "function", "function": fn}


def _input_parameters(grammar: InputGrammar | None) -> dict:
    """What the model is shown of a custom tool's input: one string, and the grammar it follows."""
    if grammar is None:
        about = "The tool's input: free-form text."
    elif grammar.syntax == "lark":
        about = f"The tool's input: raw text in this Lark grammar:\n{grammar.definition.strip()}"
    else:
        about = f"The tool's input: raw text matching this regular expression: {grammar.definition}"
    return {"type": "object", "properties": {"input": {"type": "string", "description": about}}, "required": ["input"]}


@dataclass(frozen=True)
class Tools:
    """A request's tools and whether and which the reply calls, checked by its translator.

    Attributes:
        specs: the tools (names unique).
        allowed: the names the reply may call (all of them, one named tool, or an allowed subset).
        mode: "auto" (text, or calls), "required" (calls only), "none" (text only).
        parallel: more than one call allowed in one reply.
    """

    specs: tuple[Tool, ...]
    allowed: tuple[str, ...]
    mode: ToolMode = "auto"
    parallel: bool = True

    @property
    def parameters(self) -> dict[str, Mapping[str, Any]]:
        """Each tool's arguments schema, by name."""
        return {t.name: t.parameters for t in self.specs}


@dataclass(frozen=True, slots=True)
class Output:
    """How the reply's text (not its tool calls) is constrained: a JSON schema (OpenAI's `response_format`,
    Anthropic's `output_config.format`, Responses' `text.format`), compiled.

    Attributes:
        schema: the JSON schema (`{"type": "object"}` for any JSON object).
        grammar: `schema` compiled (`constraint.json_schema` / `json_object`).
        name: the schema's name; description: what it is for (informs: shown to the model in a system message).
    """

    schema: Mapping[str, Any]
    grammar: Grammar
    name: str | None = None
    description: str | None = None


@dataclass(frozen=True, slots=True)
class Fim:
    """A fill-in-the-middle prompt: the code before and after the cursor, and more context.

    Attributes:
        prefix: the text before the cursor. suffix: the text after it.
        extra: more context, (filename, text) pairs (llama.cpp's `input_extra`: other files, recent edits).
        prompt: text appended to the prefix (llama.cpp's `prompt`: the current line up to the cursor).
        repo: llama-server's repo-level layout (`<|repo_name|>myproject`, `<|file_sep|>` per file, when the model
            has those tokens; `/infill`); False: only prefix, suffix and middle markers (`suffix` on
            `/v1/completions`, as Ollama's templates write it).
    """

    prefix: str
    suffix: str
    extra: tuple[tuple[str, str], ...] = ()
    prompt: str = ""
    repo: bool = False


@dataclass(frozen=True)
class Request:
    """One generation, as any API asks for it.

    Exactly one of `messages` (a conversation, rendered with the model's chat template), `prompt` (raw text or token
    ids) and `fim` (fill in the middle, with the model's FIM tokens) is given.

    Attributes:
        messages: the conversation, oldest first.
        prompt: raw text (special tokens such as FIM markers parsed, as llama-server does) or int token ids.
        fim: a fill-in-the-middle prompt (`server.fim.fim_prompt` lays it out).
        tools: the tools the model may call and whether it must (chat only); None: no tools.
        output: the constraint on the reply's text, or None for free text.
        config: max tokens, stop strings, sampling, log-probabilities (the engine's `GenerationConfig`; its grammar
            and prediction are filled in by the service).
        prediction: the expected output (OpenAI's predicted outputs), drafted from, never evaluated.
        template_kwargs: extra variables for the chat template (`chat_template_kwargs`, e.g. enable_thinking).
        label: what the log line calls the request ("chat", "completion", "responses", "messages", ...).
        scope: whose request it is (a digest of the API key it came with; None: no keys): the KV cache, parked
            states and the prompt cache are never shared between two scopes (`GenerationService.stream`).
        deadline_ms: the client's time budget for the reply, ms from its arrival (llama.vim's `t_max_prompt_ms` +
            `t_max_predict_ms`); None: none. Earlier deadlines are served first (`Worker`, `server.lanes`).
        prompt_ids: the prompt's token ids once rendered and tokenized (`GenerationService.tokenized`, on the HTTP
            side); None: not yet (the service renders it when asked).
        prediction_ids: `prediction`'s token ids, tokenized with the prompt (None: not yet, or no prediction).
    """

    config: GenerationConfig
    messages: tuple[Message, ...] = ()
    prompt: str | tuple[int, ...] | None = None
    fim: Fim | None = None
    tools: Tools | None = None
    output: Output | None = None
    prediction: str | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    label: str = "chat"
    scope: str | None = None
    deadline_ms: float | None = None
    prompt_ids: tuple[int, ...] | None = None
    prediction_ids: tuple[int, ...] | None = None

    @property
    def interactive(self) -> bool:
        """Served before long requests (`server.lanes.INTERACTIVE`): a fill-in-the-middle request (an editor's
        completion), a warm-up or a short reply (at most `SHORT_REPLY` tokens), or one with a deadline."""
        return self.fim is not None or self.deadline_ms is not None or self.config.max_tokens <= SHORT_REPLY

    @property
    def is_chat(self) -> bool:
        """True for a conversation (the chat template), False for a raw prompt or a FIM one."""
        return self.prompt is None and self.fim is None


SHORT_REPLY = 64
"""A reply of at most this many tokens is interactive (`Request.interactive`): an editor's completion, a title."""

DEFAULT_MAX_TOKENS = 4096
"""A reply's token limit when neither the request nor `specdec serve --max-tokens` sets one (never more than the
context window): a reply that would not end (a repeated tool call, a loop) stops here instead of at a full context."""


@dataclass(frozen=True, slots=True)
class ApiDefaults:
    """What an API documents for the sampling fields a request leaves out (used unless the server has its own).

    Attributes:
        temperature: softmax temperature (0 = greedy). top_p: nucleus (1.0 = off). top_k: keep the k most likely
            (0 = off). min_p: drop tokens under min_p x the top probability (0.0 = off).
    """

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


OPENAI = ApiDefaults(temperature=1.0, top_p=1.0)
"""OpenAI's Chat Completions, Completions and Responses: temperature 1, top_p 1 (its API reference)."""
ANTHROPIC = ApiDefaults(temperature=1.0)
"""Anthropic's Messages: temperature 1.0; top_p and top_k unset (off) unless sent (its API reference)."""
LLAMA_CPP = ApiDefaults(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05)
"""llama-server's own endpoints (`/infill`, `/completion`): its sampler defaults (`common_params_sampling`)."""


@dataclass(frozen=True)
class SamplingValues:
    """Sampling values that may be left out: a request's, or the server's own (`Defaults`); None: left out.

    Attributes:
        temperature, top_k, top_p, min_p: sampling.
        seed: the random stream's seed (a request's -1: random, as llama-server; the server's None: random).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None


@dataclass(frozen=True)
class Defaults(SamplingValues):
    """The server's own values for what a request leaves out (`specdec serve --temperature ...`); None: the API's
    documented default (`ApiDefaults`: each translator names its API's).

    Attributes:
        temperature, top_k, top_p, min_p, seed: sampling (`SamplingValues`; None: the API's default, a random seed).
        max_tokens: the reply's token limit when the request sets none (None: `DEFAULT_MAX_TOKENS`); never more
            than the context window.
    """

    max_tokens: int | None = None

    def sampling(self, api: ApiDefaults, asked: SamplingValues = SamplingValues()) -> SamplingParams:
        """The sampling of a request: each value the request sent (`asked`, not None), else the server's, else
        `api`'s. A request's seed -1 is random, as llama-server's."""

        def pick(asked, own, documented):
            return asked if asked is not None else own if own is not None else documented

        seed = asked.seed
        return SamplingParams(
            temperature=pick(asked.temperature, self.temperature, api.temperature),
            top_k=pick(asked.top_k, self.top_k, api.top_k),
            top_p=pick(asked.top_p, self.top_p, api.top_p),
            min_p=pick(asked.min_p, self.min_p, api.min_p),
            seed=self.seed if seed is None else (None if seed == -1 else seed),
        )

    def limit(self, asked: int | None, n_ctx: int) -> int:
        """A reply's token limit, the same for every API: what the request asked (`asked`) up to the server's
        `max_tokens` when it has one (`--max-tokens` is the default and the maximum), else the server's `max_tokens`,
        else `DEFAULT_MAX_TOKENS`; never more than the context window `n_ctx` (tokens), so a request cannot ask for
        1e15 tokens. The engine ends a reply at a full context in any case (finish "context")."""
        cap = min(self.max_tokens or n_ctx, n_ctx)
        if asked:
            return min(asked, cap)
        return min(self.max_tokens or DEFAULT_MAX_TOKENS, n_ctx)

    @property
    def cap(self) -> int:
        """The default token limit (the server's `max_tokens` or `DEFAULT_MAX_TOKENS`), for the start-up line."""
        return self.max_tokens or DEFAULT_MAX_TOKENS
