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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping

from specdec_cli.core.engine import GenerationConfig

if TYPE_CHECKING:
    from specdec_cli.core.constraint import Grammar

Role = Literal["system", "user", "assistant", "tool"]
ToolMode = Literal["auto", "none", "required"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call the assistant made (in a past turn, or parsed from this reply).

    Attributes:
        id: the call's id (the tool result that answers it names it).
        name: the tool's name.
        arguments: a function tool's arguments as JSON text (an object); a custom tool's raw input text.
    """

    id: str
    name: str
    arguments: str


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
class Tool:
    """A tool the model may call.

    Attributes:
        name: its name (letters, digits, _ and -, at most 64).
        description: what it does (for the model; the template shows it).
        parameters: the JSON schema of a function tool's arguments object.
    """

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(NO_PARAMETERS))

    def template_json(self) -> dict:
        """The tool as chat templates take it (OpenAI's shape, Hugging Face's convention):
        {"type": "function", "function": {"name", "description", "parameters"}}."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = dict(self.parameters)
        return {"type": "function", "function": fn}


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


@dataclass(frozen=True)
class Request:
    """One generation, as any API asks for it.

    Exactly one of `messages` (a conversation, rendered with the model's chat template) and `prompt` (raw text or
    token ids) is given.

    Attributes:
        messages: the conversation, oldest first.
        prompt: raw text (special tokens such as FIM markers parsed, as llama-server does) or int token ids.
        tools: the tools the model may call and whether it must (chat only); None: no tools.
        output: the constraint on the reply's text, or None for free text.
        config: max tokens, stop strings, sampling, log-probabilities (the engine's `GenerationConfig`; its grammar
            and prediction are filled in by the service).
        prediction: the expected output (OpenAI's predicted outputs), drafted from, never evaluated.
        template_kwargs: extra variables for the chat template (`chat_template_kwargs`, e.g. enable_thinking).
        label: what the log line calls the request ("chat", "completion", "responses", "messages", ...).
    """

    config: GenerationConfig
    messages: tuple[Message, ...] = ()
    prompt: str | tuple[int, ...] | None = None
    tools: Tools | None = None
    output: Output | None = None
    prediction: str | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    label: str = "chat"

    @property
    def is_chat(self) -> bool:
        """True for a conversation (the chat template), False for a raw prompt."""
        return self.prompt is None

    @property
    def calls_tools(self) -> bool:
        """The reply may contain tool calls (tools given and tool_choice is not "none")."""
        return self.tools is not None and self.tools.mode != "none"


@dataclass(frozen=True)
class Defaults:
    """The server's values for what a request leaves out (`specdec serve --temperature ...`).

    Attributes:
        temperature, top_k, top_p, min_p, seed: sampling.
        max_tokens: the reply's token limit when the request sets none (None: until the context is full).
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    max_tokens: int | None = None
