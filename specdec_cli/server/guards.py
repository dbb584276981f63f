"""Loop guards: no reply repeats an identical tool call (issue 27, "Replies that end").

A small model, greedy, can call the same tool with the same arguments again and again: within one reply (each copy
drafted by prompt lookup at nearly full acceptance, until the token limit), or turn after turn after the tool answered
(openai-agents' `MaxTurnsExceeded`: the call again after its result). `CallGuard` says which calls a reply may not
make: one identical (same name, same arguments compared as parsed JSON) to a call made earlier in the same reply, or
to a call of the conversation's last assistant turn that a tool result answered. `reply.ReplyStream` holds each call
back until it is complete, asks the guard, and ends the reply before a refused call, so nothing of it was streamed;
the worker then stops the generation, and generates once more without tool calls when the reply would be empty.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec_cli.server.request import Message, ToolCall

CallKey = tuple[str, str]  # (name, canonical arguments)


def call_key(name: str, arguments: str) -> CallKey:
    """What makes two calls identical: the name, and the arguments as canonical JSON (keys sorted, no spaces), so
    layout and key order do not matter; arguments that are not JSON (a custom tool's raw input) compare as text."""
    try:
        canonical = json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (json.JSONDecodeError, TypeError, RecursionError):
        canonical = arguments.strip()
    return name, canonical


def answered_calls(messages: Sequence[Message]) -> frozenset[CallKey]:
    """The calls of the conversation's last assistant turn that a later tool message answered (its
    `tool_call_id` names the call's id); empty when the last assistant turn made no calls."""
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "assistant"), None)
    if last is None or not messages[last].tool_calls:
        return frozenset()
    answered = {m.tool_call_id for m in messages[last + 1 :] if m.role == "tool"}
    return frozenset(call_key(c.name, c.arguments) for c in messages[last].tool_calls if c.id in answered)


@dataclass
class CallGuard:
    """Which calls one reply may make.

    Attributes:
        answered: the last assistant turn's answered calls (`answered_calls`).
        made: the calls this reply made so far.
    """

    answered: frozenset[CallKey] = frozenset()
    made: set[CallKey] = field(default_factory=set)

    @classmethod
    def of(cls, messages: Sequence[Message]) -> CallGuard:
        return cls(answered=answered_calls(messages))

    def admit(self, call: ToolCall) -> bool:
        """True when `call` repeats nothing (and remember it); False for a repeat, which the reply must not make."""
        key = call_key(call.name, call.arguments)
        if key in self.made or key in self.answered:
            return False
        self.made.add(key)
        return True
