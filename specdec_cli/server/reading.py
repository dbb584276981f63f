"""What the translators read alike, read once: a message's content (`content_text`), a function tool (`function_tool`:
its name, description, `strict` and arguments schema) and the tools a `tool_choice` leaves the reply (`choose`).

Each translator (`openai_chat`, `openai_responses`, `anthropic_messages`) keeps only what is its own wire format:
where a field sits and what it is called (Chat's `tools.0.function.parameters`, Responses' `tools.0.parameters`,
Anthropic's `tools.0.input_schema`), its dialect's tool-choice words, its own tool kinds (Responses' custom and
namespaced tools); it hands the fields to these functions, which check them and raise the same 400s for all three.
So llama-server turns every dialect into one chat body and parses that once (`oaicompat_chat_params_parse`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

from pydantic import BaseModel

from specdec_cli.core.constraint import json_object
from specdec_cli.server.errors import ApiError
from specdec_cli.server.request import Output, Tool, ToolMode, Tools
from specdec_cli.server.tools import NAME, check_parameters

MISSING: Any = object()  # a schema field the wire format requires and the body left out (Anthropic's input_schema)
NOT_TEXT = ("image_url", "input_audio", "file", "input_image", "input_file")  # parts refused by name: text only


def json_output(fmt: dict | None, where: str, schema_output: Callable[[dict], Output]) -> Output | None:
    """The constraint an OpenAI format object (Chat's `response_format`, Responses' `text.format`) puts on the reply:
    None for none or {"type": "text"}, any JSON object for "json_object", `schema_output(fmt)` for "json_schema"
    (where its schema and name sit is each format's own). Raises ApiError (400, param `where`.type): another type."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Output({"type": "object"}, json_object(name=where))
    if kind != "json_schema":
        raise ApiError(
            400, f"{where}.type {kind!r} is not one of 'text', 'json_object', 'json_schema'.", param=f"{where}.type"
        )
    return schema_output(fmt)


def format_name(name: Any, param: str) -> str:
    """A json_schema format's name, checked: letters, digits, _ and - (at most 64). Raises ApiError (400, `param`)."""
    if not isinstance(name, str) or not NAME.match(name):
        raise ApiError(400, f"{param} {name!r} is not a name (letters, digits, _ and -, at most 64).", param=param)
    return name


def content_text(
    content: Any, where: str, *, refusal_ok: bool = False, kinds: tuple[str, ...] = ("text",), sep: str = ""
) -> str:
    """The text of a message's content: a string, a list of text parts (of a type in `kinds`: Chat's "text",
    Responses' "input_text" / "output_text") joined with `sep`, or null (""). A part's other keys (`cache_control`,
    Responses' `annotations`) only inform. Other parts (images, audio, files) get a 400 naming them.

    Raises ApiError (400, param `where...`): content that is neither, a part that is not text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} is neither a string nor a list of parts.", param=where)
    out = []
    for i, part in enumerate(content):
        part = part.model_dump() if isinstance(part, BaseModel) else part
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in kinds and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and refusal_ok and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        elif kind in NOT_TEXT:
            raise ApiError(
                400,
                f"{where}.{i} is an {kind} part: this model reads text only. Send text parts.",
                param=f"{where}.{i}.type",
            )
        else:
            raise ApiError(
                400, f'{where}.{i} is not a text part ({{"type": "{kinds[0]}", "text": ...}}).', param=f"{where}.{i}"
            )
    return sep.join(out)


def tool_name(
    where: str, name: Any, description: Any, *, taken: Collection[str] = (), flat: str | None = None, noun: str = "tool"
) -> tuple[str, str | None]:
    """A tool's name and description, checked: (the name it is called by, its description). `where`: the object
    that holds the fields ("tools.0.function" in Chat, "tools.0" in Responses and Messages); `taken`: the names of
    the tools before it; `flat`: the name it is called by when not its own (Responses: a namespaced tool whose name
    another namespace has too); `noun`: what the dialect calls it in a message ("function", "tool").

    Raises ApiError (400, `param` the field): a name that is not letters, digits, _ and - (at most 64, OpenAI's
    rule), a name already taken, a description that is not a string."""
    if not isinstance(name, str) or not NAME.match(name):
        raise ApiError(
            400,
            f"{where}.name {name!r} is not a {noun} name (letters, digits, _ and -, at most 64).",
            param=f"{where}.name",
        )
    flat = name if flat is None else flat
    if flat in taken:
        raise ApiError(400, f"Two tools are named {flat!r}.", param=f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"{where}.description is not a string.", param=f"{where}.description")
    return flat, description


def function_tool(
    where: str,
    name: Any,
    description: Any,
    parameters: Any = None,
    *,
    strict: Any = None,
    taken: Collection[str] = (),
    flat: str | None = None,
    noun: str = "tool",
    schema: str = "parameters",
    lenient: bool = False,
) -> Tool:
    """A function tool, checked (the one check of every dialect's function tools): its name and description
    (`tool_name`), `strict` (a boolean or left out; informs), its arguments schema `parameters` (None: no arguments;
    `MISSING`: a required schema left out), which llguidance must compile (`tools.check_parameters`; `lenient`:
    keywords it does not implement are accepted and not enforced). `schema`: the schema field's name on the wire.

    Raises ApiError (400, `param` the field, e.g. "tools.0.function.parameters")."""
    flat, description = tool_name(where, name, description, taken=taken, flat=flat, noun=noun)
    if strict not in (None, True, False):
        raise ApiError(400, f"{where}.strict is not a boolean.", param=f"{where}.strict")
    if parameters is MISSING:
        raise ApiError(400, f"{where}.{schema} is missing.", param=f"{where}.{schema}")
    return Tool(flat, description, check_parameters(parameters, f"{where}.{schema}", lenient=lenient))


class Named(NamedTuple):
    """A tool a `tool_choice` names: its name, where the choice named it ("tool_choice", "tool_choice.tools.1"),
    the field to name in a 400, and what the dialect calls a tool ("function", "tool")."""

    name: Any
    where: str
    param: str
    noun: str = "tool"


def allowed_tools_mode(mode: Any, param: str) -> ToolMode:
    """The `mode` of an OpenAI `allowed_tools` choice, the same in Chat Completions and Responses: "auto" or
    "required". Raises ApiError (400, `param`, the mode's field) for anything else."""
    if mode not in ("auto", "required"):
        raise ApiError(400, f"{param} is {mode!r}; use 'auto' or 'required'.", param=param)
    return mode


def choose(specs: Sequence[Tool], mode: ToolMode, named: Sequence[Named] | None = None, *, parallel: bool) -> Tools:
    """The request's `Tools`: `specs`, and what its `tool_choice` said, read from the dialect's words by its
    translator: `mode` ("auto", "required", "none"), `named` (None: every tool may be called; else the tools the
    choice names, in its order), `parallel` (more than one call in a reply).

    Raises ApiError (400, `param` the name's field): a named tool that is not among `specs`."""
    names = [t.name for t in specs]
    if named is None:
        return Tools(tuple(specs), tuple(names), mode, parallel=parallel)
    for n in named:
        if n.name not in names:
            raise ApiError(
                400,
                f"{n.where} names the {n.noun} {n.name!r}, which is not among the tools ({', '.join(names)}).",
                param=n.param,
            )
    return Tools(tuple(specs), tuple(n.name for n in named), mode, parallel=parallel)
