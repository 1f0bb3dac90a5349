"""What the parsers produce: deltas of content, reasoning and finished tool calls (and the
tokens' log-probabilities when asked)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (what OpenAI's function.arguments carries)
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class TokenScore:
    """A generated token's text, log-probability and UTF-8 bytes; `top`: the likeliest tokens there."""

    token: str
    logprob: float
    bytes: list[int]
    top: list[TokenScore] = field(default_factory=list)


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenScore] = field(default_factory=list)  # of the tokens behind this delta

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.logprobs)

    def merge(self, other: Delta) -> Delta:
        return Delta(
            self.content + other.content,
            self.reasoning + other.reasoning,
            self.tool_calls + other.tool_calls,
            self.logprobs + other.logprobs,
        )
